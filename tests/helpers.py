"""Shared test helpers: run real multi-process trials and merge the ranks' table shards."""

from __future__ import annotations

import numpy as np

from harness.config import TrialConfig
from harness.trial import run_ranks
from harness.workload import Workload


def tiny_cfg(**kw) -> TrialConfig:
    """Tiny workload, few steps, a learning rate large enough that tables move visibly."""
    base = TrialConfig(workload=Workload.tiny(), batch_size=32, warmup_steps=1, measure_steps=4, windows=1,
                       kernel="torch", emb_lr=0.1, dense_lr=0.05, timeout_s=120)
    return base.replace(**kw)


def train(cfg: TrialConfig) -> tuple[list[float], dict[int, np.ndarray]]:
    """Losses per step and every table (merged from all ranks' shards)."""
    status, error, outs = run_ranks(cfg, collect_tables=True)
    assert status == "ok", error
    tables: dict[int, np.ndarray] = {}
    for out in outs.values():
        for t, w in out["tables"].items():
            if t not in tables:
                tables[t] = w.copy()
            else:
                m = ~np.isnan(w)
                tables[t][m] = w[m]
    for t, w in tables.items():
        assert not np.isnan(w).any(), f"table {t} not fully covered by the shards"
    return outs[0]["losses"], tables


def reference(cfg: TrialConfig, **kw) -> tuple[list[float], dict[int, np.ndarray]]:
    """One process training the same global batches (world 1, batch W*B)."""
    return train(cfg.replace(world_size=1, batch_size=cfg.batch_size * cfg.world_size, sharding_group_size=0,
                             pipeline_depth=0, comm_precision="fp32", **kw))


def max_diff(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> float:
    return max(float(np.abs(a[t] - b[t]).max()) for t in a)
