"""Optuna's TPE (default settings) as a baseline, made to propose each configuration once.

TPE on a small categorical space keeps proposing configurations it has already measured; a real
trial costs minutes, so a repeated proposal is redrawn (up to `retries` times) and, failing that,
replaced by a random untried configuration.
"""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial

from cubic.search.samplers.base import Observations, SpaceSampler, distributions
from cubic.space.search_space import SearchSpace


class TPESearch(SpaceSampler):
    name = "tpe"

    def __init__(self, space: SearchSpace, seed: int = 0, retries: int = 20, **tpe_kwargs) -> None:
        super().__init__(space, seed)
        self.tpe = optuna.samplers.TPESampler(seed=seed, **tpe_kwargs)
        self.retries = retries

    def propose(self, study: optuna.Study, trial: FrozenTrial, obs: Observations) -> tuple[tuple | None, dict]:
        dists = distributions(self.space)
        for _ in range(self.retries):
            params = {k: self.tpe.sample_independent(study, trial, k, d) for k, d in dists.items()}
            tup = self.space.tup(params)
            if tup not in obs.seen and self.space.valid(params):
                return tup, {}
        return self.random_unseen(obs), {"phase": "random"}
