"""The learned proxy: which configuration is faster, from a few real trials.

An ensemble of XGBoost rankers (`rank:pairwise`, as CubicML/AutoTVM: the searcher needs the
order, not the value) on log throughput. Inputs are the knobs (one-hot and ordinal) plus the
simulator's prediction for this machine (`cubic_harness.sim.backend.features`, the one performance model
priced on clusters/local.yaml: bytes looked up per rank, all-to-all / all-reduce bytes, MLP FLOPs,
memory per rank, load imbalance, predicted step time per phase and qps), which carry what the knobs
mean physically, so few trials suffice; the predicted qps is also the prior that orders the
warm-up. Each member sees a bootstrap
sample with its own seed; the spread of the members is the uncertainty the acquisition uses.
Ranking scores have no unit, so every member is calibrated to log qps by a least-squares line
on the training set (only for display / acquisition scale; the order is the model's).
A separate XGBoost classifier, trained on which trials failed (OOM over the cap, crashes,
timeouts), predicts feasibility.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import xgboost as xgb

from cubic.space.search_space import SearchSpace
from cubic_harness.config import TrialConfig

FeatureFn = Callable[[TrialConfig], dict[str, float]]
RANK_PARAMS = {
    "objective": "rank:pairwise", "lambdarank_pair_method": "mean", "max_depth": 3, "eta": 0.2,
    "min_child_weight": 0.0, "subsample": 0.9, "colsample_bytree": 0.8, "lambda": 1.0,
    "nthread": 1, "verbosity": 0,
}
# Pairs a round compares: each trial against up to 64 others, at most PAIRS_PER_ROUND in all. A tune of real
# trials (<= 128) compares each with 64; a simulated tune of a thousand compares each with 8, whose 8,192
# pairs a round order the configurations as well, and its refit on every proposal stays ~constant in time.
PAIRS_PER_ROUND = 8192
CLS_PARAMS = {"objective": "binary:logistic", "max_depth": 2, "eta": 0.3, "min_child_weight": 0.0,
              "nthread": 1, "verbosity": 0}


def sim_features(cfg: TrialConfig) -> dict[str, float]:
    """The simulator's prediction for the local cluster (imported lazily: the harness owns it)."""
    from cubic_harness.sim.backend import features

    return features(cfg)


class Features:
    """Feature rows for canonical configuration tuples (cached: the simulator runs once per config)."""

    def __init__(self, space: SearchSpace, feature_fn: FeatureFn | None = sim_features) -> None:
        self.space, self.fn = space, feature_fn
        self.cache: dict[tuple, np.ndarray] = {}
        self.derived_names: list[str] | None = None
        knobs = list(space.knobs.values())
        self.names = [f"{k.name}={v}" for k in knobs if len(k.choices) > 2 for v in k.choices]
        self.names += [f"{k.name}#" for k in knobs]  # ordinal index (numeric knobs: their order)

    def _derived(self, tup: tuple) -> dict[str, float]:
        if self.fn is None:
            return {}
        try:
            d = self.fn(self.space.config(self.space.params_of(tup)))
        except Exception:  # a simulator gap must not stop the search: missing features are NaN
            return {}
        return {k: float(v) for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)}

    def rows(self, tuples: Sequence[tuple]) -> np.ndarray:
        missing = [t for t in tuples if t not in self.cache]
        if missing:
            derived = [self._derived(t) for t in missing]
            if self.derived_names is None:
                self.derived_names = sorted({k for d in derived for k in d})
            onehot = self._knob_block(missing)
            for t, oh, d in zip(missing, onehot, derived, strict=True):
                der = [_squash(d.get(k, math.nan)) for k in self.derived_names]
                self.cache[t] = np.concatenate([oh, np.asarray(der, dtype=np.float32)])
        return np.stack([self.cache[t] for t in tuples]) if tuples else np.zeros((0, len(self.names)))

    def prior(self, tuples: Sequence[tuple]) -> np.ndarray | None:
        """The simulator's own throughput prediction (log) per configuration, if it gives one."""
        if self.fn is None:
            return None
        rows = self.rows(list(tuples))
        names = self.derived_names or []
        if "est_qps" not in names:
            return None
        return rows[:, len(self.names) + names.index("est_qps")]

    def _knob_block(self, tuples: Sequence[tuple]) -> np.ndarray:
        ordinal = self.space.encode(list(tuples))
        blocks = []
        for j, kn in enumerate(self.space.knobs.values()):
            if len(kn.choices) > 2:
                blocks.append(np.eye(len(kn.choices), dtype=np.float32)[ordinal[:, j].astype(int)])
        blocks.append(ordinal)
        return np.concatenate(blocks, axis=1)


def _squash(v: float) -> float:
    """Signed log: byte counts and FLOPs span orders of magnitude."""
    return float(np.sign(v) * np.log1p(abs(v))) if math.isfinite(v) else math.nan


class Proxy:
    """Ensemble ranker on log qps + feasibility classifier; `fit` then `predict` / `p_feasible`."""

    def __init__(self, space: SearchSpace, feature_fn: FeatureFn | None = sim_features,
                 n_models: int = 5, rounds: int = 40, seed: int = 0) -> None:
        self.space, self.n_models, self.rounds, self.seed = space, n_models, rounds, seed
        self.features = Features(space, feature_fn)
        self.members: list[tuple[xgb.Booster, float, float]] = []
        self.classifier: xgb.Booster | None = None
        self.fitted = False
        self.multi_fidelity = False

    def fit(self, ok: Sequence[tuple], qps: Sequence[float], failed: Sequence[tuple] = (),
            simulated: Sequence[bool] | None = None) -> Proxy:
        """ok/qps: measured configurations; failed: configurations that did not run (any reason) or
        that ran but fail the quality gate (those may also be in ok: their speed is still data).
        simulated: which of `ok` are a simulator's predictions (a warm start from a simulated study).
        Multi-fidelity: a prediction is never ranked against a measurement (each fidelity is its own
        ranking group), the `simulated` column lets the trees learn where the simulator's order is
        wrong, and the proxy answers for measurements (column = 0) with its scale fitted on them."""
        sim = np.asarray(simulated if simulated is not None else [False] * len(ok), dtype=bool)
        self.multi_fidelity = bool(sim.any())
        F = self.features.rows(list(ok))
        X = self._with_fidelity(F, sim)
        y = np.log(np.asarray(qps, dtype=np.float64))
        rng = np.random.default_rng(self.seed + len(ok))
        self.members = []
        n = len(ok)
        real = ~sim if (~sim).sum() >= 2 else np.ones(n, dtype=bool)  # the scale: from measurements
        if n >= 2:
            for m in range(self.n_models):
                idx = rng.choice(n, n, replace=True) if m else np.arange(n)  # member 0: all data
                if len(np.unique(y[idx])) < 2:
                    idx = np.arange(n)
                idx = idx[np.argsort(sim[idx], kind="stable")]  # XGBoost wants rows grouped by qid
                label = np.empty(len(idx), dtype=np.float32)
                for g in (False, True):  # relevance within each group, from its own minimum
                    sel = sim[idx] == g
                    if sel.any():
                        label[sel] = y[idx][sel] - y[idx][sel].min()
                dm = xgb.DMatrix(X[idx], label=label, qid=sim[idx].astype(np.int32))
                params = {**RANK_PARAMS, "seed": int(self.seed * 1000 + m),
                          "lambdarank_num_pair_per_sample": min(len(idx), 64, max(8, PAIRS_PER_ROUND // len(idx)))}
                bst = xgb.train(params, dm, num_boost_round=self.rounds)
                s = bst.predict(xgb.DMatrix(self._with_fidelity(F, np.zeros(n, dtype=bool))))  # as measured
                a, b = _calibrate(s[real], y[real])
                self.members.append((bst, a, b))
        self.classifier = None  # feasibility on the features alone: a predicted OOM is an OOM
        bad = set(failed)  # may include measured configurations that failed the quality gate
        good = [i for i, c in enumerate(ok) if c not in bad]
        if len(failed) and good:
            Xc = np.concatenate([F[good], self.features.rows(list(failed))])
            yc = np.concatenate([np.ones(len(good)), np.zeros(len(failed))]).astype(np.float32)
            w = np.where(yc == 0, len(good) / len(failed), 1.0).astype(np.float32)  # balance the classes
            self.classifier = xgb.train({**CLS_PARAMS, "seed": self.seed}, xgb.DMatrix(Xc, label=yc, weight=w),
                                        num_boost_round=20)
        self.fitted = bool(self.members)
        return self

    def _with_fidelity(self, X: np.ndarray, sim: np.ndarray) -> np.ndarray:
        """The feature rows plus the `simulated` column, when the proxy was fitted on two fidelities."""
        return np.concatenate([X, sim[:, None].astype(np.float32)], axis=1) if self.multi_fidelity else X

    def predict(self, tuples: Sequence[tuple]) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std) of predicted log qps per configuration (as measured: the `simulated` column 0)."""
        rows = self.features.rows(list(tuples))
        X = xgb.DMatrix(self._with_fidelity(rows, np.zeros(len(rows), dtype=bool)))
        preds = np.stack([a * bst.predict(X) + b for bst, a, b in self.members])
        return preds.mean(axis=0), preds.std(axis=0)

    def p_feasible(self, tuples: Sequence[tuple]) -> np.ndarray:
        if self.classifier is None:
            return np.ones(len(tuples))
        return self.classifier.predict(xgb.DMatrix(self.features.rows(list(tuples))))


def _calibrate(score: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares line score -> log qps (slope kept positive: the ranker's order is kept)."""
    s = score.astype(np.float64)
    if np.ptp(s) < 1e-12:
        return 0.0, float(y.mean())
    a, b = np.polyfit(s, y, 1)
    if a <= 0:
        a = float(np.std(y) / (np.std(s) + 1e-12)) * 1e-3
        b = float(y.mean() - a * s.mean())
    return float(a), float(b)


def kendall_tau(pred: Sequence[float], actual: Sequence[float]) -> float | None:
    """Kendall tau-b of predicted vs measured (None with fewer than 3 pairs)."""
    if len(pred) < 3:
        return None
    from scipy.stats import kendalltau

    tau = kendalltau(pred, actual).statistic
    return None if tau is None or not math.isfinite(tau) else float(tau)
