"""Shared test helpers: run real multi-process trials and merge the ranks' table shards; the optional
packages a test needs (`require`); the cluster file the tests ship (`FIXTURE_CLUSTER`)."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from cubic_harness.config import TrialConfig
from cubic_harness.sim.cluster import Cluster, load_cluster, local_cluster
from cubic_harness.trial import run_ranks
from cubic_harness.workload import Workload


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


def require(module_name: str) -> ModuleType:
    """Import an optional package a test needs (torchrec, fbgemm_gpu, triton, ...). Not installed: the test
    skips, except under CI=true, where `make` always installs these, so their absence is a broken environment
    and the test fails. Installed but failing to import (a missing dependency, a library built for another
    torch) is an error either way, never a skip."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise  # the package is there; something it imports is not
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module_name} is not installed, but CI=true: `make` installs it, so this environment "
                        "is broken", pytrace=False)
        pytest.skip(f"{module_name} is not installed", allow_module_level=True)


# The tests' own copy of a calibrated CPU machine (clusters/local.yaml as of when the planner and simulator
# tests were written): `cubic calibrate` writes this machine's file elsewhere, and what a test expects from
# the planners and the simulator must not move when someone recalibrates.
FIXTURE_CLUSTER = Path(__file__).resolve().parent / "data" / "local_cluster.yaml"


def fixture_cluster() -> Cluster:
    return load_cluster(FIXTURE_CLUSTER)


@contextlib.contextmanager
def fixture_cluster_as_local() -> Iterator[Cluster]:
    """FIXTURE_CLUSTER as this machine's cluster (`local_cluster()`, and the trials' rank processes, which
    inherit CUBIC_LOCAL_CLUSTER) for the duration; the previous setting and a fresh lookup after."""
    old = os.environ.get("CUBIC_LOCAL_CLUSTER")
    os.environ["CUBIC_LOCAL_CLUSTER"] = str(FIXTURE_CLUSTER)
    local_cluster.cache_clear()
    try:
        yield local_cluster()
    finally:
        if old is None:
            os.environ.pop("CUBIC_LOCAL_CLUSTER", None)
        else:
            os.environ["CUBIC_LOCAL_CLUSTER"] = old
        local_cluster.cache_clear()
