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
    if cfg.sharding == "file":
        from cubic_harness.sharding.plan_file import load_plan

        return check_constraints(cfg, check_fits(cfg, load_plan(cfg), cluster) if check_memory else load_plan(cfg))
    if cfg.sharding == "torchrec_planner":
        from cubic_harness.torchrec_planner import torchrec_plan

        return check_constraints(cfg, torchrec_plan(cfg, cluster, allowed, check_memory))
    return make_plan(cfg, TableCosts(cluster), check_memory, allowed)


def check_fits(cfg: TrialConfig, plan: ShardingPlan, cluster: Cluster | None) -> ShardingPlan:
    """`plan`, or PlanError naming the rank that cannot hold it and its largest table there (a given plan is
    not re-planned to fit: it runs as it is, or not)."""
    from cubic_harness.sharding.planner import PlanError
    from cubic_harness.sim.perf import ModelError, estimate

    if cluster is None:
        return plan
    try:
        est = estimate(cfg, plan, cluster)
    except ModelError:
        return plan
    limit = min(est.mem_limit_mb, cfg.mem_cap_mb or float("inf"))
    worst = max(range(len(est.mem_mb)), key=est.mem_mb.__getitem__)
    if est.mem_mb[worst] <= limit:
        return plan
    big = max(plan.shards_on(worst), key=lambda s: s.rows * s.dim, default=None)
    table = plan.tables[big.table].name if big else "its data-parallel tables"
    raise PlanError(f"{cfg.plan_file}: rank {worst} needs {est.mem_mb[worst]:,.0f} MB, over its {limit:,.0f} MB "
                    f"(mem_cap_mb or the device's memory); its largest table there: {table}")
