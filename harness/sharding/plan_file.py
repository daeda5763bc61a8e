"""A plan from a file (`sharding: file`, `plan_file: PATH`): a team's production plan, run or priced exactly.

Three JSON shapes are read, each per table by name:

- `cubic export --format torchrec`'s (`"format": "cubic-torchrec/1"`): its `placements`, the arguments of
  TorchRec's `sharding_plan` generators (table_wise(rank), column_wise(ranks, size_per_rank),
  row_wise(ranks, rows_per_rank), table_row_wise(host_index, ranks), data_parallel());
- TorchRec's own per-parameter sharding, serialised as its `ParameterSharding` holds it:
  `{TABLE: {"sharding_type", "ranks", "sharding_spec": [{"shard_offsets": [ROW, COL], "shard_sizes":
  [ROWS, COLS], "placement": "rank:R/cuda:R"}]}}`, optionally under its module's path
  (`{"model.sparse.ebc": {...}}`), table keys bare or as `embedding_bags.TABLE.weight`;
- cubic's own (`plan` of a TrialResult, `cubic plan --json`, or the list itself).

A plan that leaves a table out, names one the workload does not have, places a shard on a rank the sharding
group does not have, or does not cover each table's rows and columns exactly once is refused in one line that
names the file and the table: a table silently lost from a plan is the failure this guards against.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from cubic_harness.config import SHARDING_TYPES, TrialConfig
from cubic_harness.errors import ConfigError, read_text
from cubic_harness.sharding.plan import Shard, ShardingPlan, TablePlan, ascending_columns

KIND_OF = {**{k: k for k in SHARDING_TYPES}, "table_column_wise": "column_wise"}  # TorchRec's types as cubic's


def load_plan(cfg: TrialConfig) -> ShardingPlan:
    """`cfg.plan_file`'s plan for cfg's workload and sharding group; ConfigError (one line) where it is wrong."""
    path = cfg.plan_file
    try:
        raw = json.loads(read_text(Path(path), "plan file"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}") from None
    per_table = _per_table(raw, path)
    wl, G = cfg.workload, cfg.group_size
    names = {t.name for t in wl.tables}
    extra = sorted(set(per_table) - names)
    if extra:
        raise ConfigError(f"{path}: table {extra[0]!r} is not in the workload (its tables: "
                          f"{', '.join(sorted(names)[:12])}{', ...' if len(names) > 12 else ''})")
    tables = []
    for i, t in enumerate(wl.tables):
        if t.name not in per_table:
            raise ConfigError(f"{path}: table {t.name} is not in the plan: every table must be placed")
        kind, shards = per_table[t.name](i, t, cfg)
        if kind not in KIND_OF:
            raise ConfigError(f"{path}: table {t.name}: sharding type {kind!r}; cubic runs {sorted(KIND_OF)}")
        kind = KIND_OF[kind]
        _check_shards(path, t, kind, shards, G)
        tables.append(TablePlan(i, t.name, kind, ascending_columns(shards) if kind == "column_wise" else shards))
    return ShardingPlan(G, cfg.world_size, tables, [t.dim for t in wl.tables])


def _per_table(raw: Any, path: str) -> dict[str, Any]:
    """{table name: a reader of that table's (kind, shards)} for whichever shape the file has."""
    if isinstance(raw, dict) and str(raw.get("format", "")).startswith("cubic-torchrec"):
        pl = raw.get("placements")
        if not isinstance(pl, dict):
            raise ConfigError(f"{path}: 'placements' must map each table to its placement")
        return {name: _from_placement(path, name, p) for name, p in pl.items()}
    if isinstance(raw, dict) and "plan" in raw or isinstance(raw, list):
        rows = raw["plan"] if isinstance(raw, dict) else raw
        if not isinstance(rows, list) or not all(isinstance(r, dict) and "name" in r for r in rows):
            raise ConfigError(f"{path}: 'plan' must be a list of tables, each with its name, kind and shards")
        return {r["name"]: _from_cubic(path, r) for r in rows}
    if isinstance(raw, dict):
        if raw and all(isinstance(v, dict) and not _is_sharding(v) for v in raw.values()):  # under module paths
            raw = {k: v for module in raw.values() for k, v in module.items()}
        out = {}
        for key, ps in raw.items():
            if not _is_sharding(ps):
                raise ConfigError(f"{path}: {key!r} is no parameter sharding (sharding_type, ranks, sharding_spec)")
            m = re.fullmatch(r"(?:.*\.)?embedding_bags\.(.+)\.weight", key)
            out[m.group(1) if m else key] = _from_torchrec(path, key, ps)
        return out
    raise ConfigError(f"{path}: not a plan: expected cubic export's torchrec JSON, TorchRec's per-parameter "
                      "shardings or cubic's plan list")


def _is_sharding(v: Any) -> bool:
    return isinstance(v, dict) and "sharding_type" in v


def _ints(path: str, name: str, key: str, v: Any) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"{path}: table {name}: {key} must be a list of integers (got {v!r})")
    return v


def _from_placement(path: str, name: str, p: Any):
    """cubic export's placement: a sharding_plan generator's arguments."""
    if not _is_sharding(p):
        raise ConfigError(f"{path}: table {name}: a placement needs its sharding_type")

    def read(i: int, t, cfg: TrialConfig) -> tuple[str, list[Shard]]:
        kind = p["sharding_type"]
        if kind == "table_wise":
            return kind, [Shard(i, _rank(path, name, p.get("rank")), 0, t.rows, 0, t.dim)]
        if kind in ("column_wise", "table_column_wise"):
            ranks = _ints(path, name, "ranks", p.get("ranks"))
            widths = _ints(path, name, "size_per_rank", p.get("size_per_rank", [t.dim // max(1, len(ranks))]
                                                                               * len(ranks)))
            edges = [0, *_cumsum(widths)]
            return kind, [Shard(i, r, 0, t.rows, a, b) for r, a, b in zip(ranks, edges, edges[1:], strict=False)]
        if kind in ("row_wise", "table_row_wise"):
            ranks = _ints(path, name, "ranks", p.get("ranks"))
            per = p.get("rows_per_rank") or [math.ceil(t.rows / max(1, len(ranks)))] * len(ranks)
            edges = [min(t.rows, e) for e in (0, *_cumsum(_ints(path, name, "rows_per_rank", per)))]
            return kind, [Shard(i, r, a, b, 0, t.dim) for r, a, b in zip(ranks, edges, edges[1:], strict=False)
                          if b > a]
        return kind, []
    return read


def _from_torchrec(path: str, name: str, ps: dict):
    """TorchRec's ParameterSharding: each shard's offsets, sizes and placement."""
    def read(i: int, t, cfg: TrialConfig) -> tuple[str, list[Shard]]:
        spec = ps.get("sharding_spec") or []
        if isinstance(spec, dict):
            spec = spec.get("shards", [])
        shards = []
        for m in spec:
            if not isinstance(m, dict):
                raise ConfigError(f"{path}: table {name}: each shard needs shard_offsets, shard_sizes, placement")
            off = _ints(path, name, "shard_offsets", m.get("shard_offsets"))
            size = _ints(path, name, "shard_sizes", m.get("shard_sizes"))
            rank = re.match(r"rank:(\d+)", str(m.get("placement", "")))
            if len(off) != 2 or len(size) != 2 or rank is None:
                raise ConfigError(f"{path}: table {name}: a shard needs shard_offsets [row, col], shard_sizes "
                                  "[rows, cols] and placement 'rank:R/...'")
            shards.append(Shard(i, int(rank.group(1)), off[0], off[0] + size[0], off[1], off[1] + size[1]))
        if not shards and ps["sharding_type"] == "table_wise":
            shards = [Shard(i, _rank(path, name, (ps.get("ranks") or [None])[0]), 0, t.rows, 0, t.dim)]
        return ps["sharding_type"], shards
    return read


def _from_cubic(path: str, r: dict):
    def read(i: int, t, cfg: TrialConfig) -> tuple[str, list[Shard]]:
        try:
            return r.get("kind"), [Shard(i, int(s["rank"]), int(s["row_start"]), int(s["row_end"]),
                                         int(s["col_start"]), int(s["col_end"])) for s in r.get("shards", [])]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: table {t.name}: each shard needs rank, row_start, row_end, col_start, "
                              "col_end") from None
    return read


def _rank(path: str, name: str, r: Any) -> int:
    if not isinstance(r, int) or isinstance(r, bool):
        raise ConfigError(f"{path}: table {name}: table_wise needs its rank (got {r!r})")
    return r


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out


def _check_shards(path: str, t, kind: str, shards: list[Shard], G: int) -> None:
    """Every shard on a rank of the group, inside the table, and the table covered exactly once."""
    if kind == "data_parallel":
        return
    if not shards:
        raise ConfigError(f"{path}: table {t.name}: {kind} with no shards")
    for s in shards:
        if not 0 <= s.rank < G:
            raise ConfigError(f"{path}: table {t.name}: a shard on rank {s.rank}; the sharding group has ranks "
                              f"0..{G - 1}")
        if not (0 <= s.row_start < s.row_end <= t.rows and 0 <= s.col_start < s.col_end <= t.dim):
            raise ConfigError(f"{path}: table {t.name}: shard rows [{s.row_start}, {s.row_end}) x columns "
                              f"[{s.col_start}, {s.col_end}) lies outside its {t.rows} x {t.dim}")
    area = sum(s.rows * s.dim for s in shards)
    overlap = any(_overlaps(a, b) for k, a in enumerate(shards) for b in shards[k + 1:]) if len(shards) < 512 \
        else False
    if area != t.rows * t.dim or overlap:
        raise ConfigError(f"{path}: table {t.name}: its shards cover {area:,} of its {t.rows * t.dim:,} cells"
                          + (" and overlap" if overlap else "") + ": each row and column must be placed once")


def _overlaps(a: Shard, b: Shard) -> bool:
    return a.row_start < b.row_end and b.row_start < a.row_end and a.col_start < b.col_end and b.col_start < a.col_end
