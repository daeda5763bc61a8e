"""`cubic report RUN_DIR [-o report.html]`: the top configurations in the terminal, the plots in one HTML."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from cubic_harness.errors import ConfigError


def report(
    run_dir: str = typer.Argument(..., help="Run directory of `cubic tune` or `cubic codesign` (holds "
                                                 "study.db) or a storage URL."),
    output: Path | None = typer.Option(None, "--output", "-o",
                                       help="HTML file to write [default: RUN_DIR/report.html]."),
    study: str | None = typer.Option(None, "--study", help="Study name when the storage holds several."),
    top: int = typer.Option(5, "--top", "-k", min=1, help="How many top configurations to list."),
) -> None:
    """Summarise a study: top configurations with speed-up over the baseline, and a self-contained HTML
    report with the notebook's plots; of a co-design study, its front, knee and time-to-train-vs-cost plot."""
    from rich.console import Console

    from cubic.codesign import report as codesign_report
    from cubic.results import analysis
    from cubic.results import report as rep

    if output is None:
        output = Path(run_dir) / "report.html" if Path(run_dir).is_dir() else Path("report.html")
    try:
        st = analysis.open_study(run_dir, study)
        codesign = codesign_report.is_codesign(st)
        if codesign:  # a multi-objective study: its front, not a top table
            path, front = codesign_report.write_report(st, run_dir, output)
        else:
            path, df = rep.write_report(run_dir, output, study=study, k=top)
    except ConfigError as e:
        from cubic.study.store import redact

        print(f"error: {redact(' '.join(str(e).split()), run_dir)}", file=sys.stderr)  # never the URL's password
        raise typer.Exit(2) from None
    console = Console(width=None if sys.stdout.isatty() else 1000)  # a log file: every column, no folding
    if codesign:
        from cubic.codesign.front import print_front

        print_front(console, front)
        console.print(f"report: {path}", highlight=False)
        return
    console.print(rep.rich_table(df, top))
    console.print(rep.summary_line(df), highlight=False)
    if (screen := rep.screen_line(df)) is not None:
        console.print(screen, highlight=False)
    console.print(f"report: {path}", highlight=False)
