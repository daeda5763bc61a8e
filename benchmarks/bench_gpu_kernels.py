"""GPU micro-benchmark: embedding-bag kernels vs the device's copy bandwidth, and fp8 vs bf16 MLP layers.

Why: embedding lookups are memory-bound, so the honest yardstick for a kernel is the fraction of the
measured device copy bandwidth it reaches on tables much larger than L2 (default 8 x 1M x 128 fp32 =
4 GiB); and fp8 only helps the MLP layers where the probe shows it is both accurate and faster.

    python benchmarks/bench_gpu_kernels.py                      # defaults
    python benchmarks/bench_gpu_kernels.py --backends triton --rows 4000000 --skew 3

Timing: torch.cuda.Event, warm-up excluded, median of repeats; the backward also "queued" (10 calls
back to back, no sync between: launch overheads overlap device work, as in a training step).
Byte counts are the floor, the fewest bytes device memory must move: forward reads each distinct
looked-up row once (plus ids and offsets) and writes the pooled output; the fused backward reads the
output gradient once, the ids, and reads+writes each unique row (and its AdaGrad state) once.
Re-reads served by L2 are not counted, so "%copy" is the kernel's fraction of the copy roofline on the floor bytes.
Needs CUDA; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Callable

import torch

ELEM = {"fp32": 4, "fp16": 2, "bf16": 2}


def fwd_bytes(n_ids: int, n_unique: int, n_bags: int, dim: int, wbytes: int, weighted: bool = False) -> int:
    """Forward floor: each distinct row once + int64 ids (+ fp32 scores) + offsets + fp32 pooled output."""
    return n_unique * dim * wbytes + n_ids * (12 if weighted else 8) + n_bags * 8 + n_bags * dim * 4


def bwd_bytes(n_ids: int, n_unique: int, n_bags: int, dim: int, wbytes: int, adagrad: bool,
              weighted: bool = False) -> int:
    """Fused backward+update floor: output gradient once, ids (+ scores), offsets, each unique row (and state)
    r+w."""
    return (n_bags * dim * 4 + n_ids * (12 if weighted else 8) + n_bags * 8 + 2 * n_unique * dim * wbytes
            + (2 * n_unique * 4 if adagrad else 0))


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def time_ms(fn: Callable[[], object], repeats: int, warmup: int = 3, calls: int = 1) -> float:
    """Median ms per call of `fn` over `repeats` event-timed groups of `calls` calls, after `warmup`.

    `calls=1` syncs around every call, so launch overheads are charged; `calls>1` runs them back to
    back with no sync between, as a training step does when the host runs ahead of the GPU."""
    return statistics.median(event_times(fn, repeats, warmup, calls))


def event_times(fn: Callable[[], object], repeats: int, warmup: int = 3, calls: int = 1) -> list[float]:
    """`time_ms`'s ms per call of each of the `repeats` groups."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / calls)
    return out


def copy_bandwidth(gib: float, repeats: int) -> float:
    """Device-to-device copy GB/s (read + write counted), the roofline for gather kernels."""
    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda s=src, d=dst: d.copy_(s), repeats)
    del src, dst
    return gbps(2 * n * 4, ms)


def make_batch(T: int, B: int, pooling: int, rows: int, skew: float, gen: torch.Generator):
    """Table-major jagged batch: bag lengths uniform in [0, 2*pooling], ids = rows * u**skew."""
    lens = torch.randint(0, 2 * pooling + 1, (T * B,), device="cuda", generator=gen)
    offsets = torch.zeros(T * B + 1, dtype=torch.long, device="cuda")
    offsets[1:] = lens.cumsum(0)
    n = int(offsets[-1])
    u = torch.rand(n, device="cuda", generator=gen)
    ids = (u.pow(skew) * rows).long().clamp_(max=rows - 1)
    return ids, offsets


def bench_embeddings(args: argparse.Namespace, copy_gbps: float) -> list[dict]:
    from cubic_kernels import OptimSpec, make_kernel

    T, R, D, B = args.tables, args.rows, args.dim, args.batch
    wb = ELEM[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids, offsets = make_batch(T, B, args.pooling, R, args.skew, gen)
    n = ids.numel()
    table_of_id = torch.repeat_interleave(torch.arange(T, device="cuda"),
                                          offsets[B::B] - offsets[:-1:B], output_size=n)
    n_unique = int(torch.unique(table_of_id * R + ids).numel())
    grad = torch.randn(B, T * D, device="cuda")
    scores = torch.rand(n, device="cuda", generator=gen)  # per-sample weights for the :weighted variants
    print(f"\nembeddings: {T} tables x {R:,} rows x {D} {args.dtype} = {T * R * D * wb / 2**30:.2f} GiB, "
          f"B={B}, ids={n:,} (unique {n_unique:,}), optimizer {args.optim}, skew {args.skew}")
    print(f"{'backend':14} {'fwd ms':>8} {'fwd GB/s':>9} {'%copy':>6} "
          f"{'bwd ms':>8} {'bwd GB/s':>9} {'%copy':>6} {'queued':>8} {'%copy':>6}")
    results: list[dict] = []
    profiled = False
    for spec in args.backends.split(","):
        backend, *variant = spec.split(":")  # triton:8x4:p2048 = 8 rows per program, 4 warps, 2048 programs
        psw = scores if "weighted" in variant else None
        try:
            kw: dict = {}
            for v in variant:
                if v == "weighted":
                    continue  # (psw above)
                elif v == "noevict":
                    kw["evict"] = False
                elif v == "singles":
                    kw["singles"] = True
                elif v.startswith("p"):
                    kw["max_programs"] = int(v[1:])
                else:
                    br, nw = v.split("x")
                    kw.update(block_rows=int(br), num_warps=int(nw))
            k = make_kernel(backend, [R] * T, [D] * T, weight_dtype=args.dtype, device="cuda",
                            optim=OptimSpec(args.optim, lr=0.01), **kw)
        except Exception as e:  # report and go on with the other backends
            print(f"{spec:14} unavailable: {type(e).__name__}: {e}")
            continue
        for w in k.weights():
            w.uniform_(-0.01, 0.01)
        try:
            f_ms = time_ms(lambda k=k, s=psw: k.forward(ids, offsets, s), args.repeats)
            b_ms = time_ms(lambda k=k, s=psw: k.backward_update(ids, offsets, grad, s), args.repeats)
            q_ms = time_ms(lambda k=k, s=psw: k.backward_update(ids, offsets, grad, s), 5, warmup=1, calls=10)
        except Exception as e:  # e.g. a variant the compiler rejects: report and go on
            print(f"{spec:14} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        f_bw = gbps(fwd_bytes(n, n_unique, T * B, D, wb, psw is not None), f_ms)
        b_bytes = bwd_bytes(n, n_unique, T * B, D, wb, args.optim == "rowwise_adagrad", psw is not None)
        b_bw, q_bw = gbps(b_bytes, b_ms), gbps(b_bytes, q_ms)
        results.append(dict(backend=spec, fwd_ms=f_ms, fwd_gbps=f_bw, bwd_ms=b_ms, bwd_gbps=b_bw,
                            bwd_queued_ms=q_ms, bwd_queued_pct_copy=100 * q_bw / copy_gbps,
                            fwd_pct_copy=100 * f_bw / copy_gbps, bwd_pct_copy=100 * b_bw / copy_gbps))
        print(f"{spec:14} {f_ms:8.3f} {f_bw:9.1f} {100 * f_bw / copy_gbps:5.0f}% "
              f"{b_ms:8.3f} {b_bw:9.1f} {100 * b_bw / copy_gbps:5.0f}% {q_ms:8.3f} {100 * q_bw / copy_gbps:5.0f}%")
        if args.profile and backend == "triton" and not profiled:
            profile_backward(k, ids, offsets, grad)
            profiled = True
        del k
        gc.collect()
        torch.cuda.empty_cache()
    return results


def profile_backward(k, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> None:
    """Where the fused backward's time goes: device time per kernel over 5 calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            k.backward_update(ids, offsets, grad)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=48))


def mlp_dims(spec: str, d_in: int) -> list[tuple[int, int]]:
    """'1024,1024,512,256,1' with input width d_in -> [(d_in,1024), (1024,1024), ...]."""
    outs = [int(x) for x in spec.split(",") if x]
    ins = [d_in] + outs[:-1]
    return list(zip(ins, outs, strict=True))


def bench_fp8(args: argparse.Namespace) -> list[dict]:
    import torch.nn as nn

    from cubic_harness.fp8 import fp8_supported, probe_mlp

    ok, why = fp8_supported("cuda")
    dims = mlp_dims(args.mlp, args.mlp_in)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(dims):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 1:
            layers.append(nn.ReLU())
    mlp = nn.Sequential(*layers)
    batches = [torch.randn(args.mlp_batch, args.mlp_in) for _ in range(2)]
    print(f"\nfp8 probe: top MLP {args.mlp_in}->{args.mlp}, batch {args.mlp_batch} ({why})")
    probes = probe_mlp(mlp, batches, device="cuda", threshold=args.fp8_threshold, time_it=ok)
    print(f"{'layer':6} {'shape':>11} {'err bf16':>9} {'err tw':>8} {'err rw':>8} {'bf16 ms':>8} "
          f"{'fp8 ms':>8} {'speedup':>7} fp8?")
    for p in probes:
        sp = f"{p.t_bf16_ms / p.t_fp8_ms:6.2f}x" if p.t_fp8_ms and p.t_bf16_ms else "     -"
        t_b = f"{p.t_bf16_ms:8.3f}" if p.t_bf16_ms is not None else "       -"
        t_f = f"{p.t_fp8_ms:8.3f}" if p.t_fp8_ms is not None else "       -"
        print(f"{p.name:6} {p.in_features:>5}x{p.out_features:<5} {p.err_bf16:9.4f} "
              f"{p.err_fp8_tensorwise:8.4f} {p.err_fp8_rowwise:8.4f} {t_b} {t_f} {sp:>7} "
              f"{'yes' if p.use_fp8 else 'no'}")
        print(f"       {p.reason}")
    if args.profile and ok:
        profile_fp8_layer(dims[0], args.mlp_batch)
    return [p.to_dict() for p in probes]


def profile_fp8_layer(shape: tuple[int, int], batch: int) -> None:
    """Where an fp8 layer's fwd+bwd time goes, next to bf16 (device time per kernel, 5 steps)."""
    import torch.nn as nn
    from torch.profiler import ProfilerActivity, profile

    from cubic_harness.fp8 import Fp8Linear

    lin = nn.Linear(*shape).cuda()
    x = torch.randn(batch, shape[0], device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(batch, shape[1], device="cuda", dtype=torch.bfloat16)
    for name, layer in (("bf16", nn.Linear(*shape).cuda().bfloat16()), ("fp8", Fp8Linear(lin, "tensorwise"))):
        def step(layer=layer) -> None:
            xx = x.detach().requires_grad_(True)
            layer(xx).backward(gy)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(f"\n{name} {shape[0]}x{shape[1]} batch {batch}, 5 fwd+bwd steps:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="torch,triton",
                    help="comma list of cubic_kernels.BACKENDS names; triton:RxW = R rows per backward program, "
                         "W warps; "
                         "add :pN (N backward programs striding over the tiles), :noevict (no L2 eviction hints) or "
                         ":singles (rows hit once skip the sort); :weighted passes per-sample weights (TorchRec's "
                         "weighted features) to any backend")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(ELEM), default="fp32")
    ap.add_argument("--optim", choices=["rowwise_adagrad", "sgd"], default="rowwise_adagrad")
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--pooling", type=int, default=20, help="mean ids per bag")
    ap.add_argument("--skew", type=float, default=1.0, help="ids = rows * u**skew; 1 = uniform, >1 hot rows")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--mlp", default="1024,1024,512,256,1", help="top MLP widths")
    ap.add_argument("--mlp-in", type=int, default=1024)
    ap.add_argument("--mlp-batch", type=int, default=16384)
    ap.add_argument("--fp8-threshold", type=float, default=0.1)
    ap.add_argument("--skip-emb", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-kernel device time of the triton backward")
    ap.add_argument("--skip-fp8", action="store_true")
    ap.add_argument("--json", help="also write the measurements to this JSON file")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_kernels: CUDA is not available on this machine; this benchmark measures GPU "
              "kernels only (use tests/test_kernel_triton.py for CPU correctness).", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    copy = copy_bandwidth(args.copy_gib, args.repeats)
    print(f"device: {name}; copy bandwidth {copy:.1f} GB/s (read+write, {args.copy_gib} GiB buffer)")
    report: dict = {"device": name, "copy_gbps": copy, "args": vars(args)}
    if not args.skip_emb:
        report["embeddings"] = bench_embeddings(args, copy)
    if not args.skip_fp8:
        report["fp8_probe"] = bench_fp8(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
