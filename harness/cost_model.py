"""Analytic cost model: a config's step time, memory and communication on given hardware.

One model, two users: the `auto` sharding planner (per-table choices) and the
tuner's proxy (derived features, and the prior that orders its warm-up). It
lives in the harness so that the harness never imports the tuner.

The model is bytes / bandwidth (TorchRec's planner style: backward ~ 2x
forward for embeddings), ring / all-to-all collective formulas, MLP FLOPs /
rate, and the per-rank load of the sharding plan (the step waits for the
slowest rank). Kernel efficiency factors say how far each backend is from its
byte floor on CPU (FBGEMM's CPU TBE backward is ~20x off, see issue 6).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from harness.config import TrialConfig
from harness.dense_cost import dense_cost
from harness.workload import TableSpec

if TYPE_CHECKING:  # the planner imports this module
    from harness.sharding.plan import ShardingPlan


@dataclass(frozen=True)
class Hardware:
    """Bandwidths in GB/s, compute in GFLOP/s (per rank, one thread), latencies in ms."""

    name: str = "cpu-gloo"
    mem_bw: float = 8.0  # random-row gather/scatter bandwidth per thread
    intra_bw: float = 0.25  # rank-to-rank bandwidth inside a node (gloo over loopback: ~0.2 GB/s measured
    cross_bw: float = 0.25  # for a 410 MB all-reduce between 2 ranks here); across nodes
    ranks_per_node: int = 64
    flops: float = 60.0  # dense fp32 GFLOP/s per thread (small workload MLPs: 1.4 GFLOP in 22 ms here)
    low_precision_bytes: bool = False  # do fp16/bf16 tables move fewer bytes? (CPU kernels: measured no)
    bf16_speed: float = field(default_factory=lambda: _cpu_bf16_speed())  # dense bf16 rate relative to fp32
    coll_latency_ms: float = 0.08  # per collective call
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    # time / (bytes / mem_bw) per backend, measured on the small workload at 1 thread (issue 6 table):
    # fbgemm 2.5 + 7.0 ms, native 2.3 + 6.8 ms, torch 3 + ~200 ms for 42 MB of looked-up rows.
    kernel_fwd: dict = field(default_factory=lambda: {"fbgemm": 0.5, "torch": 0.6, "native": 0.45, "triton": 1.5})
    kernel_bwd: dict = field(default_factory=lambda: {"fbgemm": 1.4, "torch": 35.0, "native": 1.3, "triton": 2.0})
    # how the embedding kernels scale with threads (FBGEMM's CPU TBE does not get faster with a second one)
    kernel_thread_exp: dict = field(default_factory=lambda: {"fbgemm": 0.0, "torch": 0.3, "native": 0.9,
                                                             "triton": 0.0})

    @classmethod
    def preset(cls, name: str) -> Hardware:
        if name == "cpu-gloo":
            return cls()
        if name == "h100-nvlink":  # ZionEX-like node: NVLink inside, RDMA across
            return cls(name, mem_bw=2500.0, intra_bw=300.0, cross_bw=25.0, ranks_per_node=8, flops=400_000.0,
                       bf16_speed=2.0, coll_latency_ms=0.02, cores=10_000, low_precision_bytes=True,
                       kernel_fwd={"fbgemm": 1.3, "torch": 3.0, "native": 99.0, "triton": 1.5},
                       kernel_bwd={"fbgemm": 1.6, "torch": 6.0, "native": 99.0, "triton": 2.0})
        raise ValueError(f"unknown hardware preset {name!r}; choose cpu-gloo or h100-nvlink")


@functools.cache
def _cpu_bf16_speed() -> float:
    """bf16 GEMMs run ~2.5x fp32 with AVX512-BF16/AMX (measured here: 8.5 vs 21 ms for the small
    workload's MLPs at batch 1024, one thread) and slower than fp32 without them (emulated)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return 0.7
    return 2.5 if ("avx512_bf16" in flags or "amx_bf16" in flags) else 0.7


@functools.cache
def default_hardware() -> Hardware:
    """This machine's calibrated defaults (built once: the planner asks for them per table)."""
    return Hardware()


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8_auto": 2, "fp8_all": 1}


def table_lookup_bytes(t: TableSpec, samples: int, dim: int, wbytes: int, row_frac: float = 1.0) -> float:
    """Bytes of rows read for `samples` bags of table t (a row shard sees row_frac of the ids)."""
    return samples * t.pooling * row_frac * dim * wbytes


def a2a_ms(bytes_per_rank: float, ranks: int, hw: Hardware) -> float:
    """All-to-all: each rank sends (ranks-1)/ranks of its buffer; one latency term."""
    if ranks <= 1:
        return 0.0
    bw = hw.intra_bw if ranks <= hw.ranks_per_node else hw.cross_bw
    return bytes_per_rank * (ranks - 1) / ranks / (bw * 1e6) + hw.coll_latency_ms


def allreduce_ms(nbytes: float, ranks: int, hw: Hardware) -> float:
    """Ring all-reduce: 2 (n-1)/n of the buffer crosses each link."""
    if ranks <= 1:
        return 0.0
    bw = hw.intra_bw if ranks <= hw.ranks_per_node else hw.cross_bw
    return 2 * nbytes * (ranks - 1) / ranks / (bw * 1e6) + 2 * hw.coll_latency_ms * math.log2(ranks)


@dataclass
class CostEstimate:
    step_ms: float
    qps: float
    breakdown_ms: dict[str, float]
    mem_mb_per_rank: list[float]
    features: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(cfg: TrialConfig, hw: Hardware | None = None, plan: ShardingPlan | None = None) -> CostEstimate:
    """Predict one training step of `cfg` (ms), throughput and per-rank memory."""
    from harness.sharding.planner import make_plan  # planner uses this module's table costs

    hw = hw or default_hardware()
    wl, W, G, B = cfg.workload, cfg.world_size, cfg.group_size, cfg.batch_size
    R = W // G
    plan = plan or make_plan(cfg, check_memory=False)
    wb = weight_bytes(cfg, hw)
    cb = DTYPE_BYTES[cfg.comm_precision]
    threads = cfg.threads_per_rank
    # Oversubscribed cores slow every rank down; extra threads help sub-linearly.
    contention = max(1.0, W * threads / max(1, hw.cores))
    speed = threads ** 0.7 / contention
    kf, kb = hw.kernel_fwd.get(cfg.kernel, 3.0), hw.kernel_bwd.get(cfg.kernel, 10.0)

    fwd_bytes, upd_bytes = [0.0] * G, [0.0] * G
    recv_cols = 0  # pooled columns each rank receives per sample (RW partials count once per shard)
    ids_sent = 0.0
    for tp in plan.tables:
        t = wl.tables[tp.table]
        if tp.kind == "data_parallel":
            continue
        ids_sent += B * t.pooling * 8
        for s in tp.shards:
            frac = s.rows / t.rows
            fwd_bytes[s.rank] += table_lookup_bytes(t, G * B, s.dim, wb, frac)
            # 2D grad_allreduce updates with the union of the replicas' bags
            upd = R if (R > 1 and cfg.sparse_sync == "grad_allreduce") else 1
            upd_bytes[s.rank] += table_lookup_bytes(t, G * B * upd, s.dim, wb, frac) + G * B * upd * s.dim * 4
            recv_cols += s.dim
    # data-parallel tables: local lookup; sparse sync = all-gather of every rank's ids + pooled
    # gradients, then one fused update with the union of the W*B bags
    dp = [wl.tables[i] for i in plan.dp_tables()]
    dp_lookup = sum(table_lookup_bytes(t, B, t.dim, wb) for t in dp)
    dp_union = sum(table_lookup_bytes(t, W * B, t.dim, wb) + W * B * t.dim * 4 for t in dp)
    dp_gather_bytes = sum(B * (t.pooling * 8 + t.dim * 4) for t in dp) * W

    emb_speed = threads ** hw.kernel_thread_exp.get(cfg.kernel, 0.5) / contention
    to_ms = 1.0 / (hw.mem_bw * 1e6 * emb_speed)
    emb_fwd_rank = [b * kf * to_ms for b in fwd_bytes]
    emb_bwd_rank = [b * kb * to_ms for b in upd_bytes]
    emb_fwd = max(emb_fwd_rank) + dp_lookup * kf * to_ms
    emb_bwd = max(emb_bwd_rank) + dp_union * kb * to_ms
    mean_load = sum(emb_fwd_rank) / G + sum(emb_bwd_rank) / G
    imbalance = (max(emb_fwd_rank) + max(emb_bwd_rank)) / mean_load if mean_load > 0 else 1.0

    # communication
    pooled_bytes = B * recv_cols * cb
    comm_out = 2 * a2a_ms(pooled_bytes, G, hw)  # forward outputs + backward gradients
    comm_in = a2a_ms(ids_sent, G, hw) + (a2a_ms(B * wl.num_tables * 8, G, hw) if G > 1 else 0.0)
    if cfg.pipeline_depth > 0:  # input distribution overlaps the previous batch's compute
        comm_in *= 0.15
    dc = dense_cost(wl)
    dense_params = dc.params
    comm_ddp = allreduce_ms(dense_params * 4, W, hw)
    comm_dp = a2a_ms(dp_gather_bytes, W, hw) if dp else 0.0
    local_shard_bytes = plan.bytes_per_rank([t.rows for t in wl.tables], DTYPE_BYTES[cfg.emb_precision])
    comm_2d = 0.0
    if R > 1:
        if cfg.sparse_sync == "grad_allreduce":
            comm_2d = a2a_ms(sum(upd_bytes) / G * 0.5, R, hw) * 2
        else:  # the replica sync (weights and row state) every sparse_sync_interval steps, amortized
            comm_2d = allreduce_ms(max(local_shard_bytes), R, hw) / cfg.sparse_sync_interval
    comm = comm_out + comm_in + comm_ddp + comm_dp + comm_2d

    # dense compute: bottom + interaction + top, forward and backward GEMMs (harness/dense_cost.py)
    flops = B * dc.flops
    rate = hw.flops * 1e6 * speed * (hw.bf16_speed if cfg.dense_precision != "fp32" else 1.0)
    dense = flops / rate
    optim = dense_params * 16 / (hw.mem_bw * 1e6 * speed)

    step = emb_fwd + emb_bwd + comm + dense + optim
    qps = W * B / step * 1e3
    act_mb = B * dc.act_floats * 4 / 2**20
    base_mb = 350.0  # a torch + gloo process
    mem = [base_mb + b / 2**20 + act_mb + dense_params * 16 / 2**20 + _batch_mb(cfg) for b in local_shard_bytes]
    bd = {"emb_fwd": emb_fwd, "emb_bwd": emb_bwd, "comm": comm, "dense": dense, "optim": optim}
    features = {
        "bytes_lookup_per_rank": max(fwd_bytes),
        "a2a_bytes": pooled_bytes * 2 + ids_sent,
        "allreduce_bytes": dense_params * 4 + dp_gather_bytes,
        "mlp_gflops": flops / 1e9,
        "mem_mb_per_rank": max(mem),
        "load_imbalance": imbalance,
        "est_step_ms": step,
        "est_qps": qps,
        **{f"est_{k}_ms": v for k, v in bd.items()},
    }
    return CostEstimate(step, qps, bd, mem, features)


FEATURE_NAMES = ("bytes_lookup_per_rank", "a2a_bytes", "allreduce_bytes", "mlp_gflops", "mem_mb_per_rank",
                 "load_imbalance", "est_step_ms", "est_qps",
                 *(f"est_{k}_ms" for k in ("emb_fwd", "emb_bwd", "comm", "dense", "optim")))


def features(cfg: TrialConfig, hw: Hardware | None = None) -> dict[str, float]:
    """Derived features for the tuner's proxy (all floats; infeasible plans get NaNs)."""
    try:
        return estimate(cfg, hw).features
    except ValueError:  # the same names as a feasible plan's, so the proxy's columns never depend on order
        return dict.fromkeys(FEATURE_NAMES, float("nan"))


def _batch_mb(cfg: TrialConfig) -> float:
    """Pre-generated input batches held by one rank (see data.rank_batches)."""
    wl = cfg.workload
    per = cfg.batch_size * (sum(t.pooling for t in wl.tables) * 8 + wl.dense_features * 4 + 4)
    gb = cfg.global_batch
    steps = cfg.warmup_steps + cfg.measure_steps
    cyc = wl.sample_cycle
    return per * (min(steps, cyc // gb) if cyc % gb == 0 else steps) / 2**20


def weight_bytes(cfg: TrialConfig, hw: Hardware) -> int:
    """Bytes a kernel moves per table element: fp16/bf16 tables move fewer only where measured so."""
    return DTYPE_BYTES[cfg.emb_precision] if hw.low_precision_bytes else 4


def table_cost(t: TableSpec, cfg: TrialConfig, hw: Hardware | None = None) -> float:
    """Per-step ms one table costs the rank holding it table-wise (for the planners)."""
    hw = hw or default_hardware()
    G, B = cfg.group_size, cfg.batch_size
    wb = weight_bytes(cfg, hw)
    kf, kb = hw.kernel_fwd.get(cfg.kernel, 3.0), hw.kernel_bwd.get(cfg.kernel, 10.0)
    b = table_lookup_bytes(t, G * B, t.dim, wb)
    return b * (kf + kb) / (hw.mem_bw * 1e6)


def dp_table_cost(t: TableSpec, cfg: TrialConfig, hw: Hardware | None = None) -> float:
    """Per-step ms of a data-parallel table: local lookup, sparse gradient all-gather, union update."""
    hw = hw or default_hardware()
    B, W = cfg.batch_size, cfg.world_size
    kf, kb = hw.kernel_fwd.get(cfg.kernel, 3.0), hw.kernel_bwd.get(cfg.kernel, 10.0)
    # bandwidth only: the DP tables share the same all-gather calls (no per-table latency)
    gather = W * B * (t.pooling * 8 + t.dim * 4) * (W - 1) / W / (hw.intra_bw * 1e6) if W > 1 else 0.0
    wb = weight_bytes(cfg, hw)
    lookups = table_lookup_bytes(t, B, t.dim, wb) * kf + table_lookup_bytes(t, W * B, t.dim, wb) * kb
    return lookups / (hw.mem_bw * 1e6) + gather


def tw_comm_cost(t: TableSpec, cfg: TrialConfig, hw: Hardware | None = None) -> float:
    """Per-step ms of one table's pooled all-to-all (fwd + bwd) when model-parallel."""
    hw = hw or default_hardware()
    cb = DTYPE_BYTES[cfg.comm_precision]
    G = cfg.group_size
    # bandwidth only: all tables share the same all-to-all calls
    return 2 * cfg.batch_size * t.dim * cb * (G - 1) / G / (hw.intra_bw * 1e6) if G > 1 else 0.0
