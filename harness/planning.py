"""The sharding plan a trial runs: the harness's planner, priced by the performance model.

`sharding: torchrec_planner` is TorchRec's own planner on the same cluster (harness/torchrec_planner.py).
The planner (harness/sharding/planner.py) takes a table cost and the performance model
(harness/sim/perf.py) takes a plan; neither imports the other. This module joins them: a real trial
plans with the local cluster's prices (clusters/local.yaml), a simulated one with its cluster's, so a
simulation of this machine prices exactly the plan a real trial runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from cubic_harness.config import SHARDING_TYPES, TrialConfig
from cubic_harness.sharding.plan import ShardingPlan
from cubic_harness.sharding.planner import check_constraints, make_plan
from cubic_harness.sim.cluster import Cluster, local_cluster
from cubic_harness.sim.perf import TableCosts


def plan_for(cfg: TrialConfig, cluster: Cluster | None = None, check_memory: bool = True,
             allowed: Iterable[str] = SHARDING_TYPES) -> ShardingPlan:
    """`cfg`'s plan priced on `cluster` (default: this machine, by bytes alone before its first
    calibration); PlanError when none is legal. `allowed`: the sharding kinds the backend runs, which
    `sharding: plan` chooses among."""
    cluster = cluster or local_cluster()
    if cfg.sharding == "torchrec_planner":
        from cubic_harness.torchrec_planner import torchrec_plan

        return check_constraints(cfg, torchrec_plan(cfg, cluster, allowed, check_memory))
    return make_plan(cfg, TableCosts(cluster), check_memory, allowed)
