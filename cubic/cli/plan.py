"""`cubic plan`: the per-table plan of one configuration, priced against every rival, and why it wins.

Plans `sharding: plan` for the config (a space's baseline, a config file, `--set` knobs) on a cluster (this
machine's calibration by default, or any cluster file or preset), and prints: each rival's modelled step
(every uniform type, the greedy planners, `auto`, and TorchRec's planner with `--torchrec`) with the plan's
speed-up over it; the plan and one rival (`--vs`, default the best uniform type) by phase and by their busiest
ranks, the critical one first; and which tables the plan changes. Nothing is trained.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import typer

from cubic.cli.trial import _fail, apply_sets, apply_workload_file, base_config, load_config_file
from cubic_harness.config import SHARDING_TYPES
from cubic_harness.errors import ConfigError


def plan(
    space: Path = typer.Option(None, "--space", help="search-space YAML whose baseline is the config"),
    workload: Path = typer.Option(None, "--workload", help="workload JSON (anchor format or full)"),
    config: Path = typer.Option(None, "--config", help="a full TrialConfig YAML (e.g. from cubic export)"),
    set_: list[str] = typer.Option([], "--set", help="KNOB=VALUE, repeatable"),
    cluster: str | None = typer.Option(None, "--cluster", help="cluster file or preset name (default: this "
                                       "machine's calibration)"),
    vs: str | None = typer.Option(None, "--vs", help="the rival to set beside the plan (default: the fastest "
                                  "uniform type)"),
    torchrec: bool = typer.Option(False, "--torchrec", help="also run TorchRec's own planner as a rival"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Plan one configuration table by table and show why the plan wins (exit 1 when nothing fits)."""
    from cubic_harness.planning import plan_for
    from cubic_harness.sharding.planner import UNIFORM_RIVALS, PlanError, plan_candidates
    from cubic_harness.sim.cluster import local_cluster, resolve
    from cubic_harness.sim.explain import compare
    from cubic_harness.sim.perf import TableCosts

    try:
        cfg = load_config_file(config) if config else base_config(space)
        if workload:
            cfg = apply_workload_file(cfg, workload)
        if any(s.partition("=")[0].strip() == "sharding" for s in set_):  # (replaced unseen below)
            raise ConfigError("--set sharding: `cubic plan` plans each table itself; to set a "
                              "sharding type or planner beside its plan, name it with --vs")
        cfg = apply_sets(cfg, set_).replace("--set", sharding="plan")
        sources = [str(p) for p in (space, config, workload) if p] + (["--set"] if set_ else [])
        cfg.validate(" + ".join(sources) or "config")
        c = resolve(cluster) if cluster else local_cluster()
        if c is None:
            raise ConfigError("no cluster to price with: run `cubic calibrate`, or name one with --cluster")
        if vs is not None and vs in ("plan", "torchrec_planner") and not torchrec:
            raise ConfigError(f"--vs {vs}: choose a uniform type or planner ({', '.join(SHARDING_TYPES)}, "
                              "size_greedy, lookup_greedy, size_lookup_greedy, auto), or torchrec_planner with "
                              "--torchrec")
    except ConfigError as e:
        _fail(str(e))
    t0 = time.perf_counter()
    try:
        priced = plan_candidates(cfg, TableCosts(c))
    except PlanError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    wall = time.perf_counter() - t0
    rivals = {p.name: p for p in priced if p.name in UNIFORM_RIVALS}  # the plan may be one of them
    if torchrec:
        try:
            tr = plan_for(dataclasses.replace(cfg, sharding="torchrec_planner"), c)
            rivals["torchrec_planner"] = dataclasses.replace(priced[0], name="torchrec_planner", plan=tr,
                                                             step_ms=TableCosts(c).step_ms(cfg, tr))
        except ConfigError as e:
            typer.echo(f"warning: TorchRec's planner: {e}", err=True)
    rival = vs or min((n for n in rivals if n in SHARDING_TYPES), key=lambda n: rivals[n].step_ms)
    if rival not in rivals:
        _fail(f"--vs {rival}: no such rival fits this config; rivals: {', '.join(sorted(rivals))}")
    views, diff = compare(cfg, {"plan": priced[0].plan, rival: rivals[rival].plan}, c)
    out = {"cluster": c.name, "world_size": cfg.world_size, "tables": cfg.workload.num_tables,
           "plan_wall_s": round(wall, 3), "step_ms": priced[0].step_ms,
           "rivals": {n: {"step_ms": p.step_ms, "speedup": p.step_ms / priced[0].step_ms} for n, p in rivals.items()},
           "views": [v.to_dict() for v in views], "changed": [vars(d) for d in diff],
           "plan": priced[0].plan.to_list(), "vs": rival, "vs_plan": rivals[rival].plan.to_list()}
    if as_json:
        sys.stdout.write(json.dumps(out, default=float) + "\n")
        return
    _print(out, rival)


def _print(out: dict, rival: str) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"per-table plan: {out['tables']} tables on {out['world_size']} ranks of {out['cluster']}, "
              f"{out['step_ms']:.3f} ms a step (modelled), planned in {out['plan_wall_s']:.2f} s")
    tab = Table(title="rivals, as the simulator prices them")
    for col in ("planner", "step ms", "plan's speed-up"):
        tab.add_column(col, justify="right")
    for name, r in sorted(out["rivals"].items(), key=lambda kv: kv[1]["step_ms"]):
        tab.add_row(name, f"{r['step_ms']:.3f}", f"{r['speedup']:.2f}x")
    con.print(tab)
    phases = Table(title=f"the plan beside {rival}: ms by phase, the critical rank's lookups")
    phases.add_column("phase")
    for v in out["views"]:
        phases.add_column(v["name"], justify="right")
    for k in out["views"][0]["phases_ms"]:
        phases.add_row(k, *(f"{v['phases_ms'][k]:.3f}" for v in out["views"]))
    phases.add_row("critical rank", *(f"{v['critical']} ({v['imbalance']:.2f}x the mean)" for v in out["views"]))
    phases.add_row("its lookups fwd / bwd", *(f"{v['busiest'][0]['lookups_fwd_ms']:.3f} / "
                                              f"{v['busiest'][0]['lookups_bwd_ms']:.3f}" for v in out["views"]))
    con.print(phases)
    if out["changed"]:
        ch = Table(title=f"{len(out['changed'])} of {out['tables']} tables planned differently from {rival}")
        for col in ("table", rival, "plan"):
            ch.add_column(col)
        for d in out["changed"][:20]:
            ch.add_row(d["table"], d["before"], d["after"])
        con.print(ch)
        if len(out["changed"]) > 20:
            con.print(f"... and {len(out['changed']) - 20} more (--json lists every one)")
    else:
        con.print(f"the plan is {rival}'s: no table differs")
