"""The performance model: the one place where bytes, FLOPs and collectives become milliseconds.

Three users price with it: the planners (`TableCosts`, one table's cost on a rank), the simulator
backend (`estimate` -> a TrialResult) and the tuner's proxy (`features`, the simulator's prediction for
the local cluster). It takes a plan and never imports the planner (the planner takes a cost).

What one training step of the harness costs, per group position p (every sharding group holds the
same plan, so position p's ranks all carry the same load):

- emb_fwd[p]: the bytes of p's shards' pooled lookups (ids x row bytes read, bags x width written)
  over the copy bandwidth x the backend's measured efficiency at that row width and precision;
- emb_bwd[p]: the fused backward+optimizer's bytes (rows and row state read and written, gradient
  rows read): with 2D `grad_allreduce` the union of the R replicas' bags;
- comm: the input distribution (lengths and ids all-to-all in the group; pipelined, it runs beside the
  previous step: on a GPU hidden up to that step's length, on CPU only its waiting; none where the
  framework reads each rank's ids itself, `reads_own_ids`), the pooled all-to-all forward and backward
  in the comm precision,
  the data-parallel tables' sparse sync (all-gather of ids and pooled gradients over the world),
  DDP's dense all-reduce in `allreduce_comm_precision` (only what the backward does not hide), 2D's replica traffic
  (`grad_allreduce`: all-gather of the replicas' ids and gradients every step; `weight_avg`, every k steps,
  the harness's transport (`cubic_harness.sharding.transport`): the plain rule's in-place all-reduce of the
  rows any replica touched, else the cheaper of a sparse all-gather of the touched rows and a dense
  all-reduce);
- dense: every GEMM of the dense part at the rate measured for its size and precision;
- optim: the dense Adagrad's bytes; plus the framework's fixed cost per step.

Rule: each phase's time is the maximum over ranks (the all-to-alls synchronise the group every
step, so the slowest rank sets each phase), and the step is a critical path over the rank's compute and its
collectives, in the order the harness runs them (`schedule.py`; `estimate` lists the ops): what runs beside
what (`comm_overlap`'s pooled all-to-all beside the bottom MLP, DDP's buckets beside the backward) costs the
device's measured `overlap_hidden` share of it, and collectives at once share the links. On CPU the ranks
of a node share its cores: with more threads than cores every rank slows by the oversubscription,
and a backend's speed-up with threads is the measured exponent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cubic_harness import ids as idstats
from cubic_harness.config import DTYPE_BYTES, TrialConfig, oversubscribed
from cubic_harness.dense_cost import DenseCost, dense_cost
from cubic_harness.sharding.plan import Shard, ShardingPlan, TablePlan, group_ranks
from cubic_harness.sharding.transport import (
    HOST_BATCH_BYTES,
    averages_in_place,
    choose_transport,
    host_mean_bytes,
    union_cost,
)
from cubic_harness.sim import collectives as coll
from cubic_harness.sim.cluster import Cluster, KernelEff, log_interp
from cubic_harness.sim.schedule import Op, critical_path
from cubic_harness.timers import PHASES
from cubic_harness.workload import TableSpec, Workload

STATE_BYTES = {"rowwise_adagrad": 4, "momentum_scaled_rowwise_adagrad": 4, "sgd": 0}
ID_BYTES = 8
SCORE_BYTES = 4  # beside every id when a table is weighted (harness/data.py Batch.scores)
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the last one is launched when the backward ends
GLIBC_MMAP_MAX = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX (64-bit): larger buffers are always mmapped
GROUP, WORLD, DP, REPLICAS = "group", "world", "dp", "replicas"  # the process groups a step's collectives use
MAX_BUCKETS = 8  # DDP buckets priced apart; more are merged (their launches spread over the backward alike)


class ModelError(ValueError):
    """The cluster cannot run this configuration at all (too few devices, an uncalibrated backend)."""


# ---------------------------------------------------------------------- embedding bytes
def rows_touched(t: TableSpec, rows: int, frac: float, draws: float, profiled: bool) -> float:
    """The distinct rows `draws` lookups touch in a shard of `rows` rows holding `frac` of t's lookups: hot
    rows are touched again, not new ones, as a profile repeats them or as Zipf ids do (their ranks scattered
    over the rows, so a shard holds its share of every rank); uniform ids, the birthday count. One shard of
    `rows_touched_many`."""
    return float(rows_touched_many([t], np.zeros(1, dtype=np.int64), np.array([rows]), np.array([frac]),
                                   np.array([draws / max(frac, 1e-12)]), profiled)[0])


def rows_touched_many(tables: list[TableSpec], table: np.ndarray, rows: np.ndarray, frac: np.ndarray,
                      table_draws: np.ndarray, profiled: bool) -> np.ndarray:
    """`rows_touched` of many shards at once (shard i of table `tables[table[i]]` holds `frac[i]` of its
    lookups, of which the table draws `table_draws[i]`): the expected distinct count is taken once per id law
    (one profile, or one Zipf law over as many rows) and draw count, however many shards share them."""
    rows = np.asarray(rows, dtype=np.float64)
    draws = table_draws * frac
    out = rows * -np.expm1(-draws / np.maximum(1, rows))  # uniform ids: the birthday count
    laws: dict[object, list[int]] = {}
    for i in np.unique(table):
        t = tables[i]
        law = id(t.profile) if profiled and t.profile else (t.rows, t.zipf_alpha) if t.id_dist == "zipf" else None
        if law is not None:
            laws.setdefault(law, []).append(int(i))
    for members in laws.values():
        t = tables[members[0]]
        at = np.flatnonzero(np.isin(table, members))
        n, which = np.unique(table_draws[at], return_inverse=True)
        if profiled and t.profile:
            distinct = idstats.expected_distinct_many(t.profile, n)[which]
        else:
            distinct = idstats.distinct_on_grid(*_zipf_ranks(t.rows, t.zipf_alpha), n)[which]
        full = np.array([tables[i].rows for i in table[at]], dtype=np.float64)
        out[at] = np.minimum(rows[at], distinct * rows[at] / full)
    return out


def zipf_cdf(x: np.ndarray | float, rows: int, a: float) -> np.ndarray:
    """Share of Zipf(a) draws on ranks below x, for the law the harness draws (`cubic_harness.data`): the
    continuous power law over ranks [1, rows + 1), each draw floored to its rank."""
    x = np.asarray(x, dtype=np.float64)
    if abs(a - 1.0) < 1e-9:
        return np.log(x) / math.log(rows + 1.0)
    return (x ** (1.0 - a) - 1.0) / ((rows + 1.0) ** (1.0 - a) - 1.0)


@functools.lru_cache(maxsize=64)
def _zipf_ranks(rows: int, a: float) -> tuple[np.ndarray, np.ndarray]:
    """The ranks on a grid, as (ranks in each cell, each one's probability): the hottest 1,024 one by one, then
    cells 2% wider each, priced at their mean probability (~1,600 cells at 40M rows). Jensen's gap from the mean
    is under 0.5% of the distinct count on the default task's tables (tests/test_sim.py holds it within 3%)."""
    edges = np.arange(1.0, min(rows, 1024) + 2.0)
    if rows > 1024:
        cells = int(math.log((rows + 1) / 1025) / math.log(1.02)) + 2
        tail = np.unique(np.floor(np.geomspace(1025.0, rows + 1.0, cells)))
        edges = np.concatenate([edges, tail[tail > edges[-1]]])
    counts = np.diff(edges)
    return counts, np.diff(zipf_cdf(edges, rows, a)) / counts


def id_bytes(wl: Workload) -> float:
    """Bytes one id moves in an input all-to-all or a union's all-gather: the id, and its score when weighted."""
    return ID_BYTES + SCORE_BYTES * wl.weighted


def lookup_bytes(ids: float, bags: float, dim: int, wbytes: int) -> float:
    """Forward: every id's row read, every bag's pooled row written (fp32)."""
    return ids * dim * wbytes + bags * dim * 4


def update_bytes(ids: float, bags: float, dim: int, wbytes: int, state_bytes: int) -> float:
    """Backward+optimizer: every id's row and its state read and written, every bag's gradient read."""
    return ids * (2 * dim * wbytes + 2 * state_bytes) + bags * dim * 4


@dataclass(frozen=True)
class Speeds:
    """Per-rank rates for one config on one cluster (GB/s and GFLOP/s after threads and contention)."""

    copy_gbs: float
    eff: KernelEff
    emb_speed: float
    dense_speed: float
    ranks_per_node: int
    effs: dict[tuple[str, int], float] = field(default_factory=dict)  # (phase, width) -> efficiency
    weighted: dict[str, float] = field(default_factory=dict)  # phase -> a weighted table's time over unweighted


def speeds(cfg: TrialConfig, c: Cluster) -> Speeds:
    eff = c.device.kernel(cfg.kernel, cfg.emb_precision)
    if eff is None:
        raise ModelError(f"cluster {c.name}: kernel={cfg.kernel} (emb_precision={cfg.emb_precision}) is not "
                         f"calibrated; it has {sorted(c.device.embedding)}")
    rpn = min(cfg.world_size, c.devices_per_node)
    if c.device.type == "cpu":
        t, cores = cfg.threads_per_rank, c.device.cores
        # cores in use beyond the first, as a fraction of the rest: 0 alone, 1 when the node is full
        busy = (min(rpn * t, cores) - 1) / (cores - 1) if cores > 1 else 0.0
        share = {k: 1.0 - (1.0 - c.device.shared_speed.get(k, 1.0)) * busy for k in ("dense", "embedding")}
        emb = _thread_speed(t, rpn, cores, c.device.thread_exp.get(cfg.kernel, 0.0)) * share["embedding"]
        dense = _thread_speed(t, rpn, cores, c.device.thread_exp.get("dense", 0.0)) * share["dense"]
    else:
        emb = dense = 1.0
    return Speeds(c.device.mem_bw_gbs, eff, emb, dense, rpn, weighted=c.device.weighted_cost.get(cfg.kernel, {}))


def _thread_speed(threads: int, ranks: int, cores: int, exp: float) -> float:
    """A CPU rank's speed with `threads` threads beside `ranks` - 1 others on `cores` cores, over one thread alone.

    Alone its work runs min(t, cores) ** exp times faster (`thread_exp`, calibrated): that many cores' worth of
    it is busy at once. The ranks together then ask for ranks x that many cores, and past `cores` each gets its
    share, so a rank runs at min(its speed-up, cores / ranks). A kernel that does not parallelise (FBGEMM's CPU
    kernel: exp ~0) keeps one core busy whatever its thread count, and its idle threads cost nothing; dividing
    by ranks x threads / cores instead charged them as if they ran, half the speed at 2 x 2 on 2 cores where
    the trials lose ~7% (OMP_WAIT_POLICY=PASSIVE: `trial.rank_env`)."""
    return min(min(threads, cores) ** exp, cores / ranks)


def _emb_ms(nbytes: float, phase: str, dim: int, s: Speeds, weighted: bool = False) -> float:
    """A kernel phase's time for its bytes at this width; a weighted table's times the backend's measured
    `weighted_cost` (its scores' bytes are few; what they cost is the kernel's extra work)."""
    key = (phase, dim)
    eff = s.effs.get(key)
    if eff is None:  # a few widths per config, asked per shard: interpolate each once
        eff = s.effs[key] = s.eff.at(phase, dim)
    return nbytes / (s.copy_gbs * 1e6 * eff * s.emb_speed) * (s.weighted.get(phase, 1.0) if weighted else 1.0)


# ---------------------------------------------------------------------- planner costs
class TableCosts:
    """What the planners ask: one table's cost on the rank holding it, its data-parallel cost, and its
    share of the pooled all-to-all (ms per step), all priced on `cluster`."""

    def __init__(self, cluster: Cluster | None) -> None:
        self.cluster = cluster  # None (no calibration yet): tables are priced by their bytes alone
        self._idb: tuple[Workload, float] | None = None
        self._speed: tuple[TrialConfig, Speeds | None] | None = None

    def _speeds(self, cfg: TrialConfig) -> Speeds | None:
        if self.cluster is None:
            return None
        if self._speed is not None and self._speed[0] is cfg:  # a planner asks per shard of one config
            return self._speed[1]
        try:
            got = speeds(cfg, self.cluster)
        except ModelError:  # the planner still plans (by bytes); the simulator reports the gap
            got = None
        self._speed = (cfg, got)
        return got

    def table(self, t: TableSpec, cfg: TrialConfig) -> float:
        bags = cfg.group_size * cfg.batch_size
        return self._lookups(t, bags, bags, cfg)

    def _lookups(self, t: TableSpec, fwd_bags: float, upd_bags: float, cfg: TrialConfig) -> float:
        return sum(self.phases(t, fwd_bags, upd_bags, cfg))

    def phases(self, t: TableSpec, fwd_bags: float, upd_bags: float, cfg: TrialConfig) -> tuple[float, float]:
        """(forward, backward+optimizer) ms of one whole table for these bags (bytes alone without a cluster)."""
        wb, sb = DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer]
        pool = t.lookups(cfg.workload.profiled)
        f = lookup_bytes(fwd_bags * pool, fwd_bags, t.dim, wb)
        u = update_bytes(upd_bags * pool, upd_bags, t.dim, wb, sb)
        s = self._speeds(cfg)
        if s is None:
            return f / 1e6, u / 1e6
        return _emb_ms(f, "fwd", t.dim, s, t.weighted), _emb_ms(u, "bwd", t.dim, s, t.weighted)

    def dp_table(self, t: TableSpec, cfg: TrialConfig) -> float:
        """Local lookup of B bags, the sparse all-gather's bandwidth, the update with the union of W*B."""
        B, W = cfg.batch_size, cfg.world_size
        pool, idb = t.lookups(cfg.workload.profiled), id_bytes(cfg.workload)
        if self.cluster is None:
            return self._lookups(t, B, W * B, cfg) + W * B * (pool * idb + t.dim * 4) / 1e6
        world = _spans(W, cfg.group_size, cfg.group_placement, self.cluster)[2]
        gather = coll.all_gather(B * (pool * idb + t.dim * 4), world, self.cluster) if W > 1 else 0.0
        return self._lookups(t, B, W * B, cfg) + gather

    def comm(self, t: TableSpec, cfg: TrialConfig, parts: int = 1) -> float:
        """The table's pooled all-to-all forward and backward when model-parallel (bandwidth only: the
        tables share the calls). `parts` row blocks each send their partial sums (row-wise: the group)."""
        G = cfg.group_size
        if G <= 1:
            return 0.0
        if self.cluster is None:
            return 2 * cfg.batch_size * t.dim * parts * DTYPE_BYTES[cfg.comm_precision] / 1e6
        b = cfg.batch_size * t.dim * parts * DTYPE_BYTES[cfg.comm_precision]
        s = _spans(cfg.world_size, G, cfg.group_placement, self.cluster)[0]
        return 2 * max(0.0, coll.all_to_all(b, s, self.cluster) - coll.all_to_all(0.0, s, self.cluster))


    # the per-table planner's questions (harness/sharding/search.py PlanCost), each as `estimate` prices it
    def shard(self, t: TableSpec, cfg: TrialConfig, start: int, stop: int, width: int) -> tuple[float, float, float]:
        """(forward ms, backward+optimizer ms, id bytes received) of one model-parallel shard: rows
        [start, stop) of t, `width` columns, on the position holding it."""
        f, b, ids = self.shards(t, cfg, np.array([start]), np.array([stop]), width)
        return float(f[0]), float(b[0]), float(ids[0])

    def _id_bytes(self, wl: Workload) -> float:
        """`id_bytes` of the workload, once (it reads every table)."""
        if self._idb is None or self._idb[0] is not wl:
            self._idb = (wl, id_bytes(wl))
        return self._idb[1]

    def shards(self, t: TableSpec, cfg: TrialConfig, starts: np.ndarray, stops: np.ndarray,
               width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`shard` of many row blocks of one width at once (a row-wise table's G blocks)."""
        wl, G, B = cfg.workload, cfg.group_size, cfg.batch_size
        um = cfg.replicas if (cfg.replicas > 1 and cfg.sparse_sync == "grad_allreduce") else 1
        wb, sb = DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer]
        starts, stops = np.asarray(starts, dtype=np.float64), np.asarray(stops, dtype=np.float64)
        if wl.profiled and t.profile:
            frac = idstats.shares_of_rows(t.profile, starts, stops, t.rows)
        else:
            frac = (stops - starts) / t.rows
        bags = G * B
        ids = bags * t.lookups(wl.profiled) * frac
        f, u = lookup_bytes(ids, bags, width, wb), update_bytes(ids * um, bags * um, width, wb, sb)
        s, idb = self._speeds(cfg), self._id_bytes(wl)
        if s is None:
            return f / 1e6, u / 1e6, ids * idb
        return _emb_ms(f, "fwd", width, s, t.weighted), _emb_ms(u, "bwd", width, s, t.weighted), ids * idb

    def dp_lookups(self, t: TableSpec, cfg: TrialConfig) -> tuple[float, float]:
        """(ms of a data-parallel table's local lookups and update of every rank's bags, its bytes in the
        sparse all-gather)."""
        B, W, pool = cfg.batch_size, cfg.world_size, t.lookups(cfg.workload.profiled)
        return self._lookups(t, B, W * B, cfg), B * (pool * self._id_bytes(cfg.workload) + t.dim * 4 + ID_BYTES)

    def dp_sync_ms(self, cfg: TrialConfig, nbytes: float) -> float:
        if cfg.world_size <= 1:
            return 0.0
        if self.cluster is None:
            return cfg.world_size * nbytes / 1e6
        return coll.all_gather(nbytes, _spans(cfg.world_size, cfg.group_size, cfg.group_placement,
                                              self.cluster)[2], self.cluster)

    def exchange_ms(self, cfg: TrialConfig, recv_cols: float, max_cols: float, lens_send: float, max_lens: float,
                    ids_send: float, max_ids: float) -> tuple[float, float]:
        """(ms in the step, ms beside it) of the input all-to-alls (lengths, ids) and the pooled one, forward
        and backward, at their busiest rank's bytes: a pipelined input distribution runs beside the previous
        step (`_overlapped`), and only what outlasts that step is exposed."""
        G, B, cb = cfg.group_size, cfg.batch_size, DTYPE_BYTES[cfg.comm_precision]
        if G <= 1 or not recv_cols:
            return 0.0, 0.0
        pooled_max, pooled_mean = max(B * recv_cols, G * B * max_cols) * cb, B * recv_cols * cb
        c = self.cluster
        if c is None:
            return (max(lens_send, max_lens) + max(ids_send, max_ids) + 2 * pooled_max) / 1e6, 0.0
        g = _spans(cfg.world_size, G, cfg.group_placement, c)[0]
        inp = 0.0 if c.device.reads_own_ids else (coll.all_to_all(max(lens_send, max_lens), g, c, lens_send)
                                                  + coll.all_to_all(max(ids_send, max_ids), g, c, ids_send))
        beside = 0.0
        if inp and cfg.pipeline_depth > 0:
            s = self._speeds(cfg)
            if s is not None:
                inp, beside = _overlapped(inp, coll.all_to_all(0.0, g, c), cfg, c, s)
        return inp + 2 * coll.all_to_all(pooled_max, g, c, pooled_mean), beside

    def step_ms(self, cfg: TrialConfig, plan: ShardingPlan) -> float | None:
        """The full step estimate of `plan` (inf where a rank's memory does not hold it); None without a
        calibrated cluster."""
        if self._speeds(cfg) is None:
            return None
        est = estimate(cfg, plan, self.cluster)
        limit = min(est.mem_limit_mb, cfg.mem_cap_mb or math.inf)
        return est.step_ms if max(est.mem_mb) <= limit else math.inf

    def shard_room(self, cfg: TrialConfig) -> float | None:
        """Bytes a position has for its shards: the config's cap or its device's memory, less what a rank
        holds beside its shards (`_memory`'s buffers, read off the table-wise plan's estimate)."""
        cap = cfg.mem_cap_mb * 2**20 if cfg.mem_cap_mb > 0 else math.inf
        if self._speeds(cfg) is None:
            return cap if math.isfinite(cap) else None
        wl, wb, sb = cfg.workload, DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer]
        G = cfg.group_size
        tables = [TablePlan(i, t.name, "table_wise", [Shard(i, i % G, 0, t.rows, 0, t.dim)])
                  for i, t in enumerate(wl.tables)]
        plan = ShardingPlan(G, cfg.world_size, tables, [t.dim for t in wl.tables])
        est = estimate(cfg, plan, self.cluster)
        shards = plan.bytes_per_rank([t.rows for t in wl.tables], wb, sb)
        beside = max(m * 2**20 - b for m, b in zip(est.mem_mb, shards, strict=True))
        limit = min(est.mem_limit_mb * 2**20, cap)
        return max(0.0, limit - beside)


# ---------------------------------------------------------------------- the step
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
    offload: dict[int, list[dict]] = field(default_factory=dict)  # position -> shards in host memory
    comm_hidden_ms: float = 0.0  # comm_overlap: communication beside compute, not in the step


def estimate(cfg: TrialConfig, plan: ShardingPlan, c: Cluster) -> Estimate:
    """Predict one training step of `cfg` with `plan` on cluster `c` (see the module docstring)."""
    wl, W, G, B = cfg.workload, cfg.world_size, cfg.group_size, cfg.batch_size
    R = W // G
    pool = wl.lookups_per_sample()
    if W > c.devices:
        raise ModelError(f"world_size={W} needs {W} devices; cluster {c.name} has {c.devices} "
                         f"({c.nodes} nodes x {c.devices_per_node})")
    s = speeds(cfg, c)
    wb, sb, cb = DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer], DTYPE_BYTES[cfg.comm_precision]
    g_span, r_span, w_span = _spans(W, G, cfg.group_placement, c)

    # embedding work per position: every model-parallel shard's bytes, summed per position
    ld = _position_loads(cfg, plan, s)
    fwd, bwd = list(ld.fwd), list(ld.bwd)
    recv_cols, lens_send, ids_send = ld.recv_cols, ld.lens_send, ld.ids_send
    held_lens, held_ids, held_cols = list(ld.lens), list(ld.ids), list(ld.cols)
    rep_gather, shard_rows_bytes = list(ld.rep_gather), list(ld.rows_bytes)
    touched_bytes, touched_rows, union_rows = list(ld.touched_bytes), list(ld.touched_rows), list(ld.union_rows)
    shard_rows, shard_width = list(ld.rows), list(ld.width)
    idb = id_bytes(wl)
    # memory per position (`_memory`: every term and why), and Neo's hierarchy: what does not fit a GPU lives in
    # host memory behind a cache
    dc = dense_cost(wl)
    shard_bytes = plan.bytes_per_rank([t.rows for t in wl.tables], wb, sb)
    # 2D weight_avg's transport (harness/sharding/replica_sync.py): sparse while its bytes are the fewer
    wa_how = "dense" if R == 1 or c.device.dense_replica_merge else choose_transport(
        R, max(touched_bytes), max(shard_rows_bytes), averages_in_place(
            cfg.emb_optimizer == "momentum_scaled_rowwise_adagrad", cfg.comm_precision == "fp32"))
    wa_sparse = wa_how == "sparse"
    union_frac = [u / max(1, r) for u, r in zip(union_rows, shard_rows, strict=True)] if wa_how == "union" else []
    host_merge = wa_how == "union" and c.device.type == "cpu" and r_span.k == 1  # replica_sync's `host_reduce`
    fixed, held = _memory(cfg, c, dc, pool, ld, plan.dp_tables(), wa_sparse, union_frac, host_merge)
    mem = [(fixed + b + h) / 2**20 for b, h in zip(shard_bytes, held, strict=True)]
    mem_limit = c.rank_memory_mb(s.ranks_per_node)
    offload: dict[int, list[dict]] = {}
    if c.device.type == "gpu" and c.device.host_link_gbs > 0:
        host_per_rank = c.host_memory_gb * 2**30 / c.devices_per_node
        moves: dict[tuple, tuple] = {}  # positions that hold alike move alike
        uvm = cfg.uvm_cache_load_factor
        for p in range(G):
            if not uvm and mem[p] <= mem_limit:
                continue
            on_p = ld.on(p, wl)
            others = shard_bytes[p] - float(on_p.size.sum())  # data-parallel: on the device
            shards = on_p.key()
            if uvm:  # the knob: every shard in host memory behind its share's cache
                key = ("uvm", *shards)
                if key not in moves:
                    moves[key] = _uvm_cache(on_p, uvm, wb, host_per_rank, c)
            else:  # Neo's hierarchy: the largest shards move until the rest fits
                room = mem_limit * 2**20 - fixed - held[p] - others
                key = (room, *shards)
                if key not in moves:
                    moves[key] = _offload(on_p, room, host_per_rank, c)
            extra, off, dev = moves[key]
            fwd[p] += extra
            bwd[p] += extra
            mem[p] = (fixed + held[p] + others + dev) / 2**20
            offload[p] = off

    dp = [(wl.tables[i], pool[i]) for i in plan.dp_tables()]
    dp_fwd = sum(_emb_ms(lookup_bytes(B * p, B, t.dim, wb), "fwd", t.dim, s, t.weighted) for t, p in dp)
    dp_bwd = sum(_emb_ms(update_bytes(W * B * p, W * B, t.dim, wb, sb), "bwd", t.dim, s, t.weighted) for t, p in dp)
    emb_fwd = max(fwd) + dp_fwd
    emb_bwd = max(bwd) + dp_bwd

    # dense part
    prec = "bf16" if cfg.dense_precision != "fp32" and "bf16" in c.device.dense_gflops else "fp32"
    dense_fwd, dense_bwd = gemm_ms(dc, B, c.device.dense_gflops[prec] * s.dense_speed, c.device.gemm_half_mflop)
    ew = c.device.elementwise_gbs.get(prec)
    other = B * dc.act_floats * 4 / (log_interp(ew, B) * 1e6 * s.dense_speed) if ew else 0.0
    dense = dense_fwd + dense_bwd + other
    optim = dc.params * 16 / (s.copy_gbs * 1e6 * s.dense_speed)
    grad_bytes = DTYPE_BYTES[cfg.allreduce_comm_precision]  # per dense gradient on the wire
    if grad_bytes < 4 and W > 1:  # the comm hook's cast in and out: read fp32, write, read and write back
        optim += dc.params * 12 / (s.copy_gbs * 1e6 * s.dense_speed)

    # communication: each collective's own time (with its rank's links to itself)
    comm: dict[str, float] = {}
    beside = 0.0  # a GPU's pipelined input distribution: its time beside the previous step (hidden up to it)
    inp = pooled = 0.0
    if G > 1 and recv_cols:
        # an all-to-all takes as long as its busiest rank: every rank sends its own bags' ids (and receives
        # its pooled rows), but the rank holding the hot shards receives (and sends back) the most
        inp = 0.0 if c.device.reads_own_ids else (
            coll.all_to_all(max(lens_send, max(held_lens)), g_span, c, lens_send)
            + coll.all_to_all(max(ids_send, max(held_ids)), g_span, c, ids_send))
        if inp and cfg.pipeline_depth > 0:
            inp, beside = _overlapped(inp, coll.all_to_all(0.0, g_span, c), cfg, c, s)
        # one direction; every rank receives its bags' B x recv_cols (the mean a rank sends)
        pooled = coll.all_to_all(max(B * recv_cols, G * B * max(held_cols)) * cb, g_span, c, B * recv_cols * cb)
    dp_sync = 0.0
    if dp and W > 1:
        dp_sync = coll.all_gather(sum(B * (p * idb + t.dim * 4 + ID_BYTES) for t, p in dp), w_span, c)
    ar = coll.all_reduce(dc.params * grad_bytes, w_span, c) if W > 1 else 0.0
    gather_ms = merge_ms = 0.0
    if R > 1 and recv_cols:
        if cfg.sparse_sync == "grad_allreduce":
            gather_ms = coll.all_gather(max(rep_gather), r_span, c)
        else:  # the harness's transport (`transport.sparse_pays`)
            sparse = wa_sparse
            merge = c.device.replica_merge_gbs.get("sparse" if sparse else "dense")
            if sparse:
                t = coll.all_gather(max(touched_bytes), r_span, c)
                work = R * max(touched_rows)
            elif host_merge:  # replicas on one host: through shared memory, at memory speed (its two barriers a
                # call, ~0.2 ms each here, are left out: the link's fitted latency is no barrier's cost); the
                # slots hold the rows in the table's precision, not the fp32 wire's
                t = host_mean_bytes(max(shard_rows_bytes) * wb / cb, R) / (s.copy_gbs * 1e6 * s.emb_speed)
                work = 2 * max(shard_rows)  # gather into the slot, write the mean back
            else:
                t = coll.all_reduce(max(shard_rows_bytes), r_span, c, concurrent=G)
                work = 2 * max(shard_rows)  # build the payload, apply the sum (the collective reduces)
            if merge:  # the merge's own work on the replicas' rows (width + the state column; fp32, but in the
                # table's precision through shared memory)
                t += work * (max(shard_width) * (wb if host_merge else 4) + 4) / (merge * 1e6 * s.emb_speed)
            if wa_how == "union":  # the union where that pays: a fixed part plus its rows' (`union_cost`)
                p = max(range(G), key=lambda q: union_rows[q] / max(1, shard_rows[q]))
                t *= min(1.0, union_cost(union_rows[p], shard_rows[p]))
            merge_ms = t / cfg.sparse_sync_interval

    # the step: a critical path over the rank's compute and its collectives (`schedule`), in the harness's order
    # (harness/train.py, harness/sharding/collection.py)
    glue = B * sum(pool) * c.device.glue_ns_per_id / 1e6 / s.emb_speed  # the collection's routing and assembly
    bf, bb = gemm_ms(dataclasses.replace(dc, gemms=dc.gemms[:len(wl.bottom_mlp)]), B,
                     c.device.dense_gflops[prec] * s.dense_speed, c.device.gemm_half_mflop)
    ov = cfg.comm_overlap
    ops = [
        Op("overhead", c.device.step_overhead_ms + glue),
        Op("input_a2a", inp, GROUP, ("overhead",)),  # the ids routed (glue), then sent
        Op("emb_fwd", emb_fwd, after=("input_a2a",)),
        Op("bottom_fwd", bf),
        # launched after the lookup and run beside the bottom MLP (comm_overlap), else called after it
        Op("pooled_fwd", pooled, GROUP, ("emb_fwd",) if ov != "none" else ("bottom_fwd",)),
        Op("top_fwd", dense_fwd - bf + other, after=("pooled_fwd",)),  # interaction, top MLP, loss
        *_dense_backward(dense_bwd - bb, bb, pooled, ar, dc.params * 4, ov == "forward_backward"),
        Op("dp_sync", dp_sync, DP, ("bottom_bwd",)),
        Op("replica_gather", gather_ms, REPLICAS, ("bottom_bwd",)),
        Op("emb_bwd", emb_bwd, after=("pooled_bwd", "dp_sync", "replica_gather")),
        # after the backward, which DDP ends by waiting for its all-reduce
        Op("replica_sync", merge_ms, REPLICAS, ("emb_bwd", "ddp_last")),
        Op("optim", optim, after=("ddp_last", "replica_sync")),
    ]
    tl = critical_path(ops, c.device.overlap_hidden)
    if G > 1 and recv_cols:
        comm["input_a2a"] = tl.exposed_ms["input_a2a"]
        comm["pooled_a2a"] = tl.exposed_ms["pooled_fwd"] + tl.exposed_ms["pooled_bwd"]
    if dp_sync:
        comm["dp_sync"] = tl.exposed_ms["dp_sync"]
    if W > 1:
        comm["ddp_allreduce"] = sum(v for k, v in tl.exposed_ms.items() if k.startswith("ddp_"))
    if R > 1 and recv_cols:
        comm["replica_sync"] = tl.exposed_ms["replica_gather" if cfg.sparse_sync == "grad_allreduce" else
                                             "replica_sync"]
    hidden_ms = tl.hidden_ms["pooled_fwd"] + tl.hidden_ms["pooled_bwd"]  # what a real trial times as hidden
    step = tl.step_ms
    if W > 1 and c.device.jitter:  # ranks drift apart over their compute; each collective waits for the last
        comm["wait"] = c.device.jitter * (emb_fwd + emb_bwd + dense)
        step += comm["wait"]
    if W > 1 and (c.device.dist_overhead_ms or c.device.collection_ms):  # a framework's own bookkeeping of its
        # distributed step (calls), and of each collection of the model beyond the first
        comm["framework"] = c.device.dist_overhead_ms + c.device.collection_ms * (wl.collections - 1)
        step += comm["framework"]
    # a real trial times the weight_avg merge as its own phase (`sync`); everything else is the step's comm
    sync_ms = comm["replica_sync"] if R > 1 and recv_cols and cfg.sparse_sync == "weight_avg" else 0.0
    comm_ms = sum(comm.values()) - sync_ms
    if beside > step:  # the next batch's ids take longer to arrive than this step: the rest is exposed
        comm["input_a2a"] = beside - step
        comm_ms += beside - step
        step = beside
    qps = W * B / step * 1e3
    bd = {"emb_fwd": emb_fwd, "emb_bwd": emb_bwd, "comm": comm_ms, "sync": sync_ms,
          "dense": dense + c.device.step_overhead_ms + glue, "optim": optim}

    mean_load = (sum(fwd) + sum(bwd)) / G
    features = {
        "bytes_lookup_per_rank": max(fwd) * s.copy_gbs * 1e6,
        "a2a_bytes": B * recv_cols * cb * 2 + ids_send,
        "allreduce_bytes": dc.params * float(grad_bytes),
        "mlp_gflops": B * dc.flops / 1e9,
        "mem_mb_per_rank": max(mem),
        "load_imbalance": (max(fwd) + max(bwd)) / mean_load if mean_load > 0 else 1.0,
        "est_step_ms": step,
        "est_qps": qps,
        **{f"est_{k}_ms": v for k, v in bd.items()},
    }
    return Estimate(step, qps, bd, comm, mem, mem_limit, features, {"emb_fwd": fwd, "emb_bwd": bwd}, offload,
                    hidden_ms)


_SPANS: dict[tuple, tuple] = {}  # (cluster id, W, G, placement) -> (the cluster, its spans): the planner's
#   table costs and the step's estimate, for every configuration of a tune, read the same few


def _spans(W: int, G: int, placement: str, c: Cluster) -> tuple[coll.Span, coll.Span, coll.Span]:
    """Where a group, a position's replicas and the world sit: a walk over every rank (16,384 of them at the
    largest scale) that a tune of many configurations on one cluster asks for again and again."""
    key = (id(c), W, G, placement)
    hit = _SPANS.get(key)
    if hit is None or hit[0] is not c:
        if len(_SPANS) >= 256:  # clusters made on the fly (a fit's scaled copies): keep the cache small
            _SPANS.clear()
        groups = group_ranks(W, G, placement)
        hit = _SPANS[key] = (c, (coll.span(groups[0], c), coll.span([g[0] for g in groups], c),
                                 coll.span(list(range(W)), c)))
    return hit[1]


@dataclass(frozen=True)
class _ShardLoads:
    """What each group position's model-parallel shards ask of it, summed per position (arrays of G), and the
    shards themselves as arrays (plan order): a row-wise plan at 1,024 ranks holds 800k shards, so these
    are numpy sums, not a loop over shard objects."""

    fwd: np.ndarray  # ms of the shards' pooled lookups
    bwd: np.ndarray  # ms of their fused backward and optimizer
    cols: np.ndarray  # pooled columns the position sends back
    ids: np.ndarray  # id bytes it receives
    lens: np.ndarray  # length bytes it receives
    rep_gather: np.ndarray  # 2D grad_allreduce: bytes it all-gathers over its replicas
    rows_bytes: np.ndarray  # its shards' rows in the comm precision (2D weight_avg's dense merge)
    touched_bytes: np.ndarray  # 2D weight_avg: touched rows' sparse payload per interval
    touched_rows: np.ndarray
    union_rows: np.ndarray  # rows any of the R replicas touched per interval
    rows: np.ndarray
    width: np.ndarray  # its widest shard
    recv_cols: float  # pooled columns every rank receives (one per shard column)
    lens_send: float  # length bytes every rank sends
    ids_send: float  # id bytes every rank sends
    shard_table: np.ndarray  # per shard, plan order
    shard_rank: np.ndarray
    shard_rows: np.ndarray
    shard_dim: np.ndarray
    shard_ids: np.ndarray  # lookups per step the backward updates (x R under grad_allreduce)
    row_extra: int  # bytes of optimizer state beside each row
    wbytes: int

    def per_pos_max(self, x: np.ndarray) -> np.ndarray:
        """The largest of a per-shard quantity on each position (0 where it holds none)."""
        out = np.zeros(len(self.fwd))
        np.maximum.at(out, self.shard_rank, x)
        return out

    @functools.cached_property
    def _by_rank(self) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(self.shard_rank, kind="stable")
        return order, np.searchsorted(self.shard_rank[order], np.arange(len(self.fwd) + 1))

    def on(self, p: int, wl: Workload) -> _Held:
        """Position p's shards, in plan order (what the offload and the UVM cache move)."""
        order, bounds = self._by_rank
        i = order[bounds[p]:bounds[p + 1]]
        return _Held(self.shard_table[i], self.shard_rows[i], self.shard_dim[i] * self.wbytes + self.row_extra,
                     self.shard_ids[i], self.shard_dim[i], wl.tables, wl.profiled)


def _position_loads(cfg: TrialConfig, plan: ShardingPlan, s: Speeds) -> _ShardLoads:
    """`_ShardLoads` of `plan`: each shard's lookups (its share of its table's: the profiled row blocks'
    share, else its rows'), bytes and ms."""
    wl, G, B, R = cfg.workload, cfg.group_size, cfg.batch_size, cfg.world_size // cfg.group_size
    wb, sb, cb = DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer], DTYPE_BYTES[cfg.comm_precision]
    um = R if (R > 1 and cfg.sparse_sync == "grad_allreduce") else 1
    mp = [tp for tp in plan.tables if tp.kind != "data_parallel" and tp.shards]
    sh = plan.shard_array()
    n = len(sh)
    table, rank, dim = sh[:, 0], sh[:, 1], sh[:, 5] - sh[:, 4]
    rows = sh[:, 3] - sh[:, 2]
    frac = np.empty(n)
    at = 0
    for tp in mp:  # each table's shards' share of its lookups (its profiled row blocks where it has them)
        t, k = wl.tables[tp.table], len(tp.shards)
        lo, hi = sh[at:at + k, 2].astype(np.float64), sh[at:at + k, 3].astype(np.float64)
        part = idstats.shares_of_rows(t.profile, lo, hi, t.rows) if wl.profiled and t.profile else (hi - lo) / t.rows
        frac[at:at + k] = np.where((lo <= 0) & (hi >= t.rows), 1.0, part)
        at += k
    pool = np.asarray(wl.lookups_per_sample(), dtype=np.float64)[table]
    bags = G * B
    ids = bags * pool * frac
    idb = id_bytes(wl)
    weighted = np.array([t.weighted for t in wl.tables], dtype=bool)[table]

    def ms(nbytes: np.ndarray, phase: str) -> np.ndarray:  # `_emb_ms`, each shard at its width
        widths, inv = np.unique(dim, return_inverse=True)
        eff = np.array([s.effs.setdefault((phase, int(w)), s.eff.at(phase, int(w))) for w in widths])[inv]
        return nbytes / (s.copy_gbs * 1e6 * eff * s.emb_speed) * np.where(weighted, s.weighted.get(phase, 1.0), 1.0)

    def per_pos(x: np.ndarray | float) -> np.ndarray:
        return np.bincount(rank, weights=np.broadcast_to(x, (n,)), minlength=G).astype(np.float64)

    touched, union = np.zeros(n), np.zeros(n)
    if R > 1:  # 2D's replica merge: the rows each replica (and all of them) touch between merges
        k_draws = cfg.sparse_sync_interval * bags * pool  # a table's draws between merges (one replica's)
        both = rows_touched_many(wl.tables, np.concatenate([table, table]), np.concatenate([rows, rows]),
                                 np.concatenate([frac, frac]), np.concatenate([k_draws, R * k_draws]), wl.profiled)
        touched, union = both[:n], both[n:]
    width = np.zeros(G, dtype=np.int64)
    np.maximum.at(width, rank, dim)
    return _ShardLoads(
        fwd=per_pos(ms(lookup_bytes(ids, bags, dim, wb), "fwd")),
        bwd=per_pos(ms(update_bytes(ids * um, bags * um, dim, wb, sb), "bwd")),
        cols=per_pos(dim), ids=per_pos(ids * idb), lens=per_pos(float(bags * ID_BYTES)),
        rep_gather=per_pos(bags * (pool * frac * idb + dim * 4) + bags * ID_BYTES),
        rows_bytes=per_pos(rows * dim * cb), touched_bytes=per_pos(touched * (ID_BYTES + dim * cb)),
        touched_rows=per_pos(touched), union_rows=per_pos(union), rows=per_pos(rows), width=width,
        recv_cols=float(dim.sum()), lens_send=float(n * B * ID_BYTES), ids_send=float((B * pool * frac * idb).sum()),
        shard_table=table, shard_rank=rank, shard_rows=rows, shard_dim=dim, shard_ids=ids * um, row_extra=sb,
        wbytes=wb)


@dataclass(frozen=True)
class _Held:
    """One position's model-parallel shards as arrays, in plan order (what host memory may take)."""

    table: np.ndarray
    rows: np.ndarray
    row_bytes: np.ndarray  # weight row + its optimizer state
    ids: np.ndarray  # lookups per step (the backward updates as many rows)
    dim: np.ndarray
    specs: Sequence[TableSpec]  # by table index
    profiled: bool = False  # ids follow the tables' profiles: the cache's hit rate is the profiled one

    @property
    def size(self) -> np.ndarray:
        return self.rows * self.row_bytes

    def key(self) -> tuple:
        """Positions holding alike (most of them at scale) move alike."""
        return tuple(a.tobytes() for a in (self.table, self.rows, self.row_bytes, self.ids))


def hit_rate(cache_rows: float, rows: int, t: TableSpec, profiled: bool = False) -> float:
    """Share of lookups a cache of the hottest `cache_rows` rows serves: uniform ids c / n; Zipf(alpha)
    ids the hottest ranks' share of the law the harness draws (`zipf_cdf`); ids that follow a data sample,
    the sample's hottest rows' measured share."""
    if cache_rows >= rows:
        return 1.0
    if cache_rows < 1:
        return 0.0
    if profiled and t.profile:
        return idstats.hit_rate(t.profile, cache_rows)
    if t.id_dist != "zipf":
        return cache_rows / rows
    return float(zipf_cdf(math.floor(cache_rows) + 1.0, rows, t.zipf_alpha))


def _offload(h: _Held, room: float, host_bytes: float, c: Cluster) -> tuple[float, list[dict], float]:
    """Move the largest shards to host memory until the rest fits `room` bytes, the rest of `room` is their
    device-side cache (rows kept by heat, split by the shards' sizes). Returns (ms each of the forward and the
    backward spend on misses over the host link, what moved, bytes left on the device)."""
    size = h.size.astype(np.float64)  # whole bytes: exact in float64 below 2**53
    order = np.argsort(-size, kind="stable")
    rest = np.concatenate([np.cumsum(size[order][::-1])[::-1], [0.0]])  # bytes left if the first k move
    fits = np.flatnonzero(rest <= room * 0.5)  # half the room stays a cache
    moved = order[:int(fits[0]) if fits.size else len(order)]
    dev_bytes = float(rest[len(moved)])
    cache = max(0.0, room - dev_bytes)
    moved_bytes = float(size[moved].sum())
    ms, out = _misses(h, moved, cache * (size[moved] / (moved_bytes or 1.0)) / h.row_bytes[moved], c)
    if moved_bytes > host_bytes:  # host memory is the limit too: stays over
        return ms, out, dev_bytes + moved_bytes
    return ms, out, dev_bytes + cache


def _uvm_cache(h: _Held, load_factor: float, wb: int, host_bytes: float,
               c: Cluster) -> tuple[float, list[dict], float]:
    """FBGEMM's UVM cache (`TrialConfig.uvm_cache_load_factor`): every shard's rows and optimizer state in host
    memory, `load_factor` of its rows cached on the device (weights only: the state stays in host memory).
    Returns (ms each of the forward and the backward spend on misses, the shards, device bytes). Where the
    shards do not fit the rank's host memory the device holds them all (the memory check then refuses it)."""
    ms, out = _misses(h, np.arange(len(h.rows)), load_factor * h.rows, c)
    total = float(h.size.sum())
    if total > host_bytes:
        return ms, out, total
    return ms, out, float(np.sum(load_factor * h.rows * h.dim * wb))


def _misses(h: _Held, which: np.ndarray, cached: np.ndarray, c: Cluster) -> tuple[float, list[dict]]:
    """What host-memory shards behind a device cache cost: each shard `which[k]` with `cached[k]` rows cached
    misses the share of its lookups its hottest rows do not serve (`hit_rate`: the profiled ids where they are
    known), and each miss moves its row over the host link, in the forward and again in the backward's update.
    The hottest rows are what an LFU cache keeps; an LRU cache (FBGEMM's default) keeps fewer of them, so this
    is the cache's best case. Each shard gets its own share; FBGEMM shares one cache among a kernel's tables,
    where a small table's few rows stay cached even below one row's share."""
    ms, out = 0.0, []
    for i, rows_cached in zip(which.tolist(), np.asarray(cached, dtype=np.float64).tolist(), strict=True):
        rows, table = int(h.rows[i]), int(h.table[i])
        hr = hit_rate(rows_cached, rows, h.specs[table], h.profiled)
        ms += float(h.ids[i]) * (1 - hr) * int(h.row_bytes[i]) / (c.device.host_link_gbs * 1e6)
        out.append({"table": table, "rows": rows, "cache_rows": int(rows_cached), "hit_rate": round(hr, 4)})
    return ms, out


FEATURE_NAMES = ("bytes_lookup_per_rank", "a2a_bytes", "allreduce_bytes", "mlp_gflops", "mem_mb_per_rank",
                 "load_imbalance", "est_step_ms", "est_qps", *(f"est_{k}_ms" for k in PHASES))


def gemm_rate(mflop: float, peak_gflops: float, half_mflop: float) -> float:
    """Achieved GFLOP/s of one GEMM of `mflop` MFLOP: peak x size / (size + half) (roofline-like ramp)."""
    return peak_gflops * mflop / (mflop + half_mflop)


def gemm_ms(dc: DenseCost, B: int, peak: float, half: float) -> tuple[float, float]:
    fwd = bwd = 0.0
    for f, b in dc.gemms:
        mf = B * f / 1e6
        fwd += mf / gemm_rate(mf, peak, half)
        # the backward's GEMMs are of the forward's size (one or two of them)
        bwd += (B * b / 1e6) / gemm_rate(mf, peak, half)
    return fwd, bwd  # MFLOP / (GFLOP/s) = ms


def _dense_backward(top: float, bottom: float, pooled: float, ar: float, grad_bytes: float,
                    overlap: bool) -> list[Op]:
    """The dense backward as the harness runs it: the top (interaction and top MLP) first, then the pooled
    gradients' all-to-all (called, or launched beside the bottom MLP's backward with `overlap`), then the
    bottom MLP. DDP launches each 25 MB bucket's all-reduce when the backward has filled it: as the
    gradients come at the rate the backward computes them, bucket j of n is ready after j/n of the dense
    backward's time (the last one when it ends). Named so the step can wait: `top_bwd`, `pooled_bwd`,
    `bottom_bwd` (the last compute op), `ddp_last`."""
    n = min(MAX_BUCKETS, max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES)))
    fills = [(top + bottom) * (j + 1) / n for j in range(n)]  # when bucket j is full
    ops: list[Op] = []
    for region, lo, hi in (("top_bwd", 0.0, top), ("bottom_bwd", top, top + bottom)):
        wait = ("pooled_bwd",) if region == "bottom_bwd" and not overlap else ()
        t0 = lo
        for j, at in enumerate(fills):
            if (at <= hi) if region == "top_bwd" else (at > lo):
                ops.append(Op(f"{region}_{j}", min(at, hi) - t0, after=wait))
                ops.append(Op("ddp_last" if j == n - 1 else f"ddp_{j}", ar / n, WORLD, (f"{region}_{j}",)))
                t0, wait = min(at, hi), ()
        ops.append(Op(region, hi - t0, after=wait))
        if region == "top_bwd":
            ops.append(Op("pooled_bwd", pooled, GROUP, ("top_bwd",)))
    return ops


def _overlapped(inp: float, latency: float, cfg: TrialConfig, c: Cluster, s: Speeds) -> tuple[float, float]:
    """The pipelined input distribution runs beside the previous step's compute: (what it adds to the step,
    what runs beside it). On a GPU its copy engines and NICs run it apart from the kernels: hidden as long as
    it takes no longer than the step it runs beside. On CPU cores that the ranks already fill, its byte
    copying still takes them (only the waiting, the latency, is hidden)."""
    if c.device.type == "gpu":
        return 0.0, inp
    busy = min(1.0, s.ranks_per_node * cfg.threads_per_rank / c.device.cores)
    return max(0.0, inp - latency) * busy, 0.0


def _memory(cfg: TrialConfig, c: Cluster, dc: DenseCost, pool: list[float], ld: _ShardLoads, dp_tables: list[int],
            wa_sparse: bool, union_frac: list[float], host_merge: bool) -> tuple[float, list[float]]:
    """A rank's peak memory beyond its shards' weights and optimizer state, in bytes: (what every group
    position holds, what position p holds on top). What the harness allocates (harness/train.py,
    harness/sharding, harness/model.py), buffer by buffer; checked against real trials by
    benchmarks/bench_memory.py.

    A step's buffers come in three phases that are never alive together: the embedding forward (its end),
    the dense part (its activations at the start of the backward), the embedding backward. On a GPU the
    peak is the largest phase (max_memory_allocated counts live tensors). On CPU (peak RSS) glibc serves
    every buffer up to its mmap threshold (raised to the largest freed buffer, up to GLIBC_MMAP_MAX) from
    its heap and keeps what is freed there: a step allocates the same sequence every time and a buffer
    rarely fits another's hole while that one is alive, so the heap settles at about each such buffer of
    the step in a place of its own; larger ones are mmapped and unmapped when freed. (Measured on
    bench_memory.py's dev set: with every buffer mmapped, MALLOC_MMAP_THRESHOLD_=65536, peak RSS fell by
    50-260 MB, to within 5% of the largest phase.) A rank's start adds one block of initial weights to its
    shards (harness/model.py init_table): never the peak."""
    wl, B, G, R, W = cfg.workload, cfg.batch_size, cfg.group_size, cfg.replicas, cfg.world_size
    cb, wb = DTYPE_BYTES[cfg.comm_precision], DTYPE_BYTES[cfg.emb_precision]
    ab = 2 if cfg.dense_precision != "fp32" else 4  # autocast keeps the dense part's activations in bf16
    cpu = c.device.type == "cpu"
    # the framework: torch, the embedding kernels' code, the process groups, dynamo (the optimizer and DDP
    # import it): the calibration's bare one-rank trial's peak
    spawned = cpu and c.device.spawned_process_mb and oversubscribed(min(W, c.devices_per_node),
                                                                      cfg.threads_per_rank, c.device.cores)
    fixed = (c.device.spawned_process_mb if spawned else c.device.process_mb) * 2**20
    # the dense part: weights, gradients (DDP's buckets hold them), Adagrad's sum of squares and its step's
    # temporaries (the sum's square root, for every parameter at once: the foreach implementation); under
    # autocast a bf16 copy of every weight is cached for the step
    fixed += dc.params * 16 + (dc.params * 2 if cfg.dense_precision != "fp32" else 0)
    fixed += _batch_bytes(cfg)
    btd = B * wl.num_tables * wl.dim * 4  # the assembled pooled rows [B, T*D]
    dp_cols = len(dp_tables) * wl.dim
    idb = id_bytes(wl)
    dp_ids = B * sum(pool[t] for t in dp_tables) * idb
    own_ids = B * sum(pool) * idb
    # the dense part at the start of its backward: the pooled rows, the activations autograd keeps
    # (dense_cost: each saved tensor once) and the gradients flowing back through the widest of them
    kept = [B * f * ab for f in dc.kept] + [B * f * 4 for f in dc.kept_fp32]
    widest = max(kept, default=0.0)
    dense_phase = [btd, *kept, widest, widest]
    held: list[float] = []
    held_cols, held_ids, held_lens, touched_rows, recv_cols = ld.cols, ld.ids, ld.lens, ld.touched_rows, ld.recv_cols
    width = (0 if cfg.emb_optimizer == "sgd" else 1) + (2 if cfg.emb_optimizer == "momentum_scaled_rowwise_adagrad"
                                                       else 0)  # the merge payload's columns beside the row
    # what the weight_avg merge reads of p's shards: rows, their bytes, the largest shard's payloads
    rows_sum = ld.rows
    rd_sum = np.bincount(ld.shard_rank, weights=ld.shard_rows * ld.shard_dim, minlength=G)
    rb_sum = rd_sum * wb + rows_sum * ld.row_extra
    max_rd = ld.per_pos_max(ld.shard_rows * ld.shard_dim)
    max_r4i = ld.per_pos_max(ld.shard_rows * (ld.shard_dim * 4 + ID_BYTES))
    max_rdw = ld.per_pos_max(ld.shard_rows * (ld.shard_dim + width) * 4)
    seen: dict[tuple, float] = {}  # positions that hold alike (most of them at scale) hold the same bytes
    for p in range(G):
        key = (held_cols[p], held_ids[p], held_lens[p], touched_rows[p], union_frac[p] if union_frac else 0.0,
               rows_sum[p], rd_sum[p], max_rd[p], max_r4i[p], max_rdw[p])
        if key in seen:
            held.append(seen[key])
            continue
        k_out = G * B * held_cols[p] * 4  # the kernel's pooled output for the group's bags of p's shards
        recv = B * (recv_cols + dp_cols) * 4  # the pooled columns this rank receives (and its own DP tables')
        wire = [G * B * held_cols[p] * cb, B * recv_cols * cb] if cb < 4 else []  # cast to the comm precision
        # embedding forward, at its end: the kernel's output, the all-to-all's received blocks, their
        # concatenation, and the [B, T*D] assembly (zeros, then index_add's result)
        fwd = [k_out, *wire, recv, recv, btd, btd]
        # embedding backward: the pooled gradient, its columns picked back out (index_select) and gathered for
        # the all-to-all (the split's backward), the gradient received for p's shards, scaled for the update
        bwd = [btd, recv, recv, *wire, k_out, k_out]
        upd = held_ids[p]
        if R > 1 and cfg.sparse_sync == "grad_allreduce":  # the replicas' bags and gradients, and their union
            bwd += [R * k_out, R * k_out, R * held_ids[p], R * held_ids[p]]
            upd *= R
        if dp_tables and W > 1:  # the data-parallel tables' union of every rank's bags and gradients
            bwd += [W * B * dp_cols * 4] * 2 + [W * dp_ids] * 2
            upd += W * dp_ids
        # the input distribution: this rank's bags' ids cut into pieces per shard and concatenated to send,
        # p's received (and reordered) ids; what p keeps for the step - the received ids, lengths and
        # offsets, as many again for every batch the pipeline keeps in flight (pipeline_depth)
        inp = [own_ids, own_ids, held_ids[p]]
        keep = (held_ids[p] + 2 * held_lens[p]) * (1 + cfg.pipeline_depth)
        keep += 2 * upd  # the native kernel's sort keys and scratch for the update's ids (kept and reused)
        if cpu:
            phases = (fwd + inp, dense_phase, bwd)
            heap = sum(x for ph in phases for x in ph if x <= GLIBC_MMAP_MAX)
            step = heap + max(sum(x for x in ph if x > GLIBC_MMAP_MAX) for ph in phases)
        else:
            step = max(sum(fwd), sum(inp), sum(dense_phase), sum(bwd))
        h = keep + step
        if R > 1 and cfg.sparse_sync == "weight_avg":
            # the replica sync keeps a touched-row flag per row and, unless it averages in place (the union
            # transport), its shards as they were at the last merge (weights and state); after the backward
            # the merge builds each shard's payload (delta, the state's increment and under momentum scaling
            # two more columns) in fp32: of every row when dense (all shards at once, then one at a time cast
            # to the comm precision and back), of the touched rows when sparse (with their ids: the payloads,
            # their concatenation, the R replicas' gathered)
            h += rows_sum[p] if union_frac else rb_sum[p] + rows_sum[p]
            if union_frac:  # averaging in place keeps no last-sync copy
                if host_merge:  # into shared memory that stays mapped, in the table's precision, as many shards at
                    # once as fit HOST_BATCH_BYTES: its own slot and the result whole, its chunk of each other
                    # replica's slot (and the union's ids)
                    u = min(1.0, union_frac[p])
                    slot = max(min(rd_sum[p] * wb * u, HOST_BATCH_BYTES), max_rd[p] * wb * u)
                    h += slot * (2 + (R - 1) / R) + rows_sum[p] * ID_BYTES * u
                    merge = 0.0
                else:  # one shard's union at a time, its rows widened to fp32, with their ids
                    merge = max_r4i[p] * min(1.0, union_frac[p])
            elif wa_sparse:
                dims = rd_sum[p] / max(1, rows_sum[p])
                merge = touched_rows[p] * ((dims + width) * 4 + ID_BYTES) * (2 + R)
            else:
                merge = 4 * (rd_sum[p] + width * rows_sum[p]) + (max_rdw[p] * (cb + 4) / 4 if cb < 4 else 0.0)
            # the merge is larger than the step's mmapped buffers, freed by then (the heap's stay)
            h += max(0.0, merge - (step - (heap if cpu else 0.0)))
        held.append(h)
        seen[key] = h
    return fixed, held


def _batch_bytes(cfg: TrialConfig) -> float:
    """Pre-generated input batches held by one rank (harness/data.py: rank_batches)."""
    wl = cfg.workload
    per = cfg.batch_size * (sum(wl.lookups_per_sample()) * id_bytes(wl) + wl.dense_features * 4 + 4)
    steps = cfg.warmup_steps + cfg.measure_steps
    cyc, gb = wl.sample_cycle, cfg.global_batch
    return per * (min(steps, cyc // gb) if cyc % gb == 0 else steps)
