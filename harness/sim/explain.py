"""Why a plan wins: a plan's modelled step by phase and by rank, beside a rival's, and what differs.

The performance model's own estimate (`perf.estimate`) read per group position: each position's lookups
(forward, backward+optimizer), the step's exchanges (input and pooled all-to-alls, the data-parallel
tables' sync, DDP's all-reduce, 2D's replica merge) and which position is critical, the one whose lookups
set the embedding phases for the whole group (the all-to-alls wait for it).
"""

from __future__ import annotations

from dataclasses import dataclass

from cubic_harness.config import TrialConfig
from cubic_harness.sharding.plan import ShardingPlan, TableChange, plan_diff
from cubic_harness.sim.cluster import Cluster
from cubic_harness.sim.perf import estimate

TOP_POSITIONS = 8  # positions listed per plan: the busiest ones (a 4,096-rank group lists its critical few)


@dataclass(frozen=True)
class PositionLoad:
    position: int
    lookups_fwd_ms: float
    lookups_bwd_ms: float
    mem_mb: float


@dataclass(frozen=True)
class PlanView:
    """One plan's modelled step: by phase, its busiest positions, and the critical one."""

    name: str
    step_ms: float
    phases_ms: dict[str, float]  # lookups, all_to_all, all_reduce, dp_sync, replica_sync, dense, other
    critical: int
    busiest: list[PositionLoad]
    imbalance: float  # critical position's lookups over the mean position's
    lookups_ms: tuple[float, ...] = ()  # every position's lookups, forward + backward (its load)

    def to_dict(self) -> dict:
        return {"name": self.name, "step_ms": self.step_ms, "phases_ms": self.phases_ms, "critical": self.critical,
                "imbalance": self.imbalance, "busiest": [vars(p) for p in self.busiest],
                "lookups_ms": list(self.lookups_ms)}


def view(name: str, cfg: TrialConfig, plan: ShardingPlan, c: Cluster) -> PlanView:
    est = estimate(cfg, plan, c)
    fwd, bwd = est.per_rank["emb_fwd"], est.per_rank["emb_bwd"]
    load = [f + b for f, b in zip(fwd, bwd, strict=True)]
    order = sorted(range(len(load)), key=lambda p: (-load[p], p))
    comm, bd = est.comm_ms, est.breakdown_ms
    phases = {"lookups": bd["emb_fwd"] + bd["emb_bwd"],
              "all_to_all": comm.get("input_a2a", 0.0) + comm.get("pooled_a2a", 0.0),
              "all_reduce": comm.get("ddp_allreduce", 0.0), "dp_sync": comm.get("dp_sync", 0.0),
              "replica_sync": comm.get("replica_sync", 0.0), "dense": bd["dense"] + bd["optim"]}
    phases["other"] = max(0.0, est.step_ms - sum(phases.values()))
    mean = sum(load) / len(load)
    return PlanView(name, est.step_ms, phases, order[0],
                    [PositionLoad(p, fwd[p], bwd[p], est.mem_mb[p]) for p in order[:TOP_POSITIONS]],
                    load[order[0]] / mean if mean > 0 else 1.0, tuple(load))


def compare(cfg: TrialConfig, plans: dict[str, ShardingPlan], c: Cluster) -> tuple[list[PlanView],
                                                                                    list[TableChange]]:
    """Each named plan's view, and what the first changes from the second (table by table)."""
    views = [view(n, cfg, p, c) for n, p in plans.items()]
    names = list(plans)
    diff = plan_diff(plans[names[1]], plans[names[0]]) if len(names) > 1 else []
    return views, diff


def versus(runs: dict[str, tuple[TrialConfig, ShardingPlan]], c: Cluster) -> tuple[list[PlanView],
                                                                                   list[TableChange]]:
    """Each named run's view, each priced with its own configuration (a winner and a baseline differ in
    more than the plan: batch, precisions, kernel), and what the last run's plan changes from the first's."""
    views = [view(n, cfg, p, c) for n, (cfg, p) in runs.items()]
    plans = [p for _, p in runs.values()]
    return views, plan_diff(plans[0], plans[-1]) if len(plans) > 1 else []
