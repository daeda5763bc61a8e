"""`cubic calibrate [-o FILE] [--short] [--framework torchrec]`: measure this machine and write its cluster file
(or add a framework's profile to it)."""

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
    framework: str = typer.Option("harness", "--framework", help="harness: measure the machine (cubic's own "
                                  "step); torchrec: add TorchRec's step profile to the cluster file the machine's "
                                  "calibration wrote (`--backend sim --framework torchrec` prices it)."),
) -> None:
    """Measure copy bandwidth, the embedding kernels, dense GEMMs, gloo collectives and the framework's
    step on this machine (harness/sim/calibrate.py) and write them as a cluster file."""
    import yaml
    from rich.console import Console

    from cubic_harness.sim.calibrate import calibrate as measure
    from cubic_harness.sim.cluster import FRAMEWORKS, calibrated_cluster_path, cluster_from_dict
    from cubic_harness.sim.provenance import GPU_CALIBRATION_ASSUMES

    console = Console(stderr=True)
    output_given = output is not None
    output = output or calibrated_cluster_path()
    if framework not in FRAMEWORKS:
        print(f"error: --framework {framework!r}: choose one of {list(FRAMEWORKS)}", file=sys.stderr)
        raise typer.Exit(2)
    if framework != "harness":
        _add_profile(output, framework, short, console, given=output_given)
        return
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
    if d["device"]["type"] == "gpu":  # the file says which of its figures one GPU could not measure
        d["source"].setdefault("assumed", list(GPU_CALIBRATION_ASSUMES))
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


def _add_profile(output: Path, framework: str, short: bool, console, given: bool) -> None:  # noqa: ANN001
    """Measure `framework`'s step on this machine and write its profile into the cluster file `output`, which the
    machine's own calibration wrote (the profile is priced against its figures)."""
    import yaml

    from cubic_harness.errors import ConfigError
    from cubic_harness.sim.calibrate import torchrec_profile
    from cubic_harness.sim.cluster import load_cluster
    from cubic_harness.torchrec_rules import torchrec_available

    try:
        if not output.exists():
            raise ConfigError(f"{output}: no calibration of this machine to add a {framework} profile to; run "
                              f"`cubic calibrate{f' -o {output}' if given else ''}` first")
        base = load_cluster(output)
        if not torchrec_available():
            raise ConfigError("--framework torchrec needs TorchRec: `make` installs it")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    with console.status(f"profiling {framework}") as status:
        def progress(step: str) -> None:
            console.log(step)
            status.update(f"profiling {framework}: {step}")

        prof, src = torchrec_profile(base, short, progress)
    before = output.read_text()
    raw = yaml.safe_load(before)
    raw.setdefault("frameworks", {})[framework] = prof
    raw.setdefault("source", {}).setdefault("frameworks", {})[framework] = src
    header = "".join(line for line in before.splitlines(keepends=True) if line.startswith("#"))
    output.write_text(header + yaml.safe_dump(raw, sort_keys=False))  # the calibration's comments kept
    try:
        load_cluster(output).for_framework(framework)  # what we write must load
    except ConfigError:
        output.write_text(before)
        raise
    console.print(f"wrote {output}: {framework} step {prof['step_overhead_ms']:.2f} ms fixed, "
                  f"{prof['glue_ns_per_id']:.0f} ns per id beside the kernels, {prof['dist_overhead_ms']:.2f} ms a "
                  f"step on several ranks, {prof['collection_ms']:.2f} ms per collection beyond the first (the "
                  f"harness: {base.device.step_overhead_ms:.2f} ms, {base.device.glue_ns_per_id:.0f} ns, 0, 0)")

