"""How well the simulator predicts real trials it was never fitted on (issue 16's fidelity check).

The simulator's numbers come from `cubic calibrate` alone (micro-benchmarks: clusters/local.yaml);
nothing here is fitted. Two sets of measured trials are predicted:

  landscape: every configuration of benchmarks/data/landscape_cpu.parquet (40 configurations x 2
      repeats, measured 2026-11-22 on a loaded machine: its repeats disagree by 50% at the median)
  fresh A:   `measure --set a` runs FRESH (33 configurations across sharding types and planners, batch
      sizes, kernels, table / dense / comm precisions, optimizers, pipelining, threads, 2D sparse
      parallelism with both syncs, 4 ranks, and the DCNv2 and Wukong families), one real trial at a
      time, into benchmarks/data/sim_fidelity_cpu.json. Its errors showed which mechanisms the model
      lacked, so it is not a clean test any more;
  fresh B:   `measure --set b`: 32 other configurations (combinations, 4-rank 2D, other workloads),
      measured after the model was frozen: the held-out score (sim_fidelity_cpu_b.json)

and for each: Kendall tau between predicted and measured qps, the median and 90th-percentile relative
error of the predicted qps, and whether the measured best is in the predicted top 3.

    .venv/bin/python benchmarks/bench_sim_fidelity.py measure [--set a|b]   # ~6 min of real trials
    .venv/bin/python benchmarks/bench_sim_fidelity.py report    # seconds: predict both sets, print
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cubic_harness.config import TrialConfig  # noqa: E402
from cubic_harness.sim.backend import simulate  # noqa: E402
from cubic_harness.sim.cluster import local_cluster  # noqa: E402
from cubic_harness.workload import Workload  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
OUT = DATA / "sim_fidelity_cpu.json"  # set A
OUT_B = DATA / "sim_fidelity_cpu_b.json"  # set B, held out from the model as of 58b2732
OUT_C = DATA / "sim_fidelity_cpu_c.json"  # set C, random configurations of the CPU space, held out
STEPS = {"warmup_steps": 3, "measure_steps": 12, "windows": 3, "timeout_s": 300}

FRESH: list[dict] = [
    {},
    {"sharding": "row_wise"}, {"sharding": "column_wise"}, {"sharding": "table_row_wise"},
    {"sharding": "data_parallel"}, {"sharding": "lookup_greedy"}, {"sharding": "auto"},
    {"batch_size": 512}, {"batch_size": 2048}, {"batch_size": 4096},
    {"kernel": "fbgemm"}, {"kernel": "torch"}, {"emb_precision": "fp16"}, {"kernel": "fbgemm", "emb_precision": "fp16"},
    {"dense_precision": "bf16"}, {"comm_precision": "bf16"}, {"comm_precision": "fp16"},
    {"pipeline_depth": 1}, {"pipeline_depth": 2}, {"threads_per_rank": 2}, {"emb_optimizer": "sgd"},
    {"sharding_group_size": 1, "sparse_sync": "grad_allreduce"},
    {"sharding_group_size": 1, "sparse_sync": "weight_avg", "sparse_sync_interval": 1},
    {"sharding_group_size": 1, "sparse_sync": "weight_avg", "sparse_sync_interval": 8},
    {"world_size": 4}, {"world_size": 4, "sharding": "row_wise"},
    {"world_size": 4, "sharding_group_size": 2, "sparse_sync": "grad_allreduce"},
    {"world_size": 4, "sharding_group_size": 2, "sparse_sync": "weight_avg", "sparse_sync_interval": 8,
     "group_placement": "cross_node"},
    {"batch_size": 2048, "dense_precision": "bf16", "comm_precision": "fp16", "pipeline_depth": 2},
    {"kernel": "torch", "batch_size": 4096},
    {"batch_size": 4096, "dense_precision": "bf16", "sharding": "column_wise"},
    {"workload": "mlperf-dcnv2-mini"}, {"workload": "wukong-mini"},
]


# Set B: measured after the model was frozen (commit 'sim: model frozen for held-out set B'); set A above
# guided which mechanisms the model needed (the 2D merge's own work, the collection's id routing), so
# only B is free of that: the honest score.
HELD_OUT: list[dict] = [
    {"batch_size": 2048, "sharding": "row_wise"}, {"batch_size": 512, "kernel": "fbgemm"},
    {"batch_size": 4096, "emb_precision": "fp16"}, {"batch_size": 2048, "sharding": "column_wise",
                                                    "comm_precision": "bf16"},
    {"sharding": "size_greedy", "dense_precision": "bf16"}, {"sharding": "size_lookup_greedy", "batch_size": 2048},
    {"sharding": "data_parallel", "batch_size": 2048}, {"sharding": "auto", "batch_size": 4096},
    {"kernel": "torch", "batch_size": 512}, {"kernel": "fbgemm", "batch_size": 4096, "dense_precision": "bf16"},
    {"threads_per_rank": 2, "batch_size": 2048}, {"threads_per_rank": 2, "kernel": "fbgemm"},
    {"pipeline_depth": 1, "batch_size": 4096}, {"pipeline_depth": 2, "sharding": "row_wise"},
    {"emb_optimizer": "sgd", "batch_size": 2048, "comm_precision": "fp16"},
    {"world_size": 4, "batch_size": 512}, {"world_size": 4, "sharding": "column_wise"},
    {"world_size": 4, "sharding": "data_parallel"}, {"world_size": 4, "dense_precision": "bf16", "batch_size": 2048},
    {"world_size": 4, "sharding_group_size": 1, "sparse_sync": "grad_allreduce"},
    {"world_size": 4, "sharding_group_size": 2, "sparse_sync": "weight_avg", "sparse_sync_interval": 1},
    {"world_size": 4, "sharding_group_size": 2, "sparse_sync": "grad_allreduce", "group_placement": "cross_node"},
    {"sharding_group_size": 1, "sparse_sync": "weight_avg", "sparse_sync_interval": 8, "batch_size": 2048},
    {"sharding_group_size": 1, "sparse_sync": "grad_allreduce", "batch_size": 4096},
    {"workload": "criteo-mlperf-mini"}, {"workload": "criteo-mlperf-mini", "batch_size": 2048,
                                         "dense_precision": "bf16"},
    {"workload": "mlperf-dcnv2-mini", "dense_precision": "bf16"}, {"workload": "wukong-mini", "batch_size": 512},
    {"workload": "mlperf-dcnv2-mini", "sharding": "row_wise", "batch_size": 512},
    {"workload": "tiny", "batch_size": 4096}, {"workload": "tiny", "world_size": 4, "sharding": "row_wise"},
    {"batch_size": 1024, "kernel": "native", "emb_precision": "bf16"},
]


def random_space_configs(n: int = 32, seed: int = 2026) -> list[dict]:
    """Set C: configurations drawn uniformly from the default CPU search space (what a tune explores),
    measured after calibrate's concurrency measurement was fixed (commit 'sim: frozen for set C')."""
    import numpy as np

    from cubic.space.search_space import load_space

    space = load_space(Path(__file__).resolve().parent.parent / "search_spaces" / "dlrm_cpu.yaml")
    rng, seen, out = np.random.default_rng(seed), set(), []
    base = space.baseline_params()
    while len(out) < n:
        t = space.random_tuple(rng, seen)
        seen.add(t)
        params = space.params_of(t)
        out.append({k: v for k, v in params.items() if v != base.get(k)})
    return out


def fresh_config(knobs: dict) -> TrialConfig:
    knobs = dict(knobs)
    wl = Workload.preset(knobs.pop("workload", "small"))
    return TrialConfig(workload=wl, **STEPS).replace(**knobs)


def measure(which: str) -> None:
    from cubic_harness.trial import run_trial

    console = Console()
    rows = []
    t0 = time.time()
    todo = {"a": FRESH, "b": HELD_OUT, "c": random_space_configs()}[which]
    for i, knobs in enumerate(todo):
        res = run_trial(fresh_config(knobs))
        rows.append({"knobs": knobs, "status": res.status, "error": res.error, "qps": res.qps,
                     "qps_cv": res.qps_cv, "step_ms_p50": res.step_ms_p50, "breakdown_ms": res.breakdown_ms,
                     "peak_mem_mb": res.peak_mem_mb})
        console.print(f"[{i + 1}/{len(todo)}] {knobs or 'baseline'}: {res.status} {res.qps:,.0f} samples/s "
                      f"(cv {res.qps_cv:.1%}), load {os.getloadavg()[0]:.1f}")
    out = {"a": OUT, "b": OUT_B, "c": OUT_C}[which]
    out.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
                               "seconds": round(time.time() - t0), "steps": STEPS, "trials": rows}, indent=1))
    console.print(f"wrote {out}")


def kendall_tau(a: list[float], b: list[float]) -> float:
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            x = (a[i] - a[j]) * (b[i] - b[j])
            s += (x > 0) - (x < 0)
    return s / (n * (n - 1) / 2)


def scores(pred: list[float], meas: list[float]) -> dict:
    err = sorted(abs(p - m) / m for p, m in zip(pred, meas, strict=True))
    best = max(range(len(meas)), key=lambda i: meas[i])
    top3 = sorted(range(len(pred)), key=lambda i: -pred[i])[:3]
    return {"n": len(pred), "tau": kendall_tau(pred, meas), "median_err": statistics.median(err),
            "p90_err": err[min(len(err) - 1, round(0.9 * (len(err) - 1)))], "best_in_top3": best in top3,
            "bias": statistics.median(p / m for p, m in zip(pred, meas, strict=True))}


LANDSCAPE_TODAY = DATA / "landscape_cpu_2026-11-24.parquet"  # the same 40 configurations, re-measured:
# python benchmarks/bench_searchers.py measure --repeats 1 --out benchmarks/data/landscape_cpu_2026-11-24.parquet


def landscape_set(path: Path = DATA / "landscape_cpu.parquet") -> tuple[list[str], list[float], list[float]]:
    import pandas as pd
    import yaml

    df = pd.read_parquet(path)
    space = yaml.safe_load((DATA / "landscape_cpu_space.yaml").read_text())
    knobs = ["sharding", "batch_size", "kernel", "emb_precision"]
    meas = df[df.status == "ok"].groupby(knobs)["qps"].mean().reset_index()
    names, pred, real = [], [], []
    for _, r in meas.iterrows():
        steps = {k: v for k, v in space["trial"].items() if k in ("warmup_steps", "measure_steps", "windows")}
        cfg = TrialConfig(**{k: (int(r[k]) if k == "batch_size" else r[k]) for k in knobs}, **steps,
                          mem_cap_mb=space["constraints"]["mem_cap_mb"])
        res = simulate(cfg, local_cluster())
        names.append("/".join(str(r[k]) for k in knobs))
        pred.append(res.qps)
        real.append(float(r["qps"]))
    return names, pred, real


def fresh_set(path: Path = OUT) -> tuple[list[str], list[float], list[float], list[dict]]:
    data = json.loads(path.read_text())
    names, pred, real, rows = [], [], [], []
    for row in data["trials"]:
        if row["status"] != "ok":
            continue
        res = simulate(fresh_config(row["knobs"]), local_cluster())
        names.append(",".join(f"{k}={v}" for k, v in row["knobs"].items()) or "baseline")
        pred.append(res.qps)
        real.append(row["qps"])
        rows.append({"name": names[-1], "pred": res.qps, "real": row["qps"], "pred_bd": res.breakdown_ms,
                     "real_bd": row["breakdown_ms"], "status": res.status})
    return names, pred, real, rows


def report() -> None:
    console = Console(width=160)
    results = {}
    tab = Table(title="simulator (clusters/local.yaml, calibrated by micro-benchmarks only) vs measured qps")
    for col in ("set", "configs", "Kendall tau", "median |err|", "p90 |err|", "median pred/real",
                "measured best in predicted top 3"):
        tab.add_column(col, justify="right")
    _, lp, lr = landscape_set()
    names, fp, fr, rows = fresh_set()
    sets = {"landscape (2026-11-22, loaded)": (lp, lr), "fresh A (guided the model)": (fp, fr)}
    rows_b: list[dict] = []
    if LANDSCAPE_TODAY.exists():
        _, tp, tr = landscape_set(LANDSCAPE_TODAY)
        sets["landscape re-measured (quiet)"] = (tp, tr)
    if OUT_B.exists():
        _, bp, br, rows_b = fresh_set(OUT_B)
        sets["fresh B (held out at 58b2732)"] = (bp, br)
    rows_c: list[dict] = []
    if OUT_C.exists():
        _, cp, cr, rows_c = fresh_set(OUT_C)
        sets["fresh C (random, held out)"] = (cp, cr)
    for name, (p, r) in sets.items():
        s = scores(p, r)
        results[name] = s
        tab.add_row(name, str(s["n"]), f"{s['tau']:.2f}", f"{s['median_err']:.0%}", f"{s['p90_err']:.0%}",
                    f"{s['bias']:.2f}", "yes" if s["best_in_top3"] else "no")
    console.print(tab)
    per = Table(title="set C (random configurations, held out): predicted vs measured (ms per step by phase: "
                      "sim / real)")
    for col in ("config", "pred qps", "real qps", "pred/real", "emb fwd+bwd", "comm", "dense+optim"):
        per.add_column(col, justify="right")
    for r in sorted(rows_c, key=lambda r: r["pred"] / r["real"]):
        sb, rb = r["pred_bd"], r["real_bd"]
        per.add_row(r["name"][:60], f"{r['pred']:,.0f}", f"{r['real']:,.0f}", f"{r['pred'] / r['real']:.2f}",
                    f"{sb['emb_fwd'] + sb['emb_bwd']:.1f} / {rb['emb_fwd'] + rb['emb_bwd']:.1f}",
                    f"{sb['comm']:.1f} / {rb['comm'] + rb.get('sync', 0):.1f}",
                    f"{sb['dense'] + sb['optim']:.1f} / {rb['dense'] + rb['optim']:.1f}")
    console.print(per)
    (DATA / "sim_fidelity_scores.json").write_text(json.dumps({"scores": results, "fresh_a": rows,
                                                               "fresh_b": rows_b, "fresh_c": rows_c}, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["measure", "report"])
    ap.add_argument("--set", choices=["a", "b", "c"], default="c", help="which fresh set `measure` runs")
    args = ap.parse_args()
    measure(args.set) if args.mode == "measure" else report()
