"""Searchers, each an Optuna sampler over a `SearchSpace` (see `base.SpaceSampler`)."""

from __future__ import annotations

from collections.abc import Sequence

from cubic.search.fidelity import MEASURED, Fidelity
from cubic.search.samplers.base import Observations, SpaceSampler, distributions
from cubic.search.samplers.cubic import CubicSampler
from cubic.search.samplers.dsxgb import DSXGBSearch
from cubic.search.samplers.simple import GridSearch, RandomSearch
from cubic.search.samplers.tpe import TPESearch
from cubic.space.search_space import SearchSpace
from cubic_harness.errors import ConfigError

SEARCHERS: dict[str, type[SpaceSampler]] = {
    "cubic": CubicSampler, "random": RandomSearch, "grid": GridSearch, "tpe": TPESearch, "ds-xgb": DSXGBSearch,
}


def make_sampler(name: str, space: SearchSpace, seed: int = 0, budget: int | None = None,
                 history: Sequence[tuple] = (), own: Fidelity = MEASURED) -> SpaceSampler:
    """The searcher `name` (ConfigError naming the allowed ones otherwise). `own`: where the study's
    throughputs come from; the simulator's predictions (for a cluster) make cubic's proxy learn
    from the knobs alone: its features are the same simulator priced on this machine
    (clusters/local.yaml), which says nothing about another cluster (a 4,096-rank plan is not even
    legal here, and costs ~50 ms to find out)."""
    if name not in SEARCHERS:
        raise ConfigError(f"--searcher {name!r} is not known; choose one of {list(SEARCHERS)}")
    if name == "cubic":
        n_warmup = 3 if budget is not None and budget < 10 else 4
        if own.simulated:
            return CubicSampler(space, seed=seed, n_warmup=n_warmup, history=history, feature_fn=None, own=own)
        return CubicSampler(space, seed=seed, n_warmup=n_warmup, history=history, own=own)
    return SEARCHERS[name](space, seed=seed)


__all__ = ["SEARCHERS", "CubicSampler", "DSXGBSearch", "GridSearch", "Observations", "RandomSearch",
           "SpaceSampler", "TPESearch", "distributions", "make_sampler"]
