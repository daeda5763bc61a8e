"""Memory predicted before it runs out (issue 35 item 9): the performance model's per-rank peak against real
trials' measured peak RSS, and the tuner's refusal to launch a configuration predicted over its limit."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from rich.console import Console

from cubic.execution.memory_check import predict, refusal
from cubic.execution.runner import Pending
from cubic.space.search_space import load_space
from cubic.study.store import Store, open_storage, storage_url
from cubic.tune import Tuner
from cubic_harness.config import TrialConfig, TrialResult
from cubic_harness.sim.calibrate import framework_step
from cubic_harness.trial import run_trial
from cubic_harness.workload import Workload
from tests.helpers import fixture_cluster, fixture_cluster_as_local

# benchmarks/bench_memory.py's held-out set (benchmarks/data/memory.json): median |error| 3.6%, worst 16.6% (n=34)
BOUND = 0.25


@pytest.fixture(scope="module")
def process_mb() -> float:
    """The fixed term calibrated where the trials run, as `cubic calibrate` does (`framework_step`, the bare
    rank its process_mb comes from): what a rank holds before any model state depends on the process that
    forks it (its fork server's pages, a spawned rank's own imports), not only on the machine."""
    return framework_step()["peak_mem_mb"]


@pytest.mark.parametrize("knobs", [
    {"sharding": "table_wise", "batch_size": 1024, "emb_precision": "fp16"},
    {"sharding": "row_wise", "batch_size": 2048, "pipeline_depth": 1, "comm_precision": "bf16"},
    {"sharding": "data_parallel", "batch_size": 512},
], ids=["table_wise-fp16", "row_wise-pipelined", "data_parallel"])
def test_predicted_peak_memory_is_near_the_measured_peak_rss(knobs: dict, process_mb: float) -> None:
    """The `small` workload's 0.4 GB of tables on 2 gloo ranks: the tables are a good part of each rank."""
    cfg = TrialConfig(workload=Workload.small(), world_size=2, warmup_steps=1, measure_steps=2, windows=1,
                      timeout_s=120, **knobs)
    with fixture_cluster_as_local() as c:
        c = dataclasses.replace(c, device=dataclasses.replace(c.device, process_mb=process_mb))
        p = predict(cfg, c)
        res = run_trial(cfg)
    assert res.status == "ok", res.error
    assert p is not None and len(p.mem_mb) == 2
    assert abs(p.peak_mb / res.peak_mem_mb - 1) < BOUND, (p.peak_mb, res.peak_mem_mb, process_mb,
                                                          res.env["rank_start"], res.env["rank_start_mb"])


def test_the_refusal_names_the_prediction_the_limit_and_what_it_is() -> None:
    c = fixture_cluster()
    cfg = TrialConfig(workload=Workload.tiny(), world_size=1, batch_size=65536, kernel="torch")
    assert refusal(cfg, c) is None  # the node's 23.5 GB is far away
    why, p = refusal(cfg.replace(mem_cap_mb=700), c)
    assert p.peak_mb > 700 == p.limit_mb and p.limit_what == "mem_cap_mb"
    assert f"{p.peak_mb:,.0f} MB" in why and "over mem_cap_mb (700 MB" in why and "position 0" in why
    # without a cap the limit is the rank's share of the node's host memory
    big = TrialConfig(workload=Workload.tiny(), world_size=1, batch_size=2**24, kernel="torch")
    why, p = refusal(big, c)
    assert p.limit_mb == pytest.approx(23.5 * 1024) and "host memory" in why
    # a plan over the cap is the planner's own oom, as before: no prediction, the trial reports it
    assert predict(cfg.replace(mem_cap_mb=0.01), c) is None


SPACE = """\
name: memcheck
workload: {preset: tiny}
baseline: {world_size: 1, sharding: table_wise, batch_size: 32, kernel: torch}
knobs:
  batch_size: [32, 65536, 64]
constraints: {mem_cap_mb: 700}
trial: {warmup_steps: 1, measure_steps: 2, windows: 1, timeout_s: 300, repeats: 1}
budget: {trials: 3, confirm_top_k: 0}
"""


class InlineRunner:
    """The tuner's runner interface, each trial run in this process's own rank processes (no Ray); it
    records every configuration it was asked to start."""

    simulated = False
    backend = "real"
    cpus = 1.0

    def __init__(self) -> None:
        self.submitted: list[TrialConfig] = []

    def has_room(self, pending: list[Pending]) -> bool:
        return not pending

    def submit(self, cfg: TrialConfig, tag: Any = None) -> Pending:
        self.submitted.append(cfg)
        return Pending(cfg, None, 1.0, tag=tag)

    def wait(self, pending: list[Pending], timeout: float = 1.0) -> list[tuple[Pending, TrialResult]]:
        return [(p, run_trial(p.cfg)) for p in pending]

    def stop(self) -> None:
        pass


def test_the_tuner_records_a_predicted_oom_without_launching_it_and_goes_on(tmp_path: Path) -> None:
    """Grid order: the baseline (batch 32), then batch 65536 - predicted ~950 MB a rank, over mem_cap_mb 700 -
    then batch 64. The middle one is recorded failed "oom" with the numbers, its trial never started."""
    (tmp_path / "space.yaml").write_text(SPACE)
    space = load_space(tmp_path / "space.yaml")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    store = Store(space, open_storage(storage_url(tmp_path, must_exist=False)), tmp_path)
    runner = InlineRunner()
    console = Console(record=True, width=200)
    with fixture_cluster_as_local():
        Tuner(space, store, runner, searcher="grid", console=console, live=False).run()
    trials = {t.params["batch_size"]: t for t in store.trials()}
    assert [t.params["batch_size"] for t in sorted(trials.values(), key=lambda t: t.number)] == [32, 65536, 64]
    assert [c.batch_size for c in runner.submitted] == [32, 64]  # 65536 was never started
    assert trials[32].state == trials[64].state == TrialState.COMPLETE  # the search went on after it
    refused = trials[65536]
    ua = refused.user_attrs
    assert refused.state == TrialState.FAIL and ua["status"] == "oom"
    res = ua["result"]
    assert res["extra"]["mem_limit_mb"] == 700 < res["extra"]["predicted_mem_mb"]
    assert res["env"]["launched"] is False and res["peak_mem_mb"] == 0 and not res["window_qps"]
    assert ua["error"].startswith("not launched: predicted peak memory")
    assert f"{res['extra']['predicted_mem_mb']:,.0f} MB" in ua["error"] and "mem_cap_mb (700 MB" in ua["error"]
    assert store.budget_used() == 3  # counted as a trial, as the simulator's predicted OOMs are
    assert f"trial {refused.number} not launched: predicted peak memory" in console.export_text()
