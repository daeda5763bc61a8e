"""Why the winner's plan wins: the winner's and the baseline's modelled step by phase and by rank, the critical
rank of each, and the tables the winner lays out differently (the report's figure and table, the export's
`plan_why`).

Modelled, not measured: both trials are priced by the performance model (`cubic_harness.sim.explain`) on the
cluster the study ran on (a simulated study's own cluster; a real one's calibration of this machine), each
with its own configuration, so the phases say where the winner's step went, not what a trial timed.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from cubic.results import analysis
from cubic_harness.config import TrialConfig
from cubic_harness.errors import ConfigError

CHANGED_SHOWN = 20  # tables listed in the report's table; the export lists every one


def cluster_of(df: pd.DataFrame) -> Any:
    """The cluster the study's trials ran on or were priced for (None when it cannot be loaded)."""
    from cubic_harness.sim.cluster import local_cluster, resolve

    backend = str(df.attrs.get("backend") or "real")
    try:
        return resolve(backend.removeprefix("sim:")) if backend.startswith("sim:") else local_cluster()
    except (ConfigError, OSError):
        return None


def plan_why(df: pd.DataFrame) -> dict[str, Any] | None:
    """{cluster, tables, views (baseline, winner: `PlanView.to_dict`), changed (table, baseline, winner)}; None where
    the study has no winner, no baseline plan or no cluster to price them on."""
    from cubic_harness.sharding.plan import ShardingPlan
    from cubic_harness.sim.explain import versus

    win = df.attrs.get("winner") or {}
    base = analysis.baseline_rows(df)
    base = base[base["ok"]]
    if not win.get("config") or not len(base) or "plan" not in df:
        return None
    wrow = df[df["number"] == win["trial"]]
    c = cluster_of(df)
    if not len(wrow) or c is None:
        return None
    runs = {}
    for label, cfg_d, plan in ((f"baseline #{int(base['number'].iloc[0])}", base["config"].iloc[0],
                                base["plan"].iloc[0]),
                               (f"winner #{int(win['trial'])}", win["config"], wrow["plan"].iloc[0])):
        if not plan or not cfg_d:
            return None
        cfg = TrialConfig.from_dict(cfg_d)
        dims = [t.dim for t in cfg.workload.tables]
        runs[label] = (cfg, ShardingPlan.from_list(plan, cfg.group_size, cfg.world_size, dims))
    views, changed = versus(runs, c)
    return {"cluster": c.name, "tables": cfg.workload.num_tables, "views": [v.to_dict() for v in views],
            "changed": [{"table": d.table, "baseline": d.before, "winner": d.after} for d in changed]}
