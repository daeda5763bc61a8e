"""Synthetic DLRM batches: deterministic, counter-based, with teacher labels.

Every value is a hash of (seed, global sample number g, field), where step s
of a global batch GB = W*B gives rank r the samples g = s*GB + r*B + [0, B)
(modulo the workload's sample_cycle). A sample therefore depends neither on how the global
batch is split across ranks (one process training batch W*B sees exactly the
samples of W ranks: the sharding tests' reference is exact) nor on the batch
size: N samples into training, every configuration has seen the same samples,
which is what the tuner's quality gate compares normalized entropy over.

Labels come from a fixed random "teacher" (a linear function of the dense
features plus a hashed per-id weight of every looked-up row), so the loss
really falls and normalized entropy measures quality.

Ids come from the workload's `id_source`: `synthetic` draws each table's `pooling` ids a bag from its
`id_dist`; `profile` draws each bag's length and ids from the table's profile of a data sample
(harness/ids.py); `trace` replays the sample's own rows, sample g taking trace sample g mod N (the last
eighth of the trace is the held-out set). Either way a sample is a function of its number alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cubic_harness.ids import draw_lengths, draw_ranks, rows_of_ranks
from cubic_harness.workload import TableSpec, Workload

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
# splitmix64's constants and the hash chain's first state (`cubic_harness.synthetic` computes the same)
GOLDEN, MIX1, MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
CHAIN_START = np.uint64(0x243F6A8885A308D3)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-mixed counter-based hash (uint64 -> uint64)."""
    with np.errstate(over="ignore"):
        x = x + GOLDEN
        x = (x ^ (x >> np.uint64(30))) * MIX1
        x = (x ^ (x >> np.uint64(27))) * MIX2
        return x ^ (x >> np.uint64(31))


def _uniform(*keys: np.ndarray | int) -> np.ndarray:
    """Uniform [0,1) floats from a tuple of integer keys (broadcast)."""
    h = CHAIN_START
    for k in keys:
        h = _splitmix(np.asarray(k, dtype=np.uint64) ^ h)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def id_scores(seed: int, table: int, rows: np.ndarray) -> np.ndarray:
    """A weighted feature's per-id scores (TorchRec's id-score lists), fp32 in [0.5, 1.5): a hash of (seed, table,
    row), so a row always carries the same score. The teacher's labels ignore scores, so a fixed score per row
    only rescales what the row learns and held-out NE stays comparable with the same model unweighted; the
    lookups, the 4-byte score per id in the input all-to-all and the weighted kernels are what is measured."""
    return (0.5 + _uniform(seed, 11, table, rows.astype(np.uint64))).astype(np.float32)


UNIFORM, ZIPF_LOG, ZIPF_POW = 0, 1, 2  # how a synthetic table's ids are drawn (`_id_law`)


def _id_law(t: TableSpec) -> tuple[int, float, float]:
    """How a synthetic table draws an id from a uniform u: (kind, scale, exponent) of `_draw_ids`.
    Zipf(alpha) over ranks 1..rows inverts the continuous power-law CDF: rank = exp(u * scale) at
    alpha 1 (scale = log(rows + 1)), else (scale * u + 1) ** exponent."""
    if t.id_dist == "uniform":
        return UNIFORM, 0.0, 0.0
    a, n = t.zipf_alpha, float(t.rows)
    if abs(a - 1.0) < 1e-9:
        return ZIPF_LOG, float(np.log(n + 1.0)), 0.0
    return ZIPF_POW, (n + 1.0) ** (1.0 - a) - 1.0, 1.0 / (1.0 - a)


def _draw_ids(t: TableSpec, u: np.ndarray) -> np.ndarray:
    """The id rule in numpy (`synthetic.table_bags` computes it compiled, bit for bit): a uniform table
    scales u; a Zipf one inverts the power law, then scatters ranks over rows so hot rows are not all at
    the front."""
    kind, scale, exponent = _id_law(t)
    if kind == UNIFORM:
        return np.minimum((u * t.rows).astype(np.int64), t.rows - 1)
    rank = np.exp(u * scale) if kind == ZIPF_LOG else (scale * u + 1.0) ** exponent
    rank = np.clip(rank.astype(np.int64) - 1, 0, t.rows - 1)
    return (rank * 2654435761 + 12345) % t.rows


def _synthetic_bags(t: TableSpec, seed: int, ti: int, g: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Table `ti`'s ids for samples `g` (`pooling` a bag, sample-major) and each bag's sum of the teacher's
    row weights: `_draw_ids` of `_uniform(seed, g, 10_000 + ti, position)` and `_uniform(seed, 99 + ti, id)`
    * 2 - 1. Compiled (`cubic_harness.synthetic`, 0.72x numpy's time a batch) where numba is loaded already,
    as in every rank forked from the preloaded server; a process without it draws in numpy (the sums then
    None), since importing numba (~1 s) costs a short trial more than its few batches save."""
    if "numba" not in sys.modules:
        u = _uniform(seed, g[:, None], 10_000 + ti, np.arange(t.pooling, dtype=np.uint64)[None, :])
        return _draw_ids(t, u).reshape(-1), None
    from cubic_harness.synthetic import table_bags

    ids, bag_w = np.empty(g.size * t.pooling, np.int64), np.empty(g.size)
    kind, scale, exponent = _id_law(t)
    table_bags(np.uint64(seed), g, np.uint64(10_000 + ti), np.uint64(99 + ti), int(t.pooling), int(t.rows),
               kind, float(scale), float(exponent), ids, bag_w)
    return ids, bag_w


def _profiled_bags(t: TableSpec, seed: int, ti: int, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bag lengths and rows drawn from the table's profile: one length per feature of the table (a sample
    brings one bag per feature; the harness pools them as one), then each id's popularity rank."""
    p = t.profile
    nf = len(t.feature_names)
    u_len = _uniform(seed, g[:, None], 20_000 + ti, np.arange(nf, dtype=np.uint64)[None, :])
    lens = draw_lengths(p, u_len.reshape(-1)).reshape(-1, nf).sum(axis=1)
    bag = np.repeat(np.arange(g.size), lens)
    pos = np.arange(bag.size) - np.repeat(np.cumsum(lens) - lens, lens)
    u = _uniform(seed, g[bag], 10_000 + ti, pos.astype(np.uint64))
    return lens, rows_of_ranks(p, draw_ranks(p, u), t.rows)


@dataclass(frozen=True)
class _TraceTable:
    """One table's replayed rows: per-sample bag lengths (a sample's features pooled) and their rows."""

    lengths: np.ndarray
    starts: np.ndarray
    rows: np.ndarray
    scores: np.ndarray | None = None  # the data's score per row entry (a weighted table's, where it had them)

    @property
    def train(self) -> int:
        n = self.lengths.size
        return n - n // 8 if n >= 16 else n

    def bags(self, idx: np.ndarray, held_out: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(lengths, rows, the data's scores or None) of samples `idx`."""
        n_eval = max(1, self.lengths.size - self.train)
        k = (self.train + idx % n_eval) if held_out and self.lengths.size >= 16 else idx % self.train
        lens = self.lengths[k]
        at = np.repeat(self.starts[k], lens) + np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
        return lens, self.rows[at], None if self.scores is None else self.scores[at]


_TRACES: dict[tuple[str, str], list[_TraceTable]] = {}


def _trace(wl: Workload) -> list[_TraceTable]:
    """The workload's trace, loaded once per process (every batch of every step reads it)."""
    from cubic_harness.profile import load_trace

    key = (wl.data.trace, wl.data.trace_sha256)
    if key not in _TRACES:
        tables = []
        for t, (lens, rows, scores) in zip(wl.tables, load_trace(Path(wl.data.trace), wl.num_tables), strict=True):
            lens = lens.astype(np.int64).reshape(-1, len(t.feature_names)).sum(axis=1)
            tables.append(_TraceTable(lens, np.cumsum(lens) - lens, rows.astype(np.int64) % t.rows,
                                      scores if t.weighted else None))
        _TRACES[key] = tables
    return _TRACES[key]


@dataclass
class Batch:
    """One rank's local batch. ids/offsets use the kernel layout (table-major, T*B+1)."""

    dense: torch.Tensor  # [B, dense_features] fp32
    ids: torch.Tensor  # [sum of lengths] int64
    offsets: torch.Tensor  # [T*B + 1] int64
    labels: torch.Tensor  # [B] fp32
    # [sum of lengths] fp32, beside `ids`, when the workload has weighted tables: their ids' scores (a replayed
    # trace's own where the data had them, else `id_scores`), 1.0 for the others' ids (weights come for every
    # id or none, as in a KeyedJaggedTensor)
    scores: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    def to(self, device: torch.device) -> Batch:
        return Batch(*(x.to(device, non_blocking=True) for x in (self.dense, self.ids, self.offsets, self.labels)),
                     scores=None if self.scores is None else self.scores.to(device, non_blocking=True))


def make_batch(wl: Workload, seed: int, first_sample: int, batch_size: int, held_out: bool = False) -> Batch:
    """Global samples [first_sample, first_sample + batch_size) (modulo `wl.sample_cycle`). `held_out`:
    the evaluation set instead, numbered past the training cycle (never trained on: training samples
    are numbered below it), drawn and labelled by the same teacher."""
    idx = first_sample + np.arange(batch_size, dtype=np.int64)
    g = (wl.sample_cycle + idx if held_out else idx % wl.sample_cycle).astype(np.uint64)
    s = g[:, None]
    dense = _uniform(seed, s, 1_000 + np.arange(wl.dense_features, dtype=np.uint64))
    teacher_w = _uniform(seed, 7, np.arange(wl.dense_features, dtype=np.uint64)) * 2 - 1
    logit = (dense - 0.5) @ teacher_w * (6.0 / np.sqrt(max(wl.dense_features, 1)))  # none: no dense signal
    ids_per_table, lengths, data_scores = [], [], []
    scale = wl.teacher_emb_scale / np.sqrt(wl.num_tables)
    trace = _trace(wl) if wl.id_source == "trace" else None
    for ti, t in enumerate(wl.tables):
        sc = bag_w = None
        if trace is not None:
            lens, ids, sc = trace[ti].bags(idx, held_out)
        elif wl.id_source == "profile":
            lens, ids = _profiled_bags(t, seed, ti, g)
        else:
            ids, bag_w = _synthetic_bags(t, seed, ti, g)  # [B * pooling], [B]
            lens = np.full(batch_size, t.pooling, dtype=np.int64)
        ids_per_table.append(ids)
        lengths.append(lens)
        data_scores.append(sc)
        if ids.size:  # the teacher reads each bag's mean row weight (an empty bag: 0)
            if bag_w is None:
                row_w = _uniform(seed, 99 + ti, ids.astype(np.uint64)) * 2 - 1
                bag_w = np.bincount(np.repeat(np.arange(batch_size), lens), row_w, minlength=batch_size)
            logit += bag_w / np.maximum(lens, 1) * scale
    noise = _uniform(seed, g, 5)
    labels = (noise < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
    scores = None
    if wl.weighted:
        scores = torch.from_numpy(np.concatenate([
            np.ones(ids.size, np.float32) if not t.weighted else sc if sc is not None else id_scores(seed, ti, ids)
            for ti, (t, ids, sc) in enumerate(zip(wl.tables, ids_per_table, data_scores, strict=True))]))
    return Batch(
        dense=torch.from_numpy(dense.astype(np.float32)),
        ids=torch.from_numpy(np.concatenate(ids_per_table).astype(np.int64)),
        offsets=torch.from_numpy(offsets.astype(np.int64)),
        labels=torch.from_numpy(labels),
        scores=scores,
    )


def rank_batches(wl: Workload, seed: int, rank: int, batch_size: int, world: int, steps: int) -> list[Batch]:
    """The local batches of `rank` for `steps` steps; step s uses batches[s % len(batches)].

    When the global batch divides `wl.sample_cycle` the data repeats every sample_cycle / GB steps and
    only that many batches are generated; otherwise every step's batch is.
    """
    gb = batch_size * world
    cyc = wl.sample_cycle
    n = min(steps, cyc // gb) if cyc % gb == 0 else steps
    return [make_batch(wl, seed, s * gb + rank * batch_size, batch_size) for s in range(max(1, n))]


def eval_batches(wl: Workload, seed: int, rank: int, batch_size: int, world: int, samples: int) -> list[Batch]:
    """This rank's share of the first `samples` held-out samples (whole global batches, at least one)."""
    gb = batch_size * world
    return [make_batch(wl, seed, s * gb + rank * batch_size, batch_size, held_out=True)
            for s in range(max(1, -(-samples // gb)))]
