"""Common base of cubic's searchers: Optuna samplers that propose whole configurations.

Every searcher proposes one joint configuration per trial (`sample_relative` over all knobs),
canonical (meaningless knobs at their defaults), valid (TrialConfig.validate passes) and never
one already tried or in flight: a real trial costs minutes, so no searcher may spend one twice.
The baseline configuration is always the first trial. A searcher may declare itself done
(`should_stop`: space exhausted, or its own early stopping).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from cubic.quality.screen import excluded_tuples, failing_changes, ruled_out
from cubic.quality.screen import load as load_screen
from cubic.space.search_space import SearchSpace
from cubic.study.record import NOT_RUN

MAX_REDRAWS = 20  # proposals a searcher may redraw because the quality screen ruled them out


def distributions(space: SearchSpace) -> dict[str, BaseDistribution]:
    return {k: CategoricalDistribution(list(kn.choices)) for k, kn in space.knobs.items()}


@dataclass
class Observations:
    """What the study knows, as canonical configuration tuples.

    A trial that fails quality through a change the screen ruled out is not in `quality_failed`:
    the exclusion keeps every configuration with that change out already, and as a feasibility
    example it would blame its other knobs too (where SGD tables and 4x the batch were tried
    mostly with bf16 dense math, the classifier learned bf16 dense as infeasible). The screen's
    passed changes, each run alone, are feasible examples (`quality_passed`)."""

    seen: set[tuple] = field(default_factory=set)  # tried, running, queued or screened out: never propose
    ok: list[tuple] = field(default_factory=list)  # COMPLETE, in trial order
    qps: list[float] = field(default_factory=list)
    failed: list[tuple] = field(default_factory=list)  # FAIL for a reason of the config's own
    order: list[float] = field(default_factory=list)  # objective per finished trial (failed = 0)
    # COMPLETE, but its NE fails the gate for no change the screen ruled out (those are `excluded`)
    quality_failed: list[tuple] = field(default_factory=list)
    quality_passed: list[tuple] = field(default_factory=list)  # a change the screen passed, alone
    ruled_out: frozenset = frozenset()  # numerics changes the quality screen failed (cubic.quality.screen)
    excluded: frozenset = frozenset()  # the enumerable configurations with one of them (all in seen)

    @classmethod
    def of(cls, study: optuna.Study, space: SearchSpace, exclude: int | None = None,
           feasible: Mapping[int, bool | None] | None = None) -> Observations:
        """`feasible`: each finished trial's quality verdict by number (`TrialRecord.feasible`, which
        cubic keeps in its own table, not in the Optuna trial the sampler sees); none where unknown."""
        obs = cls()
        feasible = feasible or {}
        # a configuration with a change that fails held-out quality alone is not worth a trial
        obs.ruled_out = ruled_out(study.user_attrs)
        for t in study.get_trials(deepcopy=False):
            if t.number == exclude:
                continue
            params = t.params or t.system_attrs.get("fixed_params") or {}
            if set(params) != set(space.knobs):
                continue
            tup = space.tup(params)
            if t.state == TrialState.COMPLETE and t.value is not None:
                obs.ok.append(tup)
                obs.qps.append(float(t.value))
                obs.order.append(float(t.value))
                if feasible.get(t.number) is False and not obs.screened_out(space, tup):
                    obs.quality_failed.append(tup)
            elif t.state == TrialState.FAIL:
                if t.user_attrs.get("status") in NOT_RUN:  # FAIL trials that say nothing about their config
                    continue
                obs.failed.append(tup)
                obs.order.append(0.0)
            obs.seen.add(tup)
        obs.excluded = excluded_tuples(space, obs.ruled_out)
        obs.seen |= obs.excluded
        obs.quality_passed = [space.tup(x.params) for x in load_screen(study.user_attrs)
                              if x.ok and set(x.params) == set(space.knobs)]
        return obs

    def screened_out(self, space: SearchSpace, tup: tuple) -> bool:
        return bool(failing_changes(space, space.params_of(tup), self.ruled_out))


class SpaceSampler(optuna.samplers.BaseSampler):
    """Base: dedupe, baseline first, what it knew of its proposal (`last_info`, which the tuner stores
    with the trial); subclasses implement `propose`."""

    name = "base"

    def __init__(self, space: SearchSpace, seed: int = 0) -> None:
        self.space, self.seed = space, seed
        self.rng = np.random.default_rng(seed)
        self.baseline = space.tup(space.baseline_params())
        self.last_info: dict[str, Any] = {}
        # each finished trial's quality verdict (`Store.feasible`); the tuner connects it to its store
        self.feasible: Callable[[], Mapping[int, bool | None]] = dict

    def observations(self, study: optuna.Study, exclude: int | None = None) -> Observations:
        return Observations.of(study, self.space, exclude=exclude, feasible=self.feasible())

    # ------------------------------------------------------------------ Optuna interface
    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return distributions(self.space)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        obs = self.observations(study, exclude=trial.number)
        if self.baseline not in obs.seen:
            tup, info = self.baseline, {"phase": "baseline"}
        else:
            tup, info = self.propose(study, trial, obs)
            for _ in range(MAX_REDRAWS):  # spaces too large to enumerate: screened-out ones are not in seen
                if tup is None or not obs.screened_out(self.space, tup):
                    break
                obs.seen.add(tup)
                tup, info = self.propose(study, trial, obs)
            if tup is not None and obs.screened_out(self.space, tup):
                tup = None
            if tup is None:  # nothing left: the loop stops on should_stop(); keep Optuna consistent
                tup, info = self.baseline, {"phase": "exhausted"}
        self.last_info = {"phase": self.name, "predicted_qps": None, "predicted_std": None, **info}
        return self.space.params_of(tup)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        choices = param_distribution.choices  # type: ignore[attr-defined]
        return choices[int(self.rng.integers(len(choices)))]

    def reseed_rng(self) -> None:
        self.rng = np.random.default_rng(self.rng.integers(2**31))

    # ------------------------------------------------------------------ searcher interface
    def propose(self, study: optuna.Study, trial: FrozenTrial, obs: Observations) -> tuple[tuple | None, dict]:
        """The next configuration (canonical tuple not in obs.seen) and user attrs about it."""
        raise NotImplementedError

    def should_stop(self, study: optuna.Study) -> bool:
        """True when the searcher has nothing (useful) left to propose."""
        n = self.space.size() if self.space.all_tuples is not None else None
        return n is not None and len(self.observations(study).seen) >= n

    def random_unseen(self, obs: Observations) -> tuple | None:
        return self.space.random_tuple(self.rng, obs.seen)
