"""Planners: a TrialConfig -> a ShardingPlan.

TorchRec-style decomposition: enumerate the options per table, estimate each
with a `TableCost` (the performance model's, harness/sim/perf.py, which the caller
passes: harness/planning.py), then partition onto ranks under the memory cap.
`sharding` is either one type for all tables or a planner:
  size_greedy / lookup_greedy / size_lookup_greedy  NeuroShard's baselines: table-wise, greedy
      bin-packing by rows*dim, by dim*pooling, by dim*pooling*log10(rows)
  auto   the table costs choose per table: data-parallel where the dense-gradient all-reduce is
      cheaper than the table's all-to-all, row-wise for a table hotter than a rank's fair share
      (unless moving every rank's partial sums costs more than the lookups it spreads: at scale),
      table-wise otherwise (placed greedily by estimated cost)
  plan   the per-table planner (harness/sharding/search.py): every option of every table, searched
      over combination and placement with the modelled step as the objective; never priced slower
      than any uniform type or the planners above
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from cubic_harness.config import DTYPE_BYTES, SHARDING_TYPES, TrialConfig
from cubic_harness.errors import ConfigError
from cubic_harness.sharding.plan import RowBlocks, Shard, ShardingPlan, TablePlan, ascending_columns
from cubic_harness.sharding.search import PlanCost, Priced, search_plan


class TableCost(Protocol):
    """Per-step ms of one table: held whole by one rank (`table`), data-parallel (`dp_table`), and its
    pooled all-to-all when model-parallel (`comm`)."""

    def table(self, t, cfg: TrialConfig) -> float: ...
    def dp_table(self, t, cfg: TrialConfig) -> float: ...
    def comm(self, t, cfg: TrialConfig, parts: int = 1) -> float: ...


class PlanError(ConfigError):
    """No legal plan (e.g. over the memory cap, illegal column split): the config is infeasible."""


class _Positions:
    """The group's positions by load, for greedy placement: each item goes to the least-loaded position
    (ties to the lower one) that still fits the memory cap. A heap keeps that a log-G step instead of a
    scan of every position (16,384 of them for full model parallelism at the largest scale); an entry is
    stale once its position's load has moved on (loads only grow), and is then skipped."""

    def __init__(self, load: list[float], used: list[float], cap: float | None) -> None:
        self.load, self.used, self.cap = load, used, cap
        self._heap = [(x, p) for p, x in enumerate(load)]
        heapq.heapify(self._heap)

    def place(self, cost: float, size: float, what: str) -> int:
        skipped = []
        while self._heap:
            x, p = heapq.heappop(self._heap)
            if x != self.load[p]:
                continue
            if self.cap is None or self.used[p] + size <= self.cap:
                break
            skipped.append((x, p))
        else:
            raise PlanError(f"sharding plan cannot fit mem_cap_mb={self.cap / 2**20:.0f} per rank: {what} needs "
                            f"{size / 2**20:.1f} MB and the ranks already hold "
                            f"{_held(self.used)} MB")
        self.load[p] += cost
        self.used[p] += size
        for e in (*skipped, (self.load[p], p)):
            heapq.heappush(self._heap, e)
        return p


def _held(used: list[float]) -> str:
    """What the ranks hold, in MB: each rank's up to 16 of them, else the range."""
    mb = [round(u / 2**20, 1) for u in used]
    return str(mb) if len(mb) <= 16 else f"{min(mb)}..{max(mb)} (over {len(mb)} ranks)"


def make_plan(cfg: TrialConfig, cost: TableCost, check_memory: bool = True,
              allowed: Iterable[str] = SHARDING_TYPES) -> ShardingPlan:
    """Build the plan for one sharding group; raises PlanError when no legal plan exists. `auto` picks
    kinds by speed alone, so when its plan misses the memory cap it falls back to whole tables packed
    by the cap before giving up (a plan that fits exists more often than its first choice shows).
    `allowed`: the sharding kinds the backend runs (`plan` chooses among them only)."""
    if cfg.sharding == "plan":
        return plan_candidates(cfg, cost, check_memory, allowed)[0].plan
    return check_constraints(cfg, _fixed_kinds(cfg, cost, check_memory))


def check_constraints(cfg: TrialConfig, plan: ShardingPlan) -> ShardingPlan:
    """`plan`, or ConfigError naming the first table whose constraints (`TableSpec.sharding_types`, `ranks`) it
    breaks: a plan that leaves a table where its owner said it must not go is refused, never run."""
    for tp, t in zip(plan.tables, cfg.workload.tables, strict=True):
        if t.sharding_types and tp.kind not in t.sharding_types:
            raise ConfigError(f"sharding={cfg.sharding}: table {t.name} planned {tp.kind}; its sharding_types "
                              f"allow {t.sharding_types}")
        if not t.ranks:
            continue
        ranks = tp.ranks() if tp.kind != "data_parallel" else list(range(plan.group_size))
        if not set(ranks) <= set(t.ranks):
            raise ConfigError(f"sharding={cfg.sharding}: table {t.name} planned on ranks {ranks[:8]}; its ranks "
                              f"allow {t.ranks}")
    for label, members in cfg.workload.together().items():
        where = {cfg.workload.tables[i].name: (plan.tables[i].kind, plan.tables[i].ranks())
                 for i in members}
        if len({(k, tuple(r)) for k, r in where.values()}) > 1 or next(iter(where.values()))[0] != "table_wise":
            shown = ", ".join(f"{n} {k} on {r[:4]}" for n, (k, r) in where.items())
            raise ConfigError(f"sharding={cfg.sharding}: tables together={label!r} must be table-wise on one rank; "
                              f"planned {shown}")
    return plan



def _fixed_kinds(cfg: TrialConfig, cost: TableCost, check_memory: bool) -> ShardingPlan:
    kinds = _choose_kinds(cfg, cost)
    try:
        return _place(cfg, cost, kinds, check_memory)
    except PlanError as e:
        if cfg.sharding != "auto" or set(kinds.values()) == {"table_wise"}:
            raise
        first = e
    try:
        return _place(cfg, cost, dict.fromkeys(kinds, "table_wise"), check_memory)
    except PlanError:
        raise first from None


UNIFORM_RIVALS = (*SHARDING_TYPES, "size_greedy", "lookup_greedy", "size_lookup_greedy", "auto")


def plan_candidates(cfg: TrialConfig, cost: PlanCost, check_memory: bool = True,
                    allowed: Iterable[str] = SHARDING_TYPES) -> list[Priced]:
    """`sharding: plan`'s choice first, then every rival it was priced against (the uniform types and
    greedy planners the backend runs: `UNIFORM_RIVALS`), fastest first. PlanError when none fits."""
    allowed = tuple(allowed)
    rivals: dict[str, ShardingPlan] = {}
    for name in UNIFORM_RIVALS:
        if name in SHARDING_TYPES and name not in allowed:
            continue
        try:
            plan = make_plan(dataclasses.replace(cfg, sharding=name), cost, check_memory)
        except ConfigError:  # an illegal column split, or no fit: not a rival
            continue
        if all(tp.kind in allowed for tp in plan.tables):
            rivals[name] = plan
    priced = search_plan(cfg, cost, allowed, rivals, check_memory)
    if not priced or check_memory and not math.isfinite(priced[0].step_ms):
        raise PlanError(f"sharding plan cannot fit mem_cap_mb={cfg.mem_cap_mb:.0f} or the device's memory: "
                        "no per-table plan or uniform type holds the tables on every rank")
    return priced


def _place(cfg: TrialConfig, cost: TableCost, kinds: dict[int, str], check_memory: bool) -> ShardingPlan:
    """Shards for the given kinds, placed on the group's positions (row-wise, column-wise,
    table-row-wise, then table-wise bin-packing by cost within the memory cap)."""
    wl, G = cfg.workload, cfg.group_size
    wbytes = DTYPE_BYTES[cfg.emb_precision]
    sizes = {i: t.rows * (t.dim * wbytes + 4) for i, t in enumerate(wl.tables)}
    cap = cfg.mem_cap_mb * 2**20 if (check_memory and cfg.mem_cap_mb > 0) else None
    tables = {i: TablePlan(i, t.name, kinds[i]) for i, t in enumerate(wl.tables)}
    load, used = [0.0] * G, [0.0] * G
    dp_bytes = sum(sizes[i] for i, k in kinds.items() if k == "data_parallel")
    used = [dp_bytes] * G

    # row-wise: every position gets a block of rows (positions 0.. in order: the blocks' sums are arrays)
    rw_used, rw_load = np.zeros(G), np.zeros(G)
    for i, t in enumerate(wl.tables):
        if kinds[i] == "row_wise":
            _split_rows(tables[i], t.rows, t.dim, list(range(G)))
            n = len(tables[i].shards)
            block = np.full(n, math.ceil(t.rows / G), dtype=np.float64)
            block[-1] = t.rows - block[0] * (n - 1)
            rw_used[:n] += block * (t.dim * wbytes + 4)
            rw_load[:n] += cost.table(t, cfg) * block / t.rows
    used = [u + float(x) for u, x in zip(used, rw_used, strict=True)]
    load = [lo + float(x) for lo, x in zip(load, rw_load, strict=True)]

    # column-wise: shards of width w placed greedily
    positions = _Positions(load, used, cap)
    for i, t in enumerate(wl.tables):
        if kinds[i] == "column_wise":
            w = cfg.column_width(t.dim, t.name)
            n = t.dim // w
            c = cost.table(t, cfg) / n
            for k in range(n):
                pos = positions.place(c, t.rows * (w * wbytes + 4), f"table t{i}'s column shard")
                tables[i].shards.append(Shard(i, pos, 0, t.rows, k * w, (k + 1) * w))
            tables[i].shards = ascending_columns(tables[i].shards)

    # table-row-wise: tables to nodes, rows across the node's ranks
    rpn = min(cfg.ranks_per_node, G)
    nodes = [list(range(n * rpn, (n + 1) * rpn)) for n in range(G // rpn)]
    twrw = [i for i in range(wl.num_tables) if kinds[i] == "table_row_wise"]
    if twrw:
        node_load = [0.0] * len(nodes)
        for i in sorted(twrw, key=lambda i: (-cost.table(wl.tables[i], cfg), i)):
            n = min(range(len(nodes)), key=lambda n: (node_load[n], n))
            node_load[n] += cost.table(wl.tables[i], cfg)
            _split_rows(tables[i], wl.tables[i].rows, wl.tables[i].dim, nodes[n])
            for s in tables[i].shards:
                used[s.rank] += s.rows * (wl.tables[i].dim * wbytes + 4)

    # table-wise (incl. the greedy planners): bin-packing by the planner's cost
    tw = [i for i in range(wl.num_tables) if kinds[i] == "table_wise"]
    if tw:
        costs = {i: _tw_cost(cfg, cost, i) for i in tw}
        for i in sorted(tw, key=lambda i: (-costs[i], i)):
            p = positions.place(costs[i], sizes[i], f"table t{i}")
            tables[i].shards.append(Shard(i, p, 0, wl.tables[i].rows, 0, wl.tables[i].dim))

    plan = ShardingPlan(G, cfg.world_size, [tables[i] for i in range(wl.num_tables)], [t.dim for t in wl.tables])
    if cap is not None:
        per = plan.bytes_per_rank([t.rows for t in wl.tables], wbytes)
        worst = max(range(G), key=lambda p: per[p])
        if per[worst] > cap:
            raise PlanError(f"sharding plan cannot fit mem_cap_mb={cfg.mem_cap_mb:.0f}: rank {worst} needs "
                            f"{per[worst] / 2**20:.1f} MB of tables and optimizer state")
    return plan


def _split_rows(tp: TablePlan, rows: int, dim: int, positions: list[int]) -> None:
    """Equal row blocks on `positions` in order, the last one short (and none past the last row)."""
    tp.shards = RowBlocks(tp.table, rows, dim, positions)


def _tw_cost(cfg: TrialConfig, cost: TableCost, i: int) -> float:
    t = cfg.workload.tables[i]
    if cfg.sharding == "size_greedy":
        return float(t.rows * t.dim)
    if cfg.sharding == "lookup_greedy":
        return t.dim * t.lookups(cfg.workload.profiled)
    if cfg.sharding == "size_lookup_greedy":
        return t.dim * t.lookups(cfg.workload.profiled) * math.log10(max(t.rows, 2))
    return cost.table(t, cfg) + cost.comm(t, cfg)


def _choose_kinds(cfg: TrialConfig, cost: TableCost) -> dict[int, str]:
    wl = cfg.workload
    if cfg.sharding in SHARDING_TYPES:
        return dict.fromkeys(range(wl.num_tables), cfg.sharding)
    if cfg.sharding != "auto":
        return dict.fromkeys(range(wl.num_tables), "table_wise")
    G = cfg.group_size
    costs = {i: cost.table(t, cfg) for i, t in enumerate(wl.tables)}
    fair = sum(costs.values()) / G
    kinds = {}
    for i, t in enumerate(wl.tables):
        if cost.dp_table(t, cfg) < costs[i] / G + cost.comm(t, cfg):
            kinds[i] = "data_parallel"
        elif G > 1 and costs[i] > fair and costs[i] / G + cost.comm(t, cfg, G) < costs[i] + cost.comm(t, cfg):
            kinds[i] = "row_wise"  # its lookups spread, unless every rank's partial sums cost more to move
        else:
            kinds[i] = "table_wise"
    return kinds
