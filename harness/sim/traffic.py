"""The byte formulas of the performance model: what a lookup, an update and an id move, and how many
distinct rows a shard's lookups touch under each id law (uniform, Zipf, a profile). Pure arithmetic
over a workload's tables: the planners' costs (`costs.py`), the step (`step.py`) and the calibration
all price these same bytes."""

from __future__ import annotations

import functools
import math

import numpy as np

from cubic_harness import ids as idstats
from cubic_harness.workload import TableSpec, Workload

STATE_BYTES = {"rowwise_adagrad": 4, "momentum_scaled_rowwise_adagrad": 4, "sgd": 0}
ID_BYTES = 8
SCORE_BYTES = 4  # beside every id when a table is weighted (harness/data.py Batch.scores)


def rows_touched(t: TableSpec, rows: int, frac: float, draws: float, profiled: bool) -> float:
    """The distinct rows `draws` lookups touch in a shard of `rows` rows holding `frac` of t's
    lookups: hot rows are touched again, not new ones, as a profile repeats them or as Zipf ids do
    (their ranks scattered over the rows, so a shard holds its share of every rank); uniform ids,
    the birthday count. One shard of `rows_touched_many`."""
    return float(rows_touched_many([t], np.zeros(1, dtype=np.int64), np.array([rows]),
                                   np.array([frac]), np.array([draws / max(frac, 1e-12)]),
                                   profiled)[0])


def rows_touched_many(tables: list[TableSpec], table: np.ndarray, rows: np.ndarray,
                      frac: np.ndarray, table_draws: np.ndarray, profiled: bool) -> np.ndarray:
    """`rows_touched` of many shards at once (shard i of table `tables[table[i]]` holds `frac[i]` of
    its lookups, of which the table draws `table_draws[i]`): the expected distinct count is taken
    once per id law (one profile, or one Zipf law over as many rows) and draw count, however many
    shards share them."""
    rows = np.asarray(rows, dtype=np.float64)
    draws = table_draws * frac
    out = rows * -np.expm1(-draws / np.maximum(1, rows))  # uniform ids: the birthday count
    laws: dict[object, list[int]] = {}
    for i in np.unique(table):
        t = tables[i]
        law = (id(t.profile) if profiled and t.profile
               else (t.rows, t.zipf_alpha) if t.id_dist == "zipf" else None)
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
    """Share of Zipf(a) draws on ranks below x, for the law the harness draws
    (`cubic_harness.data`): the continuous power law over ranks [1, rows + 1), each draw floored to
    its rank."""
    x = np.asarray(x, dtype=np.float64)
    if abs(a - 1.0) < 1e-9:
        return np.log(x) / math.log(rows + 1.0)
    return (x ** (1.0 - a) - 1.0) / ((rows + 1.0) ** (1.0 - a) - 1.0)


@functools.lru_cache(maxsize=64)
def _zipf_ranks(rows: int, a: float) -> tuple[np.ndarray, np.ndarray]:
    """The ranks on a grid, as (ranks in each cell, each one's probability): the hottest 1,024 one
    by one, then cells 2% wider each, priced at their mean probability (~1,600 cells at 40M rows).
    Jensen's gap from the mean is under 0.5% of the distinct count on the default task's tables
    (tests/test_sim.py holds it within 3%)."""
    edges = np.arange(1.0, min(rows, 1024) + 2.0)
    if rows > 1024:
        cells = int(math.log((rows + 1) / 1025) / math.log(1.02)) + 2
        tail = np.unique(np.floor(np.geomspace(1025.0, rows + 1.0, cells)))
        edges = np.concatenate([edges, tail[tail > edges[-1]]])
    counts = np.diff(edges)
    return counts, np.diff(zipf_cdf(edges, rows, a)) / counts


def id_bytes(wl: Workload) -> float:
    """Bytes one id moves in an input all-to-all or a union's all-gather: the id, and its score when
    weighted."""
    return ID_BYTES + SCORE_BYTES * wl.weighted


def lookup_bytes(ids: float, bags: float, dim: int, wbytes: int) -> float:
    """Forward: every id's row read, every bag's pooled row written (fp32)."""
    return ids * dim * wbytes + bags * dim * 4


def update_bytes(ids: float, bags: float, dim: int, wbytes: int, state_bytes: int) -> float:
    """Backward+optimizer: every id's row and its state read and written, every bag's gradient read.
    """
    return ids * (2 * dim * wbytes + 2 * state_bytes) + bags * dim * 4


def hit_rate(cache_rows: float, rows: int, t: TableSpec, profiled: bool = False) -> float:
    """Share of lookups a cache of the hottest `cache_rows` rows serves: uniform ids c / n;
    Zipf(alpha) ids the hottest ranks' share of the law the harness draws (`zipf_cdf`); ids that
    follow a data sample, the sample's hottest rows' measured share."""
    if cache_rows >= rows:
        return 1.0
    if cache_rows < 1:
        return 0.0
    if profiled and t.profile:
        return idstats.hit_rate(t.profile, cache_rows)
    if t.id_dist != "zipf":
        return cache_rows / rows
    return float(zipf_cdf(math.floor(cache_rows) + 1.0, rows, t.zipf_alpha))
