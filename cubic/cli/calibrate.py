"""`cubic calibrate [-o FILE] [--short]`: measure this machine and write its cluster file."""

from __future__ import annotations

import sys
from pathlib import Path

import typer


def calibrate(
    output: Path | None = typer.Option(
        None, "--output", "-o", show_default=False,
        help="Cluster file to write. Default: $XDG_CONFIG_HOME/cubic/local.yaml (~/.config/cubic/local.yaml), "
             "which the planners, real trials and `--cluster local` read before the shipped clusters/local.yaml; "
             "the default never overwrites a file of the checkout."),
    short: bool = typer.Option(False, "--short", help="Fewer sizes and repeats (~10 s instead of ~1 min): CI."),
) -> None:
    """Measure copy bandwidth, the embedding kernels, dense GEMMs, gloo collectives and the framework's
    step on this machine (harness/sim/calibrate.py) and write them as a cluster file."""
    import yaml
    from rich.console import Console

    from cubic_harness.sim.calibrate import calibrate as measure
    from cubic_harness.sim.cluster import calibrated_cluster_path, cluster_from_dict

    console = Console(stderr=True)
    output = output or calibrated_cluster_path()
    try:  # writable? (checked before a minute of measuring; a file not there before is not left behind empty)
        output.parent.mkdir(parents=True, exist_ok=True)
        existed = output.exists()
        with open(output, "a"):
            pass
        if not existed:
            output.unlink()
    except OSError as e:
        print(f"error: --output {output}: cannot write: {e.strerror}", file=sys.stderr)
        raise typer.Exit(2) from None
    with console.status("calibrating") as status:
        def progress(step: str) -> None:
            console.log(step)
            status.update(f"calibrating: {step}")

        d = measure(short=short, progress=progress)
    cluster_from_dict(d, str(output))  # what we write must load
    class NoAliases(yaml.SafeDumper):  # a number measured once and used twice is written twice, not &id1
        def ignore_aliases(self, data: object) -> bool:
            return True

    text = ("# This machine as `cubic calibrate` measured it. Re-run it to refresh; every number's\n"
            "# measurement is under `source`.\n") + yaml.dump(d, Dumper=NoAliases, sort_keys=False)
    output.write_text(text)
    dev = d["device"]
    console.print(f"wrote {output}: {dev['type']}, copy {dev['mem_bw_gbs']:.1f} GB/s, dense fp32 "
                  f"{dev['dense_gflops']['fp32']:.0f} GFLOP/s, link {d['intra_node']['bandwidth_gbs']:.2f} GB/s "
                  f"+ {d['intra_node']['latency_us']:.0f} us, in {d['source']['seconds']:.0f} s")
