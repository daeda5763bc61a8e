"""Embedding-bag kernel micro-benchmark: fbgemm vs torch vs native, side by side.

Times forward and fused backward+optimizer (ms per call, median and min over repeats, warm-up
excluded, kernels interleaved call by call) on the `small` workload shape (8 tables x 200k x 64,
batch 1024, pooling 20), uniform and Zipf ids, 1 and 2 threads, and compares them with the byte
floor: the bytes a step must move (rows read in forward; distinct rows read+written and their
state in backward) at this machine's measured copy bandwidth for that thread count.

    python benchmarks/bench_kernels.py [--repeats 20] [--threads 1,2] [--kernels fbgemm,torch,native]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from cubic_harness.data import make_batch
from cubic_harness.workload import Workload
from cubic_kernels import OptimSpec, make_kernel


def copy_bandwidth(threads: int, nbytes: int = 512 << 20, allocations: int = 3, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a large tensor copy on `threads` threads: the
    median over fresh allocations and repeats. Not the best: on this VM the 2-thread figure is
    bimodal by allocation (~43 or ~71 GB/s), and the median keeps the usual mode."""
    torch.set_num_threads(threads)
    rates = []
    for _ in range(allocations):
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            rates.append(2 * nbytes / (time.perf_counter() - t0))
        del src, dst
    return statistics.median(rates)


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


def time_kernels(kernels: dict, batches, repeats: int, warmup: int = 3) -> dict[str, tuple[list, list]]:
    """Per-call ms of forward and backward_update for every kernel, interleaved call by call (so
    load from other processes hits all kernels alike), cycling over `batches`, warm-up excluded."""
    grad = torch.randn(batches[0].batch_size, next(iter(kernels.values())).total_dim) * 1e-3
    res = {name: ([], []) for name in kernels}
    for i in range(warmup + repeats):
        b = batches[i % len(batches)]
        for name, k in kernels.items():
            t0 = time.perf_counter()
            k.forward(b.ids, b.offsets)
            t1 = time.perf_counter()
            k.backward_update(b.ids, b.offsets, grad)
            t2 = time.perf_counter()
            if i >= warmup:
                res[name][0].append((t1 - t0) * 1e3)
                res[name][1].append((t2 - t1) * 1e3)
    return res


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--kernels", default="fbgemm,torch,native")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--optim", default="rowwise_adagrad")
    args = ap.parse_args()
    console = Console(width=150)

    wl = Workload.small()
    rows = [t.rows for t in wl.tables]
    dims = [t.dim for t in wl.tables]
    B = 1024
    elem = 4 if args.dtype == "fp32" else 2
    adagrad = args.optim == "rowwise_adagrad"
    thread_counts = [int(x) for x in args.threads.split(",")]
    console.print(f"workload {wl.name}: {len(rows)} tables x {rows[0]} x {dims[0]}, batch {B}, pooling "
                  f"{wl.tables[0].pooling}, {args.dtype} weights, {args.optim}; load average "
                  f"{os.getloadavg()[0]:.1f}")

    init = [torch.randn(r, d, generator=torch.Generator().manual_seed(t)) * 0.01
            for t, (r, d) in enumerate(zip(rows, dims, strict=True))]
    table = Table(title=f"ms per call: median (min), {args.repeats} interleaved repeats after warm-up")
    for col in ("ids", "thr", "kernel", "forward", "backward+opt", "step", "native faster", "x floor"):
        table.add_column(col, justify="right")
    kernels = {}
    for name in args.kernels.split(","):
        try:
            kernels[name] = make_kernel(name, rows, dims, weight_dtype=args.dtype,
                                        optim=OptimSpec(args.optim, lr=0.01))
        except Exception as e:  # e.g. fbgemm not installed
            console.print(f"[yellow]skip {name}: {e}")
            continue
        kernels[name].load(init)
    summary = []
    for dist in ("uniform", "zipf"):
        wl_d = dataclasses.replace(wl, tables=[dataclasses.replace(t, id_dist=dist) for t in wl.tables])
        batches = [make_batch(wl_d, 0, s * B, B) for s in range(4)]
        fb, bb = zip(*(floor_bytes(b.ids, b.offsets, rows, dims, elem, adagrad) for b in batches),
                     strict=True)
        for nt in thread_counts:
            # the floor's bandwidth is measured right before and after the kernels (this VM's
            # 2-thread bandwidth changes over time, ~41 or ~70 GB/s), and averaged
            bw0 = copy_bandwidth(nt, allocations=1)
            res = time_kernels(kernels, batches, args.repeats)
            bw = (bw0 + copy_bandwidth(nt, allocations=1)) / 2
            floor = (statistics.mean(fb) / bw * 1e3, statistics.mean(bb) / bw * 1e3)
            step = {n: [a + b for a, b in zip(*res[n], strict=True)] for n in res}
            med = {n: statistics.median(v) for n, v in step.items()}
            for name, (fwd, bwd) in res.items():
                faster = f"{med[name] / med['native']:.1f}x" if "native" in med and name != "native" else ""
                table.add_row(dist, str(nt), name, fmt(fwd), fmt(bwd), fmt(step[name]), faster,
                              f"{med[name] / sum(floor):.2f}x")
            table.add_row(dist, str(nt), f"byte floor @{bw / 1e9:.0f} GB/s", f"{floor[0]:.2f}", f"{floor[1]:.2f}",
                          f"{sum(floor):.2f}", "", "1.00x", end_section=True)
            summary.append((dist, nt, med, sum(floor)))
    console.print(table)
    for dist, nt, med, floor in summary:
        if "native" in med:
            line = (f"{dist:8s} {nt} thr: native step {med['native']:.2f} ms = "
                    f"{med['native'] / floor:.2f}x floor")
            if "fbgemm" in med:
                line += f", {med['fbgemm'] / med['native']:.1f}x faster than fbgemm ({med['fbgemm']:.2f} ms)"
            console.print(line)
    console.print(f"load average at end {os.getloadavg()[0]:.1f} (on 2 cores, >1: other work shared them)")


if __name__ == "__main__":
    main()
