"""What every role of one tune shares (`Tuning`): the space, the store, the cluster, the view, the policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna

from cubic.execution.memory_check import refusal as memory_refusal
from cubic.execution.runner import Pending, Runner
from cubic.space.search_space import SearchSpace
from cubic.study.lease import TunerLease
from cubic.study.record import TrialRecord
from cubic.study.store import Store
from cubic.tune.policy import Policy
from cubic.tune.view import TuneView
from cubic_harness.config import TrialConfig, TrialResult


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

    def launch(self, trial: optuna.Trial, cfg: TrialConfig, attrs: dict[str, Any], tag: Any) -> Pending | None:
        """Start `trial` (its attrs stored first) on the cluster, or finish it at once where the memory model
        says `cfg` cannot fit: recorded as out of memory, never started (None)."""
        self.store.start(trial, attrs)
        refused = memory_refusal(cfg) if self.policy.checks_memory else None
        if refused is None:
            return self.runner.submit(cfg, tag=tag)
        why, pred = refused
        res = TrialResult.failed("oom", f"not launched: {why}", cfg, env={"backend": "real", "launched": False},
                                 extra={"predicted_mem_mb": round(pred.peak_mb, 1),
                                        "predicted_mem_per_position_mb": [round(m, 1) for m in pred.mem_mb],
                                        "mem_limit_mb": round(pred.limit_mb, 1)})
        self.view.add(self.store.finish(trial, res), None)
        self.view.note(f"trial {trial.number} not launched: {why}")
        return None
