"""What a sample of real traffic says about one table's ids, and ids drawn to behave like it.

Embedding performance is decided by the id distribution, not the table's shape: which rank holds the
hot rows (load imbalance), how many of a batch's ids are repeats (what a dedup, a cache or a sparse
sync really moves), how long the bags are and how they vary. `IdProfile` keeps those facts for one
table in a few hundred numbers (readable in the workload file), and three functions use them:

1. `draw_rows(p, rows, u_rank, u_len)`: ids for a synthetic batch. A uniform u becomes a popularity
   rank by inverting the profile's rank -> cumulative-share curve (knots at log-spaced ranks,
   log-linear between them: exact at the head, a local power law in the tail), and a rank becomes a
   row: the hottest ranks are the sample's own hottest rows (so a row-wise shard that held the hot
   rows in the data holds them here), the tail is spread over contiguous row blocks in proportion to
   the sample's lookups per block.
2. `expected_distinct(p, n)`: E[distinct ids among n draws] = sum over ranks of 1 - (1 - p_r)^n,
   the in-batch dedup the simulator prices (and the check that generated ids repeat as the data does).
3. `share_of_rows(p, start, stop, rows)` and `hit_rate(p, cache_rows)`: a row shard's share of the
   lookups, and the share a cache of the hottest rows serves.

Bag lengths are drawn from the profiled histogram by inverse CDF, so a trial's offsets vary as the
data's do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cubic_harness.errors import ConfigError

#: Knots of the rank curve, hot rows kept by name, and contiguous row blocks: enough to reproduce a
#: 40M-row table's skew and placement within a few percent, few enough to read in the workload file.
RANK_KNOTS = 48
HOT_ROWS = 256
ROW_BLOCKS = 64
_SCATTER = 2654435761  # Knuth's multiplicative hash: spreads consecutive ranks over a block's rows


@dataclass(frozen=True)
class IdProfile:
    """One table's ids in a data sample (all counts over the sample; ids hashed into the table's rows)."""

    samples: int  # bags profiled (data rows; a table fed by several features has one bag per feature)
    lookups: int  # ids looked up
    distinct: int  # distinct rows among them
    bag_mean: float
    bag_p50: int
    bag_p95: int
    bag_max: int
    bag_lengths: list[int]  # the bag-length histogram a generator draws from: lengths ...
    bag_probs: list[float]  # ... and their probabilities
    top1_share: float  # share of lookups taken by the hottest 1% of the distinct ids
    top10_share: float
    zipf_alpha: float  # least-squares slope of log(count) over log(rank), negated
    zipf_fit_err: float  # RMS residual of that fit, in log10(count): 0.05 is a good power law
    reuse: dict[int, float]  # batch size -> mean times a distinct id repeats within one batch
    rank_cdf: list[tuple[int, float]]  # (rank, share of lookups taken by ranks 1..rank), last = (distinct, 1)
    hot_rows: list[int]  # the hottest rows, hottest first
    block_share: list[float] = field(default_factory=list)  # share of lookups in each equal row block

    # ------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["reuse"] = {str(k): v for k, v in sorted(self.reuse.items())}
        d["rank_cdf"] = [[int(r), float(c)] for r, c in self.rank_cdf]
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> IdProfile:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: profile must be a mapping of {sorted(names)}")
        unknown, missing = sorted(set(d) - names, key=str), sorted(names - set(d) - {"block_share"})
        if unknown or missing:
            raise ConfigError(f"{where}: profile {'unknown' if unknown else 'missing'} key "
                              f"{(unknown or missing)[0]!r}; a profile has {sorted(names)}")
        try:
            p = cls(**{**d, "reuse": {int(k): float(v) for k, v in d["reuse"].items()},
                       "rank_cdf": [(int(r), float(c)) for r, c in d["rank_cdf"]],
                       "hot_rows": [int(r) for r in d["hot_rows"]],
                       "bag_lengths": [int(x) for x in d["bag_lengths"]],
                       "bag_probs": [float(x) for x in d["bag_probs"]],
                       "block_share": [float(x) for x in d.get("block_share", [])]})
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{where}: profile is malformed ({e})") from None
        return p.validate(where)

    def validate(self, where: str) -> IdProfile:
        if not self.rank_cdf or self.rank_cdf[-1][0] != self.distinct or abs(self.rank_cdf[-1][1] - 1) > 1e-6:
            raise ConfigError(f"{where}: profile rank_cdf must end at [distinct={self.distinct}, 1.0]")
        ranks = [r for r, _ in self.rank_cdf]
        if ranks[0] < 1 or any(b <= a for a, b in zip(ranks, ranks[1:], strict=False)):
            raise ConfigError(f"{where}: profile rank_cdf ranks must rise from 1")
        if len(self.bag_lengths) != len(self.bag_probs) or not self.bag_lengths or min(self.bag_lengths) < 0:
            raise ConfigError(f"{where}: profile bag_lengths and bag_probs must be equally long, lengths >= 0")
        return self

    # ------------------------------------------------------------------ derived
    def _curve(self) -> tuple[np.ndarray, np.ndarray]:
        r = np.array([0] + [r for r, _ in self.rank_cdf], dtype=np.float64)
        c = np.array([0.0] + [c for _, c in self.rank_cdf], dtype=np.float64)
        return r, np.maximum.accumulate(c)

    def mass_grid(self, sub: int = 16) -> tuple[np.ndarray, np.ndarray]:
        """(ranks per cell, probability of one rank in the cell): the curve cut into cells of equal
        per-rank probability (each knot interval into `sub` geometric cells), for sums over ranks.
        Kept on the (frozen) profile: the simulator asks it for every shard of every trial."""
        cache = self.__dict__.setdefault("_grids", {})
        if sub not in cache:
            cache[sub] = self._mass_grid(sub)
        return cache[sub]

    def _mass_grid(self, sub: int) -> tuple[np.ndarray, np.ndarray]:
        r, c = self._curve()
        counts, probs = [1.0], [c[1]]
        for k in range(1, len(r) - 1):
            lo, hi, mass = r[k], r[k + 1], c[k + 1] - c[k]
            if hi - lo <= sub:  # few ranks: one cell each, mass split log-linearly
                edges = np.arange(lo, hi + 1)
            else:
                edges = np.unique(np.round(np.geomspace(lo, hi, sub + 1)))
            share = np.diff(np.log(edges)) / math.log(hi / lo)
            counts.extend(np.diff(edges))
            probs.extend(mass * share / np.diff(edges))
        return np.asarray(counts), np.asarray(probs)


# ---------------------------------------------------------------------- building a profile
def profile_ids(lengths: np.ndarray, rows_hit: np.ndarray, rows: int, batch_sizes: tuple[int, ...] = (),
                bags_per_sample: int = 1) -> IdProfile:
    """The profile of one table from its bags: `lengths` (one per bag, in data order) and `rows_hit`
    (the ids already hashed into [0, rows), concatenated in bag order). `reuse` is measured over
    consecutive batches of each size (a batch of B samples holds B x bags_per_sample bags)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows_hit = np.asarray(rows_hit, dtype=np.int64)
    n = int(rows_hit.size)
    uniq, counts = np.unique(rows_hit, return_counts=True)
    order = np.argsort(-counts, kind="stable")
    sorted_counts = counts[order]
    distinct = int(uniq.size)
    cum = np.cumsum(sorted_counts) / max(n, 1)
    knots = np.unique(np.round(np.geomspace(1, max(distinct, 1), RANK_KNOTS)).astype(np.int64))
    rank_cdf = [(int(k), float(cum[k - 1])) for k in knots] if distinct else [(1, 1.0)]
    if distinct:
        rank_cdf[-1] = (distinct, 1.0)

    def top(frac: float) -> float:
        return float(cum[max(1, math.ceil(distinct * frac)) - 1]) if distinct else 0.0

    alpha, err = _zipf_fit(sorted_counts)
    vals, cnt = np.unique(lengths, return_counts=True)
    if vals.size > 64:  # many lengths: 64 quantile bins keep the shape and the mean within a bin's width
        qs = np.unique(np.quantile(lengths, np.linspace(0, 1, 65), method="inverted_cdf").astype(np.int64))
        idx = np.searchsorted(qs, lengths, side="left").clip(0, qs.size - 1)
        cnt = np.bincount(idx, minlength=qs.size)
        vals, cnt = qs[cnt > 0], cnt[cnt > 0]
    blocks = np.bincount(np.minimum(rows_hit * ROW_BLOCKS // max(rows, 1), ROW_BLOCKS - 1),
                         minlength=ROW_BLOCKS) / max(n, 1)
    return IdProfile(
        samples=int(lengths.size), lookups=n, distinct=distinct,
        bag_mean=float(lengths.mean()) if lengths.size else 0.0,
        bag_p50=int(np.percentile(lengths, 50, method="inverted_cdf")) if lengths.size else 0,
        bag_p95=int(np.percentile(lengths, 95, method="inverted_cdf")) if lengths.size else 0,
        bag_max=int(lengths.max()) if lengths.size else 0,
        bag_lengths=[int(v) for v in vals] or [0], bag_probs=[float(x) for x in cnt / max(cnt.sum(), 1)] or [1.0],
        top1_share=top(0.01), top10_share=top(0.10), zipf_alpha=alpha, zipf_fit_err=err,
        reuse={b: measured_reuse(lengths, rows_hit, b * bags_per_sample) for b in batch_sizes},
        rank_cdf=rank_cdf, hot_rows=[int(x) for x in uniq[order[:HOT_ROWS]]],
        block_share=[round(float(x), 6) for x in blocks])


def measured_reuse(lengths: np.ndarray, rows_hit: np.ndarray, bags: int) -> float:
    """Mean over consecutive batches of `bags` bags of lookups / distinct ids (1.0: no id repeats). A sample
    shorter than one batch counts as one batch."""
    if rows_hit.size == 0:
        return 1.0
    ends = np.cumsum(lengths)[bags - 1::bags] if lengths.size >= bags else np.array([rows_hit.size])
    starts = np.concatenate([[0], ends[:-1]])
    ratios = [(e - s) / np.unique(rows_hit[s:e]).size for s, e in zip(starts, ends, strict=True) if e > s]
    return float(np.mean(ratios)) if ratios else 1.0


def _zipf_fit(sorted_counts: np.ndarray) -> tuple[float, float]:
    """Slope of log10(count) on log10(rank) over log-spaced ranks (each decade weighs the same, not the
    millions of tail ranks), and the fit's RMS residual."""
    d = sorted_counts.size
    if d < 3:
        return 0.0, 0.0
    ranks = np.unique(np.round(np.geomspace(1, d, min(d, 200))).astype(np.int64))
    x, y = np.log10(ranks), np.log10(sorted_counts[ranks - 1])
    slope, icpt = np.polyfit(x, y, 1)
    return round(float(-slope), 4), round(float(np.sqrt(np.mean((y - (slope * x + icpt)) ** 2))), 4)


# ---------------------------------------------------------------------- drawing ids like it
def draw_ranks(p: IdProfile, u: np.ndarray) -> np.ndarray:
    """0-based popularity ranks for uniforms u in [0, 1): inverse of the rank curve, log-linear between knots."""
    r, c = p._curve()
    k = np.clip(np.searchsorted(c, u, side="right") - 1, 0, len(c) - 2)  # c[k] <= u < c[k+1]
    lo, hi = r[k], r[k + 1]
    width = np.maximum(c[k + 1] - c[k], 1e-300)
    frac = np.clip((u - c[k]) / width, 0.0, 1.0)
    safe_lo = np.maximum(lo, 1.0)
    x = np.where(lo < 1, frac * hi, np.exp(np.log(safe_lo) + frac * (np.log(hi) - np.log(safe_lo))))
    return np.clip(np.floor(x).astype(np.int64), lo.astype(np.int64), hi.astype(np.int64) - 1)


def rows_of_ranks(p: IdProfile, ranks: np.ndarray, rows: int) -> np.ndarray:
    """The row of each popularity rank: the sample's own hottest rows first, then the tail spread over
    contiguous row blocks by the sample's share of lookups per block (a rank keeps its row: same rank,
    same row, so repeats stay repeats)."""
    hot = np.asarray(p.hot_rows, dtype=np.int64) % rows
    out = np.empty(ranks.shape, dtype=np.int64)
    is_hot = ranks < hot.size
    out[is_hot] = hot[ranks[is_hot]]
    tail = ranks[~is_hot].astype(np.uint64)
    share = np.asarray(p.block_share or [1.0], dtype=np.float64)
    nb = share.size
    cdf = np.cumsum(share) / share.sum()
    with np.errstate(over="ignore"):
        h = (tail * np.uint64(_SCATTER) + np.uint64(12345)) & np.uint64(0xFFFFFFFF)
    block = np.minimum(np.searchsorted(cdf, h.astype(np.float64) / 2**32, side="right"), nb - 1)
    start = block * rows // nb
    length = np.maximum((block + 1) * rows // nb - start, 1)
    with np.errstate(over="ignore"):
        h2 = (tail * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(11)
    out[~is_hot] = start + (h2 % length.astype(np.uint64)).astype(np.int64)
    return out


def draw_lengths(p: IdProfile, u: np.ndarray) -> np.ndarray:
    """Bag lengths for uniforms u by inverse CDF of the profiled histogram."""
    cdf = np.cumsum(p.bag_probs)
    idx = np.minimum(np.searchsorted(cdf / cdf[-1], u, side="right"), len(p.bag_lengths) - 1)
    return np.asarray(p.bag_lengths, dtype=np.int64)[idx]


# ---------------------------------------------------------------------- what the simulator asks
def expected_distinct(p: IdProfile, n: float) -> float:
    """E[distinct ids among n independent draws]: sum over ranks of 1 - (1 - p_r)^n."""
    if n <= 0:
        return 0.0
    counts, probs = p.mass_grid()
    return float(np.sum(counts * -np.expm1(n * np.log1p(-np.minimum(probs, 1 - 1e-15)))))


def expected_distinct_many(p: IdProfile, n: np.ndarray) -> np.ndarray:
    """`expected_distinct` of many draw counts at once (every shard of a table)."""
    counts, probs = p.mass_grid()
    return distinct_on_grid(counts, probs, n)


def distinct_on_grid(counts: np.ndarray, probs: np.ndarray, n: np.ndarray) -> np.ndarray:
    n = np.asarray(n, dtype=np.float64)
    out = np.zeros(n.shape)
    pos = n > 0
    if pos.any():
        logq = np.log1p(-np.minimum(probs, 1 - 1e-15))
        out[pos] = (counts * -np.expm1(n[pos, None] * logq)).sum(axis=1)
    return out


def hit_rate(p: IdProfile, cache_rows: float) -> float:
    """Share of lookups that a cache of the `cache_rows` hottest rows serves: the rank curve at that rank."""
    if cache_rows <= 0:
        return 0.0
    r, c = p._curve()
    if cache_rows >= r[-1]:
        return 1.0
    k = int(np.searchsorted(r, cache_rows, side="right") - 1)
    lo, hi = max(r[k], 1.0), r[k + 1]
    if r[k] < 1:
        return float(c[1] * min(cache_rows, 1.0))
    return float(c[k] + (c[k + 1] - c[k]) * math.log(cache_rows / lo) / math.log(hi / lo))


def share_of_rows(p: IdProfile, start: int, stop: int, rows: int) -> float:
    """Share of the table's lookups that fall on rows [start, stop): the profiled row blocks, uniform
    inside each block (a row-wise shard holding the hot block is the busy one)."""
    cum = _block_cdf(p)
    if cum is None:
        return (stop - start) / rows
    return _cdf_at(cum, stop, rows) - _cdf_at(cum, start, rows)


def shares_of_rows(p: IdProfile, starts: np.ndarray, stops: np.ndarray, rows: int) -> np.ndarray:
    """`share_of_rows` of many row ranges at once (a row-wise table's blocks)."""
    cum = _block_cdf(p)
    if cum is None:
        return (stops - starts) / rows
    return _cdf_many(cum, stops, rows) - _cdf_many(cum, starts, rows)


def _cdf_many(cum: np.ndarray, x: np.ndarray, rows: int) -> np.ndarray:
    nb = cum.size - 1
    pos = np.clip(np.asarray(x, dtype=np.float64), 0, rows) * nb / rows
    k = np.minimum(pos.astype(np.int64), nb - 1)
    return cum[k] + (cum[k + 1] - cum[k]) * (pos - k)


def _block_cdf(p: IdProfile) -> np.ndarray | None:
    """The row blocks' cumulative share (0 first), kept on the profile: asked for every shard."""
    cache = p.__dict__
    if "_block_cdf" not in cache:
        share = np.asarray(p.block_share, dtype=np.float64)
        ok = share.size > 0 and share.sum() > 0
        cache["_block_cdf"] = np.concatenate([[0.0], np.cumsum(share / share.sum())]) if ok else None
    return cache["_block_cdf"]


def _cdf_at(cum: np.ndarray, x: float, rows: int) -> float:
    """Share of lookups on rows [0, x): whole blocks, then x's block pro rata."""
    nb = cum.size - 1
    pos = min(max(x, 0), rows) * nb / rows
    k = min(int(pos), nb - 1)
    return float(cum[k] + (cum[k + 1] - cum[k]) * (pos - k))
