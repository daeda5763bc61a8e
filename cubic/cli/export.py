"""`cubic export RUN_DIR --format yaml|json|torchrec [-o FILE]`: the winner, ready for production."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from cubic_harness.errors import ConfigError


def export(
    run_dir: str = typer.Argument(..., help="Run directory of `cubic tune` (holds study.db) or a storage "
                                                 "URL."),
    format: str = typer.Option("yaml", "--format", "-f",
                               help="yaml (TrialConfig for `cubic trial --config`), json (config + "
                                    "metrics + provenance) or torchrec (constraints, pipeline, qcomms for a "
                                    "TorchRec job)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="File to write [default: stdout]."),
    study: str | None = typer.Option(None, "--study", help="Study name when the storage holds several."),
) -> None:
    """Export the winning configuration (the confirmed winner, else the fastest completed trial)."""
    from cubic.deploy.export import write_export

    try:
        write_export(run_dir, format, output, study=study)
    except ConfigError as e:
        from cubic.study.store import redact

        print(f"error: {redact(' '.join(str(e).split()), run_dir)}", file=sys.stderr)  # never the URL's password
        raise typer.Exit(2) from None
    if output is not None:
        print(f"wrote {format} export to {output}", file=sys.stderr)
