"""2D sparse parallelism quality: momentum-scaled row-wise AdaGrad keeps NE within 0.5% of
full model parallelism after the same samples; plain row-wise AdaGrad with weight averaging
is recorded alongside so the difference is visible."""

from __future__ import annotations

from cubic_harness.trial import run_trial
from cubic_harness.workload import TableSpec, Workload
from tests.helpers import tiny_cfg


def test_momentum_scaled_2d_matches_full_model_parallel_quality(record_property):
    # Large Zipf tables (a realistic sparse regime), 64 steps x 256 samples, every sample seen once.
    wl = Workload("sparse-zipf", [TableSpec(f"t{i}", 100_000, 16, 3, "zipf", 1.05) for i in range(4)], 8,
                  [32, 16], [32, 16, 1])
    base = tiny_cfg(workload=wl, world_size=2, batch_size=128, warmup_steps=32, measure_steps=32, emb_lr=0.05)
    runs = {
        "full_mp": {},
        "2d_momentum_scaled": dict(sharding_group_size=1, sparse_sync="weight_avg",
                                   emb_optimizer="momentum_scaled_rowwise_adagrad"),
        "2d_plain_weight_avg": dict(sharding_group_size=1, sparse_sync="weight_avg"),
    }
    ne = {}
    for name, kw in runs.items():
        r = run_trial(base.replace(**kw))
        assert r.status == "ok", r.error
        ne[name] = r.ne
    rel = {k: v / ne["full_mp"] - 1 for k, v in ne.items()}
    for k, v in rel.items():
        record_property(f"ne_rel_{k}", round(v, 5))
    print({k: f"NE {ne[k]:.4f} ({rel[k]:+.2%})" for k in ne})
    assert abs(rel["2d_momentum_scaled"]) <= 0.005, rel
    # plain weight averaging is a different optimizer (embedding steps shrink by the replica count):
    # it deviates visibly from full model parallelism, in whichever direction this data takes it
    assert abs(rel["2d_plain_weight_avg"]) > 2 * abs(rel["2d_momentum_scaled"]), rel


def test_search_trial_ne_over_the_baselines_samples_equals_a_sample_matched_rerun():
    """`cubic.quality.rules.matched_ne`: the first steps of a bigger-batch search trial are the training
    a sample-matched re-run does, so its NE over the baseline's samples comes free with the trial.
    Checked against a real re-run; and a smaller-batch trial, which cannot cover them, gives None."""
    from cubic.quality.rules import covering, matched_ne, matched_steps
    from cubic_harness.trial import run_trial
    from tests.helpers import tiny_cfg

    base = tiny_cfg(world_size=1, batch_size=32, warmup_steps=4, measure_steps=8, windows=1, emb_lr=0.05)
    big = base.replace(batch_size=128, emb_optimizer="sgd")  # changes numerics: 4x batch, another optimizer
    assert matched_steps(big, base) == (1, 2)  # samples [128, 384) of 128 each = the baseline's [128, 384)
    first, count = matched_steps(big, base)
    exact = big.replace(warmup_steps=first, measure_steps=count)  # a run over exactly the baseline's samples
    rb, rbig, rmatched = (run_trial(c) for c in (base, big, exact))
    assert rb.status == rbig.status == rmatched.status == "ok"
    assert len(rmatched.losses) == 1 + 2 < len(rbig.losses)  # the re-run: 1 warm-up + 2 measured steps of 128
    est = matched_ne(rbig.losses, big, rb.losses, base, rb.ne)
    assert est is not None and abs(est - rmatched.ne) / rmatched.ne < 1e-4, (est, rmatched.ne)
    assert abs(est - rb.ne) / rb.ne > 1e-3  # and it is a real difference from the baseline's NE
    small = base.replace(batch_size=16)
    assert matched_ne(run_trial(small).losses, small, rb.losses, base, rb.ne) is None
    # the confirm runs a smaller batch longer (same warm-up, more measured steps) so it covers them
    longer = covering(small, base)
    assert (longer.warmup_steps, longer.measure_steps) == (4, 20) and covering(big, base) == big
    assert matched_ne(run_trial(longer).losses, longer, rb.losses, base, rb.ne) is not None


def test_matched_window_never_trains_past_the_baselines():
    """A non-integer batch ratio takes the whole steps inside the baseline's samples (rounding once
    took a window that ended later, so the candidate had trained longer when judged); a batch
    larger than all of them takes the step that holds their start, never a later one."""
    from cubic.quality.rules import matched_steps
    from tests.helpers import tiny_cfg

    base = tiny_cfg(world_size=1, batch_size=2048, warmup_steps=3, measure_steps=16)
    first, count = matched_steps(base.replace(batch_size=4096), base)
    assert first * 4096 >= 3 * 2048 and (first + count) * 4096 <= 19 * 2048, (first, count)
    assert matched_steps(base, base) == (3, 16)
    tiny = tiny_cfg(world_size=1, batch_size=32, warmup_steps=1, measure_steps=4)  # samples [32, 160)
    assert matched_steps(tiny.replace(batch_size=64), tiny) == (1, 1)  # [64, 128)
    assert matched_steps(tiny.replace(batch_size=256), tiny) == (0, 1)  # no step fits: [0, 256) holds them


def test_quality_gate_is_one_sided_better_ne_always_passes():
    """Lower NE is better quality: the gate bounds how much worse a configuration may train, never
    how much better (a two-sided gate once crowned the baseline over a faster, better one)."""
    from cubic.quality.rules import within

    assert within(0.94, 0.974, 0.0)  # 3.5% better NE passes even with no tolerance at all
    assert within(0.99, 0.974, 0.02)  # 1.6% worse: within 2%
    assert not within(0.9939, 0.974, 0.02)  # 2.04% worse: rejected
    assert not within(0.975, 0.974, 0.0)
