"""The MLPerf DLRM-DCNv2 dense part, measured on one GPU: what the GPU presets' dense figures
(`dense_gflops`, `gemm_half_mflop`, `elementwise_gbs`) predict for it, checked on a model they were
not set from (benchmarks/sim_dense_check.py compares; docs/simulator.md has the table).

Per-GPU batches of MLPerf's 8-GPU submissions (global 55,296 / 8 = 6,912) and around them; fp32 and
bf16 autocast; forward + backward (with the pooled input's gradient, as in a step) launched eagerly
and replayed as one CUDA graph (the device's time alone, as HugeCTR's submissions run it), and the
dense Adagrad step on its own. Event-timed medians of `--reps` calls after warm-up, with their range.

    python benchmarks/gpu_dense.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from bench_gpu_kernels import event_times  # (benchmarks/ is on the path of a script run from it)

from cubic_harness.dense_cost import dense_cost
from cubic_harness.model import build_dense_arch
from cubic_harness.sim.calibrate import graphed
from cubic_harness.workload import Workload

BATCHES = (1728, 3456, 6912, 13824)


def timed(fn: Callable[[], object], reps: int) -> dict[str, float]:
    """Median and range (ms) of `reps` event-timed calls after warm-up."""
    out = event_times(fn, reps, warmup=5)
    return {"median_ms": round(statistics.median(out), 4), "min_ms": round(min(out), 4),
            "max_ms": round(max(out), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    wl = Workload.preset("mlperf-dcnv2")
    dc = dense_cost(wl)
    arch = build_dense_arch(wl, 0).to(dev)
    opt = torch.optim.Adagrad(arch.parameters(), lr=0.01, foreach=True)
    rows = []
    for prec in ("fp32", "bf16"):
        for B in BATCHES:
            x = torch.randn(B, wl.dense_features, device=dev)
            pooled = torch.randn(B, wl.num_tables * wl.dim, device=dev, requires_grad=True)
            y = torch.rand(B, device=dev)

            def step(x=x, pooled=pooled, y=y, prec=prec) -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec != "fp32", cache_enabled=False):
                    logits = arch(x, pooled)
                torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), y).backward()

            def forward(x=x, pooled=pooled, prec=prec) -> None:
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=prec != "fp32"):
                    arch(x, pooled)

            row = {"precision": prec, "batch": B, "gemm_mflop_fwd": round(dc.flops_fwd * B / 1e6, 1),
                   "fwd_bwd": timed(step, args.reps), "fwd": timed(forward, args.reps)}
            try:  # the device's time alone: the step replayed as one CUDA graph
                row["fwd_bwd_graph"] = timed(graphed(step, dev), args.reps)
            except RuntimeError as e:
                row["fwd_bwd_graph"] = {"error": str(e)[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    optim = timed(opt.step, args.reps)
    print(json.dumps({"adagrad": optim, "params": dc.params}), flush=True)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "workload": wl.name,
           "reps": args.reps, "rows": rows, "adagrad": optim, "params": dc.params}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
