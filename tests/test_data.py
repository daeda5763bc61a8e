"""Synthetic data: a sample depends only on its global sample number (not on ranks or batch size)."""

from __future__ import annotations

import pytest
import torch

from cubic_harness.data import make_batch, rank_batches
from cubic_harness.errors import ConfigError
from cubic_harness.workload import SAMPLE_CYCLE, Workload


def _bags(b, T):
    B = b.batch_size
    return [[b.ids[b.offsets[t * B + i]:b.offsets[t * B + i + 1]].tolist() for t in range(T)] for i in range(B)]


def test_samples_do_not_depend_on_rank_split_or_batch_size():
    wl = Workload.tiny()
    T = wl.num_tables
    big = make_batch(wl, 3, 0, 256)  # one process, global batch 256
    # 2 ranks x 64 samples, two steps: steps 0 and 1 cover global samples 0..255
    parts = [b for s in range(2) for b in (rank_batches(wl, 3, r, 64, 2, 2)[s] for r in range(2))]
    assert torch.equal(torch.cat([p.dense for p in parts]), big.dense)
    assert torch.equal(torch.cat([p.labels for p in parts]), big.labels)
    assert sum((_bags(p, T) for p in parts), []) == _bags(big, T)


def test_data_cycles_over_sample_cycle_and_labels_are_learnable():
    wl = Workload.tiny()
    a, b = make_batch(wl, 0, 5, 32), make_batch(wl, 0, 5 + SAMPLE_CYCLE, 32)
    assert torch.equal(a.dense, b.dense) and torch.equal(a.ids, b.ids)
    assert len(rank_batches(wl, 0, 0, 1024, 2, 100)) == SAMPLE_CYCLE // 2048
    labels = make_batch(wl, 0, 0, 4096).labels
    assert 0.2 < labels.mean() < 0.8  # a teacher, not a constant


def test_sample_cycle_is_a_workload_setting():
    """`workload: {preset: ..., sample_cycle: N}` (the GPU space's large batches) moves the repeat."""
    wl = Workload.from_dict({"preset": "tiny", "sample_cycle": 1 << 20})
    assert wl.sample_cycle == 1 << 20 and Workload.tiny().sample_cycle == SAMPLE_CYCLE
    assert not torch.equal(make_batch(wl, 0, 5, 32).dense, make_batch(wl, 0, 5 + SAMPLE_CYCLE, 32).dense)
    assert torch.equal(make_batch(wl, 0, 5, 32).dense, make_batch(wl, 0, 5 + (1 << 20), 32).dense)
    assert len(rank_batches(wl, 0, 0, 1024, 2, 100)) == 100  # no repeat within the trial: every step generated
    with pytest.raises(ConfigError, match="sample_cycle=0 must be a positive integer"):
        Workload.from_dict({"preset": "tiny", "sample_cycle": 0})


def test_weighted_tables_ids_carry_a_fixed_score_per_row() -> None:
    """A weighted table's ids carry scores in [0.5, 1.5), the same for the same row in any batch; the other tables'
    ids carry 1.0; a workload without weighted tables has no scores at all."""
    import dataclasses

    wl = Workload.tiny()
    assert make_batch(wl, 0, 0, 64).scores is None
    wl = dataclasses.replace(wl, tables=[dataclasses.replace(wl.tables[0], weighted=True), *wl.tables[1:]])
    a, b = make_batch(wl, 0, 0, 64), make_batch(wl, 0, 64, 64)
    B = 64
    for x in (a, b):
        assert x.scores is not None and x.scores.shape == x.ids.shape and x.scores.dtype == torch.float32
        lo, hi = int(x.offsets[0]), int(x.offsets[B])
        assert ((x.scores[lo:hi] >= 0.5) & (x.scores[lo:hi] < 1.5)).all() and x.scores[lo:hi].std() > 0.1
        assert (x.scores[hi:] == 1.0).all()
    score = {}
    for x in (a, b):
        for r, s in zip(x.ids[:int(x.offsets[B])].tolist(), x.scores[:int(x.offsets[B])].tolist(), strict=True):
            assert score.setdefault(r, s) == s


@pytest.mark.parametrize("law", ["uniform", "zipf 1.0", "zipf 1.2", "zipf 0.7", "zipf 0.5"])
def test_compiled_synthetic_bags_equal_the_numpy_rule_bit_for_bit(law: str) -> None:
    """`synthetic.table_bags` (what every batch uses) against `data._draw_ids` and the teacher's row weights
    in numpy: the same ids and the same bag sums to the last bit, on training and held-out sample numbers,
    for each id law (a uniform table, Zipf at alpha 1, above, below, and at 0.5, where the power is a square)."""
    import dataclasses

    import numpy as np

    from cubic_harness import data, synthetic  # noqa: F401 - numba loaded: the compiled path

    dist, _, alpha = law.partition(" ")
    t = dataclasses.replace(Workload.tiny().tables[0], rows=200_003, pooling=7, id_dist=dist,
                            zipf_alpha=float(alpha or 1.05))
    g = np.concatenate([np.arange(0, 3000, dtype=np.uint64), np.uint64(SAMPLE_CYCLE) + np.arange(500, dtype=np.uint64)])
    ids, bag_w = data._synthetic_bags(t, 11, 3, g)
    want = data._draw_ids(t, data._uniform(11, g[:, None], 10_003, np.arange(7, dtype=np.uint64)[None, :])).reshape(-1)
    row_w = data._uniform(11, 102, want.astype(np.uint64)) * 2 - 1
    assert np.array_equal(ids, want)
    assert np.array_equal(bag_w, np.bincount(np.repeat(np.arange(g.size), 7), row_w, minlength=g.size))
    assert len(np.unique(ids)) > 1000  # a real draw, not a constant
