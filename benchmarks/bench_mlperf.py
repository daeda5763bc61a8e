"""The simulator against MLPerf Training's published DLRM-DCNv2 results (issue 21's validation).

Measured: NVIDIA's MLPerf Training v3.0 closed-division DLRM-DCNv2 submissions on DGX H100
(HugeCTR), result_0 of each system, from the public logs in mlcommons/training_results_v3.0 at
commit 9f08e30 (NVIDIA/results/dgxh100{,_n8,_n16}_ngc23.04_merlin_hugectr/dlrm_dcnv2/result_0.txt):
the training rate between two evaluations (0.05 epoch = 0.05 x 4,195,197,692 samples over the
time from one `eval_stop` to the next `eval_start`, median over the run's intervals) and the log's
own `tracked_stats.throughput` (which includes the evaluations).

Protocol (as the issue asks): ONE parameter is fitted so that the 8-GPU point is predicted exactly;
the 64- and 128-GPU points are then predicted with nothing else changed. Two such fits, both shown
(`FITS`): every device rate x one factor, or the framework's fixed cost per step. Reported per
sharding of our harness (HugeCTR runs its own hybrid embedding, which our harness does not have:
the simulator models our harness), with each error and the 64 -> 128 scaling ratio.

    .venv/bin/python benchmarks/bench_mlperf.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from harness.config import TrialConfig  # noqa: E402
from harness.sim.backend import simulate  # noqa: E402
from harness.sim.cluster import Cluster, load_cluster, shipped_cluster  # noqa: E402
from harness.workload import Workload  # noqa: E402

SOURCE = ("mlcommons/training_results_v3.0@9f08e30 "
          "NVIDIA/results/dgxh100*_ngc23.04_merlin_hugectr/dlrm_dcnv2/result_0.txt")
# gpus: (global batch, training samples/s between evaluations, the log's tracked throughput)
MLPERF = {
    8: (55_296, 14.52e6, 12_769_089),    # 14.444 s per 0.05 epoch (eval_stop 1683409425097 -> 1683409439541)
    64: (135_168, 45.80e6, 37_789_978),  # 4.572-4.637 s per 0.05 epoch
    128: (135_168, 46.00e6, 40_080_714),  # 4.52-4.60 s per 0.05 epoch
}
# Another round on the same hardware (v4.0, mlcommons/training_results_v4.0@62f111b,
# NVIDIA/results/eos_n16_ngc24.04_merlin_hugectr/dlrm_dcnv2/result_0.txt): 16 DGX H100, global batch
# 135,168, a median 2.839 s per 0.05 epoch. Its software is 1.6x v3.0's on the same H100s: a model of
# the hardware calibrated on v3.0 cannot know that, which is what this row shows.
V40_128 = (135_168, 73.85e6)
SHARDINGS = ("table_wise", "column_wise", "row_wise", "auto")


def scaled(c: Cluster, k: float) -> Cluster:
    """The cluster with every device rate x k (memory and embedding bandwidth, GEMM and elementwise rates)."""
    d = c.device
    dev = dataclasses.replace(d, mem_bw_gbs=d.mem_bw_gbs * k,
                              dense_gflops={p: v * k for p, v in d.dense_gflops.items()},
                              elementwise_gbs={p: {b: v * k for b, v in cur.items()}
                                               for p, cur in d.elementwise_gbs.items()})
    return dataclasses.replace(c, device=dev)


def config(gpus: int, sharding: str) -> TrialConfig:
    gb = MLPERF[gpus][0]
    return TrialConfig(workload=Workload.preset("mlperf-dcnv2"), world_size=gpus, batch_size=gb // gpus,
                       device="cuda", kernel="triton", sharding=sharding, emb_precision="fp16",
                       dense_precision="bf16", comm_precision="fp16", pipeline_depth=1, ranks_per_node=8)


def with_overhead(c: Cluster, ms: float) -> Cluster:
    """The cluster with the framework's fixed cost per step set to `ms` (device rates as the preset says)."""
    return dataclasses.replace(c, device=dataclasses.replace(c.device, step_overhead_ms=ms))


# The two one-parameter fits on the 8-GPU point. "rates": every device rate x k (the preset's fixed cost
# per step, 2 ms assumed for our eager-mode harness, stays). "overhead": the fixed cost per step is the
# parameter (the preset's rates: H100 kernel efficiencies measured in GPU session 5, public GEMM rates);
# HugeCTR runs its step as CUDA graphs, so a harness-sized fixed cost is the most doubtful figure.
FITS = {"rates": (scaled, 1e-3, 1e3), "overhead": (with_overhead, 0.0, 20.0)}


def fit(c: Cluster, sharding: str, how: str) -> float | None:
    """The parameter value that predicts the 8-GPU point (bisection; log scale for rates), or None if
    no value in range reaches it."""
    make, lo, hi = FITS[how]
    target = MLPERF[8][1]

    def qps(v: float) -> float:
        return simulate(config(8, sharding), make(c, v)).qps

    faster_up = how == "rates"  # larger rates: faster; larger overhead: slower
    if (qps(hi) if faster_up else qps(lo)) < target:
        return None
    for _ in range(60):
        mid = (lo * hi) ** 0.5 if how == "rates" else (lo + hi) / 2
        slow = qps(mid) < target
        lo, hi = (mid, hi) if slow == faster_up else (lo, mid)
    return (lo * hi) ** 0.5 if how == "rates" else (lo + hi) / 2


def main() -> None:
    console = Console(width=150)
    base = load_cluster(shipped_cluster("h100-128.yaml"))
    out: dict = {}
    for how in FITS:
        tab = Table(title=f"simulator vs MLPerf Training v3.0 DLRM-DCNv2 on DGX H100, one parameter fitted on 8 "
                    f"GPUs: {how} (training samples/s; {SOURCE})")
        for col in ("sharding", f"{how} (fit on 8 GPUs)", "8: pred / meas", "64: pred / meas (err)",
                    "128: pred / meas (err)", "64->128 pred / meas", "128 GPUs: phases ms (emb, comm, dense)",
                    "v4.0 128 (err)"):
            tab.add_column(col, justify="right")
        out[how] = {}
        for sh in SHARDINGS:
            k = fit(base, sh, how)
            if k is None:
                tab.add_row(sh, "cannot reach the 8-GPU point", *[""] * 6)
                out[how][sh] = {"fit": None}
                continue
            c = FITS[how][0](base, k)
            res = {g: simulate(config(g, sh), c) for g in MLPERF}
            pred = {g: r.qps for g, r in res.items()}
            err = {g: pred[g] / MLPERF[g][1] - 1 for g in MLPERF}
            ratio_p, ratio_m = pred[128] / pred[64], MLPERF[128][1] / MLPERF[64][1]
            bd = res[128].breakdown_ms
            v40 = pred[128] / V40_128[1] - 1
            out[how][sh] = {"fit": k, "pred": pred, "err": err, "ratio_pred": ratio_p, "ratio_meas": ratio_m,
                            "status": {g: r.status for g, r in res.items()}, "breakdown_128": bd,
                            "err_v40_128": v40}
            tab.add_row(sh, f"{k:.3f}" + (" ms" if how == "overhead" else "x"),
                        f"{pred[8] / 1e6:.1f}M / {MLPERF[8][1] / 1e6:.1f}M",
                        f"{pred[64] / 1e6:.1f}M / {MLPERF[64][1] / 1e6:.1f}M ({err[64]:+.0%})",
                        f"{pred[128] / 1e6:.1f}M / {MLPERF[128][1] / 1e6:.1f}M ({err[128]:+.0%})",
                        f"{ratio_p:.2f} / {ratio_m:.2f}",
                        f"{bd['emb_fwd'] + bd['emb_bwd']:.1f}, {bd['comm']:.1f}, {bd['dense'] + bd['optim']:.1f}",
                        f"{v40:+.0%}")
        console.print(tab)
    (Path(__file__).resolve().parent / "data" / "mlperf_validation.json").write_text(
        json.dumps({"source": SOURCE, "measured": {str(g): v for g, v in MLPERF.items()}, "v4.0_128": V40_128,
                    "results": out}, indent=1, default=str))


if __name__ == "__main__":
    main()
