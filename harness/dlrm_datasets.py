"""Workload presets whose ids repeat as Meta's production embedding traces do (simulated only).

Source: facebookresearch/dlrm_datasets (MIT), `embedding_bag/{2021,2022}/locality_stats.txt`, the first
shard of each year (`fbgemm_t856_bs65536_0.pt`, `fbgemm_t788_bs131072_0.pt`). Each block gives, for one
batch over all tables, the indices looked up, the distinct rows, and two histograms over a row's
reuse in the batch (the times it is looked up, bins (0,1], (1,2], (2,4], ... (32768, inf)): the share of
distinct rows in each bin, and the share of lookups. The files publish no per-table figures, no table
sizes and no widths.

How the preset is built:
1. One rank curve for the batch: bins from the most reused down, bin b holding U_b rows that take
   M_b of the lookups (U_b from the row histogram where its 3 decimals resolve it, else from M_b over
   the bin's geometric-mid reuse).
2. Every table takes every T-th row of that ranking (tables are equal in expectation: the files do not
   tell them apart), so a table's curve is the batch's with ranks divided by T.
3. Poisson thinning: a row of expected reuse 1 is absent from a batch 37% of the time, so drawing a
   batch from the raw histogram shifts it. A few multiplicative corrections of U_b and M_b move the
   drawn batch's expected histograms (`batch_histograms`, Poisson per rank cell) onto the published.
`histogram_distance` is what is left: total variation between published and drawn histograms.

Assumptions (not in the source, stated so a reader can change them): width 128, rows per table 4x the
distinct rows a batch touches, bag lengths one of the two integers around the mean.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy.stats import poisson

from cubic_harness.ids import RANK_KNOTS, IdProfile

BIN_LO = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
LOCALITY = {
    2021: {"file": "fbgemm_t856_bs65536_0.pt", "tables": 856, "batch": 65536, "indices": 468084223,
           "unique": 61644628,
           "row_hist": (0.423, 0.165, 0.167, 0.121, 0.073, 0.031, 0.011, 0.004, 0.002, 0.001, 0.001, 0.0, 0.0, 0.0,
                        0.0, 0.0, 0.0),
           "index_hist": (0.056, 0.043, 0.075, 0.099, 0.112, 0.091, 0.064, 0.052, 0.049, 0.05, 0.054, 0.058, 0.061,
                          0.052, 0.038, 0.026, 0.02)},
    2022: {"file": "fbgemm_t788_bs131072_0.pt", "tables": 788, "batch": 131072, "indices": 1405163864,
           "unique": 110259238,
           "row_hist": (0.342, 0.144, 0.149, 0.138, 0.112, 0.068, 0.029, 0.01, 0.004, 0.002, 0.001, 0.001, 0.0, 0.0,
                        0.0, 0.0, 0.0),
           "index_hist": (0.027, 0.023, 0.04, 0.068, 0.105, 0.12, 0.099, 0.07, 0.059, 0.054, 0.04, 0.072, 0.064,
                          0.047, 0.021, 0.017, 0.076)},
}
DIM = 128
ROWS_PER_DISTINCT = 4


def _mid(b: int) -> float:
    lo = BIN_LO[b]
    return 1.0 if lo == 0 else (math.sqrt(lo * 2 * lo) if b < len(BIN_LO) - 1 else 2.0 * lo)


def _curve(rows_b: np.ndarray, mass_b: np.ndarray, T: int) -> list[tuple[int, float]]:
    """Steps 1-2: one table's rank curve from rows and lookup shares per bin (most reused bin first)."""
    order = np.arange(len(BIN_LO))[::-1]
    ranks = np.cumsum(rows_b[order]) / T
    cum = np.cumsum(mass_b[order]) / mass_b.sum()
    knots = sorted({max(1, round(r)) for r in np.geomspace(1, ranks[-1], RANK_KNOTS)} | {
        max(1, round(r)) for r in ranks})
    out = [(k, float(np.interp(k, np.concatenate([[0], ranks]), np.concatenate([[0], cum])))) for k in knots]
    out[-1] = (out[-1][0], 1.0)
    return out


def _profile(year: int, rows_b: np.ndarray, mass_b: np.ndarray) -> IdProfile:
    s = LOCALITY[year]
    T, n = s["tables"], s["indices"] / s["tables"]
    cdf = _curve(rows_b, mass_b, T)
    mean = s["indices"] / (T * s["batch"])
    lo = math.floor(mean)
    return IdProfile(samples=s["batch"], lookups=round(n), distinct=cdf[-1][0], bag_mean=mean, bag_p50=lo,
                     bag_p95=lo + 1, bag_max=lo + 1, bag_lengths=[lo, lo + 1], bag_probs=[lo + 1 - mean, mean - lo],
                     top1_share=0.0, top10_share=0.0, zipf_alpha=0.0, zipf_fit_err=0.0, reuse={},
                     rank_cdf=cdf, hot_rows=[], block_share=[])


def batch_histograms(p: IdProfile, lookups: float) -> tuple[np.ndarray, np.ndarray]:
    """Expected (row share, lookup share) per reuse bin of one table's batch of `lookups` draws: per rank
    cell, a row's count is Poisson(lookups x p); E[count; count in bin] = lam x P(count - 1 in bin - 1)."""
    counts, probs = p.mass_grid()
    lam = lookups * probs
    hi = np.array([*BIN_LO[1:], np.inf])
    lo = np.array(BIN_LO, dtype=np.float64)
    rows = np.array([np.sum(counts * (poisson.cdf(h, lam) - poisson.cdf(lo_, lam))) for lo_, h in zip(lo, hi,
                                                                                                      strict=True)])
    idx = np.array([np.sum(counts * lam * (poisson.cdf(h - 1, lam) - poisson.cdf(lo_ - 1, lam)))
                    for lo_, h in zip(lo, hi, strict=True)])
    return rows / rows.sum(), idx / idx.sum()


def histogram_distance(year: int, p: IdProfile) -> dict[str, float]:
    """Total variation distance (0 = equal, 1 = disjoint) between the published and the drawn histograms,
    and the drawn batch's distinct share beside the published one."""
    s = LOCALITY[year]
    n = s["indices"] / s["tables"]
    rows, idx = batch_histograms(p, n)
    counts, probs = p.mass_grid()
    distinct = float(np.sum(counts * -np.expm1(-n * probs)))
    return {"rows_tv": round(0.5 * float(np.abs(rows - np.asarray(s["row_hist"])).sum()), 4),
            "lookups_tv": round(0.5 * float(np.abs(idx - np.asarray(s["index_hist"])).sum()), 4),
            "distinct_share_published": round(s["unique"] / s["indices"], 4),
            "distinct_share_drawn": round(distinct / n, 4)}


def fitted_profile(year: int, rounds: int = 12) -> tuple[IdProfile, dict[str, float], dict[str, float]]:
    """Steps 1-3: the table profile of `year`, with the distance before and after the correction."""
    s = LOCALITY[year]
    U, N = s["unique"], s["indices"]
    row_h, idx_h = np.asarray(s["row_hist"]), np.asarray(s["index_hist"])
    rows_b = np.array([row_h[b] * U if row_h[b] >= 0.01 else idx_h[b] * N / _mid(b) for b in range(len(BIN_LO))])
    mass_b = idx_h.copy()
    first = histogram_distance(year, _profile(year, rows_b, mass_b))
    n = N / s["tables"]
    best = (first["rows_tv"] + first["lookups_tv"], rows_b.copy(), mass_b.copy())
    for _ in range(rounds):  # damped and bounded: a bin's rows leak into its neighbours when thinned
        rows, idx = batch_histograms(_profile(year, rows_b, mass_b), n)
        rows_b *= np.clip(((row_h + 1e-3) / (rows + 1e-3)) ** 0.3, 0.8, 1.25)
        mass_b *= np.clip(((idx_h + 1e-3) / (idx + 1e-3)) ** 0.3, 0.8, 1.25)
        d = histogram_distance(year, _profile(year, rows_b, mass_b))
        if d["rows_tv"] + d["lookups_tv"] < best[0]:
            best = (d["rows_tv"] + d["lookups_tv"], rows_b.copy(), mass_b.copy())
    p = _profile(year, best[1], best[2])
    return p, first, histogram_distance(year, p)


def workload_dict(year: int) -> dict:
    """The preset `dlrm-datasets-{year}` as a workload dict (id_source profile: every table the fitted curve)."""
    s = LOCALITY[year]
    p, _, _ = fitted_profile(year)
    rows = p.distinct * ROWS_PER_DISTINCT
    p = dataclasses.replace(p, block_share=[1.0 / 64] * 64)  # hot rows spread over the table (hashed ids)
    tables = [{"name": f"t{i}", "rows": rows, "dim": DIM, "pooling": round(p.bag_mean), "profile": 0}
              for i in range(s["tables"])]
    return {"name": f"dlrm-datasets-{year}", "tables": tables, "profiles": [p.to_dict()], "dense_features": 13,
            "bottom_mlp": [512, 256, DIM], "top_mlp": [1024, 512, 256, 1], "interaction": "dot", "id_source": "profile",
            "data": {"source": f"facebookresearch/dlrm_datasets embedding_bag/{year}/locality_stats.txt "
                               f"({s['file']})", "format": "locality_stats", "sample_rows": s["batch"]}}
