"""The per-table planner (`sharding: plan`): enumerate -> estimate -> propose -> partition, as TorchRec's
planner is built, with the performance model's modelled step as the objective.

- enumerate (`options`): every way the backend runs each table: whole on one position (table-wise),
  row blocks over the group (row-wise), k column shards for each FBGEMM-legal k up to the group size
  (column-wise), row blocks over one node's positions (table-row-wise), replicated (data-parallel);
- estimate (`_Loads.step`): each option's shards priced by the cost (`PlanCost`: the performance
  model's per-shard lookups, the group's exchanges, a data-parallel table's work and sync) and folded
  into a surrogate of the step as `perf.estimate` composes it: the busiest position's forward plus
  its backward (the all-to-alls synchronise the group every phase), the exchanges at their busiest
  rank's bytes, the data-parallel tables' work and their one sync;
- propose (`greedy`): tables in order of cost (longest first), each taking the option and positions
  that raise the surrogate least (with the lookups and pooled columns still to place spread as a lower
  bound, so an early table is neither split for a maximum the rest will fill anyway nor left whole where
  the rest could even the columns out); then moves off the critical position (another option, another
  position) while one lowers the surrogate. Several starts;
- partition: placement under each position's memory is part of every move (a position that would
  overflow is never chosen).

The answer is the plan with the least *full* step estimate (`PlanCost.step_ms`: the simulator's own,
memory checked) among the proposals, every uniform type the backend runs and the greedy planners, so it
is never priced slower than any of them (tests/test_plan_search.py checks it on generated workloads).
Without a calibrated cluster the surrogate ranks them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cubic_harness.config import DTYPE_BYTES, TrialConfig
from cubic_harness.sharding.plan import RowBlocks, Shard, ShardingPlan, TablePlan

ID_BYTES = 8  # a length on the wire (the input distribution's lengths all-to-all)
MOVES_PER_TABLE = 4  # the improvement's move budget: at most this many accepted moves per table
CRITICAL_TABLES = 16  # tables on the critical position tried per move, heaviest first
POLISH_ESTIMATES = 400  # full step estimates the final polish may spend (each ~1-30 ms at <= 128 positions)
POLISH_MAX_SIZE = 128 * 64  # positions x tables up to which the polish runs (beyond, estimates take seconds)
STARTS_MAX_SIZE = POLISH_MAX_SIZE  # positions x tables up to which the greedy also starts from one kind


class PlanCost(Protocol):
    """What the per-table planner asks of the performance model (`perf.TableCosts` implements it)."""

    def shard(self, t, cfg: TrialConfig, start: int, stop: int, width: int) -> tuple[float, float, float]:
        """(forward ms, backward+optimizer ms, id bytes received) of one model-parallel shard."""
        ...

    def shards(self, t, cfg: TrialConfig, starts: np.ndarray, stops: np.ndarray,
               width: int | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`shard` of many row blocks at once, as arrays; `width`: one for all blocks, or one per block."""
        ...

    def dp_lookups(self, t, cfg: TrialConfig) -> tuple[float, float]:
        """(ms of a data-parallel table's local lookups and update, its bytes in the sparse all-gather)."""
        ...

    def dp_sync_ms(self, cfg: TrialConfig, nbytes: float) -> float: ...

    def exchange_ms(self, cfg: TrialConfig, recv_cols: float, max_cols: float, lens_send: float,
                    max_lens: float, ids_send: float, max_ids: float) -> tuple[float, float]:
        """(ms in the step, ms beside it) of the group's input and pooled all-to-alls for a plan with these
        totals and busiest positions (a pipelined input distribution runs beside the previous step)."""
        ...

    def step_ms(self, cfg: TrialConfig, plan: ShardingPlan) -> float | None:
        """The full step estimate (inf where a rank's memory does not hold it); None without a cluster."""
        ...

    def shard_room(self, cfg: TrialConfig) -> float | None:
        """Bytes one position has for its shards (weights and row state); None: no limit."""
        ...


@dataclass(frozen=True)
class Option:
    """One way to run a table: a sharding kind and, for column-wise, its number of column shards."""

    kind: str
    parts: int = 1

    def __str__(self) -> str:
        return f"column_wise/{self.parts}" if self.kind == "column_wise" else self.kind


def options(cfg: TrialConfig, t, allowed: Iterable[str]) -> list[Option]:
    """Every option for table `t` among the `allowed` kinds on this group, within its constraints (its own
    `sharding_types`; with `ranks`, only kinds whose shards can all live there)."""
    G, W, dim = cfg.group_size, cfg.world_size, t.dim
    rpn = min(cfg.ranks_per_node, G)
    allowed = set(allowed) & set(t.sharding_types or allowed)
    if t.together:  # kept whole on one rank with the tables that share its label
        allowed &= {"table_wise"}
    if t.ranks:
        ok = set(t.ranks)
        allowed.discard("data_parallel")  # replicated on every rank
        if not ok >= set(range(G)):
            allowed.discard("row_wise")
        if not any(ok >= set(range(n * rpn, (n + 1) * rpn)) for n in range(G // max(rpn, 1))):
            allowed.discard("table_row_wise")
    out = [Option("table_wise")] if "table_wise" in allowed else []
    if "column_wise" in allowed and dim % 4 == 0:
        out += [Option("column_wise", dim // w) for w in range(dim // 2, 3, -1)
                if w % 4 == 0 and dim % w == 0 and dim // w <= len(t.ranks or range(G))]
    if "row_wise" in allowed and G > 1:
        out.append(Option("row_wise"))
    if "table_row_wise" in allowed and 1 < rpn < G and G % rpn == 0 and cfg.group_placement == "intra_node":
        out.append(Option("table_row_wise"))
    if "data_parallel" in allowed and W > 1:
        out.append(Option("data_parallel"))
    return out


@dataclass
class _Part:
    """One table's share of every position's load, as chosen: the positions it touches and what it adds.
    `make`: its shards, built only for the parts a plan keeps (every table's row-wise option at 1,024
    positions would be 800k shard objects, priced as arrays)."""

    option: Option
    make: Callable[[], list[Shard]]
    pos: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    cols: np.ndarray
    ids: np.ndarray
    lens: np.ndarray
    mem: np.ndarray
    recv_cols: float = 0.0
    ids_send: float = 0.0
    lens_send: float = 0.0
    dp_ms: float = 0.0
    dp_sync_bytes: float = 0.0
    dp_mem: float = 0.0
    known_distinct: bool = False  # set where the builder knows `distinct` (asked of every option tried)

    @functools.cached_property
    def shards(self) -> list[Shard]:
        return self.make()

    @functools.cached_property
    def distinct(self) -> bool:
        """Each position at most once (every placed part): its loads add elementwise, no scatter needed."""
        return self.known_distinct or len(np.unique(self.pos)) == len(self.pos)


@dataclass(frozen=True)
class _Rest:
    """Work the proposer has not placed yet, counted as spread evenly over the positions: a lower bound on
    what the finished plan's busiest position holds, so an early table is neither split for a maximum the
    rest will fill anyway nor placed whole where the rest could have evened the columns out."""

    fwd: float = 0.0
    bwd: float = 0.0
    cols: float = 0.0  # pooled columns (each table's width at least)


NOTHING_LEFT = _Rest()


class _Loads:
    """The group's positions as a plan fills them, and the surrogate step they give (module docstring)."""

    def __init__(self, cfg: TrialConfig, cost: PlanCost, room: float | None) -> None:
        G = cfg.group_size
        self.cfg, self.cost, self.G, self.room = cfg, cost, G, room
        self.fwd, self.bwd, self.cols = np.zeros(G), np.zeros(G), np.zeros(G)
        self.ids, self.lens, self.mem = np.zeros(G), np.zeros(G), np.zeros(G)
        self.recv_cols = self.ids_send = self.lens_send = 0.0
        self.dp_ms = self.dp_sync_bytes = self.dp_mem = 0.0
        self.parts: dict[int, _Part] = {}
        self.col_ms = self.id_ms = 0.0  # set by the search: what a column / an id byte more costs a rank
        self.offset = 0.0  # set by the search: the step's part no plan changes (dense, DDP), for `beside`
        self._cache: dict[str, object] = {}  # what the state gives until the next `add` (tried many times)

    def _once(self, name: str, make: Callable[[], object]) -> object:
        got = self._cache.get(name)
        if got is None:
            got = self._cache[name] = make()
        return got

    def pressure(self) -> np.ndarray:
        """Each position's own share of the step: its lookups, and the exchange bytes it is the end of
        (the all-to-alls last as long as their busiest rank)."""
        return self._once("pressure", lambda: self.fwd + self.bwd + self.col_ms * self.cols + self.id_ms * self.ids)

    def by_pressure(self) -> np.ndarray:
        """Positions from the least pressed (ties to the lower position)."""
        return self._once("order", lambda: np.argsort(self.pressure(), kind="stable"))

    def maxima(self) -> tuple[float, ...]:
        """(busiest forward, backward, columns, lengths, ids; forward and backward sums) of the state."""
        return self._once("max", lambda: (float(self.fwd.max()), float(self.bwd.max()), float(self.cols.max()),
                                          float(self.lens.max()), float(self.ids.max()), float(self.fwd.sum()),
                                          float(self.bwd.sum())))

    def add(self, i: int, part: _Part, sign: float = 1.0) -> None:
        self._cache.clear()
        for arr, v in ((self.fwd, part.fwd), (self.bwd, part.bwd), (self.cols, part.cols),
                       (self.ids, part.ids), (self.lens, part.lens), (self.mem, part.mem)):
            if part.distinct:
                arr[part.pos] += sign * v
            else:
                np.add.at(arr, part.pos, sign * v)
        self.recv_cols += sign * part.recv_cols
        self.ids_send += sign * part.ids_send
        self.lens_send += sign * part.lens_send
        self.dp_ms += sign * part.dp_ms
        self.dp_sync_bytes += sign * part.dp_sync_bytes
        self.dp_mem += sign * part.dp_mem
        if sign > 0:
            self.parts[i] = part
        else:
            del self.parts[i]

    def fits(self, part: _Part) -> bool:
        if self.room is None:
            return True
        if part.dp_mem and float(self.mem.max()) + self.dp_mem + part.dp_mem > self.room:
            return False
        if part.distinct:
            return bool(np.all(self.mem[part.pos] + part.mem + self.dp_mem <= self.room))
        extra = np.zeros(self.G)
        np.add.at(extra, part.pos, part.mem)
        return bool(np.all(self.mem[part.pos] + extra[part.pos] + self.dp_mem <= self.room))

    def step(self, rest: _Rest = NOTHING_LEFT) -> float:
        """The surrogate step; `rest`: work not yet placed, counted as spread evenly (a lower bound)."""
        inner, beside = self.parts_ms(rest)
        return max(self.offset + inner, beside)

    def step_with(self, part: _Part, rest: _Rest = NOTHING_LEFT) -> float:
        """`step` were `part` added, without adding it: the proposers ask this of every option of every
        table, and the busiest position is the old busiest or one the part touches."""
        if not part.distinct:
            self.add(-1, part)
            got = self.step(rest)
            self.add(-1, part, -1.0)
            return got
        f_max, b_max, c_max, l_max, i_max, f_sum, b_sum = self.maxima()
        p, G = part.pos, self.G

        def top(old: float, arr: np.ndarray, v: np.ndarray) -> float:
            return max(old, float((arr[p] + v).max())) if len(p) else old

        f = max(top(f_max, self.fwd, part.fwd), (f_sum + float(part.fwd.sum()) + rest.fwd) / G)
        b = max(top(b_max, self.bwd, part.bwd), (b_sum + float(part.bwd.sum()) + rest.bwd) / G)
        cols = self.recv_cols + part.recv_cols + rest.cols
        ex, beside = self.cost.exchange_ms(
            self.cfg, cols, max(top(c_max, self.cols, part.cols), cols / G),
            self.lens_send + part.lens_send, top(l_max, self.lens, part.lens), self.ids_send + part.ids_send,
            top(i_max, self.ids, part.ids))
        sync = self.dp_sync_bytes + part.dp_sync_bytes
        dp = self.dp_ms + part.dp_ms + (self.cost.dp_sync_ms(self.cfg, sync) if sync else 0.0)
        return max(self.offset + f + b + ex + dp, beside)

    def parts_ms(self, rest: _Rest = NOTHING_LEFT) -> tuple[float, float]:
        """(the plan's part of the step, the pipelined input distribution's time beside it)."""
        G = self.G
        f = max(float(self.fwd.max()), (float(self.fwd.sum()) + rest.fwd) / G)
        b = max(float(self.bwd.max()), (float(self.bwd.sum()) + rest.bwd) / G)
        cols = self.recv_cols + rest.cols
        ex, beside = self.cost.exchange_ms(self.cfg, cols, max(float(self.cols.max()), cols / G), self.lens_send,
                                           float(self.lens.max()), self.ids_send, float(self.ids.max()))
        return f + b + ex + self.dp_step(), beside

    def dp_step(self) -> float:
        """The data-parallel tables' part of the step: their own work and their one sync."""
        sync = self.dp_sync_bytes
        return self.dp_ms + (self.cost.dp_sync_ms(self.cfg, sync) if sync else 0.0)


class _Pricer:
    """Builds a table's part for an option and placement, caching what does not depend on the state."""

    def __init__(self, cfg: TrialConfig, cost: PlanCost) -> None:
        self.cfg, self.cost = cfg, cost
        self.wl = cfg.workload
        self.pool = self.wl.lookups_per_sample()
        self.wb = DTYPE_BYTES[cfg.emb_precision]
        self.sb = 0 if cfg.emb_optimizer == "sgd" else 4
        self._shard: dict[tuple, tuple[float, float, float]] = {}
        self._fixed: dict[tuple, _Part] = {}

    def shard_cost(self, i: int, lo: int, hi: int, width: int) -> tuple[float, float, float]:
        key = (i, lo, hi, width)
        got = self._shard.get(key)
        if got is None:
            got = self._shard[key] = self.cost.shard(self.wl.tables[i], self.cfg, lo, hi, width)
        return got

    def whole_costs(self, i: int, widths: Sequence[int]) -> None:
        """`shard_cost` of table i whole at each of these widths, priced in one call (the greedy asks every
        width of every table once)."""
        rows = self.wl.tables[i].rows
        todo = [w for w in widths if (i, 0, rows, w) not in self._shard]
        if len(todo) < 2:
            return
        n = len(todo)
        got = self.cost.shards(self.wl.tables[i], self.cfg, np.zeros(n), np.full(n, float(rows)), np.array(todo))
        for k, w in enumerate(todo):
            self._shard[(i, 0, rows, w)] = (float(got[0][k]), float(got[1][k]), float(got[2][k]))

    def part(self, i: int, option: Option, shards: list[Shard]) -> _Part:
        """The load of table i run as `option` with these shards (positions set)."""
        t = self.wl.tables[i]
        if option.kind == "data_parallel":
            ms, sync = self.cost.dp_lookups(t, self.cfg)
            z = np.zeros(0)
            return _Part(option, list, np.zeros(0, dtype=np.int64), z, z, z, z, z, z, dp_ms=ms, dp_sync_bytes=sync,
                         dp_mem=t.rows * (t.dim * self.wb + self.sb))
        n = len(shards)
        fwd, bwd, ids = np.empty(n), np.empty(n), np.empty(n)
        for k, s in enumerate(shards):
            fwd[k], bwd[k], ids[k] = self.shard_cost(i, s.row_start, s.row_end, s.dim)
        rows = np.array([s.rows for s in shards], dtype=np.float64)
        dims = np.array([s.dim for s in shards], dtype=np.float64)
        pos = np.array([s.rank for s in shards], dtype=np.int64)
        return self._loaded(option, lambda: shards, pos, rows, dims, fwd, bwd, ids)

    def whole_rows(self, i: int, option: Option, ranks: np.ndarray) -> _Part:
        """Table i's `option.parts` column shards (one: the whole table) on `ranks`, ascending: column k on the
        k-th lowest rank, as TorchRec places them (`ascending_columns`). The shards are alike: priced once."""
        t, n = self.wl.tables[i], len(ranks)
        w = t.dim // option.parts
        fwd, bwd, ids = self.shard_cost(i, 0, t.rows, w)

        def make() -> list[Shard]:
            return [Shard(i, int(p), 0, t.rows, k * w, (k + 1) * w) for k, p in enumerate(ranks)]

        return self._loaded(option, make, ranks.astype(np.int64), np.full(n, float(t.rows)), np.full(n, float(w)),
                            np.full(n, fwd), np.full(n, bwd), np.full(n, ids), distinct=True)

    def _loaded(self, option: Option, make: Callable[[], list[Shard]], pos: np.ndarray, rows: np.ndarray,
                dims: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, ids: np.ndarray,
                distinct: bool = False) -> _Part:
        """A model-parallel part from its shards and their priced lookups: what each position receives and holds
        (`distinct`: the caller knows each position appears once)."""
        B, G, n = self.cfg.batch_size, self.cfg.group_size, len(pos)
        return _Part(option, make, pos, fwd, bwd, dims, ids, np.full(n, G * B * ID_BYTES),
                     rows * (dims * self.wb + self.sb), recv_cols=float(dims.sum()), ids_send=float(ids.sum()) / G,
                     lens_send=n * B * ID_BYTES, known_distinct=distinct)

    def fixed(self, i: int, option: Option, positions: tuple[int, ...]) -> _Part:
        """Parts whose positions the option fixes (row-wise: all; table-row-wise: one node's), cached, their
        row blocks priced at once as arrays."""
        key = (i, option, positions)
        got = self._fixed.get(key)
        if got is None:
            t = self.wl.tables[i]
            block = math.ceil(t.rows / len(positions))
            lo = np.arange(len(positions)) * block
            hi = np.minimum(t.rows, lo + block)
            keep = hi > lo
            pos, lo, hi = np.asarray(positions, dtype=np.int64)[keep], lo[keep], hi[keep]

            def make() -> list[Shard]:
                return [Shard(i, p, a, b, 0, t.dim) for p, a, b in zip(pos.tolist(), lo.tolist(), hi.tolist(),
                                                                           strict=True)]

            costs = self.cost.shards(t, self.cfg, lo.astype(np.float64), hi.astype(np.float64), t.dim)
            got = self._fixed[key] = self._loaded(option, make, pos, (hi - lo).astype(np.float64),
                                                  np.full(len(pos), float(t.dim)), *costs,
                                                  distinct=len(set(positions)) == len(positions))
        return got


class _Search:
    """One planning problem: the tables' options, the pricer, and the state the proposers fill."""

    def __init__(self, cfg: TrialConfig, cost: PlanCost, allowed: Iterable[str], room: float | None) -> None:
        self.cfg, self.cost, self.room = cfg, cost, room
        self.pricer = _Pricer(cfg, cost)
        wl, G = cfg.workload, cfg.group_size
        self.options = [options(cfg, t, allowed) for t in wl.tables]
        self.G = G
        self.rpn = min(cfg.ranks_per_node, G)
        self.nodes = [tuple(range(n * self.rpn, (n + 1) * self.rpn)) for n in range(G // self.rpn)]
        whole = [self.pricer.shard_cost(i, 0, t.rows, t.dim) for i, t in enumerate(wl.tables)]
        self.whole_fwd = [w[0] for w in whole]
        self.whole_bwd = [w[1] for w in whole]
        self.order = sorted(range(wl.num_tables), key=lambda i: (-(whole[i][0] + whole[i][1]), i))
        self.offset = 0.0  # `_offset`, once the rivals are priced
        self.col_ms, self.id_ms = self._slopes()
        self.together = {i: members for members in wl.together().values() for i in members}

    def empty(self) -> _Loads:
        loads = _Loads(self.cfg, self.cost, self.room)
        loads.col_ms, loads.id_ms, loads.offset = self.col_ms, self.id_ms, self.offset
        return loads

    def _slopes(self) -> tuple[float, float]:
        """What one more column, and one more id byte, on the busiest position adds to the exchanges, at a
        balanced plan's totals (the placement's exchange rates: the all-to-alls' per-byte cost there)."""
        wl, G, B = self.cfg.workload, self.cfg.group_size, self.cfg.batch_size
        cols = float(sum(t.dim for t in wl.tables))
        ids = sum(self.pricer.shard_cost(i, 0, t.rows, t.dim)[2] for i, t in enumerate(wl.tables))
        lens = wl.num_tables * B * ID_BYTES
        d, n = max(t.dim for t in wl.tables), max(ids / wl.num_tables, 1.0)

        def ex(mc: float, mi: float) -> float:
            return sum(self.cost.exchange_ms(self.cfg, cols, mc, lens, G * B * ID_BYTES, ids / G, mi))

        base = ex(cols / G, ids / G)
        return (ex(cols / G + d, ids / G) - base) / d, (ex(cols / G, ids / G + n) - base) / n

    def place(self, loads: _Loads, i: int, option: Option) -> _Part | None:
        """Table i as `option` on the positions that leave the group least loaded, or None if none fit."""
        t, G = self.cfg.workload.tables[i], self.cfg.group_size
        if option.kind == "data_parallel":
            part = self.pricer.part(i, option, [])
        elif option.kind == "row_wise":
            part = self.pricer.fixed(i, option, tuple(range(G)))
        elif option.kind == "table_row_wise":
            node = self._least_loaded_node(loads.pressure(), t.ranks)
            if node is None:
                return None
            part = self.pricer.fixed(i, option, node)
        elif i in self.together:
            return self._place_together(loads, i, option)
        else:
            return self._place_free(loads, i, option, t)
        return part if loads.fits(part) else None

    def _least_loaded_node(self, load: np.ndarray, ranks: Sequence[int]) -> tuple[int, ...] | None:
        """The node (of those whose ranks the table may use) whose busiest position is least loaded, ties
        to the lower node: one reduction over the (nodes, ranks per node) grid, as a thousand-rank group
        asks this of every table-row-wise option."""
        busiest = load[: len(self.nodes) * self.rpn].reshape(len(self.nodes), self.rpn).max(axis=1)
        if ranks:
            allowed = set(ranks)
            busiest = np.where([set(ps) <= allowed for ps in self.nodes], busiest, np.inf)
            if not np.isfinite(busiest).any():
                return None  # no whole node among the table's ranks
        return self.nodes[int(np.argmin(busiest))]

    def _place_together(self, loads: _Loads, i: int, option: Option) -> _Part | None:
        """A table kept with others: on the position one of them already holds, else (the group's first)
        on the least-loaded position where every table of the group fits and may live."""
        members = self.together[i]
        placed = [j for j in members if j != i and j in loads.parts]
        if placed:
            part = self.pricer.whole_rows(i, option, loads.parts[placed[0]].pos[:1])
            return part if loads.fits(part) else None
        tables = self.cfg.workload.tables
        ranks = [set(tables[j].ranks) for j in members if tables[j].ranks]
        need = sum(tables[j].rows * (tables[j].dim * self.pricer.wb + self.pricer.sb) for j in members)
        return self._place_free(loads, i, option, tables[i], need, sorted(set.intersection(*ranks)) if ranks
                                else None)

    def _place_free(self, loads: _Loads, i: int, option: Option, t, need: float | None = None,
                    ranks: list[int] | None = None) -> _Part | None:
        """Table-wise and column shards: each on the least-loaded position that holds it, a table's column
        shards on distinct positions. Its shards are alike, so that is the `parts` least-loaded positions
        with room (ties to the lower position), in one sort. `need` and `ranks`: a group's memory and
        positions, where the table is the first of tables kept together."""
        w = t.dim // option.parts
        need = t.rows * (w * self.pricer.wb + self.pricer.sb) if need is None else need
        ranks = t.ranks if ranks is None else ranks
        order = loads.by_pressure()
        if self.room is not None:
            order = order[loads.mem[order] + loads.dp_mem + need <= self.room]
        if ranks:  # the table's allowed positions only
            order = order[np.isin(order, ranks)]
        picked = order[:option.parts]
        if picked.size < option.parts:
            return None
        return self.pricer.whole_rows(i, option, np.sort(picked))

    # ---------------------------------------------------------------------------------- proposers
    def greedy(self, choices: Sequence[Sequence[Option]], even_cols: bool = True) -> _Loads | None:
        """Longest table first, each taking the option that raises the surrogate least (ties to the option
        listed first). `even_cols`: the columns still to place count as spread evenly too, so the first
        tables are split to the width the whole plan can even out (at 1,024 positions and 788 tables, whole
        first tables fix the busiest position at a table's width for good); without it, a start that packs
        tables as they come."""
        loads = self.empty()
        dims = [t.dim if even_cols else 0 for t in self.cfg.workload.tables]
        rem_f, rem_b, rem_c = sum(self.whole_fwd), sum(self.whole_bwd), float(sum(dims))
        for i in self.order:
            rem_f -= self.whole_fwd[i]
            rem_b -= self.whole_bwd[i]
            rem_c -= dims[i]
            rest = _Rest(rem_f, rem_b, rem_c)
            scored = self._free_steps(loads, i, choices[i], rest)
            best: tuple[float, _Part | Option] | None = None
            for opt in choices[i]:
                got = scored.get(opt)
                if got is not None:
                    cand: tuple[float, _Part | Option] = (got, opt)
                elif best is not None and self._blocks_floor(loads, i, opt, rest) >= best[0]:
                    continue  # row blocks that cannot beat the best so far: not priced block by block
                else:
                    part = self.place(loads, i, opt)
                    if part is None:
                        continue
                    cand = (loads.step_with(part, rest), part)
                if best is None or cand[0] < best[0]:
                    best = cand
            if best is None:
                return None
            chosen = best[1]
            if isinstance(chosen, Option):
                chosen = self.place(loads, i, chosen)
                assert chosen is not None  # scored: it fits where `_free_steps` placed it
            loads.add(i, chosen)
        return loads

    def _blocks_floor(self, loads: _Loads, i: int, opt: Option, rest: _Rest) -> float:
        """A floor under `step_with` of table i as row blocks (row-wise, table-row-wise), from its totals alone:
        no position's lookups fall and the busiest positions' exchange bytes do not either, while the
        exchange grows by the blocks' pooled columns and lengths (each block sends its partial sums). The
        exchange's time rises with each of its arguments, so this is never above the step the part gives;
        -inf for the other kinds. Why: at 1,024 positions a row-wise option is 1,024 blocks to price, and its
        pooled exchange alone rules it out."""
        if opt.kind not in ("row_wise", "table_row_wise"):
            return -math.inf
        t, G = self.cfg.workload.tables[i], self.G
        span = G if opt.kind == "row_wise" else self.rpn
        block = math.ceil(t.rows / span) if t.rows > 0 else 0
        n = math.ceil(t.rows / block) if block else 0
        f_max, b_max, c_max, l_max, i_max, f_sum, b_sum = loads.maxima()
        f, b = max(f_max, (f_sum + rest.fwd) / G), max(b_max, (b_sum + rest.bwd) / G)
        cols = loads.recv_cols + float(n * t.dim) + rest.cols
        ex, _ = self.cost.exchange_ms(self.cfg, cols, max(c_max, cols / G),
                                      loads.lens_send + n * self.cfg.batch_size * ID_BYTES, l_max,
                                      loads.ids_send, i_max)
        return loads.offset + f + b + ex + loads.dp_step()

    def _free_steps(self, loads: _Loads, i: int, opts: Sequence[Option], rest: _Rest) -> dict[Option, float]:
        """`step_with` of table i's whole-table and column options at once, without building their parts.
        Each takes its `parts` least-pressed positions (`_place_free`), and its shards are alike, so where
        those are the first positions of the pressure order (every position has room for the shard), the
        busiest position it gives is a prefix maximum of that order plus one shard's load. Options that do
        not qualify (a table with ranks or kept together, a position short of room) are left out: the
        caller places them one by one. Why: the greedy asks this of every option of every table, and at
        1,024 positions building each part was most of the planning time."""
        t, G = self.cfg.workload.tables[i], self.G
        free = [o for o in opts if o.kind in ("table_wise", "column_wise")]
        if not free or t.ranks or i in self.together:
            return {}
        order = loads.by_pressure()
        top = max(o.parts for o in free)
        if top > G:
            return {}
        head = order[:top]
        self.pricer.whole_costs(i, [t.dim // o.parts for o in free])
        f_max, b_max, c_max, l_max, i_max, f_sum, b_sum = loads.maxima()
        pf, pb, pc, pl, pi = (np.maximum.accumulate(a[head]) for a in
                              (loads.fwd, loads.bwd, loads.cols, loads.lens, loads.ids))
        mem_head = np.maximum.accumulate(loads.mem[head]) + loads.dp_mem
        B, lens = self.cfg.batch_size, float(G * self.cfg.batch_size * ID_BYTES)
        dp = loads.dp_step()
        out = {}
        for o in free:
            n, w = o.parts, t.dim // o.parts
            need = t.rows * (w * self.pricer.wb + self.pricer.sb)
            if self.room is not None and mem_head[n - 1] + need > self.room:
                continue  # a head position lacks room: `_place_free` skips it, the caller places this
            fk, bk, idk = self.pricer.shard_cost(i, 0, t.rows, w)
            # sums as `step_with` takes them (numpy's, of n alike shards), so both give the same float
            f = max(f_max, float(pf[n - 1] + fk), (f_sum + float(np.full(n, fk).sum()) + rest.fwd) / G)
            b = max(b_max, float(pb[n - 1] + bk), (b_sum + float(np.full(n, bk).sum()) + rest.bwd) / G)
            cols = loads.recv_cols + float(n * w) + rest.cols
            ex, beside = self.cost.exchange_ms(
                self.cfg, cols, max(c_max, float(pc[n - 1] + w), cols / G),
                loads.lens_send + n * B * ID_BYTES, max(l_max, float(pl[n - 1] + lens)),
                loads.ids_send + float(np.full(n, idk).sum()) / G, max(i_max, float(pi[n - 1] + idk)))
            out[o] = max(loads.offset + f + b + ex + dp, beside)
        return out

    def improve(self, loads: _Loads) -> _Loads:
        """Moves off the critical position: a table there takes another option or other positions, the best
        such move at a time, while one lowers the surrogate."""
        for _ in range(MOVES_PER_TABLE * len(self.order)):
            base = loads.step()
            crit = int(np.argmax(loads.pressure()))
            on = [i for i, p in loads.parts.items() if crit in p.pos]
            on.sort(key=lambda i: -self._on(loads.parts[i], crit, loads))
            best = None
            for i in on[:CRITICAL_TABLES] + self._dp_tables(loads):
                old = loads.parts[i]
                loads.add(i, old, -1.0)
                for opt in self.options[i]:
                    part = self.place(loads, i, opt)
                    if part is None:
                        continue
                    s = loads.step_with(part)
                    if s < base * (1 - 1e-9) and (best is None or s < best[0]):
                        best = (s, i, part)
                loads.add(i, old)
            if best is None:
                break
            _, i, part = best
            loads.add(i, loads.parts[i], -1.0)
            loads.add(i, part)
        return loads

    @staticmethod
    def _on(part: _Part, p: int, loads: _Loads) -> float:
        here = part.pos == p
        return float(np.sum(part.fwd[here] + part.bwd[here] + loads.col_ms * part.cols[here]
                            + loads.id_ms * part.ids[here]))

    def _dp_tables(self, loads: _Loads) -> list[int]:
        """Data-parallel tables load every position alike: the critical one never names them, so each
        iteration also tries moving the costliest few back."""
        dp = [i for i, p in loads.parts.items() if p.option.kind == "data_parallel"]
        return sorted(dp, key=lambda i: -loads.parts[i].dp_ms)[:4]

    def proposals(self) -> list[ShardingPlan]:
        """The greedy over every option, each improved; on problems up to `STARTS_MAX_SIZE` also the greedy
        without the columns still to place, and starts from whole tables and from column shards (beyond it
        they gave the first start's plan or a worse one on every benchmark case, at a greedy's cost each:
        benchmarks/bench_planner.py)."""
        starts = [(self.options, True)]
        extra = self.cfg.group_size * self.cfg.workload.num_tables <= STARTS_MAX_SIZE
        if extra:
            starts.append((self.options, False))
        for kinds in (("table_wise",), ("column_wise",)) if extra else ():
            only = [[o for o in opts if o.kind in kinds] for opts in self.options]
            if all(only) and only != self.options:
                starts.append((only, False))
        out = []
        for choices, even_cols in starts:
            loads = self.greedy(choices, even_cols)
            if loads is not None:
                out.append(self.to_plan(self.improve(loads)))
        return out

    def to_plan(self, loads: _Loads) -> ShardingPlan:
        wl = self.cfg.workload
        tables = [TablePlan(i, t.name, loads.parts[i].option.kind, list(loads.parts[i].shards))
                  for i, t in enumerate(wl.tables)]
        return ShardingPlan(self.cfg.group_size, self.cfg.world_size, tables, [t.dim for t in wl.tables])

    def loads_of(self, plan: ShardingPlan) -> _Loads:
        loads = self.empty()
        for tp in plan.tables:
            opt = Option(tp.kind, len(tp.shards)) if tp.kind == "column_wise" else Option(tp.kind)
            loads.add(tp.table, self.pricer.part(tp.table, opt, tp.shards))
        return loads

    def surrogate(self, plan: ShardingPlan) -> float:
        """The surrogate step of any plan (the ranking where no cluster prices the full step)."""
        return self.loads_of(plan).step()

    def polish(self, best: Priced, budget: int) -> Priced:
        """Coordinate descent on the full estimate from the best candidate: each table, heaviest first,
        tries its other options (placed by the positions' pressure); a change stays where the full step
        falls. At most `budget` estimates: the surrogate leaves out what `estimate` adds (the critical path's
        overlaps, memory beside the shards), and this closes that gap where estimates are cheap."""
        loads, step, spent = self.loads_of(best.plan), best.step_ms, 0
        for i in self.order:
            old = loads.parts[i]
            for opt in self.options[i]:
                if spent >= budget:
                    return Priced("plan", self.to_plan(loads), step) if step < best.step_ms else best
                if opt == old.option and opt.kind in ("row_wise", "data_parallel"):
                    continue
                loads.add(i, loads.parts[i], -1.0)
                part = self.place(loads, i, opt)
                loads.add(i, part or old)
                if part is None:
                    continue
                s = self.cost.step_ms(self.cfg, self.to_plan(loads))
                spent += 1
                if s is not None and s < step * (1 - 1e-9):
                    step, old = s, part
                else:
                    loads.add(i, part, -1.0)
                    loads.add(i, old)
        return Priced("plan", self.to_plan(loads), step) if step < best.step_ms else best


def _each_once(cands: list[tuple[str, ShardingPlan]], price) -> list:
    """`price` of each candidate, once per distinct plan (the greedy planners, `auto` and table-wise often give
    the same one, and a full estimate at a thousand ranks takes seconds)."""
    seen: dict[tuple, object] = {}
    out = []
    for _, plan in cands:
        key = tuple((tp.kind, _layout_key(tp.shards)) for tp in plan.tables)
        if key not in seen:
            seen[key] = price(plan)
        out.append(seen[key])
    return out


def _layout_key(shards: Sequence[Shard]) -> tuple:
    """A table's shards as a key: row blocks by their arithmetic (a row-wise table at 1,024 positions is
    1,024 shards), a list by its shards."""
    if isinstance(shards, RowBlocks):
        return ("rows", shards.rows, shards.dim, shards.positions)
    return tuple(shards)


def _offset(cfg: TrialConfig, cost: PlanCost, search: _Search, baselines: dict[str, ShardingPlan]) -> float:
    """The full step less the surrogate on a rival plan: what the surrogate leaves out and no plan changes
    (the dense part, DDP's all-reduce, the optimizer), so that a pipelined input distribution's time beside
    the step is weighed against the whole step."""
    for plan in baselines.values():
        full = cost.step_ms(cfg, plan)
        if full is not None and math.isfinite(full):
            return max(0.0, full - search.loads_of(plan).parts_ms()[0])
    return 0.0


@dataclass(frozen=True)
class Priced:
    """A candidate plan, where it came from, and its modelled step (ms; inf where it does not fit)."""

    name: str
    plan: ShardingPlan
    step_ms: float


def search_plan(cfg: TrialConfig, cost: PlanCost, allowed: Iterable[str], baselines: dict[str, ShardingPlan],
                check_memory: bool = True) -> list[Priced]:
    """The per-table plan first, then every candidate it was chosen among (`baselines`: the uniform types'
    and the greedy planners' plans, by name), fastest first; empty where nothing fits at all (the caller
    raises)."""
    room = cost.shard_room(cfg) if check_memory else None
    search = _Search(cfg, cost, allowed, room)
    search.offset = _offset(cfg, cost, search, baselines)
    cands = [(f"plan#{k}", p) for k, p in enumerate(search.proposals())] + list(baselines.items())
    full = _each_once(cands, lambda p: cost.step_ms(cfg, p))
    exact = all(s is not None for s in full)
    if not exact:
        full = [search.surrogate(p) for _, p in cands]
    priced = sorted((Priced(n, p, float(s)) for (n, p), s in zip(cands, full, strict=True)),
                    key=lambda x: x.step_ms)
    if exact and priced and math.isfinite(priced[0].step_ms):
        size = cfg.group_size * cfg.workload.num_tables
        if size <= POLISH_MAX_SIZE:
            polished = search.polish(priced[0], POLISH_ESTIMATES)
            if polished is not priced[0]:
                priced.insert(0, polished)
    return priced
