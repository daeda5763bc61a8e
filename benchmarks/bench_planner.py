"""The per-table planner (`sharding: plan`) against every uniform type, TorchRec's own planner, `auto` and the
greedy planners, as the simulator prices them, with each planner's wall time here.

Cases (issue 57): MLPerf DLRM-DCNv2 on 8, 64 and 128 H100 as HugeCTR's public configs run it (CUDA graphs: no
fixed cost per step; each GPU reads its own ids; SHARP; the all-to-all overlapped with the dense compute; fp16
tables, exchanges and dense gradients; MLPerf's global batches 55,296 / 135,168 / 135,168), `dlrm-datasets-2022`
(788 unequal tables, Meta's public production-like tables) on 128 and 1,024 H100 and `mlperf-dcnv2-x16` on 4,096
(1,024 samples per GPU, fp16, pipelined, overlapped). One run, every planner on the same cluster object, ratios
side by side; the step times are deterministic predictions, the wall times measurements on this machine (one
each: planning is deterministic, so a repeat only re-measures the clock).

    .venv/bin/python benchmarks/bench_planner.py [--quick] [--torchrec-max RANKS_X_TABLES]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cubic_harness.config import SHARDING_TYPES, TrialConfig  # noqa: E402
from cubic_harness.planning import plan_for  # noqa: E402
from cubic_harness.sharding.planner import PlanError  # noqa: E402
from cubic_harness.sim.cluster import Cluster, load_cluster, shipped_cluster  # noqa: E402
from cubic_harness.sim.perf import TableCosts  # noqa: E402
from cubic_harness.workload import Workload  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "planner_sim.json"
GREEDY = ("size_greedy", "lookup_greedy", "size_lookup_greedy")


def hugectr(c: Cluster) -> Cluster:
    """HugeCTR's run settings on the preset: CUDA graphs, its own data reader, SHARP (bench_mlperf.py)."""
    c = dataclasses.replace(c, device=dataclasses.replace(c.device, step_overhead_ms=0.0, reads_own_ids=True))
    return dataclasses.replace(c, network=dataclasses.replace(c.network, in_network_reduction=True))


def cases(quick: bool) -> list[tuple[str, TrialConfig, Cluster]]:
    knobs = dict(device="cuda", kernel="triton", emb_precision="fp16", dense_precision="bf16", comm_precision="fp16",
                 allreduce_comm_precision="fp16", pipeline_depth=1, ranks_per_node=8, comm_overlap="forward_backward")
    out = []
    for gpus, preset, gb in ((8, "h100-8", 55296), (64, "h100-64", 135168), (128, "h100-128", 135168)):
        cfg = TrialConfig(workload=Workload.preset("mlperf-dcnv2"), world_size=gpus, batch_size=gb // gpus, **knobs)
        out.append((f"MLPerf DLRM-DCNv2, {gpus} H100 (HugeCTR settings)", cfg,
                    hugectr(load_cluster(shipped_cluster(f"{preset}.yaml")))))
    big = [("dlrm-datasets-2022", 128, "h100-128"), ("dlrm-datasets-2022", 1024, "h100-4096"),
           ("mlperf-dcnv2-x16", 4096, "h100-4096")]
    for wl, gpus, preset in big[:1] if quick else big:
        cfg = TrialConfig(workload=Workload.preset(wl), world_size=gpus, batch_size=1024, **knobs)
        out.append((f"{wl}, {gpus:,} H100", cfg, load_cluster(shipped_cluster(f"{preset}.yaml"))))
    return out


def priced(cfg: TrialConfig, c: Cluster, sharding: str) -> dict:
    """One planner's plan on `c`: its modelled step (inf: it does not fit), kinds and wall time."""
    t0 = time.perf_counter()
    try:
        plan = plan_for(dataclasses.replace(cfg, sharding=sharding), c)
    except PlanError as e:
        return {"step_ms": math.inf, "wall_s": time.perf_counter() - t0, "error": str(e)[:160]}
    wall = time.perf_counter() - t0
    step = TableCosts(c).step_ms(cfg, plan)  # the simulated trial's estimate: plan + this is one trial's cost
    kinds: dict[str, int] = {}
    for tp in plan.tables:
        k = tp.kind + (f"/{len(tp.shards)}" if tp.kind == "column_wise" else "")
        kinds[k] = kinds.get(k, 0) + 1
    return {"step_ms": step, "wall_s": wall, "trial_s": time.perf_counter() - t0, "kinds": kinds}


def run_case(cfg: TrialConfig, c: Cluster, torchrec_max: int, con: Console) -> dict:
    rows = {}
    for s in (*SHARDING_TYPES, *GREEDY, "auto", "plan"):
        rows[s] = priced(cfg, c, s)
        con.print(f"  {s}: {rows[s]['step_ms']:.3f} ms, planned in {rows[s]['wall_s']:.2f} s, planned and "
                  f"priced in {rows[s].get('trial_s', math.nan):.2f} s")
    if cfg.world_size * cfg.workload.num_tables <= torchrec_max:
        rows["torchrec_planner"] = priced(cfg, c, "torchrec_planner")
        con.print(f"  torchrec_planner: {rows['torchrec_planner']['step_ms']:.3f} ms, planned in "
                  f"{rows['torchrec_planner']['wall_s']:.2f} s")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="MLPerf and dlrm-datasets-2022 at 128 GPUs only")
    ap.add_argument("--torchrec-max", type=int, default=128 * 26,
                    help="run TorchRec's planner up to this many ranks x tables (its enumeration and partitioning "
                         "grow with both: 788 tables on 128 ranks did not finish in 10 minutes here)")
    args = ap.parse_args()
    out = []
    con = Console(width=200)
    tab = Table(title="per-table plan vs the rest: modelled step (ms), plan's speed-up over each, planner wall time")
    for col in ("case", "plan", "best uniform", "TorchRec planner", "auto", "best greedy", "x uniform",
                "x TorchRec", "x auto", "x greedy", "wall: plan / TorchRec / uniform"):
        tab.add_column(col, justify="right")
    for name, cfg, c in cases(args.quick):
        con.print(f"[dim]{name} ...[/dim]")
        rows = run_case(cfg, c, args.torchrec_max, con)
        uni = min(SHARDING_TYPES, key=lambda s: rows[s]["step_ms"])
        greedy = min(GREEDY, key=lambda s: rows[s]["step_ms"])
        p = rows["plan"]["step_ms"]
        tr = rows.get("torchrec_planner")

        def x(ms: float, p: float = p) -> str:
            return f"{ms / p:.2f}x" if math.isfinite(ms) else "does not fit"

        tab.add_row(name, f"{p:.3f}", f"{rows[uni]['step_ms']:.3f} ({uni})",
                    f"{tr['step_ms']:.3f}" if tr else "not run", f"{rows['auto']['step_ms']:.3f}",
                    f"{rows[greedy]['step_ms']:.3f} ({greedy})", x(rows[uni]["step_ms"]),
                    x(tr["step_ms"]) if tr else "-", x(rows["auto"]["step_ms"]), x(rows[greedy]["step_ms"]),
                    f"{rows['plan']['wall_s']:.1f} / {tr['wall_s']:.1f} / {rows[uni]['wall_s']:.2f} s" if tr else
                    f"{rows['plan']['wall_s']:.1f} / - / {rows[uni]['wall_s']:.2f} s")
        out.append({"case": name, "world_size": cfg.world_size, "tables": cfg.workload.num_tables,
                    "batch_per_gpu": cfg.batch_size, "cluster": c.name, "best_uniform": uni, "best_greedy": greedy,
                    "planners": {k: {kk: (None if isinstance(vv, float) and not math.isfinite(vv) else vv)
                                     for kk, vv in v.items()} for k, v in rows.items()}})
    con.print(tab)
    DATA.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "cases": out}, indent=1))
    con.print(f"wrote {DATA}")


if __name__ == "__main__":
    main()
