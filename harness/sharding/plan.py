"""ShardingPlan: where every table (shard) lives inside one model-parallel group.

Ranks in a plan are positions 0..G-1 inside a sharding group of G ranks; with
2D sparse parallelism the same plan is replicated in world/G groups. A
`data_parallel` table is replicated on every rank of the world.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, overload

import numpy as np


class Shard(NamedTuple):
    """One block of a table on one position. A tuple, not a dataclass: a row-wise plan at 1,024 ranks holds
    800k of them, and a frozen dataclass's constructor was most of its planning time."""

    table: int
    rank: int  # position inside the sharding group
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def dim(self) -> int:
        return self.col_end - self.col_start


class RowBlocks(Sequence[Shard]):
    """A row-split table's shards as arithmetic: equal blocks of rows on `positions` in order, the
    last one short and none past the last row. Why not a list: a row-wise plan at 1,024 ranks holds
    800k shards, and the performance model reads them as one array (`array`); the `Shard` objects
    are built only for a reader of single shards (a JSON plan, the harness's own ranks)."""

    __slots__ = ("table", "rows", "dim", "block", "positions", "_list", "_array")

    def __init__(self, table: int, rows: int, dim: int, positions: Sequence[int]) -> None:
        self.table, self.rows, self.dim = table, rows, dim
        self.block = math.ceil(rows / len(positions)) if rows > 0 else 0
        n = math.ceil(rows / self.block) if rows > 0 else 0  # every block but the last is full
        self.positions = tuple(positions[:n])
        self._list: list[Shard] | None = None
        self._array: np.ndarray | None = None

    def array(self) -> np.ndarray:
        """The shards as rows of an (n, 6) int64 array in `Shard`'s field order (read-only: built once, as
        every estimate of a plan reads it)."""
        if self._array is None:
            self._array = self._build()
            self._array.flags.writeable = False
        return self._array

    def _build(self) -> np.ndarray:
        n = len(self.positions)
        lo = np.arange(n, dtype=np.int64) * self.block
        out = np.empty((n, 6), dtype=np.int64)
        out[:, 0], out[:, 1], out[:, 2] = self.table, self.positions, lo
        out[:, 3] = np.minimum(lo + self.block, self.rows)
        out[:, 4], out[:, 5] = 0, self.dim
        return out

    def _shards(self) -> list[Shard]:
        if self._list is None:
            self._list = [Shard(*r) for r in self.array().tolist()]
        return self._list

    def __len__(self) -> int:
        return len(self.positions)

    @overload
    def __getitem__(self, i: int) -> Shard: ...
    @overload
    def __getitem__(self, i: slice) -> list[Shard]: ...
    def __getitem__(self, i: int | slice) -> Shard | list[Shard]:
        return self._shards()[i]

    def __iter__(self) -> Iterator[Shard]:
        return iter(self._shards())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RowBlocks):
            return (self.table, self.rows, self.dim, self.positions) == (
                other.table, other.rows, other.dim, other.positions)
        return isinstance(other, (list, tuple)) and self._shards() == list(other)

    __hash__ = None  # type: ignore[assignment]  # compared by value, like the list it stands for

    def __repr__(self) -> str:
        return (f"RowBlocks(table={self.table}, rows={self.rows}, dim={self.dim}, "
                f"{len(self)} blocks of {self.block})")


@dataclass
class TablePlan:
    table: int
    name: str
    kind: str
    # empty for data_parallel; a RowBlocks for the row-split kinds the planners build
    shards: list[Shard] | RowBlocks = field(default_factory=list)

    def ranks(self) -> list[int]:
        """The positions its shards live on, ascending."""
        if isinstance(self.shards, RowBlocks):
            return sorted(set(self.shards.positions))
        return sorted({s.rank for s in self.shards})


@dataclass
class ShardingPlan:
    group_size: int
    world_size: int
    tables: list[TablePlan]
    dims: list[int] = field(default_factory=list)  # full dim of every table

    def shards_on(self, pos: int) -> list[Shard]:
        """Model-parallel shards held by group position `pos`, in plan order."""
        return [s for tp in self.tables for s in tp.shards if s.rank == pos]

    def dp_tables(self) -> list[int]:
        return [tp.table for tp in self.tables if tp.kind == "data_parallel"]

    def shard_array(self) -> np.ndarray:
        """Every model-parallel shard as a row of an (n, 6) array in `Shard`'s field order, in plan order: a
        row-wise plan at 1,024 ranks holds 800k shards, summed as arrays rather than one by one."""
        parts, run = [], []
        for tp in self.tables:
            if tp.kind == "data_parallel":
                continue
            if isinstance(tp.shards, RowBlocks):
                parts += [_rows_array(run), tp.shards.array()]
                run = []
            else:
                run.append(tp.shards)
        parts.append(_rows_array(run))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def bytes_per_rank(self, rows: list[int], weight_bytes: int = 4, state_bytes_per_row: int = 4) -> list[int]:
        """Weight + row-wise optimizer state bytes held by each group position."""
        dp = sum(rows[tp.table] * (self.dims[tp.table] * weight_bytes + state_bytes_per_row)
                 for tp in self.tables if tp.kind == "data_parallel")
        sh = self.shard_array()
        each = (sh[:, 3] - sh[:, 2]) * ((sh[:, 5] - sh[:, 4]) * weight_bytes + state_bytes_per_row)
        # float64 sums of integers are exact below 2**53 bytes (9 PB) a position: the int64 sum
        per = np.bincount(sh[:, 1], weights=each, minlength=self.group_size)
        return [dp + int(b) for b in per]

    def to_list(self) -> list[dict]:
        # explicit dicts: dataclasses.asdict's deep copy was a third of a 4,096-rank simulation
        return [{"table": tp.table, "name": tp.name, "kind": tp.kind,
                 "shards": [{"table": s.table, "rank": s.rank, "row_start": s.row_start, "row_end": s.row_end,
                             "col_start": s.col_start, "col_end": s.col_end} for s in tp.shards]}
                for tp in self.tables]

    def to_json(self) -> str:
        return json.dumps({"group_size": self.group_size, "world_size": self.world_size,
                           "tables": self.to_list()})

    @classmethod
    def from_list(cls, tables: list[dict], group_size: int, world_size: int, dims: list[int]) -> ShardingPlan:
        return cls(group_size, world_size, [TablePlan(t["table"], t["name"], t["kind"],
                                                      [Shard(**s) for s in t["shards"]]) for t in tables], dims)

    def rich_table(self):
        """A rich Table: one row per table, its kind and where its shards live."""
        from rich.table import Table

        tab = Table(title=f"sharding plan (group {self.group_size} of world {self.world_size})")
        for col in ("table", "kind", "shards (rank: rows x cols)"):
            tab.add_column(col)
        for tp in self.tables:
            where = "all ranks" if tp.kind == "data_parallel" else ", ".join(
                f"{s.rank}: [{s.row_start}:{s.row_end}]x[{s.col_start}:{s.col_end}]" for s in tp.shards)
            tab.add_row(tp.name, tp.kind, where)
        return tab


def _rows_array(held: list[Sequence[Shard]]) -> np.ndarray:
    n = sum(len(x) for x in held)
    flat = itertools.chain.from_iterable(itertools.chain.from_iterable(held))
    return np.fromiter(flat, dtype=np.int64, count=6 * n).reshape(n, 6)


def ascending_columns(shards: list[Shard]) -> list[Shard]:
    """A column-wise table's shards with its ranks in column order: TorchRec's column-wise generator gives the
    first columns to the lowest rank whatever order its ranks come in, so cubic's plans (which TorchRec runs,
    and which the harness runs alike) hold that order too. The load per rank is unchanged."""
    ranks = sorted(s.rank for s in shards)
    return [Shard(s.table, r, s.row_start, s.row_end, s.col_start, s.col_end)
            for s, r in zip(sorted(shards, key=lambda s: s.col_start), ranks, strict=True)]


def group_ranks(world: int, group_size: int, placement: str = "intra_node") -> list[list[int]]:
    """The ranks of each sharding group, listed by position. `intra_node`: side by side (group g is
    ranks g*G .. g*G+G-1, inside a node when G <= ranks per node); `cross_node`: strided (group g is
    ranks g, g+R, g+2R, ...: one group spans the nodes, and a position's replicas sit together)."""
    G, R = group_size, world // group_size
    if placement == "cross_node":
        return [list(range(g, world, R)) for g in range(R)]
    return [list(range(g * G, (g + 1) * G)) for g in range(R)]


@dataclass(frozen=True)
class TableChange:
    """One table planned differently in two plans: its kind and shard layout in each."""

    table: str
    before: str
    after: str


def layout(tp: TablePlan) -> str:
    """A table's plan in one phrase: its kind, and where its shards live (`column_wise/4 @ 0,1,2,3`)."""
    if tp.kind == "data_parallel":
        return "data_parallel"
    ranks = ",".join(str(s.rank) for s in tp.shards[:8]) + (",..." if len(tp.shards) > 8 else "")
    kind = f"column_wise/{len(tp.shards)}" if tp.kind == "column_wise" else tp.kind
    return f"{kind} @ {ranks}"


def plan_diff(before: ShardingPlan, after: ShardingPlan) -> list[TableChange]:
    """The tables whose kind, shards or ranks differ between two plans of the same tables, in table order."""
    return [TableChange(a.name, layout(b), layout(a)) for b, a in zip(before.tables, after.tables, strict=True)
            if (b.kind, b.shards) != (a.kind, a.shards)]
