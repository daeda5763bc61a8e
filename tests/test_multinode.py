"""Trials whose ranks span Ray nodes, on a real multi-node Ray cluster made on this machine
(`ray.cluster_utils.Cluster`: a GCS, and a raylet per node with its own workers and resources).

The head holds no CPUs, so every rank lands on one of the two worker nodes of 2 CPUs, 2 ranks each
(ranks_per_node=2). One short spanning trial runs in the default tier; the lost node and the tune
through `cubic tune --address` are `slow` (`make test-slow`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cubic_harness.config import TrialConfig, TrialResult
from cubic_harness.trial import run_trial
from cubic_harness.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


@pytest.fixture(scope="module")
def cluster() -> Iterator:
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # another test's Ray: the runner must attach to this cluster, not that one
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "object_store_memory": 100 * MB})
    for _ in range(2):
        c.add_node(num_cpus=2, object_store_memory=100 * MB)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def runner(cluster) -> Iterator:
    from cubic.execution.runner import RayRunner

    r = RayRunner(address=cluster.address, isolation="cores").start()
    try:
        yield r
    finally:
        r.stop()


def _cfg(**kw) -> TrialConfig:
    return TrialConfig(workload=Workload.tiny(), kernel="torch", world_size=4, ranks_per_node=2, batch_size=64,
                       warmup_steps=1, measure_steps=4, windows=2, timeout_s=120).replace(**kw).validate()


def _run(runner, cfg: TrialConfig, during=None) -> TrialResult:
    p = runner.submit(cfg)
    if during:
        during()
    deadline = time.monotonic() + cfg.timeout_s + 120  # the runner's own hard timeout comes first; a bug hangs
    while not (done := runner.wait([p], timeout=1.0)):
        assert time.monotonic() < deadline, f"no result {cfg.timeout_s + 120:.0f} s after submitting"
    return done[0][1]


def _rank_processes() -> list[psutil.Process]:
    """Processes of any trial's rank actors (each carries CUBIC_TRIAL_RANK in its environment)."""
    out = []
    for p in psutil.process_iter():
        try:
            if "CUBIC_TRIAL_RANK" in p.environ() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return out


def test_a_4_rank_trial_spans_2_nodes_and_computes_what_1_node_computes(runner) -> None:
    cfg = _cfg()
    assert runner.spans(cfg)
    t0 = time.time()
    res = _run(runner, cfg)
    outside_s = time.time() - t0
    assert res.status == "ok", res.error
    ids = res.env["rank_node_ids"]
    assert res.env["placement"] == "nodes" and res.env["nodes"] == 2
    assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]  # ranks_per_node=2, as configured
    # startup_s is the trial's start to its first training step: inside the trial's wall time, leaving room for
    # the measured steps after it (both rounded to 0.01 s), and within what the caller waited
    startup, wall = res.env["startup_s"], res.env["wall_s"]
    measured_s = sum(cfg.global_batch * cfg.measure_steps / cfg.windows / q for q in res.window_qps)
    assert 0 < startup <= wall - measured_s + 0.02 and wall <= outside_s + 0.01, (startup, wall, measured_s)
    local = run_trial(cfg)  # the same trial as spawned processes on this one node
    assert local.status == "ok" and local.env["nodes"] == 1 and local.env["placement"] == "local"
    assert res.losses == pytest.approx(local.losses, rel=1e-6, abs=1e-7)
    assert res.ne == pytest.approx(local.ne, rel=1e-6)
    assert not _rank_processes(), "rank actors outlived their trial"


def test_a_placement_the_cluster_cannot_give_fails_at_once(runner) -> None:
    t0 = time.monotonic()
    res = _run(runner, _cfg(world_size=8))  # 4 nodes of 2 ranks; the cluster has 2
    assert res.status == "error" and time.monotonic() - t0 < 30
    assert res.error.startswith("placement infeasible: 4 nodes with 2 CPU each are needed"), res.error
    assert "the cluster has 2 such of 3 alive" in res.error


def test_a_crashed_rank_fails_the_multinode_trial_with_its_reason_and_the_next_runs(runner, monkeypatch) -> None:
    """The default tier's multi-node failure: a rank dies mid-trial across 2 nodes; the trial is an error naming
    the rank and its exception, no rank process outlives it, and the next trial on the same cluster runs."""
    monkeypatch.setenv("CUBIC_INJECT_FAULT", "crash")  # the runner hands it to the cluster's workers
    res = _run(runner, _cfg())
    assert res.status == "error" and res.error.startswith("rank 1: RuntimeError: injected crash"), res.error
    monkeypatch.delenv("CUBIC_INJECT_FAULT")
    assert not _rank_processes()
    res = _run(runner, _cfg())
    assert res.status == "ok" and res.env["nodes"] == 2, res.error


@pytest.mark.slow  # ~40 s: a lost node, a node added back
def test_a_lost_node_fails_the_trial_with_its_reason_and_the_next_runs(cluster, runner, monkeypatch) -> None:
    workers = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
    victim = workers[-1]

    def remove_when_training() -> None:  # rank 1 hangs after its first step: the others wait in a collective
        deadline = time.monotonic() + 60
        while len(_rank_processes()) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5)
        cluster.remove_node(victim)

    t0 = time.monotonic()
    monkeypatch.setenv("CUBIC_INJECT_FAULT", "hang")
    res = _run(runner, _cfg(timeout_s=100), during=remove_when_training)
    monkeypatch.delenv("CUBIC_INJECT_FAULT")
    assert res.status == "error" and time.monotonic() - t0 < 90, res.error  # not the 100 s timeout
    assert "its node died" in res.error and f"(id {victim.node_id[:12]})" in res.error, res.error
    deadline = time.monotonic() + 20
    while _rank_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _rank_processes(), "rank processes survived the lost node"
    cluster.add_node(num_cpus=2, object_store_memory=100 * MB)
    cluster.wait_for_nodes()
    res = _run(runner, _cfg())
    assert res.status == "ok" and res.env["nodes"] == 2, res.error


@pytest.mark.slow  # ~60 s: a 3-trial tune whose every trial spans both nodes
def test_cubic_tune_address_runs_every_trial_across_both_nodes(cluster, tmp_path: Path) -> None:
    from cubic.results.analysis import load_study

    space = (ROOT / "search_spaces" / "tiny.yaml").read_text()
    assert "world_size: 2" in space
    space = space.replace("world_size: 2", "world_size: 4\n  ranks_per_node: 2", 1)
    (tmp_path / "s.yaml").write_text(space)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-m", "cubic", "tune", "--space", str(tmp_path / "s.yaml"), "--run-dir",
                        str(tmp_path / "run"), "--trials", "3", "--no-live", "--address", cluster.address],
                       cwd=ROOT, env={**env, "CI": "true"}, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    df = load_study(tmp_path / "run")
    done = df[df["state"] == "COMPLETE"]
    assert len(done) >= 3 and (done["env_nodes"] == 2).all() and (done["env_placement"] == "nodes").all()
    assert all(len(set(ids.split(","))) == 2 for ids in done["env_rank_node_ids"])
