"""The simulator: the harness's second trial backend (`TrialConfig` in, `TrialResult` out).

`simulate(cfg, cluster)` plans the configuration with the harness's own planner priced on the
cluster, prices one step with the performance model (harness/sim/perf.py) and returns the result a
real trial would: qps, step time, the per-phase breakdown, per-rank memory, the plan; status `oom`
naming the rank and the bytes over when a rank's memory exceeds what its device has (or the
config's mem_cap_mb), `error` when the cluster cannot run it at all. It says nothing about quality:
`ne` and the losses stay empty and `extra.quality` says so; `extra.figures` says which of the
cluster's figures were measured (`cubic calibrate`) and which assumed (a preset's). It never
imports the tuner.
"""

from __future__ import annotations

import datetime
import math

from cubic_harness.config import TrialConfig, TrialResult, env_overrides
from cubic_harness.errors import ConfigError
from cubic_harness.planning import plan_for
from cubic_harness.sharding.planner import PlanError
from cubic_harness.sim.cluster import Cluster
from cubic_harness.sim.perf import ModelError, estimate
from cubic_harness.sim.provenance import split

NO_QUALITY = "not measured: a simulated trial predicts speed and memory, never model quality"


def sim_env(cfg: TrialConfig, c: Cluster) -> dict:
    """The real backend's env keys, with what the simulation stands for."""
    nodes = math.ceil(cfg.world_size / c.devices_per_node)
    return {"backend": "sim", "cluster": c.name, "framework": c.framework, "torch": None, "fbgemm": None,
            "device": c.device.type,
            "device_name": f"simulated {c.device.type} ({c.name})", "world_size": cfg.world_size,
            "hostname": "", "cpus": c.device.cores or c.devices, "omp_wait_policy": "n/a", "niceness": None,
            "ids": cfg.workload.ids_record(), "env_overrides": env_overrides(),
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "placement": "simulated",
            # a simulated rank's node is rank // devices_per_node, not a measurement: not listed (16,384 names would
            # be most of each stored trial of a large study, read back by every proposal)
            "nodes": nodes, "rank_nodes": [],
            "wall_s": 0.0, "startup_s": 0.0}


POSITIONS_LISTED = 1024  # a larger group's per-position figures are stored as a summary
OFFLOAD_LISTED = 8  # likewise the shards each position moved to host memory (a list per position)


def per_position(xs: list[float]) -> list[float] | dict[str, float]:
    """One figure per group position, or beyond POSITIONS_LISTED its max (and where), mean and count: what a
    reader of a 16,384-GPU trial looks at, and `cubic trial --backend sim --config` re-derives the rest."""
    if len(xs) <= POSITIONS_LISTED:
        return xs
    worst = max(range(len(xs)), key=xs.__getitem__)
    return {"max": xs[worst], "argmax": worst, "mean": sum(xs) / len(xs), "positions": len(xs)}


def offloaded(offload: dict[int, list[dict]]) -> dict[str, list[dict]]:
    """The shards in host memory per group position; beyond OFFLOAD_LISTED positions only the one that moved
    the most rows, and how many moved any (a trial's record stays small: a tune stores and reads back every
    record; `cubic trial --backend sim --config` re-derives the rest)."""
    if len(offload) <= OFFLOAD_LISTED:
        return {str(p): v for p, v in offload.items()}
    worst = max(offload, key=lambda p: sum(x["rows"] for x in offload[p]))
    return {str(worst): offload[worst], "positions": len(offload)}


def check_holds(cfg: TrialConfig, c: Cluster, where: str) -> None:
    """ConfigError (one line) when the cluster cannot hold `cfg`'s ranks at all: bad input, not a failed trial
    (a tune's own proposals that do not fit fail as trials; its baseline must fit)."""
    if cfg.world_size > c.devices:
        raise ConfigError(f"{where}: world_size={cfg.world_size}: cluster {c.name} holds {c.devices:,} devices "
                          f"({c.nodes} nodes x {c.devices_per_node})")


def simulate(cfg: TrialConfig, c: Cluster) -> TrialResult:
    """Predict one trial of `cfg` on cluster `c`; never raises for a config the cluster cannot run."""
    env = sim_env(cfg, c)
    # which figures the prediction rests on were measured, which assumed (harness/sim/provenance.py)
    extra = {"quality": NO_QUALITY, "figures": split(c.figures)}
    try:
        cfg.validate()
        plan = plan_for(cfg, c)
        est = estimate(cfg, plan, c)
    except PlanError as e:
        return TrialResult.failed("oom" if "mem_cap" in str(e) else "error", str(e), cfg, env=env, extra=extra)
    except (ModelError, ConfigError) as e:
        return TrialResult.failed("error", str(e), cfg, env=env, extra=extra)
    worst = max(range(len(est.mem_mb)), key=lambda p: est.mem_mb[p])
    peak = est.mem_mb[worst]
    limit = min(est.mem_limit_mb, cfg.mem_cap_mb or math.inf)
    extra["sim"] = {"comm_ms": est.comm_ms, "mem_mb": per_position(est.mem_mb), "mem_limit_mb": limit,
                    "emb_fwd_ms": per_position(est.per_rank["emb_fwd"]),
                    "emb_bwd_ms": per_position(est.per_rank["emb_bwd"])}
    if cfg.comm_overlap != "none":  # as a real trial reports it
        extra["comm_hidden_ms"] = est.comm_hidden_ms
    if est.offload:  # Neo's hierarchy: shards in host memory behind a device-side cache, per group position
        extra["sim"]["offload"] = offloaded(est.offload)
    if peak > limit:
        what = "mem_cap_mb" if limit == cfg.mem_cap_mb else f"its device's memory on {c.name}"
        return TrialResult.failed("oom", f"rank {worst}: needs {peak:,.0f} MB, {peak - limit:,.0f} MB over "
                                  f"{what} ({limit:,.0f} MB)", cfg, env=env, extra=extra, peak_mem_mb=peak,
                                  plan=plan.to_list())
    return TrialResult(status="ok", qps=est.qps, qps_cv=0.0, step_ms_p50=est.step_ms, step_ms_p90=est.step_ms,
                       peak_mem_mb=peak, breakdown_ms=est.breakdown_ms, config=cfg.to_dict(), env=env,
                       window_qps=[est.qps], plan=plan.to_list(), extra=extra)


def features(cfg: TrialConfig, c: Cluster | None = None) -> dict[str, float]:
    """The simulator's prediction as the proxy's features (the local cluster by default); NaNs where
    it has none (no calibration, an illegal plan), under the same names, so columns never shift."""
    from cubic_harness.sim.cluster import local_cluster
    from cubic_harness.sim.perf import FEATURE_NAMES

    c = c or local_cluster()
    try:
        if c is None:
            raise ModelError("no clusters/local.yaml: run cubic calibrate")
        return estimate(cfg, plan_for(cfg, c, check_memory=False), c).features
    except (PlanError, ModelError, ConfigError):
        return dict.fromkeys(FEATURE_NAMES, float("nan"))
