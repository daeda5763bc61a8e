"""The synthetic id source's bags, compiled: `harness/data.py`'s rule, the same floats bit for bit.

Why compiled: a quality run draws a million samples' ids before its first step (512 batches a rank,
each 8 tables x 1024 bags x 20 ids, every id two chained hashes and a power law), and numpy's chain of
array temporaries took 5.7-11 ms a batch: 3-6 s of a quality run's start on 2 CPU ranks. One pass per id
here does the same arithmetic in the same order (the same integer hashes; IEEE float operations one at a
time, libm's `pow` and `exp` as numpy calls them where it has no vector code for them), so a batch is
identical to the numpy statement of the rule (`data._draw_ids`, tests/test_data.py checks every dist).
"""

from __future__ import annotations

import numpy as np

from cubic_harness.data import CHAIN_START, GOLDEN, MIX1, MIX2, ZIPF_LOG, ZIPF_POW
from cubic_kernels.jit import cached_jit


@cached_jit(inline="always")
def _mix(x: np.uint64) -> np.uint64:  # data._splitmix, one value
    x = x + GOLDEN
    x = (x ^ (x >> np.uint64(30))) * MIX1
    x = (x ^ (x >> np.uint64(27))) * MIX2
    return x ^ (x >> np.uint64(31))


@cached_jit(inline="always")
def _unit(h: np.uint64) -> float:  # data._uniform's last step
    return float(h >> np.uint64(11)) * (1.0 / (1 << 53))


@cached_jit()
def table_bags(seed: np.uint64, g: np.ndarray, draw_key: np.uint64, weight_key: np.uint64, pooling: int,
               rows: int, kind: int, scale: float, exponent: float, ids: np.ndarray, bag_w: np.ndarray) -> None:
    """One table's `pooling` ids for each sample number in `g` (into `ids`, sample-major) and the sum of
    the teacher's row weights over each bag (into `bag_w`, summed in id order as numpy's bincount does).

    kind UNIFORM: id = min(int(u * rows), rows - 1); ZIPF_LOG: rank = exp(u * scale) (scale = log(rows + 1));
    ZIPF_POW: rank = (scale * u + 1) ** exponent; a Zipf rank is clipped to [0, rows) and scattered."""
    hs = _mix(seed ^ CHAIN_START)
    hw = _mix(weight_key ^ hs)
    for b in range(g.size):
        hb = _mix(g[b] ^ hs)
        hk = _mix(draw_key ^ hb)
        acc = 0.0
        for p in range(pooling):
            u = _unit(_mix(np.uint64(p) ^ hk))
            if kind != ZIPF_LOG and kind != ZIPF_POW:  # UNIFORM
                r = np.int64(u * rows)
                row = r if r < rows - 1 else rows - 1
            else:
                x = np.exp(u * scale) if kind == ZIPF_LOG else (scale * u + 1.0) ** exponent
                r = np.int64(x) - 1
                r = 0 if r < 0 else (rows - 1 if r > rows - 1 else r)
                row = (r * 2654435761 + 12345) % rows
            ids[b * pooling + p] = row
            acc += _unit(_mix(np.uint64(row) ^ hw)) * 2.0 - 1.0
        bag_w[b] = acc


def warm_cache() -> None:
    """Compile `table_bags` into numba's on-disk cache (`make` runs this at install), so no rank pays it."""
    ids, bag_w = np.empty(2, np.int64), np.empty(1)
    table_bags(np.uint64(0), np.zeros(1, np.uint64), np.uint64(1), np.uint64(2), 2, 5, ZIPF_POW, 0.5, 2.0, ids, bag_w)


if __name__ == "__main__":
    warm_cache()
