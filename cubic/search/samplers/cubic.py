"""CubicSampler: the CubicML searcher (docs/architecture.md "CubicSampler").

1. Baseline first (SpaceSampler).
2. Warm-up: a space-filling design - each warm-up configuration is the random candidate farthest
   (Hamming distance over knobs) from everything tried, so a few trials touch every knob value.
3. Proxy: `cubic.search.proxy.Proxy` (XGBoost rank:pairwise ensemble on log qps with the simulator's
   derived features, bootstrap spread as uncertainty, feasibility classifier from failed trials
   and from trials whose NE over the baseline's samples fails the quality gate, `cubic.quality.rules`),
   refit on every proposal; trials of earlier studies on the same space (`history`) join the
   training set, so a second study starts where the first stopped.
4. Candidates: random untried configurations, every one-knob neighbour and random two-knob
   mutations of the best trials (an evolutionary local search), and TPE proposals; duplicates and
   configurations already tried or in flight are dropped.
5. Acquisition: predicted log qps + kappa * std (optimism under uncertainty), candidates the
   classifier deems infeasible (p < 0.5) last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import optuna
from optuna.trial import FrozenTrial

from cubic.search.fidelity import MEASURED, Fidelity
from cubic.search.proxy import FeatureFn, Proxy, kendall_tau, sim_features
from cubic.search.samplers.base import Observations, SpaceSampler, distributions
from cubic.space.search_space import SearchSpace

# TPE proposes n_tpe candidates while a study is small; past this many trials (a simulated tune of a thousand),
# one: each sample rescans the whole history (the largest cost of a proposal there), and the pool's random
# configurations and the best trials' neighbours already number over a thousand.
TPE_FULL_UNTIL = 256
# The proxy refits once what it learns from (measured and failed configurations) grew by 1/REFIT_GROWTH since its
# last fit: after every trial of a real tune (under 2 x REFIT_GROWTH trials), every ~16th of a thousand-trial
# simulated one, where five boosted rankers on hundreds of rows are a proposal's largest cost and one row more
# hardly moves them.
REFIT_GROWTH = 64


class CubicSampler(SpaceSampler):
    name = "cubic"

    def __init__(self, space: SearchSpace, seed: int = 0, n_warmup: int = 5, kappa: float = 1.0,
                 n_random: int = 1000, n_fresh: int = 100, n_best: int = 3, n_tpe: int = 4,
                 feature_fn: FeatureFn | None = sim_features,
                 history: Sequence[tuple[dict, float | None] | tuple[dict, float | None, Fidelity]] = (),
                 use_prior: bool = True, slack: int = 1, own: Fidelity = MEASURED) -> None:
        """history: (params, qps or None if the trial failed[, where it came from]) of earlier
        studies on this space (a warm start: `cubic tune --warm-start`); `own`: where this study's
        throughputs come from (measured, or simulated for one cluster), the source of a history
        entry that names none."""
        super().__init__(space, seed)
        self.n_warmup, self.kappa, self.n_best, self.n_tpe = n_warmup, kappa, n_best, n_tpe
        self.n_random, self.n_fresh = n_random, n_fresh
        self.use_prior, self.slack = use_prior, slack
        self.reservoir: set[tuple] = set()  # random candidates kept across proposals (features are cached)
        self.proxy = Proxy(space, feature_fn, seed=seed)
        self.fit_rows = 0  # the configurations the proxy last fitted on (REFIT_GROWTH)
        self.tpe = optuna.samplers.TPESampler(seed=seed, n_startup_trials=3, multivariate=True)
        self.own = own
        self.hist_ok = [(space.tup(h[0]), h[1], h[2] if len(h) > 2 else own) for h in history
                        if h[1] is not None and h[1] > 0]
        # a simulated failure (a predicted OOM) says where memory runs out, as a real one does
        self.hist_failed = [space.tup(h[0]) for h in history if h[1] is None or h[1] <= 0]

    def propose(self, study: optuna.Study, trial: FrozenTrial, obs: Observations) -> tuple[tuple | None, dict]:
        n_known = len(obs.ok) + len(obs.failed) + len(self.hist_ok)
        ok = [t for t, _, _ in self.hist_ok] + obs.ok
        qps = [q for _, q, _ in self.hist_ok] + obs.qps
        src = [s for _, _, s in self.hist_ok] + [self.own] * len(obs.ok)
        if n_known < self.n_warmup or len(ok) < 2:
            mine = [(t, q) for t, q, s in zip(ok, qps, src, strict=True) if s == self.own]
            return self._space_filling(obs, self._prior_agrees([t for t, _ in mine], [q for _, q in mine])), {
                "phase": "warmup"}
        # configurations whose NE fails the quality gate teach the feasibility classifier too
        failed = self.hist_failed + obs.failed + obs.quality_failed
        if not self.proxy.fitted or len(ok) + len(failed) >= self.fit_rows + max(1, self.fit_rows // REFIT_GROWTH):
            self.proxy.fit(ok, qps, failed, sources=src, own=self.own, passed=obs.quality_passed)
            self.fit_rows = len(ok) + len(failed)
        pool = self._pool(study, trial, obs, ok, qps)
        if not pool:
            return None, {}
        mu, sd = self.proxy.predict(pool)
        acq = mu + self.kappa * sd
        acq = np.where(self.proxy.p_feasible(pool) < 0.5, acq - 1e3, acq)
        i = int(np.argmax(acq))
        pred = math.exp(float(mu[i]))
        return pool[i], {"phase": "proxy", "predicted_qps": pred, "predicted_std": pred * float(sd[i])}

    # ------------------------------------------------------------------ proposals
    def _prior_agrees(self, ok: list[tuple], qps: list[float]) -> bool:
        """Trust the simulator's prediction for warm-up picks until measurements contradict it
        (Kendall tau <= 0 over >= 3 measured configurations)."""
        if not self.use_prior or len(ok) < 3:
            return self.use_prior
        est = self.proxy.features.prior(ok)
        if est is None or not np.isfinite(est).all():
            return False
        tau = kendall_tau(list(est), qps)
        return tau is not None and tau > 0

    def _space_filling(self, obs: Observations, use_prior: bool, n_cand: int = 256) -> tuple | None:
        """The random candidate farthest from everything tried; among equally far ones, the one the
        simulator predicts to be fastest (a prior that costs no trial)."""
        seen = [t for t in obs.seen if t not in obs.excluded]  # far from what ran, not from what was ruled out
        cands = {self.space.random_tuple(self.rng, obs.seen) for _ in range(n_cand)} - {None}
        if not cands or not seen:
            return next(iter(cands), None)
        cl = sorted(cands, key=str)
        C = self.space.encode(cl)
        S = self.space.encode(seen)
        dist = (C[:, None, :] != S[None, :, :]).sum(axis=2).min(axis=1)
        best = np.flatnonzero(dist >= dist.max() - self.slack)
        prior = self.proxy.features.prior([cl[i] for i in best]) if use_prior else None
        if prior is not None and np.isfinite(prior).any():
            return cl[int(best[int(np.nanargmax(prior))])]
        return cl[int(self.rng.choice(best))]

    def _pool(self, study: optuna.Study, trial: FrozenTrial, obs: Observations, ok: list[tuple],
              qps: list[float]) -> list[tuple]:
        every = self.space.all_tuples
        if every is not None and len(every) - len(obs.seen) <= self.n_random:
            pool = set(every)
        else:  # a reservoir of random configurations, topped up with a few fresh ones each time
            want = max(self.n_random - len(self.reservoir - obs.seen), 0) + self.n_fresh
            for _ in range(want):
                t = self.space.random_tuple(self.rng, obs.seen, tries=20)
                if t is not None:
                    self.reservoir.add(t)
            pool = set(self.reservoir)
        top = [ok[i] for i in np.argsort(qps)[::-1][: self.n_best]]
        for t in top:  # evolution: every one-knob neighbour and some two-knob mutations of the best
            near = list(self.space.neighbours(t))
            pool.update(near)
            for j in self.rng.permutation(len(near))[:8]:
                further = list(self.space.neighbours(near[j]))
                pool.update(further[k] for k in self.rng.permutation(len(further))[:3])
        pool.update(self._tpe(study, trial, self.n_tpe if len(obs.seen) <= TPE_FULL_UNTIL else 1))
        return sorted(pool - obs.seen, key=str)

    def _tpe(self, study: optuna.Study, trial: FrozenTrial, n: int) -> list[tuple]:
        out = []
        dists = distributions(self.space)
        for _ in range(n):
            try:
                params = self.tpe.sample_relative(study, trial, dists)
            except Exception:  # TPE is one candidate source among several
                return out
            if params and self.space.valid(params):
                out.append(self.space.tup(params))
        return out
