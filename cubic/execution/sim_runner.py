"""Runs trials on the simulator (`cubic tune --backend sim`): the RayRunner's interface, no Ray.

A simulated trial takes milliseconds, so a Ray task per trial would cost more than the trial: the
runner prices each submitted configuration in this process (cubic_harness.sim.backend.simulate) and hands
the results back at the next `wait`. `has_room` lets the tuner keep BATCH proposals in flight, as it
would with BATCH free workers, so the searcher proposes in batches. The tuner asks `simulated` to
leave out what a simulation cannot judge (the quality gate) and to re-measure nothing (it is
deterministic).
"""

from __future__ import annotations

from typing import Any

from cubic.execution.runner import Pending
from cubic_harness.config import TrialConfig, TrialResult
from cubic_harness.sim.backend import simulate
from cubic_harness.sim.cluster import Cluster

BATCH = 8


class SimRunner:
    simulated = True
    backend = "sim"

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def check(self) -> SimRunner:
        return self

    def start(self) -> SimRunner:
        return self

    def stop(self) -> None:
        pass

    @property
    def cpus(self) -> float:
        return float(BATCH)

    @property
    def gpus(self) -> float:
        return 0.0

    def has_room(self, pending: list[Pending]) -> bool:
        return len(pending) < BATCH

    def spans(self, cfg: TrialConfig) -> bool:
        return False

    def submit(self, cfg: TrialConfig, tag: Any = None) -> Pending:
        return Pending(cfg, simulate(cfg, self.cluster), 1.0, 0.0, tag, running=0.0)

    def wait(self, pending: list[Pending], timeout: float = 1.0) -> list[tuple[Pending, TrialResult]]:
        return [(p, p.ref) for p in pending]
