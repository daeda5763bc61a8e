"""The co-design searcher: XGBoost proxies of each objective that learn across clusters from their
figures.

Why: a study of 60 clusters x the space's knobs cannot price every pair at 256 GPUs (a per-table
plan there takes a second), and a searcher that treats `cluster.node` as a name learns nothing about
a node it has priced less. The proxy's features are the knobs (one-hot) and the cluster's figures
(`ClusterChoice.figures`: GPUs, the NVLink domain as composed, memory and copy bandwidth, FLOP/s,
NVLink and NIC bandwidth and latency, in-network reduction), so what it learns on H100 at 64 GPUs
carries to H200 at 128, and on an 8-GPU domain to a 64-GPU one.

Each proposal is ParEGO's: a random weight over the objectives (each scaled to [0, 1] over what was
priced, in log space), an augmented Tchebycheff scalarisation of the proxies' optimistic prediction
(mean minus the spread of a bootstrap ensemble) over candidates drawn at random and never priced,
the best taken. A classifier of failures (a configuration that does not fit) keeps it off what will
not run. The first `WARMUP` trials are drawn at random, as Optuna's samplers start.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna
import xgboost as xgb
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

if TYPE_CHECKING:
    from cubic.codesign.study import CodesignStudy

WARMUP = 16  # random trials before the proxies propose
CANDIDATES = 384  # drawn per proposal
MEMBERS = 4  # bootstrap ensemble per objective
OPTIMISM = 1.0  # spreads subtracted from the mean: explore where the members disagree
RHO = 0.05  # augmented Tchebycheff's sum term (ParEGO)
PARAMS = {
    "objective": "reg:squarederror",
    "max_depth": 4,
    "eta": 0.15,
    "subsample": 0.9,
    "min_child_weight": 1.0,
    "nthread": 1,
    "verbosity": 0,
}
ROUNDS = 60


class ProxySampler(BaseSampler):
    """Optuna's sampler interface; `CodesignStudy` asks it for the next trial's parameters."""

    def __init__(self, codesign: CodesignStudy, seed: int = 0) -> None:
        self.cd = codesign
        self.rng = np.random.default_rng(seed)
        self.random = RandomSampler(seed=seed)
        self._figures: dict[str, list[float]] = {}  # cluster label -> its figures, as features
        knobs = self.cd.dists
        self.columns = [
            (k, v) for k, d in knobs.items() if not k.startswith("cluster.") for v in d.choices
        ]  # type: ignore[attr-defined]

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return dict(self.cd.dists)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, name: str, dist: BaseDistribution
    ) -> Any:
        return self.random.sample_independent(study, trial, name, dist)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
        ok = [t for t in done if t.state == TrialState.COMPLETE]
        if len(ok) < WARMUP:
            return {}  # every parameter from sample_independent: random
        cands = self._candidates(search_space)
        if not cands:
            return {}
        X = np.array([self.row(c) for c in cands])
        score = self._scalarised(ok, X) + self._failure_penalty(done, X)
        return cands[int(np.argmin(score))]

    # ------------------------------------------------------------------ features and candidates
    def row(self, params: dict[str, Any]) -> list[float]:
        ch = self.cd.choice(params)
        fig = self._figures.get(ch.label)
        if fig is None:  # per cluster, once: every proposal rows hundreds of candidates
            fig = self._figures[ch.label] = [math.log1p(x) for x in ch.figures().values()]
        return [float(params.get(k) == v) for k, v in self.columns] + fig

    def _candidates(self, space: dict[str, BaseDistribution]) -> list[dict[str, Any]]:
        """Distinct configurations on distinct clusters, never priced, drawn at random."""
        out, keys = [], set()
        for _ in range(CANDIDATES * 3):
            p = {
                k: d.choices[self.rng.integers(len(d.choices))]  # type: ignore[attr-defined]
                for k, d in space.items()
            }
            key = (self.cd.choice(p).label, self.cd.config(p).key())
            if key in keys or key in self.cd.priced:
                continue
            keys.add(key)
            out.append(p)
            if len(out) == CANDIDATES:
                break
        return out

    # ------------------------------------------------------------------ the proxies
    def _scalarised(self, ok: list[FrozenTrial], X: np.ndarray) -> np.ndarray:
        """Each candidate's augmented Tchebycheff value under a random weight (lower is better)."""
        Xo = np.array([self.row(t.params) for t in ok])
        n_obj = len(ok[0].values)
        w = self.rng.dirichlet(np.ones(n_obj))
        parts = []
        for j, direction in enumerate(self.cd.study.directions):
            y = np.array([_oriented(t.values[j], direction) for t in ok])
            lo, hi = float(y.min()), float(y.max())
            scale = hi - lo or 1.0
            pred = self._optimistic(Xo, (y - lo) / scale, X)
            parts.append(w[j] * pred)
        P = np.array(parts)
        return P.max(axis=0) + RHO * P.sum(axis=0)

    def _optimistic(self, Xo: np.ndarray, y: np.ndarray, X: np.ndarray) -> np.ndarray:
        preds = []
        for m in range(MEMBERS):
            idx = self.rng.integers(0, len(y), len(y))
            d = xgb.DMatrix(Xo[idx], label=y[idx])
            b = xgb.train({**PARAMS, "seed": int(self.rng.integers(1 << 30)) + m}, d, ROUNDS)
            preds.append(b.predict(xgb.DMatrix(X)))
        P = np.array(preds)
        return P.mean(axis=0) - OPTIMISM * P.std(axis=0)

    def _failure_penalty(self, done: list[FrozenTrial], X: np.ndarray) -> np.ndarray:
        """+1 for a candidate the failures' classifier expects to fail (0 where none failed yet)."""
        failed = [t.state == TrialState.FAIL for t in done]
        if not any(failed) or all(failed):
            return np.zeros(len(X))
        d = xgb.DMatrix(np.array([self.row(t.params) for t in done]), label=np.array(failed, float))
        b = xgb.train(
            {
                "objective": "binary:logistic",
                "max_depth": 3,
                "eta": 0.3,
                "nthread": 1,
                "verbosity": 0,
            },
            d,
            30,
        )
        return (b.predict(xgb.DMatrix(X)) > 0.5).astype(float)


def _oriented(v: float, direction: optuna.study.StudyDirection) -> float:
    """An objective as a loss in log space (every objective here is positive and spans decades)."""
    x = math.log(max(v, 1e-12))
    return x if direction == optuna.study.StudyDirection.MINIMIZE else -x
