"""What every role of one tune shares (`Tuning`): the space, the store, the cluster, the view, the policy."""

from __future__ import annotations

from dataclasses import dataclass

from cubic.execution.runner import Runner
from cubic.space.search_space import SearchSpace
from cubic.study.lease import TunerLease
from cubic.study.record import TrialRecord
from cubic.study.store import Store
from cubic.tune.policy import Policy
from cubic.tune.view import TuneView


@dataclass
class Tuning:
    space: SearchSpace
    store: Store
    runner: Runner
    view: TuneView
    policy: Policy
    base_key: str  # the baseline configuration's `TrialConfig.key()`
    budget: int  # search trials (quality runs and re-measurements spend none)
    lease: TunerLease | None = None  # held while the tune runs (`Tuner.run`)

    def baseline_of(self, records: list[TrialRecord]) -> TrialRecord | None:
        return next((t for t in records if t.config_key == self.base_key), None)

    def check_lease(self, fresh: bool = False) -> None:
        if self.lease is not None:
            self.lease.check(fresh=fresh)
