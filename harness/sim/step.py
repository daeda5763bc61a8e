"""One training step of the harness, priced: each group position's embedding work
(`loads.Position`), its memory (`memory.py`) and the host-memory hierarchy (`offload.py`), the dense
part, every collective, and the critical path over them in the order the harness runs them
(`schedule.py`). The rules are in the performance model's overview (`perf.py`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cubic_harness.config import DTYPE_BYTES, TrialConfig
from cubic_harness.dense_cost import DenseCost, dense_cost
from cubic_harness.sharding.plan import ShardingPlan
from cubic_harness.sharding.transport import host_mean_bytes, union_cost
from cubic_harness.sim import collectives as coll
from cubic_harness.sim.cluster import Cluster, log_interp
from cubic_harness.sim.loads import (
    Position,
    ReplicaMerge,
    ShardLoads,
    positions,
    replica_merge,
    shard_loads,
)
from cubic_harness.sim.memory import MemoryInput, memory
from cubic_harness.sim.offload import Placed, place
from cubic_harness.sim.rates import ModelError, Speeds, emb_ms, gemm_ms, overlapped, spans, speeds
from cubic_harness.sim.schedule import Op, Timeline, critical_path
from cubic_harness.sim.traffic import ID_BYTES, STATE_BYTES, id_bytes, lookup_bytes, update_bytes
from cubic_harness.timers import PHASES

DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the last one launched when the backward ends
GROUP, WORLD, DP, REPLICAS = "group", "world", "dp", "replicas"  # the collectives' process groups
# DDP buckets priced apart; more are merged (their launches spread over the backward alike)
MAX_BUCKETS = 8
FEATURE_NAMES = ("bytes_lookup_per_rank", "a2a_bytes", "allreduce_bytes", "mlp_gflops",
                 "mem_mb_per_rank", "load_imbalance", "est_step_ms", "est_qps",
                 *(f"est_{k}_ms" for k in PHASES))


@dataclass(frozen=True)
class Estimate:
    step_ms: float
    qps: float
    breakdown_ms: dict[str, float]
    comm_ms: dict[str, float]  # the comm phase by collective
    mem_mb: list[float]  # per group position
    mem_limit_mb: float
    features: dict[str, float]
    per_rank: dict[str, list[float]] = field(default_factory=dict)  # emb_fwd / emb_bwd per position
    offload: dict[int, list[dict]] = field(default_factory=dict)  # position -> shards in host mem.
    comm_hidden_ms: float = 0.0  # comm_overlap: communication beside compute, not in the step


@dataclass(frozen=True)
class _Dense:
    """The dense part's ms: forward, backward (the bottom MLP's of each apart), the work beyond
    GEMMs, the optimizer, and a dense gradient's bytes on the wire."""

    fwd: float
    bwd: float
    other: float
    bottom_fwd: float
    bottom_bwd: float
    optim: float
    grad_bytes: int

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.other


@dataclass(frozen=True)
class _Parts:
    """Every piece of the step, each priced alone (ms): the schedule then says how they add up."""

    emb_fwd: float
    emb_bwd: float
    dense: _Dense
    glue: float  # the collection's routing and assembly
    inp: float  # the input all-to-alls (in the step)
    beside: float  # a GPU's pipelined input distribution: its time beside the previous step
    pooled: float  # the pooled all-to-all, one direction
    dp_sync: float
    allreduce: float
    replica_gather: float  # 2D grad_allreduce
    replica_sync: float  # 2D weight_avg, per step


def estimate(cfg: TrialConfig, plan: ShardingPlan, c: Cluster) -> Estimate:
    """Predict one training step of `cfg` with `plan` on cluster `c` (see `perf.py`'s overview)."""
    return _estimate(cfg, plan, c, {})


def step_at(cfg: TrialConfig, plan: ShardingPlan, c: Cluster, **parts_ms: float) -> float:
    """The step `plan` gives, with the named parts of it (`_Parts` fields: `emb_fwd`, `pooled`, `inp`,
    ...) at these durations instead of its own: the model's critical path over a plan's least possible
    parts is a floor under every plan's step (benchmarks/bench_plan_bound.py)."""
    return _estimate(cfg, plan, c, parts_ms).step_ms


def _estimate(cfg: TrialConfig, plan: ShardingPlan, c: Cluster, given: dict[str, float]) -> Estimate:
    wl, W, G = cfg.workload, cfg.world_size, cfg.group_size
    if W > c.devices:
        raise ModelError(f"world_size={W} needs {W} devices; cluster {c.name} has {c.devices} "
                         f"({c.nodes} nodes x {c.devices_per_node})")
    s = speeds(cfg, c)
    wb, sb = DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer]
    g_span, r_span, w_span = spans(W, G, cfg.group_placement, c)
    # embedding work per position: every model-parallel shard's bytes, summed per position
    ld = shard_loads(cfg, plan, s)
    dc = dense_cost(wl)
    pos = positions(cfg, ld, plan.bytes_per_rank([t.rows for t in wl.tables], wb, sb))
    merge = replica_merge(cfg, c, pos, r_span)
    # memory per position (`memory.py`: every term and why), and Neo's hierarchy: what does not fit
    # a GPU lives in host memory behind a cache
    fixed, held = memory(MemoryInput(cfg, c, dc, pos, ld.recv_cols, plan.dp_tables(), merge))
    mem_limit = c.rank_memory_mb(s.ranks_per_node)
    placed = place(cfg, c, ld, pos, fixed, held, mem_limit)
    # each piece of the step alone; a collective with its rank's links to itself
    emb_fwd, emb_bwd, dp_bytes = _embedding(cfg, s, plan, placed)
    dense = _dense(cfg, c, s, dc)
    inp, beside, pooled = _exchange(cfg, c, s, ld, pos, g_span)
    dp_sync = coll.all_gather(dp_bytes, w_span, c) if dp_bytes is not None and W > 1 else 0.0
    ar = coll.all_reduce(dc.params * dense.grad_bytes, w_span, c) if W > 1 else 0.0
    gather_ms, merge_ms = _replica_ms(cfg, c, s, ld, pos, merge, r_span)
    ids = cfg.batch_size * sum(wl.lookups_per_sample())
    glue = ids * c.device.glue_ns_per_id / 1e6 / s.emb_speed  # the collection's routing, assembly
    parts = dataclasses.replace(_Parts(emb_fwd, emb_bwd, dense, glue, inp, beside, pooled, dp_sync, ar,
                                       gather_ms, merge_ms), **given)
    tl = critical_path(_ops(cfg, c, parts, dc.params * 4), c.device.overlap_hidden)
    return _result(cfg, c, s, dc, ld, placed, parts, tl, mem_limit)


def _embedding(cfg: TrialConfig, s: Speeds, plan: ShardingPlan,
               placed: Sequence[Placed]) -> tuple[float, float, float | None]:
    """(the busiest position's lookups, and its backward, each with the data-parallel tables' own
    beside them; the bytes of the data-parallel tables' sparse sync, None without any)."""
    wl, W, B = cfg.workload, cfg.world_size, cfg.batch_size
    wb, sb = DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer]
    pool = wl.lookups_per_sample()
    dp = [(wl.tables[i], pool[i]) for i in plan.dp_tables()]
    dp_fwd = sum(emb_ms(lookup_bytes(B * p, B, t.dim, wb), "fwd", t.dim, s, t.weighted)
                 for t, p in dp)
    dp_bwd = sum(emb_ms(update_bytes(W * B * p, W * B, t.dim, wb, sb), "bwd", t.dim, s, t.weighted)
                 for t, p in dp)
    idb = id_bytes(wl)
    dp_bytes = sum(B * (p * idb + t.dim * 4 + ID_BYTES) for t, p in dp) if dp else None
    return max(p.fwd_ms for p in placed) + dp_fwd, max(p.bwd_ms for p in placed) + dp_bwd, dp_bytes


def _dense(cfg: TrialConfig, c: Cluster, s: Speeds, dc: DenseCost) -> _Dense:
    """Every GEMM of the dense part at the rate measured for its size and precision, its other work
    at the elementwise rate, and the dense Adagrad's bytes."""
    B, W = cfg.batch_size, cfg.world_size
    prec = "bf16" if cfg.dense_precision != "fp32" and "bf16" in c.device.dense_gflops else "fp32"
    fwd, bwd = gemm_ms(dc, B, c.device.dense_gflops[prec] * s.dense_speed, c.device.gemm_half_mflop)
    ew = c.device.elementwise_gbs.get(prec)
    other = B * dc.act_floats * 4 / (log_interp(ew, B) * 1e6 * s.dense_speed) if ew else 0.0
    optim = dc.params * 16 / (s.copy_gbs * 1e6 * s.dense_speed)
    grad_bytes = DTYPE_BYTES[cfg.allreduce_comm_precision]  # per dense gradient on the wire
    if grad_bytes < 4 and W > 1:  # the comm hook's cast in and out: read fp32, write; read, write
        optim += dc.params * 12 / (s.copy_gbs * 1e6 * s.dense_speed)
    bf, bb = gemm_ms(dataclasses.replace(dc, gemms=dc.gemms[:len(cfg.workload.bottom_mlp)]), B,
                     c.device.dense_gflops[prec] * s.dense_speed, c.device.gemm_half_mflop)
    return _Dense(fwd, bwd, other, bf, bb, optim, grad_bytes)


def _exchange(cfg: TrialConfig, c: Cluster, s: Speeds, ld: ShardLoads, pos: Sequence[Position],
              group: coll.Span) -> tuple[float, float, float]:
    """(the input all-to-alls in the step, their time beside it, the pooled all-to-all one way). An
    all-to-all takes as long as its busiest rank: every rank sends its own bags' ids (and receives
    its pooled rows), but the rank holding the hot shards receives (and sends back) the most."""
    G = cfg.group_size
    recv_cols, lens_send, ids_send = ld.recv_cols, ld.lens_send, ld.ids_send
    if not (G > 1 and recv_cols):
        return 0.0, 0.0, 0.0
    beside = 0.0
    inp = 0.0 if c.device.reads_own_ids else (
        coll.all_to_all(max(lens_send, max(p.lens for p in pos)), group, c, lens_send)
        + coll.all_to_all(max(ids_send, max(p.ids for p in pos)), group, c, ids_send))
    if inp and cfg.pipeline_depth > 0:
        inp, beside = overlapped(inp, coll.all_to_all(0.0, group, c), cfg, c, s)
    return inp, beside, pooled_ms(cfg, c, group, recv_cols, max(p.cols for p in pos))


def pooled_ms(cfg: TrialConfig, c: Cluster, group: coll.Span, recv_cols: float, max_cols: float) -> float:
    """The pooled all-to-all one way: every rank receives its bags' B x `recv_cols` (the mean a rank
    sends), the busiest sends its bags' share of `max_cols` to every rank."""
    G, B, cb = cfg.group_size, cfg.batch_size, DTYPE_BYTES[cfg.comm_precision]
    return coll.all_to_all(max(B * recv_cols, G * B * max_cols) * cb, group, c, B * recv_cols * cb)


def _replica_ms(cfg: TrialConfig, c: Cluster, s: Speeds, ld: ShardLoads, pos: Sequence[Position],
                merge: ReplicaMerge, replicas: coll.Span) -> tuple[float, float]:
    """2D's replica traffic per step: (grad_allreduce's all-gather, weight_avg's merge by the
    harness's transport, `transport.sparse_pays`)."""
    R, G = cfg.world_size // cfg.group_size, cfg.group_size
    if not (R > 1 and ld.recv_cols):
        return 0.0, 0.0
    if cfg.sparse_sync == "grad_allreduce":
        return coll.all_gather(max(p.rep_gather for p in pos), replicas, c), 0.0
    wb, cb = DTYPE_BYTES[cfg.emb_precision], DTYPE_BYTES[cfg.comm_precision]
    rate = c.device.replica_merge_gbs.get("sparse" if merge.sparse else "dense")
    if merge.sparse:
        t = coll.all_gather(max(p.touched_bytes for p in pos), replicas, c)
        work = R * max(p.touched_rows for p in pos)
    elif merge.host:  # replicas on one host: through shared memory, at memory speed (its two
        # barriers a call, ~0.2 ms each here, are left out: the link's fitted latency is no
        # barrier's cost); the slots hold the rows in the table's precision, not the fp32 wire's
        t = (host_mean_bytes(max(p.rows_comm_bytes for p in pos) * wb / cb, R)
             / (s.copy_gbs * 1e6 * s.emb_speed))
        work = 2 * max(p.rows for p in pos)  # gather into the slot, write the mean back
    else:
        t = coll.all_reduce(max(p.rows_comm_bytes for p in pos), replicas, c, concurrent=G)
        work = 2 * max(p.rows for p in pos)  # build the payload, apply the sum (the wire sums)
    if rate:  # the merge's own work on the replicas' rows (width + the state column; fp32, but in
        # the table's precision through shared memory)
        t += (work * (max(p.width for p in pos) * (wb if merge.host else 4) + 4)
              / (rate * 1e6 * s.emb_speed))
    if merge.union:  # the union where that pays: a fixed part plus its rows' (`union_cost`)
        p = max(pos, key=lambda q: q.union_rows / max(1, q.rows))
        t *= min(1.0, union_cost(p.union_rows, p.rows))
    return 0.0, t / cfg.sparse_sync_interval


def _ops(cfg: TrialConfig, c: Cluster, parts: _Parts, grad_bytes: float) -> list[Op]:
    """The step as the harness runs it (harness/train.py, harness/sharding/collection.py): a
    critical path over the rank's compute and its collectives (`schedule`)."""
    d, ov = parts.dense, cfg.comm_overlap
    return [
        Op("overhead", c.device.step_overhead_ms + parts.glue),
        Op("input_a2a", parts.inp, GROUP, ("overhead",)),  # the ids routed (glue), then sent
        Op("emb_fwd", parts.emb_fwd, after=("input_a2a",)),
        Op("bottom_fwd", d.bottom_fwd),
        # launched after the lookup, beside the bottom MLP (comm_overlap), else called after it
        Op("pooled_fwd", parts.pooled, GROUP, ("emb_fwd",) if ov != "none" else ("bottom_fwd",)),
        # the interaction, the top MLP, the loss
        Op("top_fwd", d.fwd - d.bottom_fwd + d.other, after=("pooled_fwd",)),
        *_dense_backward(d.bwd - d.bottom_bwd, d.bottom_bwd, parts.pooled, parts.allreduce,
                         grad_bytes, ov == "forward_backward"),
        Op("dp_sync", parts.dp_sync, DP, ("bottom_bwd",)),
        Op("replica_gather", parts.replica_gather, REPLICAS, ("bottom_bwd",)),
        Op("emb_bwd", parts.emb_bwd, after=("pooled_bwd", "dp_sync", "replica_gather")),
        # after the backward, which DDP ends by waiting for its all-reduce
        Op("replica_sync", parts.replica_sync, REPLICAS, ("emb_bwd", "ddp_last")),
        Op("optim", d.optim, after=("ddp_last", "replica_sync")),
    ]


def _dense_backward(top: float, bottom: float, pooled: float, ar: float, grad_bytes: float,
                    overlap: bool) -> list[Op]:
    """The dense backward as the harness runs it: the top (interaction and top MLP) first, then the
    pooled gradients' all-to-all (called, or launched beside the bottom MLP's backward with
    `overlap`), then the bottom MLP. DDP launches each 25 MB bucket's all-reduce when the backward
    has filled it: as the gradients come at the rate the backward computes them, bucket j of n is
    ready after j/n of the dense backward's time (the last one when it ends). Named so the step can
    wait: `top_bwd`, `pooled_bwd`, `bottom_bwd` (the last compute op), `ddp_last`."""
    n = min(MAX_BUCKETS, max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES)))
    fills = [(top + bottom) * (j + 1) / n for j in range(n)]  # when bucket j is full
    ops: list[Op] = []
    for region, lo, hi in (("top_bwd", 0.0, top), ("bottom_bwd", top, top + bottom)):
        wait = ("pooled_bwd",) if region == "bottom_bwd" and not overlap else ()
        t0 = lo
        for j, at in enumerate(fills):
            if (at <= hi) if region == "top_bwd" else (at > lo):
                ops.append(Op(f"{region}_{j}", min(at, hi) - t0, after=wait))
                ops.append(Op("ddp_last" if j == n - 1 else f"ddp_{j}", ar / n, WORLD,
                              (f"{region}_{j}",)))
                t0, wait = min(at, hi), ()
        ops.append(Op(region, hi - t0, after=wait))
        if region == "top_bwd":
            ops.append(Op("pooled_bwd", pooled, GROUP, ("top_bwd",)))
    return ops


def _comm(cfg: TrialConfig, c: Cluster, parts: _Parts, tl: Timeline,
          recv_cols: float) -> tuple[dict[str, float], float, float, float]:
    """(the comm phase by collective, the step, the weight_avg merge's own phase, the comm phase):
    what of each collective the critical path leaves exposed, and what the step adds beyond it."""
    W, G, R, wl = cfg.world_size, cfg.group_size, cfg.world_size // cfg.group_size, cfg.workload
    comm: dict[str, float] = {}
    if G > 1 and recv_cols:
        comm["input_a2a"] = tl.exposed_ms["input_a2a"]
        comm["pooled_a2a"] = tl.exposed_ms["pooled_fwd"] + tl.exposed_ms["pooled_bwd"]
    if parts.dp_sync:
        comm["dp_sync"] = tl.exposed_ms["dp_sync"]
    if W > 1:
        comm["ddp_allreduce"] = sum(v for k, v in tl.exposed_ms.items() if k.startswith("ddp_"))
    if R > 1 and recv_cols:
        comm["replica_sync"] = tl.exposed_ms[
            "replica_gather" if cfg.sparse_sync == "grad_allreduce" else "replica_sync"]
    step = tl.step_ms
    if W > 1 and c.device.jitter:  # ranks drift apart over their compute; collectives wait for
        # the last of them
        comm["wait"] = c.device.jitter * (parts.emb_fwd + parts.emb_bwd + parts.dense.total)
        step += comm["wait"]
    if W > 1 and (c.device.dist_overhead_ms or c.device.collection_ms):  # a framework's own
        # bookkeeping of its distributed step (calls), and of each collection beyond the first
        comm["framework"] = (c.device.dist_overhead_ms
                             + c.device.collection_ms * (wl.collections - 1))
        step += comm["framework"]
    # a real trial times the weight_avg merge as its own phase (`sync`); everything else is the
    # step's comm
    weight_avg = R > 1 and recv_cols and cfg.sparse_sync == "weight_avg"
    sync_ms = comm["replica_sync"] if weight_avg else 0.0
    comm_ms = sum(comm.values()) - sync_ms
    if parts.beside > step:  # the next batch's ids take longer to arrive than this step: exposed
        comm["input_a2a"] = parts.beside - step
        comm_ms += parts.beside - step
        step = parts.beside
    return comm, step, sync_ms, comm_ms


def _result(cfg: TrialConfig, c: Cluster, s: Speeds, dc: DenseCost, ld: ShardLoads,
            placed: Sequence[Placed], parts: _Parts, tl: Timeline, mem_limit: float) -> Estimate:
    """The estimate: the step, its phases as a real trial times them, and the tuner's proxy
    features."""
    W, G, B, cb = cfg.world_size, cfg.group_size, cfg.batch_size, DTYPE_BYTES[cfg.comm_precision]
    comm, step, sync_ms, comm_ms = _comm(cfg, c, parts, tl, ld.recv_cols)
    qps = W * B / step * 1e3
    bd = {"emb_fwd": parts.emb_fwd, "emb_bwd": parts.emb_bwd, "comm": comm_ms, "sync": sync_ms,
          "dense": parts.dense.total + c.device.step_overhead_ms + parts.glue,
          "optim": parts.dense.optim}
    fwd, bwd = [p.fwd_ms for p in placed], [p.bwd_ms for p in placed]
    mem = [p.mem_mb for p in placed]
    mean_load = (sum(fwd) + sum(bwd)) / G
    features = {
        "bytes_lookup_per_rank": max(fwd) * s.copy_gbs * 1e6,
        "a2a_bytes": B * ld.recv_cols * cb * 2 + ld.ids_send,
        "allreduce_bytes": dc.params * float(parts.dense.grad_bytes),
        "mlp_gflops": B * dc.flops / 1e9,
        "mem_mb_per_rank": max(mem),
        "load_imbalance": (max(fwd) + max(bwd)) / mean_load if mean_load > 0 else 1.0,
        "est_step_ms": step,
        "est_qps": qps,
        **{f"est_{k}_ms": v for k, v in bd.items()},
    }
    offload = {p: x.offload for p, x in enumerate(placed) if x.offload is not None}
    # what a real trial times as hidden
    hidden_ms = tl.hidden_ms["pooled_fwd"] + tl.hidden_ms["pooled_bwd"]
    return Estimate(step, qps, bd, comm, mem, mem_limit, features, {"emb_fwd": fwd, "emb_bwd": bwd},
                    offload, hidden_ms)
