"""A rank's peak memory beyond its shards' weights and optimizer state, in bytes: what the harness
allocates (harness/train.py, harness/sharding, harness/model.py), buffer by buffer; checked against
real trials by benchmarks/bench_memory.py.

A step's buffers come in three phases that are never alive together: the embedding forward (its
end), the dense part (its activations at the start of the backward), the embedding backward. On a
GPU the peak is the largest phase (max_memory_allocated counts live tensors). On CPU (peak RSS)
glibc serves every buffer up to its mmap threshold (raised to the largest freed buffer, up to
GLIBC_MMAP_MAX) from its heap and keeps what is freed there: a step allocates the same sequence
every time and a buffer rarely fits another's hole while that one is alive, so the heap settles at
about each such buffer of the step in a place of its own; larger ones are mmapped and unmapped when
freed. (Measured on bench_memory.py's dev set: with every buffer mmapped,
MALLOC_MMAP_THRESHOLD_=65536, peak RSS fell by 50-260 MB, to within 5% of the largest phase.) A
rank's start adds one block of initial weights to its shards (harness/model.py init_table): never
the peak."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cubic_harness.config import DTYPE_BYTES, TrialConfig, ranks_spawned
from cubic_harness.dense_cost import DenseCost
from cubic_harness.sharding.transport import HOST_BATCH_BYTES
from cubic_harness.sim.cluster import Cluster
from cubic_harness.sim.loads import Position, ReplicaMerge, payload_cols
from cubic_harness.sim.traffic import ID_BYTES, id_bytes

# glibc's DEFAULT_MMAP_THRESHOLD_MAX (64-bit): larger buffers are always mmapped
GLIBC_MMAP_MAX = 32 * 2**20


@dataclass(frozen=True)
class MemoryInput:
    """What a rank's buffers depend on beyond the config: the cluster's device, the dense part, what
    each position's shards ask of it, and the step's exchange and replica merge."""

    cfg: TrialConfig
    cluster: Cluster
    dense: DenseCost
    positions: Sequence[Position]
    recv_cols: float  # pooled columns every rank receives
    dp_tables: list[int]
    merge: ReplicaMerge


@dataclass(frozen=True)
class _Shared:
    """The buffers every position's step holds alike (bytes), and the config's widths."""

    btd: float  # the assembled pooled rows [B, T*D]
    recv: float  # the pooled columns a rank receives (and its own DP tables')
    recv_cols: float
    dp: bool  # it holds data-parallel tables
    dp_cols: int
    dp_ids: float
    own_ids: float
    dense_phase: list[float]
    payload_cols: int  # the merge payload's columns beside the row
    cb: int
    wb: int
    cpu: bool


def memory(m: MemoryInput) -> tuple[float, list[float]]:
    """(what every group position holds, what position p holds on top), in bytes: every term and
    why in the module docstring and beside each buffer."""
    fixed = _fixed_bytes(m.cfg, m.cluster, m.dense)
    sh = _shared(m)
    held: list[float] = []
    seen: dict[tuple, float] = {}  # positions that hold alike (most of them at scale) hold alike
    for p in m.positions:
        key = (p.cols, p.ids, p.lens, p.touched_rows, p.union_frac if m.merge.union else 0.0,
               p.rows, p.row_dims, p.max_row_dims, p.max_rows_wide, p.max_payload)
        h = seen.get(key)
        if h is None:
            h = seen[key] = _held_bytes(p, sh, m)
        held.append(h)
    return fixed, held


def _fixed_bytes(cfg: TrialConfig, c: Cluster, dc: DenseCost) -> float:
    """What every position holds: the process, the dense part, the pre-generated batches."""
    # the framework: torch, the embedding kernels' code, the process groups, dynamo (the optimizer
    # and DDP import it): the calibration's bare one-rank trial's peak
    spawned = c.device.type == "cpu" and c.device.spawned_process_mb and ranks_spawned(cfg, c.framework)
    fixed = (c.device.spawned_process_mb if spawned else c.device.process_mb) * 2**20
    # the dense part: weights, gradients (DDP's buckets hold them), Adagrad's sum of squares and its
    # step's temporaries (the sum's square root, for every parameter at once: the foreach
    # implementation); under autocast a bf16 copy of every weight is cached for the step
    fixed += dc.params * 16 + (dc.params * 2 if cfg.dense_precision != "fp32" else 0)
    fixed += batch_bytes(cfg)
    return fixed


def _shared(m: MemoryInput) -> _Shared:
    """What every position's step allocates alike, once per estimate."""
    cfg, dc = m.cfg, m.dense
    wl, B = cfg.workload, cfg.batch_size
    pool = wl.lookups_per_sample()
    ab = 2 if cfg.dense_precision != "fp32" else 4  # autocast keeps the dense activations in bf16
    btd = B * wl.num_tables * wl.dim * 4
    dp_cols = len(m.dp_tables) * wl.dim
    idb = id_bytes(wl)
    # the dense part at the start of its backward: the pooled rows, the activations autograd keeps
    # (dense_cost: each saved tensor once) and the gradients flowing back through the widest of them
    kept = [B * f * ab for f in dc.kept] + [B * f * 4 for f in dc.kept_fp32]
    widest = max(kept, default=0.0)
    return _Shared(btd=btd, recv=B * (m.recv_cols + dp_cols) * 4, recv_cols=m.recv_cols,
                   dp=bool(m.dp_tables), dp_cols=dp_cols,
                   dp_ids=B * sum(pool[t] for t in m.dp_tables) * idb, own_ids=B * sum(pool) * idb,
                   dense_phase=[btd, *kept, widest, widest],
                   payload_cols=payload_cols(cfg.emb_optimizer),
                   cb=DTYPE_BYTES[cfg.comm_precision], wb=DTYPE_BYTES[cfg.emb_precision],
                   cpu=m.cluster.device.type == "cpu")


def _held_bytes(p: Position, sh: _Shared, m: MemoryInput) -> float:
    """Position p's bytes beyond `fixed` and its shards: what it keeps for the step, the step's
    largest phase, and 2D weight_avg's merge."""
    cfg = m.cfg
    fwd, inp, bwd, upd = _phases(p, sh, cfg)
    # what p keeps for the step - the received ids, lengths and offsets, as many again for every
    # batch the pipeline keeps in flight (pipeline_depth)
    keep = (p.ids + 2 * p.lens) * (1 + cfg.pipeline_depth)
    keep += 2 * upd  # the native kernel's sort keys and scratch for the update's ids (kept, reused)
    heap = 0.0
    if sh.cpu:
        phases = (fwd + inp, sh.dense_phase, bwd)
        heap = sum(x for ph in phases for x in ph if x <= GLIBC_MMAP_MAX)
        step = heap + max(sum(x for x in ph if x > GLIBC_MMAP_MAX) for ph in phases)
    else:
        step = max(sum(fwd), sum(inp), sum(sh.dense_phase), sum(bwd))
    h = keep + step
    if cfg.replicas > 1 and cfg.sparse_sync == "weight_avg":
        # the merge is larger than the step's mmapped buffers, freed by then (the heap's stay)
        for x in _merge_bytes(p, sh, m, step - (heap if sh.cpu else 0.0)):
            h += x
    return h


def _phases(p: Position, sh: _Shared, cfg: TrialConfig) -> tuple[list, list, list, float]:
    """Position p's buffers in the embedding forward (and the input distribution) and backward, and
    the ids its update sorts."""
    B, G, R, W, cb = cfg.batch_size, cfg.group_size, cfg.replicas, cfg.world_size, sh.cb
    k_out = G * B * p.cols * 4  # the kernel's pooled output for the group's bags of p's shards
    # cast to the comm precision
    wire = [G * B * p.cols * cb, B * sh.recv_cols * cb] if cb < 4 else []
    # embedding forward, at its end: the kernel's output, the all-to-all's received blocks, their
    # concatenation, and the [B, T*D] assembly (zeros, then index_add's result)
    fwd = [k_out, *wire, sh.recv, sh.recv, sh.btd, sh.btd]
    # embedding backward: the pooled gradient, its columns picked back out (index_select) and
    # gathered for the all-to-all (the split's backward), the gradient received for p's shards,
    # scaled for the update
    bwd = [sh.btd, sh.recv, sh.recv, *wire, k_out, k_out]
    upd = p.ids
    if R > 1 and cfg.sparse_sync == "grad_allreduce":  # the replicas' bags, gradients, their union
        bwd += [R * k_out, R * k_out, R * p.ids, R * p.ids]
        upd *= R
    if sh.dp and W > 1:  # the data-parallel tables' union of every rank's bags and gradients
        bwd += [W * B * sh.dp_cols * 4] * 2 + [W * sh.dp_ids] * 2
        upd += W * sh.dp_ids
    # the input distribution: this rank's bags' ids cut into pieces per shard and concatenated to
    # send, p's received (and reordered) ids
    inp = [sh.own_ids, sh.own_ids, p.ids]
    return fwd, inp, bwd, upd


def _merge_bytes(p: Position, sh: _Shared, m: MemoryInput, free: float) -> list[float]:
    """What 2D weight_avg adds to position p, term by term (summed onto the step in this order): the
    replica sync keeps a touched-row flag per row and, unless it averages in place (the union
    transport), its shards as they were at the last merge (weights and state); after the backward
    the merge builds each shard's payload (delta, the state's increment and under momentum scaling
    two more columns) in fp32: of every row when dense (all shards at once, then one at a time cast
    to the comm precision and back), of the touched rows when sparse (with their ids: the payloads,
    their concatenation, the R replicas' gathered), beyond the `free` bytes of the step's mmapped
    buffers, freed by then."""
    R, wb, cb, width, merge = m.cfg.replicas, sh.wb, sh.cb, sh.payload_cols, m.merge
    out = [p.rows if merge.union else p.rows_held_bytes + p.rows]
    if merge.union:  # averaging in place keeps no last-sync copy
        if merge.host:  # into shared memory that stays mapped, in the table's precision, as many
            # shards at once as fit HOST_BATCH_BYTES: its own slot and the result whole, its chunk
            # of each other replica's slot (and the union's ids)
            u = min(1.0, p.union_frac)
            slot = max(min(p.row_dims * wb * u, HOST_BATCH_BYTES), p.max_row_dims * wb * u)
            out.append(slot * (2 + (R - 1) / R) + p.rows * ID_BYTES * u)
            size = 0.0
        else:  # one shard's union at a time, its rows widened to fp32, with their ids
            size = p.max_rows_wide * min(1.0, p.union_frac)
    elif merge.sparse:
        dims = p.row_dims / max(1, p.rows)
        size = p.touched_rows * ((dims + width) * 4 + ID_BYTES) * (2 + R)
    else:
        size = 4 * (p.row_dims + width * p.rows) + (p.max_payload * (cb + 4) / 4 if cb < 4 else 0.0)
    out.append(max(0.0, size - free))
    return out


def batch_bytes(cfg: TrialConfig) -> float:
    """Pre-generated input batches held by one rank (harness/data.py: rank_batches)."""
    wl = cfg.workload
    per = cfg.batch_size * (sum(wl.lookups_per_sample()) * id_bytes(wl) + wl.dense_features * 4 + 4)
    steps = cfg.warmup_steps + cfg.measure_steps
    cyc, gb = wl.sample_cycle, cfg.global_batch
    return per * (min(steps, cyc // gb) if cyc % gb == 0 else steps)
