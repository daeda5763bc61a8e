"""`cubic calibrate`: measure the machine at hand and write its cluster file.

Each factor of the performance model is fitted on its own micro-benchmark, never on a training trial
(so factors cannot absorb each other's errors; docs/architecture.md, "How the best performance models are
built"):

- copy bandwidth: a large tensor copy, one thread (read + write bytes / time);
- embedding kernels: each backend's forward and backward+optimizer over a few row widths and table
  precisions, as the fraction of the copy bandwidth its bytes (cubic_harness.sim.perf.lookup_bytes /
  update_bytes, the model's own formulas) achieve; a second thread's speed-up as an exponent;
- dense GEMMs: fp32 and bf16 at the workloads' layer sizes, fitted as time = MFLOP / peak + a fixed
  cost per GEMM (the model's `gemm_half_mflop` is that cost x peak);
- collectives: gloo all-to-all and all-reduce between two rank processes over a size sweep, fitted
  as latency + bytes on the wire / bandwidth;
- framework cost per step and a rank's resident memory: the harness's own step on a workload too
  small to compute anything (one rank, 16 samples).

On a CUDA device the same measurements run on the GPU (copy, the torch/triton kernels, GEMMs; NCCL
is not measured with one GPU). Times are medians after warm-up.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from cubic_harness.config import host_cores
from cubic_harness.sharding.transport import host_mean_bytes
from cubic_harness.sim.perf import lookup_bytes, update_bytes

Progress = Callable[[str], None]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def graphed(step: Callable[[], Any], device: torch.device, warmup: int = 3) -> Callable[[], Any]:
    """`step` captured as one CUDA graph (warmed up on a side stream first, as capture requires):
    its replay runs the step's kernels without the host's launches between them, so its time is the
    device's. `step` must not sync the host or allocate outside the graph's pool after warm-up."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    """GB/s moved (read + write) by a large copy."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / (ms * 1e6)


QUEUED = 20


def gemm_fit(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int, int]], reps: int) -> dict:
    """time(ms) = MFLOP / peak + per-GEMM cost, least squares over `shapes` (m, k, n). On a GPU each
    time is of QUEUED calls in a row, as a step issues them: one call between two host syncs would
    add the sync's round trip to the per-GEMM cost."""
    mf, ms = [], []
    queued = QUEUED if device.type == "cuda" else 1
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        ms.append(_median_ms(lambda a=a, b=b: [a @ b for _ in range(queued)], device, reps) / queued)
        mf.append(2 * m * k * n / 1e6)
    A = np.stack([np.asarray(mf), np.ones(len(mf))], axis=1)
    (inv_peak, fixed), *_ = np.linalg.lstsq(A, np.asarray(ms), rcond=None)
    inv_peak = max(inv_peak, 1e-9)
    peak = 1.0 / inv_peak  # MFLOP per ms = GFLOP/s
    return {"peak_gflops": float(peak), "fixed_ms": float(max(fixed, 0.0)),
            "points": [[round(f, 3), round(t, 4)] for f, t in zip(mf, ms, strict=True)]}


def _kernel_batches(backend: str, precision: str, dim: int, device: torch.device, tables: int, rows: int,
                    bags: int, pooling: int, n: int) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]],
                                                             torch.Tensor, torch.Generator]:
    """One backend's kernel over `tables` tables of rows x dim (row-wise AdaGrad, small random rows), `n` batches of
    `bags` bags of `pooling` uniform ids a table, a pooled gradient for them, and the generator that drew the ids."""
    from cubic_kernels import OptimSpec, make_kernel

    k = make_kernel(backend, [rows] * tables, [dim] * tables, weight_dtype=precision,
                    optim=OptimSpec("rowwise_adagrad", lr=0.01), device=device)
    k.load([torch.randn(rows, dim) * 0.01 for _ in range(tables)])
    g = torch.Generator().manual_seed(dim)
    ids_n = tables * bags * pooling
    batches = [(torch.randint(0, rows, (ids_n,), generator=g).to(device),
                torch.arange(0, ids_n + 1, pooling, device=device)) for _ in range(n)]
    return k, batches, torch.randn(bags, tables * dim, device=device) * 1e-3, g


def embedding_eff(backend: str, precision: str, dim: int, device: torch.device, copy_gbs: float, reps: int,
                  tables: int = 4, rows: int = 200_000, bags: int = 2048, pooling: int = 20) -> dict[str, float]:
    """Achieved fraction of the copy bandwidth of one backend's forward and backward+optimizer."""
    k, batches, grad, _ = _kernel_batches(backend, precision, dim, device, tables, rows, bags, pooling, 4)
    i = [0]

    def fwd() -> None:
        k.forward(*batches[i[0] % 4])
        i[0] += 1

    def bwd() -> None:
        k.backward_update(*batches[i[0] % 4], grad)
        i[0] += 1

    wb = {"fp32": 4, "fp16": 2, "bf16": 2}[precision]
    n_ids, n_bags = tables * bags * pooling, tables * bags
    f_ms, b_ms = _median_ms(fwd, device, reps), _median_ms(bwd, device, reps)
    return {"fwd": lookup_bytes(n_ids, n_bags, dim, wb) / (f_ms * 1e6) / copy_gbs,
            "bwd": update_bytes(n_ids, n_bags, dim, wb, 4) / (b_ms * 1e6) / copy_gbs,
            "fwd_ms": f_ms, "bwd_ms": b_ms}


def weighted_cost(backend: str, device: torch.device, reps: int, dim: int = 64, tables: int = 4,
                  rows: int = 200_000, bags: int = 2048, pooling: int = 20) -> dict[str, float]:
    """What per-sample weights (TorchRec's weighted features) cost one backend: a weighted call's time over an
    unweighted one's, forward and backward+optimizer, the two interleaved call by call on one kernel, so the
    machine's drift hits both alike. The bytes cannot say it: the score is 4 bytes beside an id's 8 and a row's
    256, yet FBGEMM's CPU backward also computes the scores' gradient (3x its step, `bench_weighted.py`)."""
    k, [(ids, offsets)], grad, g = _kernel_batches(backend, "fp32", dim, device, tables, rows, bags, pooling, 1)
    psw = (torch.rand(ids.numel(), generator=g) + 0.5).to(device)
    calls = {"fwd": lambda *w: k.forward(ids, offsets, *w), "bwd": lambda *w: k.backward_update(ids, offsets, grad, *w)}
    ms: dict[str, list[float]] = {f"{ph}{w}": [] for ph in calls for w in ("", "_w")}
    for r in range(2 + reps):  # 2 warm-up rounds
        for ph, call in calls.items():
            for w, args in (("", ()), ("_w", (psw,))) if r % 2 else (("_w", (psw,)), ("", ())):
                _sync(device)
                t0 = time.perf_counter()
                call(*args)
                _sync(device)
                if r >= 2:
                    ms[f"{ph}{w}"].append((time.perf_counter() - t0) * 1e3)
    med = {name: statistics.median(v) for name, v in ms.items()}
    return {"fwd": med["fwd_w"] / med["fwd"], "bwd": med["bwd_w"] / med["bwd"],
            **{f"{name}_ms": round(v, 4) for name, v in med.items()}}


# ---------------------------------------------------------------------- two rank processes side by side
def _burst(a: torch.Tensor, n: int) -> None:
    for _ in range(n):
        a @ a


def _pair_rank(rank: int, port: int, sizes: list[int], reps: int, q) -> None:
    """One of two rank processes: (1) a GEMM and an embedding kernel alone (rank 1 waits) and then both
    ranks at once: how much of its speed a rank keeps when every core runs one; (2) all-to-all and
    all-reduce over a size sweep, each call after a burst of compute and without a barrier, as a
    training step issues them: the mean time then includes the peers' skew and a waiting rank's wake-up
    (a barrier-synchronised loop measured a third of it here)."""
    import datetime as dt

    import torch.distributed as dist

    from cubic_kernels import OptimSpec, make_kernel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, dt.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    a = torch.randn(384, 384)
    k = make_kernel("native", [200_000] * 4, [64] * 4, optim=OptimSpec("rowwise_adagrad", lr=0.01))
    ids = torch.randint(0, 200_000, (4 * 1024 * 20,))
    offs = torch.arange(0, ids.numel() + 1, 20)
    grad = torch.randn(1024, 256) * 1e-3
    work = {"dense": lambda: _burst(a, 8),
            "embedding": lambda: (k.forward(ids, offs), k.backward_update(ids, offs, grad))}
    out: dict = {"shared": {}, "all_to_all": [], "all_reduce": [], "merge": {}}
    dev = torch.device("cpu")
    for name, fn in work.items():
        # alone: rank 1 blocks on the store's socket until rank 0 is done, not in a collective (gloo's
        # wait keeps a core busy, which made the first version of this measure "alone" beside a
        # spinning core and find no slowdown at all) nor for a fixed sleep (on a loaded machine the
        # measurement outlasted it and calibration failed)
        dist.barrier()
        if rank == 0:
            solo = _median_ms(fn, dev, 5 * reps)  # ~0.5 s: the slowdown comes and goes with the neighbours
            store.set(f"solo/{name}", "done")
        else:
            store.wait([f"solo/{name}"])
        dist.barrier()
        both = torch.tensor([_median_ms(fn, dev, 5 * reps)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the slower rank sets the step
        out["shared"][name] = solo / float(both) if rank == 0 else 0.0
    out["merge"] = _replica_merge(k, reps)
    out["glue"] = _collection_glue(rank, reps)
    for s in sizes:
        x = torch.ones(s // 4)
        y = torch.empty_like(x)
        for name, fn in (("all_to_all", lambda x=x, y=y: dist.all_to_all_single(y, x)),
                         ("all_reduce", lambda x=x: dist.all_reduce(x))):
            synced, loaded = [], []
            for _ in range(3 * reps + 3):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                synced.append((time.perf_counter() - t0) * 1e3)
            dist.barrier()
            for _ in range(6 * reps + 3):
                _burst(a, 2)
                t0 = time.perf_counter()
                fn()
                loaded.append((time.perf_counter() - t0) * 1e3)
            out[name].append([s, statistics.median(synced[3:]), statistics.mean(loaded[3:])])
    out["jitter"] = _jitter(a, reps)
    out["overlap"] = _overlap(a, reps)
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _jitter(a: torch.Tensor, reps: int) -> dict[str, float]:
    """How the wait at a collective grows with the compute before it: two ranks that run the same work
    still finish it at different times (preemption, cache and memory contention), and the first waits.
    A small all-to-all after 2 and after 16 GEMMs: the extra mean wait per ms of extra compute."""
    import torch.distributed as dist

    x, y = torch.ones(1024), torch.empty(1024)
    res = {}
    for n in (2, 16):
        burst = _median_ms(lambda n=n: _burst(a, n), torch.device("cpu"), reps)
        waits = []
        dist.barrier()
        for _ in range(6 * reps + 3):
            _burst(a, n)
            t0 = time.perf_counter()
            dist.all_to_all_single(y, x)
            waits.append((time.perf_counter() - t0) * 1e3)
        res[n] = (burst, statistics.mean(waits[3:]))
    (b2, w2), (b16, w16) = res[2], res[16]
    return {"burst_ms": [b2, b16], "wait_ms": [w2, w16], "per_compute_ms": max(0.0, (w16 - w2) / (b16 - b2))}


def _overlap(a: torch.Tensor, reps: int, nbytes: int = 8 << 20) -> dict[str, float]:
    """How much of a collective beside compute is hidden (`comm_overlap`): an all-to-all of `nbytes` alone
    (t_c), a burst of GEMMs alone (t_p, sized near t_c), and the all-to-all launched asynchronously with the
    burst run before its wait (t_o). Hidden: t_c + t_p - t_o of the shorter, min(t_c, t_p): 1 when they
    overlap perfectly, 0 when they serialise, below 0 when together they take longer than one after the other
    (on CPU the collective's copies and waits take cores from the compute)."""
    import torch.distributed as dist

    x, y = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    cpu, reps = torch.device("cpu"), 5 * reps  # (a single pass varied 0-0.35 here)
    dist.barrier()
    comm = _median_ms(lambda: (dist.barrier(), dist.all_to_all_single(y, x)), cpu, reps) - \
        _median_ms(dist.barrier, cpu, reps)
    one = _median_ms(lambda: _burst(a, 1), cpu, reps)
    n = max(1, round(comm / max(one, 1e-3)))
    compute = _median_ms(lambda: _burst(a, n), cpu, reps)

    def overlapped() -> None:
        dist.barrier()
        w = dist.all_to_all_single(y, x, async_op=True)
        _burst(a, n)
        w.wait()

    both = _median_ms(overlapped, cpu, reps) - _median_ms(dist.barrier, cpu, reps)
    hidden = (comm + compute - both) / max(min(comm, compute), 1e-6)
    return {"comm_ms": comm, "compute_ms": compute, "both_ms": both, "hidden": min(1.0, max(-1.0, hidden))}


def _collection_glue(rank: int, reps: int) -> dict[str, float]:
    """What the harness's sharded embedding collection costs beyond its kernels and collectives: its
    own forward + backward on two ranks (small workload, table-wise, batch 1024; no dense part, no
    optimizer, no DDP), less the time its phase timers give the kernels and the all-to-alls. That is
    the input routing (per-shard id selection, concatenation, offsets), the pooled output's assembly
    and autograd, per looked-up id of the rank's own bags."""
    from cubic_harness.config import TrialConfig
    from cubic_harness.data import rank_batches
    from cubic_harness.sharding.collection import ShardedEmbeddingCollection
    from cubic_harness.sharding.comm import make_groups
    from cubic_harness.sharding.planner import make_plan
    from cubic_harness.sim.perf import TableCosts
    from cubic_harness.timers import TIMERS
    from cubic_harness.workload import Workload

    cfg = TrialConfig(workload=Workload.small(), world_size=2, batch_size=1024)
    plan = make_plan(cfg, TableCosts(None))
    coll = ShardedEmbeddingCollection(cfg, plan, make_groups(rank, 2, 2), torch.device("cpu"))
    batches = rank_batches(cfg.workload, 0, rank, cfg.batch_size, 2, 4)
    steps, warm = 3 * reps, 3
    TIMERS.totals.clear()
    t_all = 0.0
    for i in range(warm + steps):
        TIMERS.enabled = i >= warm
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        pooled = coll.forward(coll.input_dist(b.ids, b.offsets, cfg.batch_size, b.scores))
        pooled.sum().backward()
        if i >= warm:
            t_all += time.perf_counter() - t0
    TIMERS.enabled = False
    phases = sum(TIMERS.totals.values())
    ids = cfg.batch_size * sum(t.pooling for t in cfg.workload.tables)
    return {"ms_per_step": t_all * 1e3 / steps, "phases_ms": phases * 1e3 / steps,
            "ns_per_id": max(0.0, (t_all - phases) / steps / ids * 1e9)}


def _replica_merge(k, reps: int) -> dict[str, list[float]]:
    """The 2D weight_avg merge (harness/sharding/replica_sync.py) of two replicas, after one step's
    touched rows (sparse transport) and after eight steps' (dense): [payload bytes, ms] per transport.
    One ReplicaSync per transport, its first merge untimed, as a trial's merger lives through its run: a
    first merge also reserves and faults in the shared-memory slots (`host_reduce`), which a trial pays once."""
    from cubic_harness.sharding.replica_sync import ReplicaSync

    out = {}
    g = torch.Generator().manual_seed(1)
    for name, steps in (("sparse", 1), ("dense", 8)):
        times, payload = [], 0.0
        # the transport priced here, whatever the rule would pick for this many rows
        rs = ReplicaSync(k, 2, None, steps, False, torch.float32, transport=name)
        for rep in range(reps + 1):
            for _s in range(steps):
                ids = torch.randint(0, 200_000, (4 * 1024 * 20,), generator=g)
                rs.record(ids, torch.arange(0, ids.numel() + 1, 20))
            touched = sum(int(t.sum()) for t in rs.touched)
            rows = touched if name == "sparse" else sum(k.rows)
            payload = 2 * rows * (64 + 1) * 4  # R replicas' rows x (width + the state column), fp32
            t0 = time.perf_counter()
            rs.sync()
            if rep:
                times.append((time.perf_counter() - t0) * 1e3)
        out[name] = [payload, statistics.median(times)]
        if rs.host is not None:
            out["host"] = True  # the dense merge averaged in place through shared memory, not the link
    return out


def pair(sizes: list[int], reps: int) -> dict:
    """Two spawned rank processes (gloo): each resource's shared speed, and per collective a latency and
    a bandwidth (t = latency x calls + wire bytes / bandwidth, wire bytes per nccl-tests' bus factors)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_pair_rank, args=(r, port, sizes, reps, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = q.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    fits: dict = {"shared": {k: round(min(1.0, v), 3) for k, v in out["shared"].items()}, "merge": out["merge"],
                  "glue": out["glue"], "jitter": out["jitter"], "overlap": out["overlap"]}
    for name in ("all_to_all", "all_reduce"):
        pts = out[name]
        factor = 0.5 if name == "all_to_all" else 1.0  # (n-1)/n and 2(n-1)/n of the buffer at n = 2
        calls = 1.0 if name == "all_to_all" else 2.0
        wire = np.asarray([p[0] * factor for p in pts])
        synced = np.asarray([p[1] for p in pts])
        A = np.stack([wire / 1e6, np.full(len(wire), calls)], axis=1)
        (inv_bw, _), *_ = np.linalg.lstsq(A, synced, rcond=None)
        bw = float(1.0 / max(inv_bw, 1e-3))
        # the latency a step sees: a call after compute, less its bytes; the median over the sizes up to
        # 256 KB, where latency dominates (one size alone varied 2x between calibrations)
        small = [p[2] - w / (bw * 1e6) for p, w in zip(pts, wire, strict=True) if p[0] <= 1 << 18]
        lat = statistics.median(small or [pts[0][2] - wire[0] / (bw * 1e6)]) / calls
        fits[name] = {"bandwidth_gbs": bw, "latency_us": float(max(lat, 0.0) * 1e3),
                      "points_bytes_synced_ms_loaded_ms": [[int(p[0]), round(p[1], 4), round(p[2], 4)]
                                                           for p in pts]}
    return fits


def dense_other(device: torch.device, gemm: dict, reps: int, batches: tuple[int, ...]) -> dict[str, dict[int, float]]:
    """What the dense part costs beyond its GEMMs (activations, casts, the interaction's gathers, the
    loss), per dense precision and batch size, as GB/s of activation bytes: the small workload's
    DenseArch forward + backward, minus the model's GEMM time for it. Its rate falls with the batch as
    the activations leave the caches, so it is a curve, interpolated in log batch. On a GPU the step
    is replayed as a CUDA graph: eager, the host's launches bound a small model's step (an H200 ran
    this one in the same time at 2,048 and 8,192), and that cost is the step's fixed one
    (`framework_step`), not a rate of its bytes."""
    from cubic_harness.dense_cost import dense_cost
    from cubic_harness.model import build_dense_arch
    from cubic_harness.sim.perf import gemm_ms
    from cubic_harness.workload import Workload

    wl = Workload.small()
    arch = build_dense_arch(wl, 0).to(device)
    dc = dense_cost(wl)
    out: dict[str, dict[int, float]] = {}
    for prec, g in gemm.items():
        out[prec] = {}
        for B in batches:
            x = torch.randn(B, wl.dense_features, device=device)
            pooled = torch.randn(B, wl.num_tables * wl.dim, device=device, requires_grad=True)
            y = torch.rand(B, device=device)

            def step(x=x, pooled=pooled, y=y, prec=prec) -> None:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=prec != "fp32",
                                    cache_enabled=False):  # (a graph replays its own casts)
                    logits = arch(x, pooled)
                torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), y).backward()

            ms = _median_ms(graphed(step, device) if device.type == "cuda" else step, device, reps)
            f, b = gemm_ms(dc, B, g["peak_gflops"], g["fixed_ms"] * g["peak_gflops"])
            out[prec][B] = round(B * dc.act_floats * 4 / (max(ms - f - b, 0.05 * ms) * 1e6), 3)
    return out


def framework_step(cuda: bool = False) -> dict:
    """The harness's own step where there is nothing to compute: its fixed cost and a rank's memory, a
    rank forked from its fork server as every harness rank is (`trial.rank_context`). On a GPU the
    fixed cost is the launches of a step's kernels, which a step of any size pays."""
    from cubic_harness.config import TrialConfig
    from cubic_harness.trial import run_trial
    from cubic_harness.workload import Workload

    cfg = TrialConfig(workload=Workload.tiny(), world_size=1, batch_size=16, warmup_steps=5, measure_steps=30,
                      windows=3, kernel="torch" if cuda else "native", device="cuda" if cuda else "cpu")
    old = os.environ.get("CUBIC_LOCAL_CLUSTER")
    os.environ["CUBIC_LOCAL_CLUSTER"] = "none"  # one table-wise rank: no plan to price, no file to read
    try:
        res = run_trial(cfg)
    finally:
        if old is None:
            os.environ.pop("CUBIC_LOCAL_CLUSTER")
        else:
            os.environ["CUBIC_LOCAL_CLUSTER"] = old
    if res.status != "ok":
        raise RuntimeError(f"calibration step failed: {res.error}")
    return {"step_ms": res.step_ms_p50, "peak_mem_mb": res.peak_mem_mb}


# ---------------------------------------------------------------------- the whole calibration
def _backends(device: torch.device) -> list[str]:
    from cubic_kernels.fbgemm_backend import available

    if device.type == "cuda":
        return ["torch", "triton"]
    return ["native", "fbgemm", "torch"] if available() else ["native", "torch"]


@dataclass
class _Run:
    """One calibration: where it measures, how often, and the record (`source`) every step adds to."""

    device: torch.device
    short: bool
    reps: int
    cores: int
    progress: Progress
    src: dict[str, Any]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def threads(self) -> bool:
        """A CPU with a second core: each kernel's speed-up on two threads is measured too."""
        return not self.cuda and self.cores > 1


def _dense(run: _Run, thread_exp: dict[str, float]) -> dict[str, dict]:
    """The GEMM fits per precision (and, on a CPU, the speed-up on two threads)."""
    run.progress("dense GEMMs")
    sizes = [(256, 64, 256), (1024, 256, 128), (1024, 512, 256)] if run.short else [
        (256, 64, 256), (512, 13, 256), (1024, 256, 128), (1024, 415, 512), (2048, 512, 256),
        (4096, 512, 256), (4096, 1024, 512)]
    if run.cuda:  # a GPU's peak shows only in GEMMs of a step's size (MLPerf DCNv2's, 6,912 a GPU):
        # the small ones above are its per-GEMM cost
        sizes += [(6912, 3456, 1024), (6912, 1024, 1024), (8192, 4096, 4096)]
    dense = {"fp32": gemm_fit(run.device, torch.float32, sizes, run.reps)}
    dense["bf16"] = gemm_fit(run.device, torch.bfloat16, sizes, run.reps)
    run.src["gemm"] = dense
    if run.threads:
        run.progress("dense GEMMs, 2 threads")
        torch.set_num_threads(2)
        two = gemm_fit(run.device, torch.float32, sizes[-2:], run.reps)["points"]
        torch.set_num_threads(1)
        one = dense["fp32"]["points"][-2:]  # the largest GEMMs: a speed-up, not a fit's slope
        speedup = sum(t for _, t in one) / sum(t for _, t in two)
        thread_exp["dense"] = round(max(0.0, math.log2(speedup)), 3)
    return dense


class _Probe(NamedTuple):
    """The embedding probe's size: a step's, on the device measured."""

    tables: int
    rows: int
    bags: int


def _probe(run: _Run, backend: str) -> _Probe:
    """A GPU's kernels reach their share of the copy only at a GPU step's size (8 x 1M rows,
    16,384 bags a table: at a CPU's 4 x 200k x 2,048 an H200's triton forward reached 0.34 of its
    copy, against 0.58 at the step's size); a CPU's reach it at a CPU step's."""
    if run.cuda:
        return _Probe(8, 1_000_000, 4096 if run.short else 16384)
    return _Probe(4, 200_000, 512 if (run.short or backend == "torch") else 2048)


def _embedding(run: _Run, copy: float, thread_exp: dict[str, float]) -> tuple[dict, dict]:
    """Each backend's efficiency per precision and width, and its per-sample weight cost."""
    emb: dict[str, dict] = {}
    raw: dict[str, dict] = {}
    weighted: dict[str, dict] = {}
    dims = [64] if run.short else [16, 64, 128]
    for b in _backends(run.device):
        emb[b] = {}
        size = _probe(run, b)
        run.src.setdefault("embedding_probe", {})[b] = size._asdict()
        for p in ("fp32", "fp16", "bf16"):
            if b == "fbgemm" and p == "bf16":
                continue
            run.progress(f"embedding kernel {b} {p}")
            curve = {d: embedding_eff(b, p, d, run.device, copy, run.reps, **size._asdict())
                     for d in dims}
            raw[f"{b}/{p}"] = {d: {k: round(v, 4) for k, v in c.items()} for d, c in curve.items()}
            emb[b][p] = {"fwd": {d: round(c["fwd"], 4) for d, c in curve.items()},
                         "bwd": {d: round(c["bwd"], 4) for d, c in curve.items()}}
        run.progress(f"embedding kernel {b}, weighted")
        w = weighted_cost(b, run.device, run.reps, **size._asdict())
        run.src.setdefault("weighted", {})[b] = {k: round(v, 4) for k, v in w.items()}
        weighted[b] = {"fwd": round(w["fwd"], 3), "bwd": round(w["bwd"], 3)}
        if run.threads:
            run.progress(f"embedding kernel {b}, 2 threads")
            torch.set_num_threads(2)
            two = embedding_eff(b, "fp32", 64, run.device, copy, run.reps, **size._asdict())
            torch.set_num_threads(1)
            one = raw[f"{b}/fp32"][64]
            speedup = (one["fwd_ms"] + one["bwd_ms"]) / (two["fwd_ms"] + two["bwd_ms"])
            thread_exp[b] = round(max(0.0, math.log2(speedup)), 3)
    run.src["embedding"] = raw
    return emb, weighted


def _merge_speeds(fits: dict[str, Any], copy: float) -> dict[str, float]:
    """The replica merge's own work: its time less its collective (an all-gather of the payload
    sparse, an all-reduce dense), as GB/s of the replicas' payload."""
    merge = {}
    host = fits["merge"].pop("host", False)
    for name, (payload, ms) in fits["merge"].items():
        link = fits["all_to_all" if name == "sparse" else "all_reduce"]
        if name == "sparse":
            wire = payload / 2 * 0.5 / (link["bandwidth_gbs"] * 1e6)
        elif host:
            wire = host_mean_bytes(payload / 2, 2) / (copy * 1e6)
        else:
            wire = payload / 2 / (link["bandwidth_gbs"] * 1e6)
        merge[name] = round(payload / (max(ms - wire, 0.1 * ms) * 1e6), 3)
    return merge


def _links(run: _Run, copy: float) -> tuple[dict[str, float], dict]:
    """The local link and, on a CPU, two ranks side by side: their shared speed and gloo's
    collectives; one GPU has no link to measure."""
    if run.cuda:
        run.src["links"] = ("one GPU here: NVLink figures are DGX H100's public ones "
                            "(docs/architecture.md, Public hardware figures), not measured")
        return {"bandwidth_gbs": 450.0, "latency_us": 20.0}, {}
    run.progress("2 ranks side by side: shared speed, gloo collectives")
    csizes = ([1 << 12, 1 << 16, 1 << 20, 1 << 22] if run.short else
              [1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24])
    fits = pair(csizes, run.reps)
    run.src["collectives"] = {k: v for k, v in fits.items() if k != "shared"}
    merge = _merge_speeds(fits, copy)
    run.src["replica_merge"] = {"measured": fits["merge"], "merge_gbs": merge}
    run.src["collection_glue"] = {k: round(v, 3) for k, v in fits["glue"].items()}
    run.src["jitter"] = fits["jitter"]
    run.src["overlap"] = fits["overlap"]
    a2a = fits["all_to_all"]
    link = {"bandwidth_gbs": round(a2a["bandwidth_gbs"], 4),
            "latency_us": round(a2a["latency_us"], 1)}
    return link, fits["shared"]


def _measured_extras(src: dict[str, Any], shared: dict) -> dict[str, Any]:
    """The device keys only a CPU's two-rank measurements give."""
    return {
        **({"shared_speed": shared} if shared else {}),
        **({"replica_merge_gbs": src["replica_merge"]["merge_gbs"]}
           if "replica_merge" in src else {}),
        **({"glue_ns_per_id": src["collection_glue"]["ns_per_id"]}
           if "collection_glue" in src else {}),
        **({"jitter": round(src["jitter"]["per_compute_ms"], 4)} if "jitter" in src else {}),
        **({"overlap_hidden": round(src["overlap"]["hidden"], 3)} if "overlap" in src else {}),
    }


def calibrate(short: bool = False, progress: Progress = lambda s: None) -> dict:
    """Measure this machine; return a cluster file's dict (see harness/sim/cluster.py)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    src: dict[str, Any] = {"command": "cubic calibrate" + (" --short" if short else ""),
                           "host": platform.node(), "torch": str(torch.__version__),
                           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                           "load_avg": round(os.getloadavg()[0], 2)}
    run = _Run(device, short, 3 if short else 7, host_cores(), progress, src)
    t_start = time.perf_counter()

    progress("copy bandwidth")
    copy = copy_bandwidth(device, (64 if short else 256) << 20, run.reps)
    src["copy_gbs"] = round(copy, 3)
    thread_exp: dict[str, float] = {}
    dense = _dense(run, thread_exp)
    half = statistics.median(d["fixed_ms"] * d["peak_gflops"] for d in dense.values())
    emb, weighted = _embedding(run, copy, thread_exp)

    progress("dense part beyond its GEMMs")
    batches = ((4096, 16384) if short else (2048, 8192, 32768)) if cuda else (
        (512, 2048) if short else (256, 1024, 4096))  # a step's batches on the device measured
    other = dense_other(device, dense, run.reps, batches)
    src["elementwise_gbs"] = other
    link, shared = _links(run, copy)

    progress("framework step")
    fw = framework_step(cuda)
    src["framework_step"] = fw
    src["seconds"] = round(time.perf_counter() - t_start, 1)

    mem_gb = (torch.cuda.get_device_properties(0).total_memory / 2**30) if cuda else _host_gb()
    return {
        "name": "local",
        "about": ("This machine, measured by `cubic calibrate` (harness/sim/calibrate.py); single "
                  "node, so `network` repeats the measured local link."),
        "nodes": 1,
        "devices_per_node": 1 if cuda else 8,
        "host_memory_gb": round(_host_gb(), 1),
        "device": {
            "type": "gpu" if cuda else "cpu",
            **({} if cuda else {"cores": run.cores}),
            "memory_gb": round(mem_gb, 1),
            "mem_bw_gbs": round(copy, 3),
            "dense_gflops": {k: round(v["peak_gflops"], 2) for k, v in dense.items()},
            "gemm_half_mflop": round(half, 4),
            "embedding": emb,
            "thread_exp": thread_exp,
            "weighted_cost": weighted,
            "elementwise_gbs": other,
            **_measured_extras(src, shared),
            "step_overhead_ms": round(fw["step_ms"], 3),
            "process_mb": round(fw["peak_mem_mb"], 1),
        },
        "intra_node": link,
        "network": dict(link),
        "source": src,
    }


def _host_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 16.0


# ---------------------------------------------------------------------- a framework's profile
# ids per bag of the two steps whose difference gives the collection's cost per id. Far apart: a 2-rank step's
# difference between the frameworks varies by 1-3 ms from one pair of runs to the next here (a ~15 ms step), and
# that noise is divided by the ids between the two steps. With 1 and 16 ids a bag, two calibrations two hours apart
# put TorchRec's cost per id at 27 and 107 ns (the harness's: 30-32 ns); with 1 and 64, at 17, 23 and 31 ns in
# three in a row, and pairs at 1, 16 and 64 ids (3 each) grew by ~8 ns an id: TorchRec's routing costs what the
# harness's does.
PROFILE_POOLS = (1, 64)


COLLECTION_POOL = 20  # ids a bag of the collection step: what a recommendation model's multi-hot features look up


def _probe_workload(name: str) -> Any:
    """The tiny workload's tables as `probe_models.NAME` holds them (one collection or two), COLLECTION_POOL ids a
    bag."""
    import dataclasses

    from cubic_harness.sim import probe_models  # (imports TorchRec)
    from cubic_harness.torchrec_import import import_workload

    wl = import_workload(f"cubic_harness.sim.probe_models:{name}", dense_features=probe_models.DENSE_FEATURES)
    return dataclasses.replace(wl, tables=[dataclasses.replace(t, pooling=COLLECTION_POOL) for t in wl.tables])


class _Steps(NamedTuple):
    harness: float  # median step, ms
    torchrec: float
    paired: float  # median of the paired differences, TorchRec's minus the harness's, ms
    torchrec_mb: float  # TorchRec's peak RSS


def _both_steps(cfg: Any, reps: int) -> _Steps:
    """`cfg`'s median step (ms) in cubic's harness and in TorchRec, alternating over `reps` runs; the median of
    the paired differences (each TorchRec run minus the harness's run right after it, so the machine's drift
    between pairs cancels); and TorchRec's peak RSS (MB). TorchRec runs first, so this process's fork server
    preloads TorchRec as a TorchRec tune's does (`trial.rank_context`): its ranks are forked as a tune's are, the
    harness's spawned (their step is the same)."""
    from cubic_harness.torchrec_trial import run_torchrec
    from cubic_harness.trial import run_trial

    h, t, mem = [], [], 0.0
    for _ in range(reps):
        for run, out in ((run_torchrec, t), (run_trial, h)):
            res = run(cfg)
            if res.status != "ok":
                raise RuntimeError(f"calibration step failed ({run.__name__}): {res.error}")
            out.append(res.step_ms_p50)
            if run is run_torchrec:
                mem = max(mem, res.peak_mem_mb)
    paired = statistics.median(b - a for a, b in zip(h, t, strict=True))
    return _Steps(statistics.median(h), statistics.median(t), paired, mem)


def _step_record(s: _Steps) -> dict[str, float]:
    """What a calibrated profile's `source` keeps of one pair of steps."""
    return {"harness": round(s.harness, 3), "torchrec": round(s.torchrec, 3), "paired_difference": round(s.paired, 3)}


def torchrec_profile(base: Any, short: bool = False, progress: Progress = lambda s: None) -> tuple[dict, dict]:
    """TorchRec's step on this machine as a framework profile (`frameworks.torchrec` of a cluster file: the
    figures where it differs from `base`, the harness's calibration of this machine) and what measured it.

    Each micro-step runs in both frameworks with the same kernel (FBGEMM's fused TBE), ids and dense part, so
    their difference is the framework's alone; the harness's own figures (`base`) are what it is added to:
    1. the fixed cost of a step: a bare one-rank step (the tiny workload, batch 16). TorchRec's
       `step_overhead_ms` is the harness's plus the paired difference. Its peak RSS is a forked TorchRec rank's
       `process_mb`; the same step on a rank spawned afresh (TorchRec's 2D ranks on CPU) gives
       `spawned_process_mb`.
    2. the collection's work per looked-up id (KeyedJaggedTensor routing, the distribution's bookkeeping,
       autograd): two table-wise steps on two ranks (the tiny workload's tables, batch 512) that differ only
       in their bags, PROFILE_POOLS ids each. The growth of the difference per id a rank looks up, added to
       the harness's `glue_ns_per_id`.
    3. a distributed step's own calls: what is left of the difference at PROFILE_POOLS[0] ids a bag once 1 and
       2 are taken out: `dist_overhead_ms` (the harness's is 0: its collectives are priced by the links).
    4. a collection beyond the first: the same tables in one EmbeddingBagCollection and split over two
       (`probe_models`), TorchRec only, two ranks, COLLECTION_POOL ids a bag: the median paired difference is
       `collection_ms` (each collection distributes its input and output and looks up apart; the harness looks
       every table up in one, so its own is 0).
    5. not measured, TorchRec's design: 2D's DMPCollection.sync() all-reduces every shard's weights and optimizer
       state, never only the rows the replicas touched (`dense_replica_merge`).
    Micro-measurements, not trials of the configurations it will price (benchmarks/bench_backend_fidelity.py
    validates it on those)."""
    import dataclasses

    from cubic_harness.config import TrialConfig
    from cubic_harness.torchrec_trial import package_version, run_torchrec
    from cubic_harness.trial import spawned_ranks
    from cubic_harness.workload import Workload

    reps = 2 if short else 3
    steps = dict(warmup_steps=3, measure_steps=8 if short else 16, windows=1, timeout_s=300, kernel="fbgemm")
    progress("a bare step, harness and TorchRec")
    bare = TrialConfig(workload=Workload.tiny(), world_size=1, batch_size=16, **steps)
    bare_steps = _both_steps(bare, reps)
    fixed = bare_steps.paired
    progress("a bare TorchRec rank spawned afresh (as TorchRec's 2D ranks on CPU are)")
    with spawned_ranks():
        spawned = run_torchrec(bare)
    if spawned.status != "ok" or spawned.env.get("rank_start") != "spawn":
        raise RuntimeError("calibration step (a spawned TorchRec rank): "
                           f"{spawned.error or 'started by ' + str(spawned.env.get('rank_start'))}")
    by_pool, ids = [], []
    for pool in PROFILE_POOLS:
        progress(f"{pool} ids a bag, harness and TorchRec")
        wl = Workload.tiny()
        wl = dataclasses.replace(wl, tables=[dataclasses.replace(t, pooling=pool) for t in wl.tables])
        cfg = TrialConfig(workload=wl, world_size=2, batch_size=512, sharding="table_wise", **steps)
        by_pool.append(_both_steps(cfg, reps))
        ids.append(cfg.batch_size * sum(wl.lookups_per_sample()))
    per_id_ns = (by_pool[1].paired - by_pool[0].paired) / (ids[1] - ids[0]) * 1e6
    glue = max(0.0, base.device.glue_ns_per_id + per_id_ns)
    dist_ms = max(0.0, by_pool[0].paired - fixed - (glue - base.device.glue_ns_per_id) * ids[0] / 1e6)
    progress("the tables in one collection and in two, TorchRec")
    one, two = (TrialConfig(workload=_probe_workload(name), world_size=2, batch_size=512, sharding="table_wise",
                            **steps) for name in ("one", "two"))
    coll = []
    for _ in range(2 * reps + 1):  # (a ~5 ms difference that varies 3-12 ms pair to pair here)
        a, b = run_torchrec(one), run_torchrec(two)
        if a.status != "ok" or b.status != "ok":
            raise RuntimeError(f"calibration step (one collection, two): {a.error or b.error}")
        coll.append(b.step_ms_p50 - a.step_ms_p50)
    src = {"command": "cubic calibrate --framework torchrec" + (" --short" if short else ""),
           "torchrec": package_version("torchrec"),
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "bare_step_ms": _step_record(bare_steps), "pools": list(PROFILE_POOLS), "ids_per_rank": ids,
           "step_ms": [_step_record(s) for s in by_pool], "collection_pool": COLLECTION_POOL,
           "second_collection_ms": [round(x, 3) for x in coll]}
    return {"step_overhead_ms": round(base.device.step_overhead_ms + max(0.0, fixed), 3),
            "glue_ns_per_id": round(glue, 2), "dist_overhead_ms": round(dist_ms, 3),
            "collection_ms": round(max(0.0, statistics.median(coll)), 3), "dense_replica_merge": True,
            "process_mb": round(bare_steps.torchrec_mb, 1), "spawned_process_mb": round(spawned.peak_mem_mb, 1)}, src
