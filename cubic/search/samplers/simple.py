"""The two model-free baselines: uniform random search and grid search (both without repeats)."""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial

from cubic.search.samplers.base import Observations, SpaceSampler


class RandomSearch(SpaceSampler):
    """Uniform over the distinct valid configurations not tried yet."""

    name = "random"

    def propose(self, study: optuna.Study, trial: FrozenTrial, obs: Observations) -> tuple[tuple | None, dict]:
        return self.random_unseen(obs), {}


class GridSearch(SpaceSampler):
    """Every configuration in declaration order (the last knob varies fastest), as a user's nested loops
    would run them; exhaustive when the budget covers the space. Spaces too large to enumerate fall
    back to random order."""

    name = "grid"

    def propose(self, study: optuna.Study, trial: FrozenTrial, obs: Observations) -> tuple[tuple | None, dict]:
        grid = self.space.all_tuples
        if grid is None:
            return self.random_unseen(obs), {}
        return next((t for t in grid if t not in obs.seen), None), {}
