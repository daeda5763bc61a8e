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

from cubic.search.fidelity import MEASURED, Fidelity
from cubic.space.search_space import SearchSpace
from cubic_harness.config import TrialConfig

FeatureFn = Callable[[TrialConfig], dict[str, float]]
# another source's weight is checked on this study's own trials once it has this many (3 pairs)
MIN_OWN = 3
MIN_WEIGHT = 1e-3  # a source whose order is own's reversed: kept, but as good as gone
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
        self.own: Fidelity = MEASURED
        self.columns: dict[Fidelity, np.ndarray] = {}  # per source its columns; empty: one source
        # per other source, its rows' count and the ranker fitted on them alone (`_source_weights`):
        # a warm start's rows do not change between fits, only this study's do
        self._alone: dict[Fidelity, tuple[int, xgb.Booster]] = {}

    @property
    def multi_fidelity(self) -> bool:
        """Whether the proxy was fitted on throughputs of more than one source."""
        return bool(self.columns)

    def fit(self, ok: Sequence[tuple], qps: Sequence[float], failed: Sequence[tuple] = (),
            sources: Sequence[Fidelity] | None = None, own: Fidelity = MEASURED,
            passed: Sequence[tuple] = ()) -> Proxy:
        """ok/qps: measured configurations; failed: configurations that did not run (any reason) or
        that ran but fail the quality gate (those may also be in ok: their speed is still data);
        passed: configurations known to pass it whose speed is not data here (the screen's).
        sources: where each of `ok` came from (cubic/search/fidelity.py; default: all `own`, the
        source the proxy answers for). Several sources: a throughput is ranked only against its own
        source's (each is a ranking group), the sources' columns (simulated or not, the cluster's
        figures) let the trees learn how the order moves between them, and the scale is fitted on
        `own`'s rows."""
        src = list(sources) if sources is not None else [own] * len(ok)
        groups = list(dict.fromkeys([own, *src]))  # `own` is group 0
        gid = np.array([groups.index(g) for g in src], dtype=np.int32)
        self.own, self.columns = own, source_columns(groups) if len(groups) > 1 else {}
        F = self.features.rows(list(ok))
        X = self._with_source(F, src)
        y = np.log(np.asarray(qps, dtype=np.float64))
        rng = np.random.default_rng(self.seed + len(ok))
        self.members = []
        n = len(ok)
        mine = gid == 0 if (gid == 0).sum() >= 2 else np.ones(n, dtype=bool)  # the scale: own's rows
        weights = self._source_weights(X, y, gid, groups) if self.columns else None
        if n >= 2:
            for m in range(self.n_models):
                idx = rng.choice(n, n, replace=True) if m else np.arange(n)  # member 0: all data
                if len(np.unique(y[idx])) < 2:
                    idx = np.arange(n)
                idx = idx[np.argsort(gid[idx], kind="stable")]  # XGBoost wants rows grouped by qid
                label = np.empty(len(idx), dtype=np.float32)
                for g in np.unique(gid[idx]):  # relevance within each group, from its own minimum
                    sel = gid[idx] == g
                    label[sel] = y[idx][sel] - y[idx][sel].min()
                dm = xgb.DMatrix(X[idx], label=label, qid=gid[idx])
                if weights is not None:  # a ranker's weights are its groups', in qid order
                    dm.set_weight(weights[np.unique(gid[idx])])
                params = {**RANK_PARAMS, "seed": int(self.seed * 1000 + m),
                          "lambdarank_num_pair_per_sample": min(len(idx), 64, max(8, PAIRS_PER_ROUND // len(idx)))}
                bst = xgb.train(params, dm, num_boost_round=self.rounds)
                s = bst.predict(xgb.DMatrix(self._with_source(F, [own] * n)))  # as `own` would
                a, b = _calibrate(s[mine], y[mine])
                self.members.append((bst, a, b))
        self.classifier = None  # feasibility on the features alone: a predicted OOM is an OOM
        bad = set(failed)  # may include measured configurations that failed the quality gate
        measured = set(ok)
        good = [c for c in ok if c not in bad] + [c for c in dict.fromkeys(passed)
                                                   if c not in bad and c not in measured]
        if len(failed) and good:
            Xc = self.features.rows(good + list(failed))  # (cached per configuration)
            yc = np.concatenate([np.ones(len(good)), np.zeros(len(failed))]).astype(np.float32)
            w = np.where(yc == 0, len(good) / len(failed), 1.0).astype(np.float32)  # balance the classes
            self.classifier = xgb.train({**CLS_PARAMS, "seed": self.seed}, xgb.DMatrix(Xc, label=yc, weight=w),
                                        num_boost_round=20)
        self.fitted = bool(self.members)
        return self

    def _source_weights(self, X: np.ndarray, y: np.ndarray, gid: np.ndarray,
                        groups: Sequence[Fidelity]) -> np.ndarray:
        """Per source, how far its order holds for `own` (group 0), as its weight in the ranking:
        a ranker fitted on the source alone orders own's trials, and 2 x the share of their pairs
        it orders right - 1, floored near 0, weighs it (as RGPE weighs a warm start's models by
        their ranking loss on the target's data). Trees split poorly on a column that is constant
        within each ranking group (a cluster's figures): their pairs never differ in it, so a
        source whose order is another cluster's would pull own's order its way. While own has
        fewer than MIN_OWN trials, every source weighs 1: there is no order to check yet."""
        w = np.ones(int(gid.max()) + 1, dtype=np.float32)
        mine = gid == 0
        if mine.sum() < MIN_OWN:
            return w
        for g in range(1, len(w)):
            sel = gid == g
            n = int(sel.sum())
            if n < 2 or np.ptp(y[sel]) == 0:
                continue
            got = self._alone.get(groups[g])
            if got is None or got[0] != n:
                dm = xgb.DMatrix(X[sel], label=(y[sel] - y[sel].min()).astype(np.float32),
                                 qid=np.zeros(n, dtype=np.int32))
                got = self._alone[groups[g]] = (n, xgb.train({**RANK_PARAMS, "seed": self.seed}, dm,
                                                             num_boost_round=self.rounds))
            agree = pair_agreement(got[1].predict(xgb.DMatrix(X[mine])), y[mine])
            w[g] = max(MIN_WEIGHT, 2 * agree - 1) if agree is not None else 1.0
        return w

    def _with_source(self, X: np.ndarray, src: Sequence[Fidelity]) -> np.ndarray:
        """The feature rows plus each row's source columns, when the proxy was fitted on several."""
        if not self.columns:
            return X
        return np.concatenate([X, np.stack([self.columns[g] for g in src])], axis=1)

    def predict(self, tuples: Sequence[tuple]) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std) of predicted log qps per configuration, for the source the proxy answers for."""
        rows = self.features.rows(list(tuples))
        X = xgb.DMatrix(self._with_source(rows, [self.own] * len(rows)))
        preds = np.stack([a * bst.predict(X) + b for bst, a, b in self.members])
        return preds.mean(axis=0), preds.std(axis=0)

    def p_feasible(self, tuples: Sequence[tuple]) -> np.ndarray:
        if self.classifier is None:
            return np.ones(len(tuples))
        return self.classifier.predict(xgb.DMatrix(self.features.rows(list(tuples))))


def pair_agreement(score: np.ndarray, y: np.ndarray) -> float | None:
    """The share of the pairs of unequal `y` that `score` orders the same way (None: no such pair)."""
    dy = np.sign(y[:, None] - y[None, :])
    ds = np.sign(score[:, None] - score[None, :])
    pairs = dy != 0
    return float((dy[pairs] == ds[pairs]).mean()) if pairs.any() else None


def source_columns(groups: Sequence[Fidelity]) -> dict[Fidelity, np.ndarray]:
    """Per source its columns: simulated (0/1), then every cluster figure any source records
    (NaN where a source has none: a measured one, or a study that did not record its cluster)."""
    names = sorted({k for g in groups for k, _ in g.figures})
    out = {}
    for g in groups:
        fig = dict(g.figures)
        out[g] = np.array([float(g.simulated), *(fig.get(k, math.nan) for k in names)], dtype=np.float32)
    return out


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
