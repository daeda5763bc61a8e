"""Memory before launch: the performance model's per-rank peak of a real trial, and a refusal when it
would not fit (issue 35 item 9).

The tuner asks `refusal(cfg)` before it starts a real trial: the configuration is planned as the trial
would plan it (`cubic_harness.planning.plan_for`, priced on the machine's calibrated cluster) and
`cubic_harness.sim.perf.estimate` predicts each group position's peak memory (a CPU rank's RSS, a GPU's
allocated bytes). Over the limit - `mem_cap_mb` if the space sets one, else what one rank has on that
cluster (its GPU's memory, or its share of the node's host memory) - the trial is not launched: it
would only run until the memory ran out. benchmarks/bench_memory.py measures how far the prediction is
from real trials' peaks.

Where the model cannot say (no calibration of this machine, a CUDA trial on a CPU calibration, a kernel
the calibration did not measure, no legal plan) there is no refusal: the trial runs and fails or not as
it always did (a plan over mem_cap_mb is the planner's own "oom", unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cubic_harness.config import TrialConfig
from cubic_harness.errors import ConfigError
from cubic_harness.sim.cluster import Cluster, local_cluster
from cubic_harness.sim.perf import ModelError, estimate


@dataclass(frozen=True)
class MemoryPrediction:
    mem_mb: list[float]  # predicted peak per group position
    position: int  # the position with the highest peak
    limit_mb: float  # min(mem_cap_mb, the rank's memory on the cluster)
    limit_what: str  # what the limit is, in words
    cluster: str

    @property
    def peak_mb(self) -> float:
        return self.mem_mb[self.position]

    @property
    def fits(self) -> bool:
        return self.peak_mb <= self.limit_mb

    def reason(self) -> str:
        return (f"predicted peak memory {self.peak_mb:,.0f} MB on group position {self.position} is "
                f"{self.peak_mb - self.limit_mb:,.0f} MB over {self.limit_what} ({self.limit_mb:,.0f} MB; "
                f"performance model on cluster {self.cluster})")


def trial_cluster(cfg: TrialConfig) -> Cluster | None:
    """The cluster a real trial of `cfg` runs on, as calibrated: this machine's (`local_cluster`), when
    its device is the trial's kind."""
    c = local_cluster()
    if c is None or (c.device.type == "gpu") != (cfg.device == "cuda"):
        return None
    return c


def predict(cfg: TrialConfig, cluster: Cluster | None = None) -> MemoryPrediction | None:
    """Each group position's predicted peak for a real trial of `cfg` on `cluster` (default: the one it
    runs on, `trial_cluster`); None where the model cannot say (see the module docstring)."""
    from cubic_harness.planning import plan_for

    c = cluster or trial_cluster(cfg)
    if c is None:
        return None
    try:
        est = estimate(cfg, plan_for(cfg, c), c)
    except (ConfigError, ModelError):  # PlanError is a ConfigError: the trial reports it as it always did
        return None
    pos = max(range(len(est.mem_mb)), key=lambda p: est.mem_mb[p])
    cap = cfg.mem_cap_mb or math.inf
    if cap < est.mem_limit_mb:
        limit, what = cap, "mem_cap_mb"
    else:
        limit = est.mem_limit_mb
        what = ("its GPU's memory" if c.device.type == "gpu" else
                f"its share of the node's host memory ({c.host_memory_gb:g} GB / "
                f"{min(cfg.world_size, c.devices_per_node)} ranks)")
    return MemoryPrediction(list(est.mem_mb), pos, limit, what, c.name)


def refusal(cfg: TrialConfig, cluster: Cluster | None = None) -> tuple[str, MemoryPrediction] | None:
    """(one-line reason, prediction) when the model predicts a rank of `cfg` to exceed its limit; else None."""
    p = predict(cfg, cluster)
    if p is None or p.fits:
        return None
    return p.reason(), p
