"""`cubic trial`: run one configuration and print its TrialResult.

Sources of a config, each over the one before: the space's baseline, or --config (a full
TrialConfig, e.g. an export); then --workload (swaps the workload, and the knobs an anchor-format
file fixes); then --set. Errors name the source they come from.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import typer
import yaml

from cubic_harness.config import CHOICES, TrialConfig, TrialResult
from cubic_harness.errors import ConfigError, read_text


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


BACKENDS = ("real", "sim", "torchrec")  # cubic's harness trains, the simulator predicts, TorchRec trains


def sim_cluster_of(backend: str, cluster: str | None, framework: str = "harness"):
    """The cluster `--backend sim --cluster FILE|NAME [--framework NAME]` names, pricing that framework's step
    (None for trials that train); ConfigError otherwise."""
    from cubic_harness.sim.cluster import FRAMEWORKS, resolve

    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend!r}: choose one of {list(BACKENDS)}")
    if (backend == "sim") != (cluster is not None):
        raise ConfigError("--cluster FILE goes with --backend sim (and --backend sim needs one)")
    if framework not in FRAMEWORKS:
        raise ConfigError(f"--framework {framework!r}: choose one of {list(FRAMEWORKS)}")
    if cluster is None:
        if framework != "harness":
            raise ConfigError("--framework goes with --backend sim (a trial that trains runs in its backend's)")
        return None
    return resolve(cluster).for_framework(framework)


def base_config(space: Path | None) -> TrialConfig:
    """The baseline of `space` (default: the shipped CPU space; TrialConfig's defaults without one)."""
    from cubic.space.search_space import load_space, shipped_space

    if space is None:
        space = shipped_space("dlrm_cpu.yaml")
        if not space.exists():
            return TrialConfig()
    return load_space(space, check_choices=False).baseline  # the baseline alone: no need to enumerate the space


def apply_workload_file(cfg: TrialConfig, path: Path) -> TrialConfig:
    """The anchor JSON format (tables: N, rows, pooling, local_batch, world, ...) or a full workload."""
    from cubic_harness.workload import Workload

    wl, knobs = Workload.from_json_file(path)
    return cfg.replace(str(path), workload=wl, **knobs)


def load_config_file(path: Path) -> TrialConfig:
    """A full TrialConfig as YAML/JSON (what `cubic export --format yaml` writes)."""
    try:
        raw = yaml.safe_load(read_text(path, "config file"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"{path}{f':{mark.line + 1}' if mark else ''}: malformed YAML") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping of TrialConfig keys")
    raw = raw.get("config", raw)  # accept the json export too
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: 'config' must be a mapping of TrialConfig keys")
    return TrialConfig.from_dict(raw, where=str(path))


def apply_sets(cfg: TrialConfig, sets: list[str]) -> TrialConfig:
    knobs = parse_sets(sets)
    return cfg.replace("--set", **knobs) if knobs else cfg


def parse_sets(sets: list[str]) -> dict[str, object]:
    """`--set KNOB=VALUE` pairs as TrialConfig keys and values (integer knobs as ints); ConfigError names a
    malformed pair, an unknown knob or a value an integer knob cannot take."""
    knobs: dict[str, object] = {}
    fields = sorted(f.name for f in dataclasses.fields(TrialConfig) if f.name != "workload")
    for s in sets:
        key, eq, val = s.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"--set {s!r}: expected KNOB=VALUE")
        if key not in fields:
            raise ConfigError(f"--set {key}: unknown knob; allowed: {', '.join(fields)}")
        val = val.strip()
        if key in CHOICES and isinstance(CHOICES[key][0], int):
            try:
                val = int(val)
            except ValueError:
                raise ConfigError(f"--set {key}={val!r}: choose one of {list(CHOICES[key])}") from None
        knobs[key] = val
    return knobs


def trial(
    space: Path = typer.Option(None, "--space", help="search-space YAML (or a shipped space's name) whose "
                               "baseline is the starting config"),
    workload: Path = typer.Option(None, "--workload", help="workload JSON (anchor format or full)"),
    config: Path = typer.Option(None, "--config", help="a full TrialConfig YAML (e.g. from cubic export)"),
    set_: list[str] = typer.Option([], "--set", help="KNOB=VALUE, repeatable"),
    as_json: bool = typer.Option(False, "--json", help="print the TrialResult as one JSON line"),
    backend: str = typer.Option("real", "--backend", help="real: train in cubic's harness; torchrec: train in "
                                "TorchRec (the workload's own model where it names a factory); sim: predict "
                                "with the simulator"),
    cluster: str | None = typer.Option(None, "--cluster", help="cluster file or preset name for --backend sim"),
    framework: str = typer.Option("harness", "--framework", help="--backend sim: whose step to price, cubic's "
                                  "harness or torchrec (the cluster's profile: `cubic calibrate --framework`)"),
) -> None:
    """Run one real training trial (or simulate it) and print its result (exit 1 when the trial fails:
    error, oom, timeout)."""
    try:
        sim_cluster = sim_cluster_of(backend, cluster, framework)
        cfg = load_config_file(config) if config else base_config(space)
        if workload:
            cfg = apply_workload_file(cfg, workload)
        cfg = apply_sets(cfg, set_)
        # the whole config is checked once, naming what made it (a later source may fix an earlier one)
        sources = [str(p) for p in (space, config, workload) if p] + (["--set"] if set_ else [])
        cfg.validate(" + ".join(sources) or "config")
        if backend == "torchrec":
            from cubic_harness.torchrec_rules import check_runs_in_torchrec

            check_runs_in_torchrec(cfg)
        if sim_cluster is None:
            from cubic_harness.trial import check_config

            check_config(cfg)
        else:
            from cubic_harness.sim.backend import check_holds

            check_holds(cfg, sim_cluster, " + ".join(sources) or "config")
    except ConfigError as e:
        _fail(str(e))
    if sim_cluster is not None:
        from cubic_harness.sim.backend import simulate

        res = simulate(cfg, sim_cluster)
        if as_json:
            sys.stdout.write(res.to_json() + "\n")
        else:
            print_result(res)
        if res.status != "ok":
            raise typer.Exit(1)
        return
    if cfg.device == "cuda":
        import torch

        if torch.cuda.device_count() < cfg.world_size:
            typer.echo(f"warning: {cfg.world_size} ranks on {torch.cuda.device_count()} GPU(s): NCCL refuses two "
                       "ranks on one device, falling back to gloo", err=True)
    if backend == "torchrec":
        from cubic_harness.torchrec_trial import run_torchrec as run
    else:
        from cubic_harness.trial import run_trial as run

    if not as_json:
        typer.echo(f"running {cfg.world_size} ranks x batch {cfg.batch_size}, {cfg.sharding}, kernel={cfg.kernel}, "
                   f"{cfg.warmup_steps} warm-up + {cfg.measure_steps} measured steps"
                   + (" in TorchRec" if backend == "torchrec" else "") + " ...", err=True)
    res = run(cfg)
    if as_json:
        sys.stdout.write(res.to_json() + "\n")
    else:
        print_result(res)
    if res.status != "ok":  # the result is printed either way; scripts see the failure in the exit code
        raise typer.Exit(1)


def _cv(cv: float | None) -> str:
    return "n/a: one window" if cv is None or cv != cv else f"{cv:.1%}"


def _host_memory(offload: dict[str, Any]) -> str:
    """The simulator's shards in host memory behind a device cache (`extra.sim.offload`), in one line."""
    shards = [x for k, v in offload.items() if k != "positions" for x in v]
    hits = [x["hit_rate"] for x in shards]
    where = f" (the position that moved most, of {offload['positions']})" if "positions" in offload else ""
    return f"{len(shards)} shard(s) in host memory{where}, device cache hit rate {min(hits):.1%}..{max(hits):.1%}"


def print_result(res: TrialResult) -> None:
    from rich.console import Console
    from rich.table import Table

    from cubic_harness.sim.provenance import describe

    con = Console()
    if res.status != "ok":
        con.print(f"[bold red]trial {res.status}[/]: {res.error}")
        return
    t = Table(title="trial result", show_header=False)
    rows = [
        ("samples/s (median of windows)", f"{res.qps:,.0f}  (cv {_cv(res.qps_cv)}, windows "
                                          f"{', '.join(f'{q:,.0f}' for q in res.window_qps)})"),
        ("step ms p50 / p90", f"{res.step_ms_p50:.1f} / {res.step_ms_p90:.1f}"),
        ("peak memory per rank", f"{res.peak_mem_mb:,.0f} MB"),
        *([("quality", res.extra["quality"])] if res.env.get("backend") == "sim" else [
            ("loss first -> last", f"{res.loss_first:.4f} -> {res.loss_last:.4f}"),
            ("normalized entropy", f"{res.ne:.4f}")]),
        ("breakdown ms/step", "  ".join(f"{k} {v:.1f}" for k, v in res.breakdown_ms.items())),
        *([("host memory", _host_memory(res.extra["sim"]["offload"]))] if res.extra.get("sim", {}).get("offload")
          else []),
        ("env", f"simulated on {res.env.get('cluster')} ({res.env.get('nodes')} node(s))"
         if res.env.get("backend") == "sim" else
         f"torch {res.env.get('torch')}, fbgemm {res.env.get('fbgemm')}, {res.env.get('device_name')}"),
        *([("figures", describe(res.extra["figures"]))] if res.extra.get("figures") else []),
    ]
    for k, v in rows:
        t.add_row(k, v)
    con.print(t)
    if res.plan:
        from cubic_harness.sharding.plan import ShardingPlan

        c = res.config
        g = c["sharding_group_size"] or c["world_size"]
        dims = [tb["dim"] for tb in c["workload"]["tables"]]
        con.print(ShardingPlan.from_list(res.plan, g, c["world_size"], dims).rich_table())
