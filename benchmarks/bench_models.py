"""Model families side by side: dot (DLRM) vs DCN-v2 vs Wukong on the same tables, batch and ranks.

Real 2-rank trials of the harness on MLPerf's 26 capped tables (dim 128), each family's interaction
over them, fp32 and bf16 dense; repeats alternate between the configurations so drift in the
machine's speed hits all alike. Prints samples/s (median and spread), the time breakdown and the
dense share of the step, plus the analytic GEMM FLOPs a sample, and writes the rows as JSON.

    .venv/bin/python benchmarks/bench_models.py [--repeats 3] [--batch 512] [--out benchmarks/data/models_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cubic_harness.config import TrialConfig
from cubic_harness.dense_cost import dense_cost
from cubic_harness.trial import run_trial
from cubic_harness.workload import Workload


def workloads() -> dict[str, Workload]:
    dot = Workload.preset("criteo-mlperf-mini")
    return {
        "dot": dot,
        "dcn": Workload.preset("mlperf-dcnv2-mini"),  # the same tables, cross rank 128
        "wukong": Workload.from_dict({**dot.to_dict(), "name": "criteo-wukong", "interaction": "wukong",
                                      "wukong_layers": 3, "wukong_fm_embs": 16, "wukong_lcb_embs": 16,
                                      "wukong_rank": 24, "wukong_mlp": [512, 512]}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/data/models_cpu.json"))
    a = ap.parse_args()
    # each family at its space's dense learning rate (search_spaces/*_cpu.yaml): speed does not depend on it
    lrs = {"dot": 0.01, "dcn": 0.001, "wukong": 0.0003}
    cfgs = {(fam, prec): TrialConfig(workload=wl, world_size=2, batch_size=a.batch, kernel="native",
                                     dense_precision=prec, warmup_steps=2, measure_steps=a.steps, windows=2,
                                     timeout_s=300, dense_lr=lrs[fam])
            for fam, wl in workloads().items() for prec in ("fp32", "bf16")}
    runs: dict[tuple[str, str], list] = {k: [] for k in cfgs}
    for rep in range(a.repeats):
        for k, cfg in cfgs.items():
            r = run_trial(cfg)
            assert r.status == "ok", (k, r.error)
            runs[k].append(r)
            print(f"repeat {rep + 1}/{a.repeats} {k[0]:7} {k[1]}: {r.qps:9.0f} samples/s", flush=True)
    rows = []
    print("\n| family | dense | samples/s (median, min-max) | vs dot | emb fwd+bwd ms | comm ms | dense ms | "
          "optim ms | dense share | GFLOP/sample fwd+bwd | dense params |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (fam, prec), rs in runs.items():
        q = [r.qps for r in rs]
        bd = {p: statistics.median(r.breakdown_ms[p] for r in rs) for p in rs[0].breakdown_ms}
        step = sum(bd.values())
        dot_q = statistics.median(r.qps for r in runs[("dot", prec)])
        c = dense_cost(cfgs[(fam, prec)].workload)
        row = {"family": fam, "dense_precision": prec, "qps_median": statistics.median(q), "qps": q,
               "vs_dot": statistics.median(q) / dot_q, "breakdown_ms": bd, "dense_share": bd["dense"] / step,
               "gflop_per_sample": c.flops / 1e9, "dense_params": c.params}  # 10-step speed runs: no NE
        rows.append(row)
        print(f"| {fam} | {prec} | {row['qps_median']:,.0f} ({min(q):,.0f}-{max(q):,.0f}) | {row['vs_dot']:.2f}x | "
              f"{bd['emb_fwd'] + bd['emb_bwd']:.1f} | {bd['comm']:.1f} | {bd['dense']:.1f} | {bd['optim']:.1f} | "
              f"{row['dense_share']:.0%} | {c.flops / 1e9:.4f} | {c.params:,} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"batch_per_rank": a.batch, "world_size": 2, "repeats": a.repeats,
                                 "rows": rows}, indent=1) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
