"""Embedding-bag kernel micro-benchmark: fbgemm vs torch vs native, side by side.

Times forward and fused backward+optimizer (ms per call, median and spread over repeats,
warm-up excluded) on the `small` workload shape (8 tables x 200k x 64, batch 1024, pooling 20),
uniform and Zipf ids, 1 and 2 threads, and compares them with the byte floor: the bytes a step
must move (rows read in forward; rows read+written and state in backward) at this machine's
measured copy bandwidth.

    python benchmarks/bench_kernels.py [--repeats 15] [--kernels fbgemm,torch,native]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from harness.data import make_batch
from harness.workload import Workload
from kernels import OptimSpec, make_kernel


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 7) -> float:
    """Bytes moved per second (read + write) by a large single-threaded tensor copy."""
    torch.set_num_threads(1)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)


def floor_bytes(ids: torch.Tensor, offsets: torch.Tensor, rows: list[int], dims: list[int],
                elem: int, adagrad: bool) -> tuple[int, int]:
    """(forward, backward) bytes that cannot be avoided: forward reads every looked-up row;
    backward reads and writes each distinct row once (and its 4-byte state)."""
    T = len(rows)
    B = (offsets.numel() - 1) // T
    fwd = bwd = 0
    for t in range(T):
        tid = ids[int(offsets[t * B]): int(offsets[(t + 1) * B])]
        fwd += tid.numel() * dims[t] * elem
        bwd += torch.unique(tid).numel() * (2 * dims[t] * elem + (8 if adagrad else 0))
    return fwd, bwd


def time_kernel(kernel, batches, repeats: int, warmup: int = 3) -> tuple[list[float], list[float]]:
    """Per-call ms of forward and backward_update, cycling over `batches` (warm-up excluded)."""
    grad = torch.randn(batches[0].batch_size, kernel.total_dim) * 1e-3
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        kernel.forward(b.ids, b.offsets)
        t1 = time.perf_counter()
        kernel.backward_update(b.ids, b.offsets, grad)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
    return fwd, bwd


def fmt(xs: list[float]) -> str:
    med = statistics.median(xs)
    spread = (np.percentile(xs, 90) - np.percentile(xs, 10)) / med * 100
    return f"{med:7.2f} ±{spread:3.0f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kernels", default="fbgemm,torch,native")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--optim", default="rowwise_adagrad")
    args = ap.parse_args()
    console = Console()

    bw = copy_bandwidth()
    wl = Workload.small()
    rows = [t.rows for t in wl.tables]
    dims = [t.dim for t in wl.tables]
    B = 1024
    elem = 4 if args.dtype == "fp32" else 2
    adagrad = args.optim == "rowwise_adagrad"
    console.print(f"workload {wl.name}: {len(rows)} tables x {rows[0]} x {dims[0]}, batch {B}, pooling "
                  f"{wl.tables[0].pooling}, {args.dtype} weights, {args.optim}; copy bandwidth "
                  f"{bw / 1e9:.1f} GB/s (1 thread, read+write)")

    init = [torch.randn(r, d, generator=torch.Generator().manual_seed(t)) * 0.01
            for t, (r, d) in enumerate(zip(rows, dims, strict=True))]
    table = Table(title=f"ms per call (median ±p10-p90 spread), {args.repeats} repeats after warm-up")
    for col in ("ids", "thr", "kernel", "forward", "backward+opt", "step", "vs fbgemm", "vs floor"):
        table.add_column(col, justify="right")
    kernels = args.kernels.split(",")
    summary = {}
    for dist in ("uniform", "zipf"):
        wl_d = dataclasses.replace(wl, tables=[dataclasses.replace(t, id_dist=dist) for t in wl.tables])
        batches = [make_batch(wl_d, 0, s, 0, B) for s in range(4)]
        fb, bb = zip(*(floor_bytes(b.ids, b.offsets, rows, dims, elem, adagrad) for b in batches), strict=True)
        floor_ms = (statistics.mean(fb) + statistics.mean(bb)) / bw * 1e3
        for nt in (int(x) for x in args.threads.split(",")):
            torch.set_num_threads(nt)
            step_ms = {}
            for name in kernels:
                try:
                    k = make_kernel(name, rows, dims, weight_dtype=args.dtype, optim=OptimSpec(args.optim, lr=0.01))
                except Exception as e:  # e.g. fbgemm not installed
                    console.print(f"[yellow]skip {name}: {e}")
                    continue
                k.load(init)
                fwd, bwd = time_kernel(k, batches, args.repeats)
                step = [a + b for a, b in zip(fwd, bwd, strict=True)]
                step_ms[name] = statistics.median(step)
                vs_fb = f"{step_ms['fbgemm'] / step_ms[name]:.1f}x" if "fbgemm" in step_ms else "-"
                table.add_row(dist, str(nt), name, fmt(fwd), fmt(bwd), fmt(step), vs_fb,
                              f"{step_ms[name] / floor_ms:.2f}x")
                del k
            summary[(dist, nt)] = step_ms
            table.add_row(dist, str(nt), "floor", f"{statistics.mean(fb) / bw * 1e3:7.2f}",
                          f"{statistics.mean(bb) / bw * 1e3:7.2f}", f"{floor_ms:7.2f}", "", "1.00x",
                          end_section=True)
    console.print(table)
    for (dist, nt), s in summary.items():
        if "native" in s and "fbgemm" in s:
            console.print(f"{dist:8s} {nt} thr: native step {s['native']:.2f} ms = "
                          f"{s['fbgemm'] / s['native']:.1f}x faster than fbgemm ({s['fbgemm']:.2f} ms)")


if __name__ == "__main__":
    main()
