"""The proxy ranks unseen configurations of a landscape whose structure we know.

Landscape: log qps over the default CPU space = main effects of five knobs (batch size, kernel,
sharding, pipelining, threads) + an interaction (fp16 tables pay off only with a low-precision
all-to-all). The proxy sees 40 random configurations and ranks 300 others.

Threshold: Kendall tau >= 0.65. Chance is tau = 0 with a standard deviation of ~0.04 at n = 300,
so 0.65 is >15 sigma from guessing; and the proxy must also beat by 0.1 the ranking by the single
strongest knob (batch size alone reaches tau ~0.53-0.55 here), i.e. it must have learned several knobs
and their interaction, not one trend. (Measured over five data seeds: 0.68-0.79 knobs only;
0.65-0.75 with the cost-model features, which carry no information about this synthetic
landscape, so that variant's bar is 0.6 / +0.05.)
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from cubic.search.fidelity import MEASURED, Fidelity
from cubic.search.proxy import Proxy, kendall_tau
from cubic.space.search_space import SearchSpace, load_space

SIM = Fidelity("sim")  # a simulated source that names no cluster

ROOT = Path(__file__).resolve().parent.parent
SHARDING = {"table_wise": 0.0, "row_wise": 0.25, "column_wise": 0.1, "table_row_wise": 0.2,
            "data_parallel": -0.3, "size_greedy": 0.05, "lookup_greedy": 0.15, "size_lookup_greedy": 0.3}


def log_qps(p: dict) -> float:
    v = 0.25 * math.log2(p["batch_size"] / 512) + SHARDING[p["sharding"]]
    v += 0.4 * (p["kernel"] == "fbgemm") + 0.3 * (p["kernel"] == "native")
    v += 0.2 * (p["pipeline_depth"] > 0) - 0.15 * (p["threads_per_rank"] == 2)
    v += 0.3 * (p["emb_precision"] == "fp16" and p["comm_precision"] != "fp32")
    return v


@pytest.fixture(scope="module")
def data() -> tuple[SearchSpace, list[tuple], np.ndarray, list[tuple], np.ndarray]:
    space = load_space(ROOT / "search_spaces" / "dlrm_cpu.yaml")
    rng = np.random.default_rng(0)
    # the landscape's sharding values (the space's planners beside them would only dilute 40 training points)
    pool = [t for t in space.all_tuples if space.params_of(t)["sharding"] in SHARDING]
    picks = rng.permutation(len(pool))[:340]
    tuples = [pool[i] for i in picks]
    y = np.exp([log_qps(space.params_of(t)) for t in tuples]) * 1e4
    return space, tuples[:40], y[:40], tuples[40:], y[40:]


@pytest.mark.parametrize("derived", [False, True], ids=["knobs-only", "with-simulator-features"])
def test_proxy_ranks_held_out_configs(data, derived: bool) -> None:
    space, train, y_train, test, y_test = data
    kw = {} if derived else {"feature_fn": None}
    proxy = Proxy(space, seed=1, **kw).fit(train, list(y_train))
    mu, sd = proxy.predict(test)
    tau = kendall_tau(list(mu), list(y_test))
    single = kendall_tau([space.params_of(t)["batch_size"] for t in test], list(y_test))
    assert tau is not None and single is not None
    # With the simulator features the proxy also gets ~14 inputs that carry nothing about this
    # synthetic landscape: it must still rank well despite them (a lower bar, same >14 sigma from chance).
    floor, margin = (0.6, 0.05) if derived else (0.65, 0.1)
    assert tau >= floor and tau >= single + margin, (tau, single)
    assert (sd >= 0).all() and sd.mean() > 0  # the bootstrap ensemble disagrees somewhere
    # calibrated to log qps: predictions land in the measured range, not arbitrary score units
    assert np.median(np.abs(mu - np.log(y_test))) < 0.5


def test_feasibility_classifier_learns_which_configs_fail(data) -> None:
    space, train, y_train, test, _ = data

    def fails(t: tuple) -> bool:
        p = space.params_of(t)
        return p["batch_size"] == 4096 and p["emb_precision"] == "fp32"

    ok = [(t, y) for t, y in zip(train, y_train, strict=True) if not fails(t)]
    bad = [t for t in train if fails(t)]
    assert bad, "the random training set should contain failing configs"
    proxy = Proxy(space, feature_fn=None, seed=0).fit([t for t, _ in ok], [y for _, y in ok], bad)
    p = proxy.p_feasible(test)
    mask = np.array([fails(t) for t in test])
    assert p[mask].mean() < 0.5 < p[~mask].mean()


def test_proxy_features_include_the_simulator(data) -> None:
    space, train, *_ = data
    proxy = Proxy(space)
    rows = proxy.features.rows(train[:3])
    names = proxy.features.derived_names or []
    assert {"est_qps", "bytes_lookup_per_rank", "a2a_bytes", "mem_mb_per_rank", "load_imbalance"} <= set(names)
    assert rows.shape == (3, len(proxy.features.names) + len(names))
    assert np.isfinite(rows).all()
    # a plan the simulator cannot price has the same feature names (NaN), so a first batch of
    # infeasible configurations cannot drop features for the rest of the study
    from cubic_harness.config import TrialConfig
    from cubic_harness.sim.backend import features
    from cubic_harness.sim.perf import FEATURE_NAMES

    bad = features(TrialConfig(sharding="column_wise", column_shard_dim=6))
    assert set(bad) == set(features(TrialConfig())) == set(FEATURE_NAMES)
    assert all(np.isnan(v) for v in bad.values())


def test_measured_configs_that_fail_quality_teach_the_classifier(data) -> None:
    """Configurations that ran (their speed stays in the ranking model) but whose NE fails the
    quality gate are passed as failed too: the classifier must learn them as infeasible although
    they also appear among the measured ones."""
    space, train, y_train, test, _ = data

    def bad_quality(t: tuple) -> bool:
        return space.params_of(t)["emb_optimizer"] == "sgd" and space.params_of(t)["batch_size"] >= 2048

    flagged = [t for t in train if bad_quality(t)]
    assert flagged
    proxy = Proxy(space, feature_fn=None, seed=0).fit(train, list(y_train), flagged)
    assert len(proxy.members) > 0  # the speed model still trains on every measured configuration
    p = proxy.p_feasible(test)
    mask = np.array([bad_quality(t) for t in test])
    assert p[mask].mean() < 0.5 < p[~mask].mean()


def test_a_simulated_warm_start_teaches_the_order_and_measurements_set_the_scale(data) -> None:
    """Multi-fidelity: 300 'simulated' trials with the right order at twice the speed and 8 measured ones.
    The proxy ranks held-out configurations better than from the 8 measurements alone, and its answers
    are on the measured scale (a prediction is never ranked against a measurement)."""
    space, train, y_train, test, y_test = data
    sim_t, sim_y = test[:300], list(2.0 * y_test[:300])
    held, held_y = train[8:], list(y_train[8:])
    few = Proxy(space, seed=1, feature_fn=None).fit(train[:8], list(y_train[:8]))
    warm = Proxy(space, seed=1, feature_fn=None).fit(sim_t + train[:8], sim_y + list(y_train[:8]),
                                                     sources=[SIM] * 300 + [MEASURED] * 8)
    assert warm.multi_fidelity and not few.multi_fidelity
    tau_few = kendall_tau(list(few.predict(held)[0]), held_y)
    tau_warm = kendall_tau(list(warm.predict(held)[0]), held_y)
    assert tau_warm > tau_few + 0.1, (tau_warm, tau_few)
    mu, _ = warm.predict(held)
    assert abs(np.median(mu - np.log(held_y))) < 0.3  # not log 2 = 0.69 above: the measured scale


def test_a_warm_start_from_two_clusters_ranks_each_apart_and_learns_from_their_figures(data) -> None:
    """Two simulated studies of the space on two clusters whose orders are opposite (a fast and a
    slow network) and three trials of this study, on a cluster with a fast network. Ranked apart
    with the clusters' figures as features, the proxy gives this cluster's order; merged into one
    simulated source, as when a warm start did not tell clusters apart, it cannot."""
    space, train, y_train, test, y_test = data
    fast = Fidelity.of("sim:fast", {"network_gbs": 46.0, "nodes": 8.0})
    slow = Fidelity.of("sim:slow", {"network_gbs": 12.5, "nodes": 8.0})
    own = Fidelity.of("sim:mine", {"network_gbs": 40.0, "nodes": 8.0})
    a, b = test[:150], test[150:300]
    ok = a + b + train[:3]
    qps = list(y_test[:150]) + list(1e8 / y_test[150:300]) + list(y_train[:3])  # slow: the order reversed
    held, held_y = train[3:], list(y_train[3:])
    apart = Proxy(space, seed=2, feature_fn=None).fit(ok, qps, sources=[fast] * 150 + [slow] * 150 + [own] * 3,
                                                      own=own)
    merged = Proxy(space, seed=2, feature_fn=None).fit(ok, qps, sources=[SIM] * 300 + [own] * 3, own=own)
    alike = Proxy(space, seed=2, feature_fn=None).fit(a + train[:3], qps[:150] + qps[300:],
                                                      sources=[fast] * 150 + [own] * 3, own=own)
    tau_apart, tau_merged, tau_alike = (kendall_tau(list(p.predict(held)[0]), held_y)
                                        for p in (apart, merged, alike))
    # as good as warm-started from the like cluster alone; far better than merged
    assert tau_apart > tau_alike - 0.1 and tau_apart > tau_merged + 0.3, (tau_apart, tau_merged, tau_alike)


def test_the_cubic_sampler_refits_its_proxy_as_its_data_grows(data) -> None:
    """Below 2 x REFIT_GROWTH trials (a real tune) the proxy refits after every trial; past it, once its data grew
    by 1/REFIT_GROWTH, so a thousand-trial simulated tune pays ~270 fits of five rankers, not a thousand."""
    import optuna

    from cubic.search.samplers import CubicSampler, Observations
    from cubic.search.samplers.cubic import REFIT_GROWTH

    space, tuples, y, more, ymore = data
    T, Y = tuples + more, list(y) + list(ymore)
    s = CubicSampler(space, feature_fn=None, n_random=50, n_fresh=5, n_tpe=0)
    study = optuna.create_study(direction="maximize")
    study.ask()
    frozen = study.get_trials(deepcopy=False)[-1]
    fitted_at = []
    for n in range(2 * REFIT_GROWTH - 4, 2 * REFIT_GROWTH + 48):
        before = s.fit_rows
        pick, info = s.propose(study, frozen, Observations(seen=set(T[:n]), ok=T[:n], qps=Y[:n]))
        assert pick is not None and pick not in T[:n] and info["phase"] == "proxy"
        if s.fit_rows != before:
            fitted_at.append(n)
    assert fitted_at[:5] == list(range(2 * REFIT_GROWTH - 4, 2 * REFIT_GROWTH + 1))  # every trial, then
    gaps = np.diff(fitted_at[4:])
    assert len(gaps) > 10 and (gaps == [max(1, a // REFIT_GROWTH) for a in fitted_at[4:-1]]).all() and min(gaps) >= 2
