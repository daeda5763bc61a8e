"""`cubic verify RUN_DIR [--top N] [--repeats N] [--fidelity N] [--json]`: the winner's speed-up in TorchRec."""

from __future__ import annotations

import json
import sys

import typer

from cubic_harness.errors import ConfigError


def verify(
    run_dir: str = typer.Argument(..., help="Run directory of `cubic tune` (holds study.db) or a storage URL."),
    top: int = typer.Option(1, "--top", help="Verify the winner and the next N-1 fastest configurations."),
    repeats: int = typer.Option(3, "--repeats", help="Alternating runs of each configuration in each framework."),
    fidelity: int = typer.Option(0, "--fidelity",
                                 help="Instead: run N completed configurations in TorchRec and print the Kendall "
                                      "tau between cubic's and TorchRec's samples/s."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    study: str | None = typer.Option(None, "--study", help="Study name when the storage holds several."),
) -> None:
    """Train the baseline and the winner in TorchRec itself, beside cubic's harness: both speed-ups, and
    every knob TorchRec ran differently (substitutions)."""
    from rich.console import Console

    from cubic.deploy import verify as v

    con = Console(stderr=True)
    try:
        with con.status("starting") as status:
            def show(msg: str) -> None:
                status.update(msg)

            out = (v.fidelity(run_dir, fidelity, study, show) if fidelity
                   else v.verify(run_dir, top, repeats, study, show))
    except ConfigError as e:
        from cubic.study.store import redact

        print(f"error: {redact(' '.join(str(e).split()), run_dir)}", file=sys.stderr)  # never the URL's password
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(out, allow_nan=False))
    else:
        _print(out, fidelity > 0)
    if not fidelity and any(c["errors"] for c in out["configs"]):
        raise typer.Exit(1)


def _print(out: dict, fidelity: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if out.get("needs_nothing"):
        con.print(out["needs_nothing"] + ": nothing to verify")
        return
    if fidelity:
        t = Table(title=f"{out['study']}: {out['configs']} configurations, cubic vs TorchRec")
        for c in ("trial", "cubic samples/s", "TorchRec samples/s", "substitutions"):
            t.add_column(c)
        for r in out["rows"]:
            t.add_row(str(r["trial"]), f"{r['qps_cubic']:,.0f}", f"{r['qps_torchrec']:,.0f}",
                      "; ".join(r["substitutions"]) or "-")
        con.print(t)
        tau, ratio = out["kendall_tau"], out["median_qps_ratio_cubic_over_torchrec"]  # None: too few ran
        con.print(("Kendall tau " + (f"{tau:.2f}" if tau is not None else f"n/a ({out['configs']} of the "
                                     "configurations ran in TorchRec; a rank correlation needs 3)"))
                  + "; median cubic/TorchRec samples/s ratio " + (f"{ratio:.2f}" if ratio is not None else "n/a")
                  + (f"; skipped: {out['skipped']}" if out["skipped"] else ""))
        return
    t = Table(title=f"{out['study']}: cubic vs TorchRec, median of {out['repeats']} alternating runs")
    for c in ("config", "trial", "cubic samples/s", "speed-up", "TorchRec samples/s", "speed-up"):
        t.add_column(c, justify="right")

    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    for c in out["configs"]:
        t.add_row(c["label"], str(c["trial"]), f(c["qps_cubic"], ",.0f"), f(c["speedup_cubic"], ".2f") + "x",
                  f(c["qps_torchrec"], ",.0f"), f(c["speedup_torchrec"], ".2f") + "x")
    con.print(t)
    for c in out["configs"]:
        for s in c["substitutions"]:
            con.print(f"[yellow]substitution[/] ({c['label']}): {s}")
        for e in c["errors"]:
            con.print(f"[red]failed[/] ({c['label']}): {e}")
