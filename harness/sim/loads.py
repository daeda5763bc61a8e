"""What a plan asks of each group position in a step: every model-parallel shard's lookups, bytes
and ms as arrays (`ShardLoads`; a row-wise plan at 1,024 ranks holds 800k shards, so these are numpy
sums, not a loop over shard objects), summed into one typed record per position (`Position`) that
the step, the memory and the host-memory hierarchy read. Every group holds the same plan, so
position p's ranks carry one load."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cubic_harness import ids as idstats
from cubic_harness.config import DTYPE_BYTES, TrialConfig
from cubic_harness.sharding.plan import ShardingPlan
from cubic_harness.sharding.transport import averages_in_place, choose_transport
from cubic_harness.sim import collectives as coll
from cubic_harness.sim.cluster import Cluster
from cubic_harness.sim.rates import Speeds
from cubic_harness.sim.traffic import (
    ID_BYTES,
    STATE_BYTES,
    id_bytes,
    lookup_bytes,
    rows_touched_many,
    update_bytes,
)
from cubic_harness.workload import TableSpec, Workload


@dataclass(slots=True)
class Position:
    """One group position's model-parallel shards in a step, summed (every group's position p
    alike). Read only; not frozen because a frozen dataclass's __init__ costs three times as much,
    and an estimate makes one per position (4,096 of them at the largest groups)."""

    fwd_ms: float  # the shards' pooled lookups
    bwd_ms: float  # their fused backward and optimizer
    cols: float  # pooled columns the position sends back
    ids: float  # id bytes it receives
    lens: float  # length bytes it receives
    rep_gather: float  # 2D grad_allreduce: bytes it all-gathers over its replicas
    rows_comm_bytes: float  # its rows in the comm precision (2D weight_avg's dense merge)
    touched_bytes: float  # 2D weight_avg: the touched rows' sparse payload per interval
    touched_rows: float
    union_rows: float  # rows any of the R replicas touched per interval
    rows: float
    width: int  # its widest shard
    row_dims: float  # rows x columns over its shards: what the weight_avg merge reads
    rows_held_bytes: float  # its rows' weights and optimizer state
    max_row_dims: float  # its largest shard's rows x columns
    max_rows_wide: float  # its largest shard's rows in fp32, with their ids (the union merge)
    max_payload: float  # its largest shard's merge payload in fp32 (row and state columns)
    shard_bytes: float  # weights and state of all it holds, data-parallel tables included

    @property
    def union_frac(self) -> float:
        """The share of its rows the R replicas' union touches between merges."""
        return self.union_rows / max(1, self.rows)


@dataclass(frozen=True)
class ReplicaMerge:
    """2D weight_avg's transport (harness/sharding/replica_sync.py), which both the step's time and
    a position's memory depend on: "dense", "sparse" (while its bytes are the fewer) or "union"
    (averaged in place); `host`: the union through shared memory, the replicas on one CPU host
    (`host_reduce`)."""

    how: str
    host: bool

    @property
    def sparse(self) -> bool:
        return self.how == "sparse"

    @property
    def union(self) -> bool:
        return self.how == "union"


@dataclass(frozen=True)
class Held:
    """One position's model-parallel shards as arrays, in plan order (what host memory may take)."""

    table: np.ndarray
    rows: np.ndarray
    row_bytes: np.ndarray  # weight row + its optimizer state
    ids: np.ndarray  # lookups per step (the backward updates as many rows)
    dim: np.ndarray
    specs: Sequence[TableSpec]  # by table index
    profiled: bool = False  # ids follow the tables' profiles: the cache hits as the profile does

    @property
    def size(self) -> np.ndarray:
        return self.rows * self.row_bytes

    def key(self) -> tuple:
        """Positions holding alike (most of them at scale) move alike."""
        return tuple(a.tobytes() for a in (self.table, self.rows, self.row_bytes, self.ids))


@dataclass(frozen=True)
class ShardLoads:
    """Every model-parallel shard of a plan as arrays (plan order), with what each asks of its
    position."""

    groups: int  # positions in a group (G)
    table: np.ndarray
    rank: np.ndarray  # the position holding it
    rows: np.ndarray
    dim: np.ndarray
    pool: np.ndarray  # its table's lookups per sample
    frac: np.ndarray  # its share of its table's lookups
    ids: np.ndarray  # lookups per step of the group's bags
    fwd_ms: np.ndarray  # its pooled lookups
    bwd_ms: np.ndarray  # its fused backward and optimizer
    touched: np.ndarray  # 2D weight_avg: rows one replica touches between merges
    union: np.ndarray  # rows any of the R replicas touch between merges
    bags: int  # the group's bags per step
    update_ids: np.ndarray  # lookups the backward updates (x R under grad_allreduce)
    row_extra: int  # bytes of optimizer state beside each row
    wbytes: int
    recv_cols: float  # pooled columns every rank receives (one per shard column)
    lens_send: float  # length bytes every rank sends
    ids_send: float  # id bytes every rank sends

    def per_pos(self, x: np.ndarray | float) -> np.ndarray:
        """A per-shard quantity summed on each position."""
        n = len(self.rank)
        return np.bincount(self.rank, weights=np.broadcast_to(x, (n,)),
                           minlength=self.groups).astype(np.float64)

    def per_pos_max(self, x: np.ndarray) -> np.ndarray:
        """The largest of a per-shard quantity on each position (0 where it holds none)."""
        order, bounds = self._by_rank
        out = np.zeros(self.groups)
        held = bounds[1:] > bounds[:-1]  # reduceat over the shards sorted by position, none empty
        if held.any():
            out[held] = np.maximum.reduceat(np.asarray(x, dtype=np.float64)[order], bounds[:-1][held])
        return np.maximum(out, 0.0)

    @functools.cached_property
    def _by_rank(self) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(self.rank, kind="stable")
        return order, np.searchsorted(self.rank[order], np.arange(self.groups + 1))

    def on(self, p: int, wl: Workload) -> Held:
        """Position p's shards, in plan order (what the offload and the UVM cache move)."""
        order, bounds = self._by_rank
        i = order[bounds[p]:bounds[p + 1]]
        return Held(self.table[i], self.rows[i], self.dim[i] * self.wbytes + self.row_extra,
                    self.update_ids[i], self.dim[i], wl.tables, wl.profiled)


def shard_loads(cfg: TrialConfig, plan: ShardingPlan, s: Speeds) -> ShardLoads:
    """`ShardLoads` of `plan`: each shard's lookups (its share of its table's: the profiled row
    blocks' share, else its rows'), bytes and ms."""
    wl, G, B, R = cfg.workload, cfg.group_size, cfg.batch_size, cfg.world_size // cfg.group_size
    wb, sb = DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer]
    um = R if (R > 1 and cfg.sparse_sync == "grad_allreduce") else 1
    sh = plan.shard_array()
    n = len(sh)
    table, rank, dim = sh[:, 0], sh[:, 1], sh[:, 5] - sh[:, 4]
    rows = sh[:, 3] - sh[:, 2]
    frac = _lookup_shares(wl, plan, sh)
    pool = np.asarray(wl.lookups_per_sample(), dtype=np.float64)[table]
    bags = G * B
    ids = bags * pool * frac
    idb = id_bytes(wl)
    weighted = np.array([t.weighted for t in wl.tables], dtype=bool)[table]
    touched, union = np.zeros(n), np.zeros(n)
    if R > 1:  # 2D's replica merge: the rows each replica (and all of them) touch between merges
        k_draws = cfg.sparse_sync_interval * bags * pool  # a replica's draws between merges
        both = rows_touched_many(wl.tables, np.concatenate([table, table]),
                                 np.concatenate([rows, rows]), np.concatenate([frac, frac]),
                                 np.concatenate([k_draws, R * k_draws]), wl.profiled)
        touched, union = both[:n], both[n:]
    return ShardLoads(
        groups=G, table=table, rank=rank, rows=rows, dim=dim, pool=pool, frac=frac, ids=ids,
        fwd_ms=shard_ms(lookup_bytes(ids, bags, dim, wb), "fwd", dim, weighted, s),
        bwd_ms=shard_ms(update_bytes(ids * um, bags * um, dim, wb, sb), "bwd", dim, weighted, s),
        touched=touched, union=union, bags=bags, update_ids=ids * um, row_extra=sb, wbytes=wb,
        recv_cols=float(dim.sum()), lens_send=float(n * B * ID_BYTES),
        ids_send=float((B * pool * frac * idb).sum()))


def _lookup_shares(wl: Workload, plan: ShardingPlan, sh: np.ndarray) -> np.ndarray:
    """Each shard's share of its table's lookups (its profiled row blocks' where the table has
    them)."""
    frac = np.empty(len(sh))
    at = 0
    for tp in plan.tables:
        if tp.kind == "data_parallel" or not tp.shards:
            continue
        t, k = wl.tables[tp.table], len(tp.shards)
        frac[at:at + k] = lookup_share(t, wl.profiled, sh[at:at + k, 2], sh[at:at + k, 3])
        at += k
    return frac


def lookup_share(t: TableSpec, profiled: bool, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """The share of table t's lookups that falls on each row range [start, stop): all of them on a
    whole table (table-wise, a column shard), else its profiled row blocks' share, else its rows'."""
    lo, hi = np.asarray(starts, dtype=np.float64), np.asarray(stops, dtype=np.float64)
    whole = (lo <= 0) & (hi >= t.rows)
    if whole.all():  # no row blocks to read (asked per table and width by the planner)
        return np.ones(len(lo))
    part = idstats.shares_of_rows(t.profile, lo, hi, t.rows) if profiled and t.profile else (hi - lo) / t.rows
    return np.where(whole, 1.0, part)


def shard_ms(nbytes: np.ndarray, phase: str, dim: np.ndarray, weighted: np.ndarray,
              s: Speeds) -> np.ndarray:
    """`rates.emb_ms`, each shard at its width."""
    widths, inv = np.unique(dim, return_inverse=True)
    eff = np.array([s.effs.setdefault((phase, int(w)), s.eff.at(phase, int(w)))
                    for w in widths])[inv]
    return (nbytes / (s.copy_gbs * 1e6 * eff * s.emb_speed)
            * np.where(weighted, s.weighted.get(phase, 1.0), 1.0))


def payload_cols(optimizer: str) -> int:
    """The weight_avg merge payload's columns beside the row: the state's increment, and two more
    under momentum scaling."""
    return ((0 if optimizer == "sgd" else 1)
            + (2 if optimizer == "momentum_scaled_rowwise_adagrad" else 0))


def positions(cfg: TrialConfig, ld: ShardLoads, shard_bytes: Sequence[float]) -> list[Position]:
    """The shards' loads summed per position; `shard_bytes`: what each position holds
    (`bytes_per_rank`)."""
    cb, idb, bags = DTYPE_BYTES[cfg.comm_precision], id_bytes(cfg.workload), ld.bags
    payload = payload_cols(cfg.emb_optimizer)
    width = np.zeros(ld.groups, dtype=np.int64)
    np.maximum.at(width, ld.rank, ld.dim)
    rows = ld.per_pos(ld.rows)
    row_dims = np.bincount(ld.rank, weights=ld.rows * ld.dim, minlength=ld.groups)
    columns = (
        ld.per_pos(ld.fwd_ms), ld.per_pos(ld.bwd_ms), ld.per_pos(ld.dim), ld.per_pos(ld.ids * idb),
        ld.per_pos(float(bags * ID_BYTES)),
        ld.per_pos(bags * (ld.pool * ld.frac * idb + ld.dim * 4) + bags * ID_BYTES),
        ld.per_pos(ld.rows * ld.dim * cb), ld.per_pos(ld.touched * (ID_BYTES + ld.dim * cb)),
        ld.per_pos(ld.touched), ld.per_pos(ld.union), rows, width,
        row_dims, row_dims * ld.wbytes + rows * ld.row_extra, ld.per_pos_max(ld.rows * ld.dim),
        ld.per_pos_max(ld.rows * (ld.dim * 4 + ID_BYTES)),
        ld.per_pos_max(ld.rows * (ld.dim + payload) * 4), shard_bytes)
    return [Position(*v) for v in zip(*columns, strict=True)]


def replica_merge(cfg: TrialConfig, c: Cluster, pos: Sequence[Position],
                  replicas: coll.Span) -> ReplicaMerge:
    """2D weight_avg's transport for these positions (the harness's `choose_transport`)."""
    R = cfg.world_size // cfg.group_size
    how = "dense" if R == 1 or c.device.dense_replica_merge else choose_transport(
        R, max(p.touched_bytes for p in pos), max(p.rows_comm_bytes for p in pos),
        averages_in_place(cfg.emb_optimizer == "momentum_scaled_rowwise_adagrad",
                          cfg.comm_precision == "fp32"))
    return ReplicaMerge(how, how == "union" and c.device.type == "cpu" and replicas.k == 1)
