"""Predicted vs measured peak memory per rank (issue 35 item 9): is the performance model's memory right?

Each configuration runs as a real trial (`cubic_harness.trial.run_trial`: gloo ranks on this CPU, a few steps)
and its measured peak - the highest VmHWM (peak RSS) over its ranks - is set beside the model's: the
highest `cubic_harness.sim.perf.estimate(...).mem_mb` over the group positions, priced on this machine's
calibrated cluster exactly as the tuner prices a real trial before launching it (`cubic.execution.memory_check`).
Nothing is fitted here: the model's only measured memory constant is the calibration's `process_mb`
(a bare one-rank trial's peak RSS, `cubic calibrate`).

Three sets of configurations (nothing is fitted on any of them; the model's terms are what the harness
allocates, buffer by buffer, see `cubic_harness.sim.memory`):

  dev: 10 configurations the model's terms were checked on while they were written (the criteo-mlperf-mini
      and small-zipf workloads, batch sizes 1536-6144);
  val1: 34 configurations measured as the first held-out set (small, mlperf-dcnv2-mini, small-1m). Its
      errors (DCN-v2's activations counted twice, bf16 autocast's not halved, row-wise pooled buffers G
      times larger, 2D weight_avg's merge) reshaped the model, so it is a development set since;
  val: 34 others, measured once after that, the held-out score (benchmarks/data/memory.json): across
      sharding types (table-, row-, column-, table-row-wise, data-parallel), 2D (grad_allreduce and
      weight_avg), batch sizes 512-6144, table / dense / comm precisions, pipeline_depth 0-2, 2 and 4 ranks,
      SGD and row-wise AdaGrad, and six workloads: small and small-zipf (8 x 200k x 64: 0.4 GB of fp32
      tables), criteo-mlperf-mini and mlperf-dcnv2-mini (26 tables x 128: 0.8 GB; dot and DCN-v2),
      wukong-mini (8 x 100k x 128, the Wukong stack) and small-1m (small's tables at 1M rows: 2 GB, where
      the tables are most of a rank's memory).

    .venv/bin/python benchmarks/bench_memory.py measure [--set val|val1|dev]   # ~10 min of real trials (val)
    .venv/bin/python benchmarks/bench_memory.py report [--set val|val1|dev]    # seconds: re-predict, store

A rank's RSS on CPU counts what its process touched: torch, numba's kernels, the gloo process groups,
the tables and their optimizer state, the batches, and what the allocator keeps of the step's freed
buffers. On CUDA the harness reports max_memory_allocated instead (not measured here: no GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from cubic.execution.memory_check import predict  # noqa: E402
from cubic_harness.config import TrialConfig  # noqa: E402
from cubic_harness.sim.cluster import local_cluster, local_cluster_path  # noqa: E402
from cubic_harness.workload import Workload  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
OUT = {"val": DATA / "memory.json", "dev": DATA / "memory_dev.json", "val1": DATA / "memory_val1.json"}
STEPS = {"warmup_steps": 2, "measure_steps": 3, "windows": 1, "timeout_s": 900}

TW, RW, CW, TRW, DP = "table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"
GA, WA = "grad_allreduce", "weight_avg"


def workloads() -> dict[str, Workload]:
    small = Workload.small()
    return {
        "small": small,
        "small-zipf": Workload.small_zipf(),
        "mlperf-dcnv2-mini": Workload.mlperf_dcnv2_mini(),
        "criteo-mlperf-mini": Workload.criteo_mlperf_mini(),
        # tables that dominate a rank: small's 8 tables at 1M rows (2 GB of fp32)
        "small-1m": dataclasses.replace(small, name="small-1m",
                                        tables=[dataclasses.replace(t, rows=1_000_000) for t in small.tables]),
        "wukong-mini": Workload.wukong_mini(),
    }


def c(wl: str, ws: int, sharding: str, b: int, **kw) -> dict:
    return {"wl": wl, "world_size": ws, "sharding": sharding, "batch_size": b, **kw}


SETS: dict[str, list[dict]] = {
    "dev": [
        c("small", 2, TW, 1536), c("small", 2, RW, 6144), c("small-zipf", 2, CW, 3072, emb_precision="fp16"),
        c("small", 2, DP, 3072), c("small", 4, TW, 1536, sharding_group_size=2, sparse_sync=GA),
        c("criteo-mlperf-mini", 2, TW, 1536), c("criteo-mlperf-mini", 2, RW, 3072, pipeline_depth=1),
        c("criteo-mlperf-mini", 4, TRW, 1536, ranks_per_node=2),
        c("criteo-mlperf-mini", 4, TW, 3072, sharding_group_size=2, sparse_sync=WA),
        c("small-zipf", 4, CW, 6144, comm_precision="bf16", dense_precision="bf16"),
    ],
    "val1": [
        # small: 8 x 200k x 64
        c("small", 2, TW, 1024), c("small", 2, TW, 4096, emb_precision="fp16"), c("small", 2, RW, 2048),
        c("small", 4, RW, 8192, emb_precision="fp16"), c("small", 2, CW, 1024),
        c("small", 4, CW, 4096, comm_precision="bf16"), c("small", 4, TRW, 2048, ranks_per_node=2),
        c("small", 2, DP, 512), c("small", 4, DP, 2048), c("small", 2, TW, 2048, pipeline_depth=1),
        c("small", 2, RW, 4096, pipeline_depth=2), c("small", 4, TW, 1024, sharding_group_size=2, sparse_sync=GA),
        c("small", 4, RW, 4096, sharding_group_size=2, sparse_sync=WA),
        c("small", 2, TW, 8192, dense_precision="bf16"),
        # mlperf-dcnv2-mini: 26 tables (rows capped at 200k) x 128, DCN-v2
        c("mlperf-dcnv2-mini", 2, TW, 1024), c("mlperf-dcnv2-mini", 2, TW, 4096, emb_precision="fp16"),
        c("mlperf-dcnv2-mini", 2, RW, 2048, dense_precision="bf16"),
        c("mlperf-dcnv2-mini", 4, CW, 1024, comm_precision="fp16"),
        c("mlperf-dcnv2-mini", 4, TRW, 4096, ranks_per_node=2), c("mlperf-dcnv2-mini", 2, DP, 512),
        c("mlperf-dcnv2-mini", 4, TW, 2048, pipeline_depth=2),
        c("mlperf-dcnv2-mini", 4, TW, 2048, sharding_group_size=2, sparse_sync=GA),
        c("mlperf-dcnv2-mini", 4, RW, 1024, sharding_group_size=2, sparse_sync=WA, emb_precision="fp16"),
        c("mlperf-dcnv2-mini", 2, CW, 8192, dense_precision="bf16"),
        c("mlperf-dcnv2-mini", 2, TW, 2048, emb_optimizer="sgd", comm_precision="bf16"),
        # small-1m: 8 x 1M x 64 (2 GB of fp32 tables)
        c("small-1m", 2, TW, 1024), c("small-1m", 2, RW, 4096, emb_precision="fp16"), c("small-1m", 4, CW, 2048),
        c("small-1m", 2, DP, 1024), c("small-1m", 4, TRW, 1024, ranks_per_node=2, emb_precision="bf16"),
        c("small-1m", 4, TW, 2048, sharding_group_size=2, sparse_sync=WA),
        c("small-1m", 4, RW, 1024, sharding_group_size=2, sparse_sync=GA),
        c("small-1m", 2, TW, 2048, pipeline_depth=1, comm_precision="bf16"),
        c("small-1m", 4, RW, 8192, pipeline_depth=2, dense_precision="bf16"),
    ],
    "val": [
        # small and small-zipf: 8 x 200k x 64
        c("small", 4, TW, 3072, emb_precision="fp16", comm_precision="fp16"), c("small", 2, RW, 768, pipeline_depth=1),
        c("small", 2, CW, 6144, dense_precision="bf16"),
        c("small", 4, TRW, 4096, ranks_per_node=2, comm_precision="bf16"),
        c("small", 4, DP, 1024, emb_precision="fp16"), c("small", 4, TW, 6144, sharding_group_size=2, sparse_sync=GA),
        c("small", 4, CW, 2048, sharding_group_size=2, sparse_sync=WA, emb_optimizer="sgd"),
        c("small-zipf", 2, TW, 3072), c("small-zipf", 4, RW, 1536, pipeline_depth=2, emb_precision="bf16"),
        c("small-zipf", 2, DP, 6144, dense_precision="bf16"),
        c("small-zipf", 4, CW, 3072, sharding_group_size=2, sparse_sync=WA),
        # criteo-mlperf-mini: 26 tables x 128, dot
        c("criteo-mlperf-mini", 2, TW, 768, emb_precision="fp16"),
        c("criteo-mlperf-mini", 4, RW, 3072, comm_precision="bf16"),
        c("criteo-mlperf-mini", 2, CW, 6144), c("criteo-mlperf-mini", 2, DP, 1536),
        c("criteo-mlperf-mini", 4, TRW, 6144, ranks_per_node=2, dense_precision="bf16", pipeline_depth=1),
        c("criteo-mlperf-mini", 4, TW, 1536, sharding_group_size=2, sparse_sync=GA),
        # mlperf-dcnv2-mini: the same tables, DCN-v2
        c("mlperf-dcnv2-mini", 4, TW, 1536, emb_precision="fp16"), c("mlperf-dcnv2-mini", 2, RW, 768, pipeline_depth=1),
        c("mlperf-dcnv2-mini", 2, CW, 3072, comm_precision="bf16"), c("mlperf-dcnv2-mini", 4, DP, 768),
        c("mlperf-dcnv2-mini", 4, TRW, 1536, ranks_per_node=2, dense_precision="bf16"),
        c("mlperf-dcnv2-mini", 4, TW, 3072, sharding_group_size=2, sparse_sync=WA),
        c("mlperf-dcnv2-mini", 4, RW, 6144, sharding_group_size=2, sparse_sync=GA, dense_precision="bf16"),
        # wukong-mini: 8 x 100k x 128, Wukong
        c("wukong-mini", 2, TW, 1024), c("wukong-mini", 2, RW, 2048, dense_precision="bf16"),
        c("wukong-mini", 4, CW, 512, pipeline_depth=2), c("wukong-mini", 2, DP, 768),
        # small-1m: 8 x 1M x 64
        c("small-1m", 2, TW, 3072, emb_precision="fp16"), c("small-1m", 2, RW, 1536, comm_precision="fp16"),
        c("small-1m", 2, CW, 6144, pipeline_depth=1), c("small-1m", 4, DP, 768),
        c("small-1m", 4, TRW, 3072, ranks_per_node=2),
        c("small-1m", 4, RW, 3072, sharding_group_size=2, sparse_sync=WA, emb_precision="fp16"),
    ],
}

SHORT = {TW: "tw", RW: "rw", CW: "cw", TRW: "trw", DP: "dp"}


def config(spec: dict) -> TrialConfig:
    kw = {k: v for k, v in spec.items() if k != "wl"}
    return TrialConfig(workload=workloads()[spec["wl"]], **STEPS, **kw)


def kind(spec: dict) -> str:
    if spec.get("sharding_group_size"):
        return f"2D {spec.get('sparse_sync', GA)}"
    return spec["sharding"]


def describe(spec: dict) -> str:
    s = [spec["wl"], SHORT[spec["sharding"]], f"W{spec['world_size']}", f"B{spec['batch_size']}"]
    if spec.get("sharding_group_size"):
        s.append(f"G{spec['sharding_group_size']} {'ga' if spec.get('sparse_sync', GA) == GA else 'wa'}")
    for key, short in (("emb_precision", "emb"), ("dense_precision", "dense"), ("comm_precision", "comm")):
        if spec.get(key, "fp32") != "fp32":
            s.append(f"{short} {spec[key]}")
    if spec.get("pipeline_depth"):
        s.append(f"pipe{spec['pipeline_depth']}")
    if spec.get("emb_optimizer"):
        s.append(spec["emb_optimizer"])
    return " ".join(s)


def predicted(spec: dict) -> tuple[float, list[float]]:
    p = predict(config(spec), local_cluster())
    if p is None:
        raise SystemExit(f"the model cannot predict {describe(spec)} (is this machine calibrated?)")
    return p.peak_mb, p.mem_mb


def row(spec: dict, measured: float, extra: dict) -> dict:
    pred, per = predicted(spec)
    return {"desc": describe(spec), "kind": kind(spec), "spec": spec, "predicted_mb": round(pred, 1),
            "per_position_mb": [round(x, 1) for x in per], "measured_mb": round(measured, 1),
            "error": round(pred / measured - 1, 4), **extra}


def summary(rows: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in rows if r.get("status", "ok") == "ok"]
    by_kind: dict[str, list[float]] = {}
    for r in rows:
        if r.get("status", "ok") == "ok":
            by_kind.setdefault(r["kind"], []).append(r["error"])
    signed = [r["error"] for r in rows if r.get("status", "ok") == "ok"]
    return {"n": len(errs), "median_abs_error": round(statistics.median(errs), 4),
            "worst_abs_error": round(max(errs), 4), "mean_error": round(statistics.mean(signed), 4),
            "within_10pct": sum(e <= 0.10 for e in errs),
            "by_kind": {k: {"n": len(v), "median_abs_error": round(statistics.median(abs(e) for e in v), 4),
                            "worst_error": round(max(v, key=abs), 4)} for k, v in sorted(by_kind.items())}}


def show(rows: list[dict], title: str, console: Console) -> dict:
    t = Table(title=title)
    for col, just in (("#", "right"), ("configuration", "left"), ("kind", "left"), ("predicted MB", "right"),
                      ("measured MB", "right"), ("error", "right")):
        t.add_column(col, justify=just)
    for i, r in enumerate(rows):
        e = r["error"]
        color = "green" if abs(e) <= 0.10 else "yellow" if abs(e) <= 0.20 else "red"
        t.add_row(str(i), r["desc"], r["kind"], f"{r['predicted_mb']:,.0f}", f"{r['measured_mb']:,.0f}",
                  f"[{color}]{e:+.1%}[/]")
    console.print(t)
    s = summary(rows)
    console.print(f"n={s['n']}  median |error| {s['median_abs_error']:.1%}  worst |error| "
                  f"{s['worst_abs_error']:.1%}  mean (signed) {s['mean_error']:+.1%}  within 10%: "
                  f"{s['within_10pct']}/{s['n']}")
    k = Table(title="by kind")
    for col in ("kind", "n", "median |error|", "worst error"):
        k.add_column(col)
    for name, v in s["by_kind"].items():
        k.add_row(name, str(v["n"]), f"{v['median_abs_error']:.1%}", f"{v['worst_error']:+.1%}")
    console.print(k)
    return s


def measure(which: str, console: Console) -> None:
    from cubic_harness.trial import run_trial

    specs = SETS[which]
    rows = []
    t0 = time.time()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("measuring", total=len(specs))
        for spec in specs:
            progress.update(task, description=describe(spec))
            t = time.perf_counter()
            res = run_trial(config(spec))
            wall = round(time.perf_counter() - t, 1)
            if res.status != "ok":
                console.print(f"[red]{describe(spec)}: {res.status}: {res.error}[/]")
                rows.append({"desc": describe(spec), "kind": kind(spec), "spec": spec, "status": res.status,
                             "error_msg": res.error})
            else:
                r = row(spec, res.peak_mem_mb, {"wall_s": wall})
                rows.append(r)
                progress.console.print(f"{r['desc']:<55} predicted {r['predicted_mb']:>7,.0f} MB  measured "
                                       f"{r['measured_mb']:>7,.0f} MB  {r['error']:+.1%}  ({wall:.0f} s)")
            progress.advance(task)
    ok = [r for r in rows if r.get("status", "ok") == "ok"]
    s = show(ok, f"peak memory per rank, {which} set: predicted vs measured", console)
    meta = {"set": which, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
            "seconds": round(time.time() - t0), "host": platform.node(), "cpus": os.cpu_count(),
            "cluster": str(local_cluster_path()), "steps": STEPS,
            "measured": "max over ranks of VmHWM (peak RSS) of a real CPU trial (gloo ranks)",
            "predicted": "max over group positions of cubic_harness.sim.perf.estimate(cfg, plan_for(cfg), "
                         "local cluster).mem_mb (cubic.execution.memory_check.predict)"}
    OUT[which].parent.mkdir(parents=True, exist_ok=True)
    OUT[which].write_text(json.dumps({"meta": meta, "summary": s, "rows": rows}, indent=1) + "\n")
    console.print(f"wrote {OUT[which]}")


def report(which: str, console: Console) -> None:
    """Re-predict the stored measurements with the model as it is now (nothing runs) and store the predictions
    beside them (`meta.predicted_when`)."""
    d = json.loads(OUT[which].read_text())
    rows = [row(r["spec"], r["measured_mb"], {k: r[k] for k in ("wall_s",) if k in r})
            for r in d["rows"] if r.get("status", "ok") == "ok"]
    s = show(rows, f"peak memory per rank, {which} set (measured {d['meta']['when']}), predicted now", console)
    d["meta"]["predicted_when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    OUT[which].write_text(json.dumps({"meta": d["meta"], "summary": s, "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("measure", "report"))
    ap.add_argument("--set", dest="which", choices=tuple(SETS), default="val")
    a = ap.parse_args()
    console = Console()
    if a.what == "measure":
        measure(a.which, console)
    else:
        report(a.which, console)


if __name__ == "__main__":
    main()
