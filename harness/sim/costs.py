"""One table's price for the planners (`TableCosts`): what its lookups, its share of the all-to-alls
and its data-parallel sync cost on the rank holding it, priced by the same rates and byte formulas
as the step (`step.estimate`), and the whole step where a planner asks for it."""

from __future__ import annotations

import math

import numpy as np

from cubic_harness.config import DTYPE_BYTES, TrialConfig
from cubic_harness.sharding.plan import Shard, ShardingPlan, TablePlan
from cubic_harness.sim import collectives as coll
from cubic_harness.sim.cluster import Cluster
from cubic_harness.sim.loads import lookup_share, shard_ms
from cubic_harness.sim.rates import ModelError, Speeds, emb_ms, overlapped, spans, speeds
from cubic_harness.sim.step import estimate, pooled_ms
from cubic_harness.sim.traffic import ID_BYTES, STATE_BYTES, id_bytes, lookup_bytes, update_bytes
from cubic_harness.workload import TableSpec, Workload


class TableCosts:
    """What the planners ask: one table's cost on the rank holding it, its data-parallel cost, and
    its share of the pooled all-to-all (ms per step), all priced on `cluster`."""

    def __init__(self, cluster: Cluster | None) -> None:
        self.cluster = cluster  # None (no calibration yet): tables are priced by their bytes alone
        self._idb: tuple[Workload, float] | None = None
        self._speed: tuple[TrialConfig, Speeds | None] | None = None

    def _speeds(self, cfg: TrialConfig) -> Speeds | None:
        if self.cluster is None:
            return None
        if self._speed is not None and self._speed[0] is cfg:  # asked per shard of one config
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

    def phases(self, t: TableSpec, fwd_bags: float, upd_bags: float,
               cfg: TrialConfig) -> tuple[float, float]:
        """(forward, backward+optimizer) ms of one whole table for these bags (bytes alone without a
        cluster)."""
        wb, sb = DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer]
        pool = t.lookups(cfg.workload.profiled)
        f = lookup_bytes(fwd_bags * pool, fwd_bags, t.dim, wb)
        u = update_bytes(upd_bags * pool, upd_bags, t.dim, wb, sb)
        s = self._speeds(cfg)
        if s is None:
            return f / 1e6, u / 1e6
        return emb_ms(f, "fwd", t.dim, s, t.weighted), emb_ms(u, "bwd", t.dim, s, t.weighted)

    def dp_table(self, t: TableSpec, cfg: TrialConfig) -> float:
        """Local lookup of B bags, the sparse all-gather's bandwidth, the update with the union of
        W*B."""
        B, W = cfg.batch_size, cfg.world_size
        pool, idb = t.lookups(cfg.workload.profiled), self._id_bytes(cfg.workload)
        if self.cluster is None:
            return self._lookups(t, B, W * B, cfg) + W * B * (pool * idb + t.dim * 4) / 1e6
        world = spans(W, cfg.group_size, cfg.group_placement, self.cluster)[2]
        gather = (coll.all_gather(B * (pool * idb + t.dim * 4), world, self.cluster) if W > 1
                  else 0.0)
        return self._lookups(t, B, W * B, cfg) + gather

    def comm(self, t: TableSpec, cfg: TrialConfig, parts: int = 1) -> float:
        """The table's pooled all-to-all forward and backward when model-parallel (bandwidth only:
        the tables share the calls). `parts` row blocks each send their partial sums (row-wise: the
        group)."""
        G = cfg.group_size
        if G <= 1:
            return 0.0
        if self.cluster is None:
            return 2 * cfg.batch_size * t.dim * parts * DTYPE_BYTES[cfg.comm_precision] / 1e6
        b = cfg.batch_size * t.dim * parts * DTYPE_BYTES[cfg.comm_precision]
        s = spans(cfg.world_size, G, cfg.group_placement, self.cluster)[0]
        return 2 * max(0.0, coll.all_to_all(b, s, self.cluster)
                       - coll.all_to_all(0.0, s, self.cluster))

    # the per-table planner's questions (harness/sharding/search.py PlanCost), each as `estimate`
    # prices it
    def shard(self, t: TableSpec, cfg: TrialConfig, start: int, stop: int,
              width: int) -> tuple[float, float, float]:
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
               width: int | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`shard` of many row blocks at once (a row-wise table's G blocks); `width`: one for all, or one
        per block (a table's column shards of every width)."""
        wl, G, B = cfg.workload, cfg.group_size, cfg.batch_size
        um = cfg.replicas if (cfg.replicas > 1 and cfg.sparse_sync == "grad_allreduce") else 1
        wb, sb = DTYPE_BYTES[cfg.emb_precision], STATE_BYTES[cfg.emb_optimizer]
        frac = lookup_share(t, wl.profiled, starts, stops)
        bags = G * B
        ids = bags * t.lookups(wl.profiled) * frac
        f, u = lookup_bytes(ids, bags, width, wb), update_bytes(ids * um, bags * um, width, wb, sb)
        s, idb = self._speeds(cfg), self._id_bytes(wl)
        if s is None:
            return f / 1e6, u / 1e6, ids * idb
        widths, weighted = np.broadcast_to(width, f.shape), np.full(f.shape, t.weighted)
        return shard_ms(f, "fwd", widths, weighted, s), shard_ms(u, "bwd", widths, weighted, s), ids * idb

    def dp_lookups(self, t: TableSpec, cfg: TrialConfig) -> tuple[float, float]:
        """(ms of a data-parallel table's local lookups and update of every rank's bags, its bytes
        in the sparse all-gather)."""
        B, W, pool = cfg.batch_size, cfg.world_size, t.lookups(cfg.workload.profiled)
        idb = self._id_bytes(cfg.workload)
        return self._lookups(t, B, W * B, cfg), B * (pool * idb + t.dim * 4 + ID_BYTES)

    def dp_sync_ms(self, cfg: TrialConfig, nbytes: float) -> float:
        if cfg.world_size <= 1:
            return 0.0
        if self.cluster is None:
            return cfg.world_size * nbytes / 1e6
        return coll.all_gather(nbytes, spans(cfg.world_size, cfg.group_size, cfg.group_placement,
                                              self.cluster)[2], self.cluster)

    def exchange_ms(self, cfg: TrialConfig, recv_cols: float, max_cols: float, lens_send: float,
                    max_lens: float, ids_send: float, max_ids: float) -> tuple[float, float]:
        """(ms in the step, ms beside it) of the input all-to-alls (lengths, ids) and the pooled
        one, forward and backward, at their busiest rank's bytes: a pipelined input distribution
        runs beside the previous step (`rates.overlapped`), and only what outlasts that step is
        exposed."""
        G, B, cb = cfg.group_size, cfg.batch_size, DTYPE_BYTES[cfg.comm_precision]
        if G <= 1 or not recv_cols:
            return 0.0, 0.0
        c = self.cluster
        if c is None:
            pooled_max = max(B * recv_cols, G * B * max_cols) * cb
            return (max(lens_send, max_lens) + max(ids_send, max_ids) + 2 * pooled_max) / 1e6, 0.0
        g = spans(cfg.world_size, G, cfg.group_placement, c)[0]
        inp = 0.0 if c.device.reads_own_ids else (
            coll.all_to_all(max(lens_send, max_lens), g, c, lens_send)
            + coll.all_to_all(max(ids_send, max_ids), g, c, ids_send))
        beside = 0.0
        if inp and cfg.pipeline_depth > 0:
            s = self._speeds(cfg)
            if s is not None:
                inp, beside = overlapped(inp, coll.all_to_all(0.0, g, c), cfg, c, s)
        return inp + 2 * pooled_ms(cfg, c, g, recv_cols, max_cols), beside

    def step_ms(self, cfg: TrialConfig, plan: ShardingPlan) -> float | None:
        """The full step estimate of `plan` (inf where a rank's memory does not hold it); None
        without a calibrated cluster."""
        if self._speeds(cfg) is None:
            return None
        est = estimate(cfg, plan, self.cluster)
        limit = min(est.mem_limit_mb, cfg.mem_cap_mb or math.inf)
        return est.step_ms if max(est.mem_mb) <= limit else math.inf

    def shard_room(self, cfg: TrialConfig) -> float | None:
        """Bytes a position has for its shards: the config's cap or its device's memory, less what a
        rank holds beside its shards (`memory.py`'s buffers, read off the table-wise plan's
        estimate)."""
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

