"""`cubic tune` end to end: real trials (tiny workload) on a real local Ray, real Optuna SQLite store."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from typer.testing import CliRunner

from cubic.execution.runner import STARTED
from cubic.search.samplers import SEARCHERS, distributions, make_sampler
from cubic.space.search_space import load_space
from cubic.study.record import FIELDS, TrialRecord
from cubic.study.store import FLAT_KEYS, Store, open_storage, storage_url
from cubic.tune.candidates import Phase
from cubic_harness.config import TrialResult

ROOT = Path(__file__).resolve().parent.parent
# One-rank trials of the tiny workload: ~4 s each, two at a time on a 2-core machine (isolation: cores).
FAST = """\
name: fast
workload: {preset: tiny}
baseline: {world_size: 1, sharding: table_wise, batch_size: 32, kernel: torch}
knobs:
  batch_size: [32, 64, 128, 256]
  pipeline_depth: [0, 1]
  emb_precision: [fp32, fp16]
constraints: {mem_cap_mb: 3000, quality_tolerance: 0.5}
trial: {warmup_steps: 1, measure_steps: 2, windows: 1, timeout_s: 300, repeats: 1}
budget: {trials: 5, confirm_top_k: 1, isolation: cores}
"""
def cubic_tune(*args: str, timeout: float = 540, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cubic", "tune", "--no-live", *args], cwd=ROOT,  # (pytest-timeout)
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def confirm_order(stdout: str) -> list[int]:
    """The trial numbers of the confirm's re-measurements, in the order the tune printed them."""
    return [int(m.group(1)) for m in re.finditer(r"^#(\d+)\s+confirm\s", stdout, re.M)]


def load(run_dir: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{run_dir / 'study.db'}")


def records(run_dir: Path, name: str) -> dict[int, TrialRecord]:
    """The study's trials as cubic's records (what it learned after each finished is not in Optuna's tables)."""
    from cubic.results import analysis

    return {r.number: r for r in analysis.records(run_dir, name)}


def space_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


def test_end_to_end_tune_writes_every_trial_with_metrics(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = cubic_tune("--space", str(space_file(tmp_path, FAST)), "--run-dir", str(run), "--seed", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "winner" in r.stdout and "x the baseline" in r.stdout
    assert str(run) in r.stdout.replace("\n", "")  # (a long path wraps at the terminal's width)
    study = load(run, "fast")
    trials = study.get_trials()
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(done) == 5 == len(trials)
    assert trials[0].user_attrs["phase"] == "baseline" and trials[0].params == {
        "batch_size": 32, "pipeline_depth": 0, "emb_precision": "fp32"}
    assert len({t.user_attrs["config_key"] for t in done}) == 5
    for t in done:
        ua = t.user_attrs
        assert t.value == ua["qps"] == ua["result"]["qps"] > 0
        assert set(FLAT_KEYS) <= set(ua) and ua["status"] == "ok" and ua["ne"] > 0 and ua["peak_mem_mb"] > 0
        assert {"searcher", "phase", "predicted_qps", "predicted_std", "config_key", "config"} <= set(ua)
        assert ua["searcher"] == "cubic" and ua["config"]["batch_size"] == t.params["batch_size"]
        assert (run / "trials" / f"{t.number:04d}.json").exists()
    # trials ran concurrently on Ray (isolation: cores: one CPU each, two CPUs)
    spans = sorted((t.datetime_start, t.datetime_complete) for t in done)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))
    # confirm: re-measured on the original trials, quality-gated, winner recorded
    w = study.user_attrs["winner"]
    assert {"trial", "qps", "qps_spread", "speedup", "baseline_qps", "config"} <= set(w)
    assert study.user_attrs["space"]["baseline_config"]["batch_size"] == 32
    recs = records(run, "fast")
    wt = recs[w["trial"]]
    assert wt.quality_ok is True and len(wt.confirm_qps) == 1
    assert len(recs[0].confirm_ne) == 1 and recs[0].quality_reason == "baseline"
    if w["trial"] != 0:  # its one re-measurement ran right after the baseline's, and is judged against it
        assert wt.confirm_base_qps == recs[0].confirm_qps
    # what cubic added after the trials finished is in its own table, not written into Optuna's
    assert not any(set(FIELDS) & set(t.user_attrs) for t in trials)
    assert w["speedup"] == pytest.approx(w["qps"] / w["baseline_qps"])
    # running the finished study again changes nothing and exits 0
    r2 = cubic_tune("--space", str(space_file(tmp_path, FAST)), "--run-dir", str(run))
    assert r2.returncode == 0, r2.stderr
    assert len(load(run, "fast").get_trials()) == 5


def gated(name: str, knobs: str, trials: int) -> str:
    """A tiny space whose gate (tolerance 0) passes only exact configurations; `knobs` in grid order."""
    return f"""\
name: {name}
workload: {{preset: tiny}}
baseline: {{world_size: 1, sharding: table_wise, batch_size: 32, kernel: torch, pipeline_depth: 0}}
knobs:
{knobs}
constraints: {{mem_cap_mb: 3000, quality_tolerance: 0.0}}
trial: {{warmup_steps: 1, measure_steps: 4, windows: 1, timeout_s: 300, repeats: 2}}
budget: {{trials: {trials}, confirm_top_k: 1, isolation: cores}}
"""


# Bigger batches are faster but change numerics; with tolerance 0 only exact configurations pass.
GATED = gated("gated", "  batch_size: [32, 256]\n  pipeline_depth: [0, 1]", 4)


def test_confirm_walks_past_configs_the_quality_gate_rejects(tmp_path: Path) -> None:
    """The fastest configurations (batch 256) fail the gate; confirm goes on down the ranking to
    the exact one (pipelining only) instead of leaving the baseline as the winner. A configuration
    whose search trial already shows the NE failing is skipped; one that must be screened costs one
    run, not `repeats`."""
    run = tmp_path / "run"
    r = cubic_tune("--space", str(space_file(tmp_path, GATED)), "--run-dir", str(run), "--searcher", "grid")
    assert r.returncode == 0, r.stdout + r.stderr
    study = load(run, "gated")
    by = {(t.params["batch_size"], t.params["pipeline_depth"]): t for t in records(run, "gated").values()}
    assert len(by) == 4 and all(t.state == TrialState.COMPLETE for t in by.values())
    exact = by[(32, 1)]
    assert exact.quality_ok is True and "numerics unchanged" in exact.quality_reason
    assert len(exact.confirm_qps) == 2
    big = [by[(256, d)] for d in (0, 1)]
    assert by[(256, 0)].value > by[(32, 1)].value  # ranked above the exact config: the walk passed it
    for rec in big:  # passed over: its own NE over the baseline's samples already failed, or screened once
        if rec.quality_est_ok is False:
            assert rec.ne_matched > 0 and not rec.confirm_qps
        else:
            assert rec.quality_ok is False and "NE" in rec.quality_reason and len(rec.confirm_qps) == 1
    assert study.user_attrs["winner"]["config"]["batch_size"] == 32
    assert "skipped" in r.stdout and "fails the quality gate" in r.stdout
    # every re-measurement of a candidate came right after one of the baseline's, which it is divided by
    order = confirm_order(r.stdout)
    assert order.count(0) == sum(len(t.confirm_qps) for t in by.values() if t.number) >= 2, order
    assert all(a == 0 for a, b in zip(order, order[1:], strict=False) if b != 0), order
    base = records(run, "gated")[0]
    assert exact.confirm_base_qps == base.confirm_qps[-2:] and len(exact.paired_ratios) == 2
    # the winner is the faster by those pairs (the baseline by definition 1.0x)
    sp = statistics.median(exact.paired_ratios)
    w = study.user_attrs["winner"]
    assert (w["trial"], w["speedup"]) == ((exact.number, pytest.approx(sp)) if sp > 1 else (0, pytest.approx(1.0)))


# The search ran one configuration besides the baseline: pipelining stacked on an 8x batch, which the gate
# (tolerance 0) rejects. Its layout alone, pipelining, was never run.
STACKED = gated("stacked", "  pipeline_depth: [1, 0]\n  batch_size: [256, 32]", 2)


def test_the_confirm_backs_off_a_rejected_fastest_configuration_to_its_layout(tmp_path: Path) -> None:
    """The fastest configuration fails the gate for its numerics and nothing else passed: the confirm runs
    its layout without the numerics change as a new trial (phase "backoff", beyond the search budget),
    which needs no quality run and passes, instead of leaving only the baseline to crown."""
    run = tmp_path / "run"
    r = cubic_tune("--space", str(space_file(tmp_path, STACKED)), "--run-dir", str(run), "--searcher", "grid")
    assert r.returncode == 0, r.stdout + r.stderr
    by = {(t.params["pipeline_depth"], t.params["batch_size"]): t for t in records(run, "stacked").values()}
    assert set(by) == {(0, 32), (1, 256), (1, 32)}, sorted(by)
    fast, back = by[(1, 256)], by[(1, 32)]
    assert fast.quality_est_ok is False or fast.quality_ok is False
    assert back.run["phase"] == "backoff" and back.state == TrialState.COMPLETE
    assert back.quality_ok is True and "numerics unchanged" in back.quality_reason and len(back.confirm_qps) == 2
    assert load(run, "stacked").user_attrs["winner"]["config"]["batch_size"] == 32
    assert "back off: #1" in r.stdout and "keep none (the layout alone)" in r.stdout
    assert "1 of them the confirm's back-off" in r.stdout and "(back-off)" in r.stdout



def back_off_plan_of_three_changes(measured: dict[frozenset, float] | None = None,
                                   ruled_out: frozenset = frozenset()):
    """A `make tune` whose winner came out at 1.00x: fp16 tables, bf16 dense and bf16 comm on the default
    space, rejected as not resolved. The screen measured dense bf16 costliest; dense bf16 also carries the speed."""
    from cubic.tune import backoff

    space = load_space(ROOT / "search_spaces" / "dlrm_cpu.yaml")
    src = {**space.baseline_params(), "kernel": "native", "sharding": "size_greedy", "pipeline_depth": 2,
           "emb_precision": "fp16", "dense_precision": "bf16", "comm_precision": "bf16"}
    changed = space.differs_in_numerics(src)
    assert sorted(changed) == ["comm_precision", "dense_precision", "emb_precision"]

    def speed(p: dict) -> float:
        return (100.0 * (1.67 if p["dense_precision"] == "bf16" else 1.0) * (1.2 if p["emb_precision"] == "fp16"
                else 1.0) * (1.1 if p["comm_precision"] == "bf16" else 1.0))

    def kept(p: dict) -> frozenset:
        return frozenset(k for k in changed if p[k] == src[k])

    cost = {"dense_precision": 0.079, "comm_precision": 0.074, "emb_precision": 0.034}
    return backoff.plan(space, src, changed, lambda p: (measured or {}).get(kept(p)),
                        lambda ps: [speed(p) for p in ps], cost.__getitem__, ruled_out=ruled_out)


def test_back_off_judges_the_fastest_expected_variant_first_and_goes_on_past_a_failure() -> None:
    """The chain ordered by the screen's cost dropped dense bf16 first and stopped when that variant was no
    faster than the baseline. The plan judges the variant that would win if it passed first, and a failed one
    prunes only the variants that keep all of its changes."""
    from cubic.tune.backoff import FAILED, PASSED

    plan = back_off_plan_of_three_changes()
    assert len(plan.order) == 7 and plan.budget == 3
    d, e, c = "dense_precision", "emb_precision", "comm_precision"
    first = plan.next(best_passed=100.0)
    assert first is not None and first.kept == {d, e} and not first.measured and first.speed == pytest.approx(200.4)
    plan.record(first, FAILED)
    second = plan.next(best_passed=100.0)
    assert second is not None and second.kept == {d, c}  # not pruned: it does not keep fp16 tables
    plan.record(second, PASSED)
    assert plan.next(best_passed=100.0) is None  # the first that passes wins: the rest is expected slower


def test_back_off_prunes_by_what_was_judged_and_keeps_the_layout_alone_as_the_last_resort() -> None:
    from cubic.tune.backoff import FAILED, SLOW

    d, e, c = "dense_precision", "emb_precision", "comm_precision"
    plan = back_off_plan_of_three_changes()
    for want in ({d, e}, {d, c}, {d}):  # each fails: three variants with quality runs spend the budget
        v = plan.next(best_passed=100.0)
        assert v is not None and v.kept == want
        plan.record(v, FAILED)
    last = plan.next(best_passed=100.0)
    assert last is not None and last.kept == frozenset()  # no quality run needed: beyond the budget
    plan.record(last, SLOW)
    assert plan.next(best_passed=100.0) is None

    plan = back_off_plan_of_three_changes()
    v = plan.next(best_passed=100.0)
    plan.record(v, SLOW)  # keeping dense bf16 + fp16 tables is no faster than the baseline
    rest = []
    while (v := plan.next(best_passed=100.0)) is not None:
        rest.append(v.kept)
        plan.record(v, FAILED)
    assert rest == [{d, c}, {e, c}]  # the subsets of a slow variant are slower still; then the budget is spent

    # a variant the search ran is ordered by its run, and skipped where that is no faster than what passed
    plan = back_off_plan_of_three_changes(measured={frozenset({d, e}): 90.0, frozenset({d, c}): 300.0})
    v = plan.next(best_passed=100.0)
    assert v is not None and v.kept == {d, c} and v.measured
    plan.record(v, FAILED)
    assert plan.next(best_passed=100.0).kept == {d}  # {d, e}'s run was 90: it cannot beat 100


def test_back_off_judges_no_variant_that_keeps_a_change_the_screen_ruled_out() -> None:
    """A `make tune` backed off from a 2D layout with SGD tables and judged two variants that kept SGD, which
    its screen had put at +3.5% eval NE, for 3 pairs and a quality run each. A change the screen ruled out
    alone is kept by no variant, and the budget counts only the changes left."""
    d, e, c = "dense_precision", "emb_precision", "comm_precision"
    plan = back_off_plan_of_three_changes(ruled_out=frozenset({(e, "fp16")}))
    assert plan.budget == 2 and all(e not in v.kept for v in plan.order)
    assert [v.kept for v in plan.order] == [{d, c}, {d}, {c}, set()]
    assert len(back_off_plan_of_three_changes().order) == 7


def test_a_back_off_trial_no_faster_than_what_passed_is_not_judged() -> None:
    """A variant's own back-off trial that ran no faster than the best that passed costs no quality
    run: it is slow, and so are the variants that keep only some of its changes."""
    from cubic.tune.backoff import SLOW, Variant

    d, e, c = "dense_precision", "emb_precision", "comm_precision"
    plan = back_off_plan_of_three_changes()
    v = plan.next(best_passed=100.0)
    assert v is not None and v.kept == {d, e} and not v.measured
    assert plan.ran(v, 100.0, best_passed=100.0) is False and plan.outcomes[v.kept] == SLOW
    assert plan.next(best_passed=100.0).kept == {d, c}  # not {d} or {e}: slower than {d, e}
    faster = back_off_plan_of_three_changes()
    w = faster.next(best_passed=100.0)
    assert faster.ran(w, 101.0, best_passed=100.0) is True and w.kept not in faster.outcomes
    alone = Variant(frozenset(), {})  # the layout alone: its paired re-measurements judge it
    assert faster.ran(alone, 90.0, best_passed=100.0) is True

BAD_YAML = "name: x\nknobs:\n  sharding: [table_wise\n  kernel: [torch]\n"


@pytest.mark.parametrize("case, expected", [
    ("malformed", ":4: malformed YAML"),
    ("unknown_knob", "knobs.colour: unknown key"),
    ("empty_choices", "knobs.kernel.choices: choices must not be empty"),
    ("baseline_outside", "baseline value 'table_wise' is outside the space"),
    ("storage", "cannot open the trial store"),
    ("address", "Ray cluster unreachable"),
    ("empty_address", "--address '': empty"),
    ("searcher", "--searcher 'annealing'"),
    ("quality_store", "--quality-store /nonexistent/run: no such run directory or storage URL"),
    ("quality_store_sim", "--quality-store /nonexistent/run: no such run directory or storage URL"),
    ("quality_store_corrupt", "q.db: cannot open it as a store (DatabaseError: "),
])
def test_bad_input_exits_2_with_one_line(tmp_path: Path, case: str, expected: str) -> None:
    from cubic.cli.app import app

    good = (ROOT / "search_spaces" / "tiny.yaml").read_text()
    text = {
        "malformed": BAD_YAML,
        "unknown_knob": good.replace("knobs:\n", "knobs:\n  colour: [red]\n"),
        "empty_choices": good.replace("knobs:\n", "knobs:\n  kernel: []\n"),
        "baseline_outside": good.replace("[table_wise, row_wise, column_wise, data_parallel]", "[row_wise]"),
    }.get(case, good)
    args = ["tune", "--space", str(space_file(tmp_path, text)), "--run-dir", str(tmp_path / "run")]
    args += {"storage": ["--storage", "sqlite:////nonexistent/dir/study.db"],
             "address": ["--address", "127.0.0.1:1"], "empty_address": ["--address", ""],
             "searcher": ["--searcher", "annealing"], "quality_store": ["--quality-store", "/nonexistent/run"],
             "quality_store_sim": ["--quality-store", "/nonexistent/run", "--backend", "sim",
                                   "--cluster", "h100-8"],
             "quality_store_corrupt": ["--quality-store", str(tmp_path / "q.db")]}.get(case, [])
    (tmp_path / "q.db").write_bytes(b"not a database, not empty either" * 64)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in res.output, res.output
    if case.startswith("quality_store"):  # judged before the study's store is made: nothing written
        assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- searchers and warm start (no trials)
@pytest.mark.parametrize("name", list(SEARCHERS))
def test_every_searcher_proposes_baseline_first_then_distinct_valid_configs(name: str) -> None:
    space = load_space(ROOT / "search_spaces" / "tiny.yaml")
    sampler = make_sampler(name, space, seed=3, budget=20)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    keys = []
    for i in range(20):
        if sampler.should_stop(study):
            break
        trial = study.ask(distributions(space))
        cfg = space.config(trial.params)
        keys.append(cfg.key())
        if i == 0:
            assert trial.params == space.baseline_params()
        study.tell(trial, float(cfg.batch_size * (2 if cfg.pipeline_depth else 1)))
    assert len(keys) == len(set(keys)) and len(keys) >= (7 if name == "ds-xgb" else 20)


def test_grid_search_exhausts_a_small_space() -> None:
    space = load_space(ROOT / "search_spaces" / "tiny.yaml")
    sampler = make_sampler("grid", space)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    while not sampler.should_stop(study):
        trial = study.ask(distributions(space))
        study.tell(trial, 1.0)
    assert len({space.tup(t.params) for t in study.trials}) == len(study.trials) == space.size()


def test_cubic_warm_starts_from_an_earlier_study_on_the_same_space(tmp_path: Path) -> None:
    text = (ROOT / "search_spaces" / "tiny.yaml").read_text()
    first = load_space(space_file(tmp_path, text))
    rdb = open_storage(storage_url(tmp_path, must_exist=False))
    old = Store(first, rdb, None)
    old.record_space()  # as its tuner did
    dists = distributions(first)
    for i, tup in enumerate(first.all_tuples[:6]):
        old.study.add_trial(optuna.trial.create_trial(params=first.params_of(tup), distributions=dists,
                                                      value=1000.0 + i))
    (tmp_path / "b").mkdir()
    second = load_space(space_file(tmp_path / "b", text.replace("name: tiny", "name: tiny_again")))
    new = Store(second, rdb, None)
    history = [(t.params, t.value) for t in new.history()]
    assert len(history) == 6
    other = load_space(space_file(tmp_path / "b", text.replace("measure_steps: 3", "measure_steps: 4")
                                  .replace("name: tiny", "name: tiny_other")))
    assert Store(other, rdb, None).history() == []  # a different space shares nothing
    sampler = make_sampler("cubic", second, history=history)
    new.study.sampler = sampler
    new.study.tell(new.study.ask(dists), 900.0)  # the baseline
    trial = new.study.ask(dists)
    assert trial.params and sampler.last_info["phase"] == "proxy"  # no warm-up needed
    assert sampler.last_info["predicted_qps"] > 0


def _drain(runner: Any, pending: list, poll: float = 0.5) -> dict:
    """Every pending trial's result, by tag; a trial still pending after 120 s fails the test by name
    (a guard against a hung runner, not a timing claim)."""
    results = {}
    deadline = time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        for p, res in runner.wait(pending, timeout=poll):
            pending.remove(p)
            results[p.tag] = res
    assert not pending, f"still pending after 120 s: {[p.tag for p in pending]}"
    return results


def test_ray_task_failures_become_failed_results_not_a_dead_tuner() -> None:
    import ray

    from cubic.execution.runner import RayRunner
    from cubic_harness.config import TrialConfig

    def die(cfg: dict) -> Iterator[Any]:
        yield STARTED
        os._exit(3)  # the Ray worker process itself dies

    def boom(cfg: dict) -> Iterator[Any]:
        yield STARTED
        raise RuntimeError("planner exploded")

    runner = RayRunner().start()
    try:
        cfg = TrialConfig(world_size=1)
        results = {}
        for name, fn in (("die", die), ("boom", boom)):
            runner._remote = ray.remote(max_retries=0)(fn)
            results |= _drain(runner, [runner.submit(cfg, tag=name)])
        assert results["die"].status == "error" and "Ray worker died" in results["die"].error
        assert results["boom"].status == "error" and "planner exploded" in results["boom"].error
        assert "\n" not in results["boom"].error
    finally:
        runner.stop()


def test_cuda_trials_ask_ray_for_gpus_and_do_not_share_them() -> None:
    """Two trials timed on one GPU at once would measure each other: a cuda trial asks for one GPU
    per rank (capped at the cluster's), Ray pins it to those (CUDA_VISIBLE_DEVICES), and the tuner
    starts no second GPU trial while the GPUs are taken. Ray's resource accounting is real; the
    GPU is a logical one (this machine has none)."""
    import ray

    from cubic.execution.runner import RayRunner
    from cubic_harness.config import TrialConfig

    def visible(cfg: dict) -> Iterator[Any]:  # what the trial saw, carried in its result's error field
        yield STARTED
        seen = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_ids": ray.get_gpu_ids()}
        yield TrialResult.failed("error", json.dumps(seen), TrialConfig.from_dict(cfg)).to_dict()

    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 2**20)
    runner = RayRunner(isolation="cores").start()  # a CPU trial may run beside the GPU one
    try:
        runner._remote = ray.remote(max_retries=0)(visible)
        assert runner.gpus == 1.0
        gpu_cfg, cpu_cfg = TrialConfig(world_size=2, device="cuda"), TrialConfig(world_size=1)
        assert runner.gpus_for(gpu_cfg) == 1.0 and runner.gpus_for(cpu_cfg) == 0.0  # 2 ranks share the one GPU
        g = runner.submit(gpu_cfg, tag="cuda")
        assert g.gpus == 1.0 and not runner.has_room([g])  # the GPU is taken: no second trial beside it
        c = runner.submit(cpu_cfg, tag="cpu")
        assert runner.has_room([c])
        got = {tag: json.loads(res.error) for tag, res in _drain(runner, [g, c]).items()}
        assert got["cuda"]["gpu_ids"] == [0] and got["cuda"]["CUDA_VISIBLE_DEVICES"] == "0"
        assert got["cpu"]["gpu_ids"] == []
    finally:
        runner.stop()
        ray.shutdown()


def test_node_isolation_runs_one_cpu_trial_per_node_and_cores_packs_them() -> None:
    """Trials side by side on one node time each other (shared memory bandwidth and caches), so by
    default a CPU trial asks Ray for the whole node; `isolation: cores` packs one-rank trials two to a
    2-CPU node. A cuda trial takes its GPUs and their share of the node's CPUs. Real Ray tasks record
    when they ran: with node isolation no two overlap, with cores they do."""
    import ray

    from cubic.execution.runner import RayRunner
    from cubic_harness.config import TrialConfig

    @ray.remote(max_concurrency=4, num_cpus=0)
    class Meeting:
        """Trials arrive here; `wait_peer` returns once two have arrived (events, not a timed window: a
        Ray worker's cold start on a busy machine may take longer than any sleep)."""

        def __init__(self) -> None:
            import threading

            self.arrived, self.two = 0, threading.Event()

        def arrive(self) -> None:
            self.arrived += 1
            if self.arrived >= 2:
                self.two.set()

        def wait_peer(self, timeout: float) -> bool:
            return self.two.wait(timeout)

    def span(cfg: dict, meeting: Any, wait_for_peer: bool) -> Iterator[Any]:
        yield STARTED
        t0 = time.time()
        if wait_for_peer:  # packed trials must run side by side: the first waits until the second runs
            ray.get(meeting.arrive.remote())
            assert ray.get(meeting.wait_peer.remote(120.0)), "the second packed trial never started"
        else:  # node isolation must never overlap them, however long each holds the node. (No ray.get
            # here: a task blocked in ray.get lends its CPUs back to Ray, which may start the next task.)
            time.sleep(0.3)
        yield TrialResult.failed("error", json.dumps([t0, time.time()]), TrialConfig.from_dict(cfg)).to_dict()

    def overlaps(runner: RayRunner) -> bool:
        """Submit three one-rank trials at once (Ray queues what does not fit); did any two overlap?"""
        pending = [runner.submit(TrialConfig(world_size=1, seed=i), tag=i) for i in range(3)]
        assert runner.has_room(pending[:1]) == (runner.isolation == "cores")  # the tuner's own check
        spans = sorted(json.loads(r.error) for r in _drain(runner, pending).values())
        assert len(spans) == 3
        return any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))

    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 2**20)
    try:
        node, cores = RayRunner().start(), RayRunner(isolation="cores").start()
        for r in (node, cores):
            meeting = Meeting.remote()
            packed = r.isolation == "cores"
            r._remote = ray.remote(max_retries=0)(_bound(span, meeting, packed))
        one, cuda = TrialConfig(world_size=1), TrialConfig(world_size=1, device="cuda")
        assert (node.cpus_for(one), cores.cpus_for(one)) == (2.0, 1.0)
        assert (node.cpus_for(cuda), node.gpus_for(cuda)) == (1.0, 1.0)  # 1 of 2 GPUs: half the CPUs
        assert not overlaps(node)
        assert overlaps(cores)
    finally:
        ray.shutdown()


def _bound(body: Any, *args: Any) -> Any:
    """A generator function (what Ray streams) of the trial config alone, with `args` bound."""
    def trial(cfg: dict) -> Iterator[Any]:
        yield from body(cfg, *args)
    return trial


def test_a_trial_queued_for_resources_is_not_timed_out_but_a_hung_one_is(monkeypatch) -> None:
    """The hard timeout counts from the task's STARTED marker, not from submission: on a cluster
    busy with other work a trial may wait in Ray's queue longer than it may run. One CPU: the first
    trial hangs and is cancelled 6 s after it started; the second, allowed 3 s, waited those 6 s in
    the queue and still runs (it used to be cancelled as a timeout while queued)."""
    import ray

    import cubic.execution.runner as runner_mod
    from cubic.execution.runner import RayRunner
    from cubic_harness.config import TrialConfig

    def trial(cfg: dict) -> Iterator[Any]:
        yield STARTED
        c = TrialConfig.from_dict(cfg)
        if c.seed == 1:
            time.sleep(60)  # hangs
        yield TrialResult.failed("error", "ran", c).to_dict()

    monkeypatch.setattr(runner_mod, "HARD_TIMEOUT_SLACK_S", 0.0)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    runner = RayRunner().start()
    try:
        runner._remote = ray.remote(max_retries=0)(trial)
        # the queued trial waits the hung one's 6 s, twice its own 3 s (ample for a busy machine to run it)
        results = _drain(runner, [runner.submit(TrialConfig(world_size=1, seed=1, timeout_s=6), tag="hung"),
                                  runner.submit(TrialConfig(world_size=1, seed=2, timeout_s=3), tag="queued")], 0.2)
        assert results["hung"].status == "timeout" and "after the trial started" in results["hung"].error
        assert results["queued"].error == "ran"
    finally:
        runner.stop()
        ray.shutdown()


def test_trials_under_ray_run_at_the_drivers_priority_not_rays_worker_niceness() -> None:
    """Ray starts workers at niceness 15; a trial's ranks inherit it, and on a machine with any other busy
    process they then run 25x slower (measured: cubic/execution/runner.py). A real trial through the runner
    records the niceness it ran at, which must be the driver's."""
    from cubic.execution.runner import RayRunner
    from cubic_harness.config import TrialConfig

    runner = RayRunner().start()
    try:
        cfg = TrialConfig(world_size=1, warmup_steps=1, measure_steps=2, windows=1, kernel="torch")
        res = _drain(runner, [runner.submit(cfg, tag="t")])["t"]
        assert res.status == "ok", res.error
        assert res.env["niceness"] == os.getpriority(os.PRIO_PROCESS, 0) == 0
    finally:
        runner.stop()


def _open_and_write(url: str, barrier: Any, i: int) -> None:
    from cubic.study.store import rdb_storage

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    barrier.wait()
    study = optuna.create_study(study_name="race", storage=rdb_storage(url), load_if_exists=True)
    study.set_user_attr(f"p{i}", i)


def test_processes_opening_a_new_store_at_once_all_succeed(tmp_path: Path) -> None:
    """A tuner starting while a notebook or a second tuner opens the same new store: without
    `rdb_storage`'s retry, the loser of the schema race died (alembic_version UNIQUE)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for round_ in range(4):
        url = f"sqlite:///{tmp_path / f'race{round_}.db'}"
        barrier = ctx.Barrier(3)
        procs = [ctx.Process(target=_open_and_write, args=(url, barrier, i)) for i in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0], round_
        assert set(optuna.load_study(study_name="race", storage=url).user_attrs) == {"p0", "p1", "p2"}


TWINS = """\
name: twins
workload: {preset: tiny}
baseline: {world_size: 1, sharding: table_wise, batch_size: 64, kernel: torch, emb_lr: 0.1, dense_lr: 0.05}
knobs:
  emb_lr: [0.1, 0.0001]            # a learning rate that costs eval NE far past the tolerance
  pipeline_depth: [0, 1]           # layout only: the same model
quality: {samples: 8192, eval_samples: 2048, seeds: 2, tolerance: 0.002, screen: false}
trial: {warmup_steps: 1, measure_steps: 3, windows: 1, timeout_s: 300, repeats: 1}
budget: {trials: 4, confirm_top_k: 2}
"""


# ~1 min, in the default tier: the confirm alone, run in-process (3 re-measurements and 3-4 quality runs)
def test_a_layout_waits_for_its_twins_verdict_and_a_rejection_costs_it_no_re_measurement(tmp_path: Path) -> None:
    """Two layouts of one numerics change: the faster one's re-measurement and quality runs judge the model; the
    other is not re-measured while that verdict is out, and the rejection reaches it with the twin's runs, so it
    costs no run at all. The layout-only candidate is paired and wins. (confirm_top_k 1: with 2 the walk screens
    the layout beside the open model at once, and once it passes faster the twins are spared for speed.)"""
    from rich.console import Console

    from cubic.tune.checks import QualityChecks
    from cubic.tune.confirm import Confirm
    from cubic.tune.context import Tuning
    from cubic.tune.policy import Policy
    from cubic.tune.view import TuneView
    from cubic_harness.trial import run_trial
    from tests.test_memory import InlineRunner

    space = load_space(space_file(tmp_path, TWINS.replace("confirm_top_k: 2", "confirm_top_k: 1")))
    store = Store(space, open_storage(storage_url(tmp_path, must_exist=False)), tmp_path)
    base_params = space.baseline_params()
    base_res = run_trial(space.config(base_params))  # the baseline's search run, measured
    assert base_res.status == "ok", base_res.error
    # the search's findings: the twins' search runs at 10x the baseline's (a winner's-curse high: speed cannot
    # rule them out, only quality decides), the layout-only change at 2x
    found = [(base_params, base_res.qps), ({**base_params, "emb_lr": 0.0001, "pipeline_depth": 1}, 10 * base_res.qps),
             ({**base_params, "emb_lr": 0.0001}, 9 * base_res.qps), ({**base_params, "pipeline_depth": 1},
                                                                     2 * base_res.qps)]
    for params, qps in found:
        store.enqueue(params, {"phase": "search"})
        trial = store.study.ask(distributions(space))
        store.finish(trial, base_res if params == base_params else TrialResult(qps=qps, ne=base_res.ne))
    first, second, layout = (store.records(TrialState.COMPLETE)[i] for i in (1, 2, 3))
    runner = InlineRunner()
    view = TuneView(space, 4, Console(record=True, width=200), live=False)
    ctx = Tuning(space, store, runner, view, Policy.measured(space), base_key=space.config(base_params).key(),
                 budget=4)
    Confirm(ctx, QualityChecks(ctx)).run()

    assert first.quality_runs_of is None and first.quality_eval_ne and first.quality_ok is False
    assert len(first.confirm_qps) == 1 and first.confirm_base_qps  # its one re-measurement, paired
    # the second layout of that model: no run of its own, the twin's verdict and runs
    assert second.quality_runs_of == first.number and second.quality_eval_ne == first.quality_eval_ne
    assert second.quality_ok is False and not second.confirm_qps and not second.confirm_failed
    remeasured = [c for c in runner.submitted if c.eval_samples == 0]
    assert space.config(second.params).key() not in {c.key() for c in remeasured}
    assert f"#{second.number} trains what #{first.number} trains: rejected with it" in view.console.export_text()
    # the layout-only change needs no quality run and is paired with the baseline
    assert layout.quality_ok is True and len(layout.confirm_qps) == 1 == len(layout.confirm_base_qps)


def confirm_over(tmp_path: Path, text: str, trials: list[tuple[dict[str, Any], float]]):
    """A confirm over a store of finished search trials, each the baseline's params with `trials`' overrides and
    its search qps, nothing trained: for the verdict logic alone. Returns (confirm, store, the records)."""
    from rich.console import Console

    from cubic.tune.checks import QualityChecks
    from cubic.tune.confirm import Confirm
    from cubic.tune.context import Tuning
    from cubic.tune.policy import Policy
    from cubic.tune.view import TuneView

    space = load_space(space_file(tmp_path, text))
    store = Store(space, open_storage(storage_url(tmp_path, must_exist=False)), tmp_path)
    bp = space.baseline_params()
    for over, qps in trials:
        store.enqueue({**bp, **over}, {"phase": "search"})
        store.finish(store.study.ask(distributions(space)), TrialResult(qps=qps, ne=0.7))
    view = TuneView(space, 3, Console(record=True, width=240), live=False)
    ctx = Tuning(space, store, None, view, Policy.measured(space), base_key=space.config(bp).key(), budget=3)
    return Confirm(ctx, QualityChecks(ctx)), store, store.records(TrialState.COMPLETE)


def test_a_model_whose_runs_equal_a_rejected_ones_bit_for_bit_takes_its_verdict_without_more_seeds(
        tmp_path: Path) -> None:
    """`make tune`'s walk judged two stacks that differ only in comm_precision (bf16 vs fp32) under bf16 dense
    math, where the bf16 wire rounds nothing the dense side does not round anyway: six seeds each, equal to
    every digit. A candidate whose first quality run equals a decided one's bit for bit (NE and AUC) takes
    that one's runs and verdict (`IDENTICAL_SEEDS`); one differing in the last bit runs its own seeds, and
    none is taken for another's before it ran one. (The verdict logic alone: the records are set, nothing
    is trained.)"""
    confirm, store, (base, judged, alike) = confirm_over(
        tmp_path, TWINS.replace("emb_lr: [0.1, 0.0001]", "emb_lr: [0.1, 0.0001, 0.00011]"),
        [({}, 100.0), ({"emb_lr": 0.0001}, 300.0), ({"emb_lr": 0.00011}, 200.0)])
    space = confirm.ctx.space
    assert space.numerics_key(judged.params) != space.numerics_key(alike.params)
    store.update(base, quality_eval_ne=[0.800, 0.810, 0.805, 0.808], quality_eval_auc=[0.7] * 4)
    ne, auc = [0.8008, 0.819, 0.814, 0.817], [0.71, 0.69, 0.70, 0.68]
    store.update(judged, quality_eval_ne=ne, quality_eval_auc=auc, confirm_qps=[300.0])
    store.update(alike, confirm_qps=[200.0])
    confirm.screened = [judged, alike]
    assert confirm.verdict(judged) is False
    assert confirm.quality_seed(alike) == 0  # no run yet: nothing to compare
    store.update(alike, quality_eval_ne=[math.nextafter(ne[0], 1.0)], quality_eval_auc=auc[:1])
    assert confirm.quality_seed(alike) == 1 and alike.quality_runs_of is None  # not bit for bit: its own seeds
    store.update(alike, quality_eval_ne=ne[:1])
    assert confirm.quality_seed(alike) is None
    assert alike.quality_eval_ne == ne and alike.quality_runs_of == judged.number
    assert confirm.verdict(alike) is False and not confirm.wants(alike)
    assert f"equal #{judged.number}'s bit for bit" in confirm.ctx.view.console.export_text()


def test_two_open_models_whose_runs_equal_bit_for_bit_pool_their_seeds_as_one(tmp_path: Path) -> None:
    """A `make tune` judged the fp16/bf16 stack with fp32 and with bf16 communication as two models, both
    open at the tolerance: their first two seeds equal to every digit, then seeds 3-6 trained twice (4 of
    its 17 quality runs). Once two seeds are equal bit for bit, the models are one (`Candidates.key`) even
    while undecided: the faster asks for seed 3 and takes the slower one's instead of training its own, and
    the two count once toward `confirm_top_k`. (The verdict logic alone: the records are set, nothing is
    trained.)"""
    confirm, store, (base, slow, fast) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 250.0), ({"emb_lr": 0.00011}, 260.0)])
    space = confirm.ctx.space
    assert space.numerics_key(slow.params) != space.numerics_key(fast.params)
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE, quality_eval_auc=[0.7] * 4)
    straddle = [0.001, 0.003, 0.0005]  # +0.15% +- : straddles the 0.2% tolerance, open after three seeds
    _set(store, slow, [2.5, 2.5, 2.5], straddle)
    _set(store, fast, [2.6, 2.6, 2.6], straddle[:2])
    confirm.screened = [slow, fast]
    assert confirm.verdict(slow) is None and confirm.verdict(fast) is None  # both open
    assert confirm.model_of(slow) != confirm.model_of(fast)  # not known alike before the runs are compared
    assert confirm.focus() is fast
    assert confirm.quality_seed(fast) is None  # seed 3 is the slow one's: not trained again
    assert fast.quality_eval_ne == slow.quality_eval_ne and fast.quality_runs_of == slow.number
    assert confirm.model_of(slow) == confirm.model_of(fast)
    assert f"equal #{slow.number}'s bit for bit" in confirm.ctx.view.console.export_text()


def test_a_candidate_whose_chance_to_pass_is_spent_stops_after_three_seeds_and_its_verdict_says_why(
        tmp_path: Path) -> None:
    """A candidate at the tolerance (+0.20% +- 0.01% against 0.20% over three seeds) would spend the whole
    seed budget to end "not resolved": it stops at three, asks for no fourth seed, and its verdict names
    the chance it had. (The verdict logic alone: the records are set, nothing is trained.)"""
    confirm, store, (base, cand) = confirm_over(tmp_path, TWINS, [({}, 100.0), ({"emb_lr": 0.0001}, 300.0)])
    bne = [0.800, 0.810, 0.805]
    store.update(base, quality_eval_ne=bne, quality_eval_auc=[0.7] * 3)
    store.update(cand, quality_eval_ne=[b * (1 + d) for b, d in zip(bne, (0.0021, 0.0019, 0.0020), strict=True)],
                 quality_eval_auc=[0.7] * 3, confirm_qps=[300.0])
    confirm.screened = [cand]
    assert confirm.verdict(cand) is False and confirm.quality_seed(cand) is None
    ok, why = confirm.gate(cand)
    assert not ok and "NOT RESOLVED after 3 paired seeds (its chance to pass within quality.max_seeds=6" in why, why


def test_a_rejection_reaches_a_twin_through_runs_held_from_a_check_while_searching(tmp_path: Path) -> None:
    """The twins of `make tune` hold their model's first seeds from a check while searching (on a third
    layout, not screened). When the confirm's further seeds reject the model on the faster twin, the slower
    twin takes that verdict with all the runs, named by the layout that ran the first ones; a twin that only
    crashed passes nothing on. (The verdict logic alone: the records are set, nothing is trained.)"""
    slow = {"emb_lr": 0.0001}
    confirm, store, (base, fast, twin) = confirm_over(
        tmp_path, TWINS, [({}, 100.0), ({**slow, "pipeline_depth": 1}, 300.0), (slow, 200.0)])
    owner = 7  # the layout a check while searching ran seed 1 on (not among these)
    store.update(base, quality_eval_ne=[0.800, 0.810, 0.805, 0.808])
    # seed 1 within the tolerance (0.2%), the confirm's seeds 2-4 over 1% worse: rejected
    store.update(fast, quality_eval_ne=[0.8008, 0.819, 0.814, 0.817], quality_eval_auc=[0.7] * 4, quality_runs_of=owner)
    store.update(twin, quality_eval_ne=[0.8008], quality_eval_auc=[0.7], quality_runs_of=owner)
    confirm.screened = [fast, twin]
    assert confirm.verdict(fast) is False and confirm.verdict(twin) is None
    confirm.inherit_rejection(twin)
    assert twin.quality_eval_ne == fast.quality_eval_ne and twin.quality_runs_of == owner
    assert confirm.verdict(twin) is False and not confirm.wants(twin)
    # a twin that failed by crashing, with no quality runs of the model, passes no verdict
    store.update(twin, quality_eval_ne=[0.8008], quality_eval_auc=[0.7])
    store.update(fast, quality_eval_ne=[], quality_eval_auc=[], confirm_failed=["error: a crash"])
    confirm.inherit_rejection(twin)
    assert twin.quality_eval_ne == [0.8008] and confirm.verdict(twin) is None


def test_the_winners_speedup_over_torchrecs_plan_goes_through_the_baseline_side_by_side(tmp_path: Path) -> None:
    """`make tune SEED=1` crowned a 1.15x winner and printed "0.92x TorchRec's plan": its re-measured qps
    over the plan's one search run, minutes earlier, while the machine slowed 15% (the baseline's 22,485 qps
    in the search, 19,101 in the confirm). The ratio now goes through the baseline, each side measured beside
    it: the winner's paired re-measurements, the plan's search run over the baseline's, or its own pairs
    where the confirm re-measured it. (The summary's arithmetic alone: nothing runs.)"""
    from rich.console import Console

    from cubic.study.record import REFERENCE
    from cubic.study.winner import Winner
    from cubic.tune.context import Tuning
    from cubic.tune.policy import Policy
    from cubic.tune.summary import reference
    from cubic.tune.view import TuneView

    space = load_space(space_file(tmp_path, TWINS))
    store = Store(space, open_storage(storage_url(tmp_path, must_exist=False)), tmp_path)
    bp = space.baseline_params()
    for over, qps, phase in (({}, 22485.0, "baseline"), ({"pipeline_depth": 1}, 22394.0, REFERENCE)):
        store.enqueue({**bp, **over}, {"phase": phase})
        store.finish(store.study.ask(distributions(space)), TrialResult(qps=qps, ne=0.7))
    view = TuneView(space, 3, Console(record=True, width=240), live=False)
    ctx = Tuning(space, store, None, view, Policy.measured(space), base_key=space.config(bp).key(), budget=3)
    win = Winner(trial=9, qps=20545.0, speedup=1.15)
    ref = reference(ctx, win, None)
    assert ref.trial == 1 and ref.qps == 22394.0 and not ref.re_measured
    assert ref.speedup == pytest.approx(1.15 / (22394.0 / 22485.0))  # 1.155x, not 20,545 / 22,394 = 0.92x
    assert ref.baseline_speedup == pytest.approx(22485.0 / 22394.0)
    plan = store.records(TrialState.COMPLETE)[1]
    store.update(plan, confirm_qps=[19000.0, 19500.0, 18800.0], confirm_base_qps=[20000.0, 19500.0, 19100.0])
    ref = reference(ctx, win, None)
    assert ref.re_measured and ref.qps == 19000.0
    assert ref.speedup == pytest.approx(1.15 / statistics.median([0.95, 1.0, 18800.0 / 19100.0]))


# three numerics changes (learning rates) and three re-measurements: for the confirm's order and its spare rule
RACE = (TWINS.replace("emb_lr: [0.1, 0.0001]", "emb_lr: [0.1, 0.0001, 0.00011, 0.00012]")
        .replace("repeats: 1", "repeats: 3"))
BNE = [0.800, 0.810, 0.805, 0.808]


def _set(store: Store, t: TrialRecord, ratios: list[float], diffs: list[float]) -> None:
    """t re-measured at `ratios` over a baseline at 100 qps beside each, its quality runs `diffs` from BNE."""
    store.update(t, confirm_qps=[100.0 * r for r in ratios], confirm_base_qps=[100.0] * len(ratios),
                 quality_eval_ne=[b * (1 + d) for b, d in zip(BNE, diffs, strict=False)],
                 quality_eval_auc=[0.7] * len(diffs))


def test_a_layout_its_search_run_may_tell_faster_than_its_re_measured_twin_does_not_wait_for_the_verdict(
        tmp_path: Path) -> None:
    """`make tune` ranked two layouts of the fp16-comm model first and second by their search runs: the first
    re-measured at 1.15x, its model open after two seeds, and the second (1.54x by its search run) waited for
    that verdict while 8 quality runs judged two slower stacks; measured at last, it won at 1.60x. A layout whose
    search run over the baseline's median is above its twin's final re-measurements now gets its first pair at
    once; one below them, or beside a twin still being re-measured, waits. (The verdict logic alone.)"""

    confirm, store, (base, first, second, slow) = confirm_over(
        tmp_path, RACE.replace("pipeline_depth: [0, 1]", "pipeline_depth: [0, 1, 2]"),
        [({}, 100.0), ({"emb_lr": 0.0001}, 300.0), ({"emb_lr": 0.0001, "pipeline_depth": 1}, 250.0),
         ({"emb_lr": 0.0001, "pipeline_depth": 2}, 110.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:2], quality_eval_auc=[0.7] * 2)
    _set(store, first, [1.15, 1.15], [0.001, 0.003])  # +0.2% +- : straddles the 0.2% tolerance
    confirm.screened = [first, second, slow]
    assert confirm.verdict(first) is None and confirm.cannot_win(first) is None
    # its twin's pairs not all in: the second layout waits for them
    assert confirm.phase(second) is Phase.WAITING and not confirm.wants(second)
    _set(store, first, [1.15, 1.16, 1.14], [0.001, 0.003])
    assert confirm.final(first) and confirm.phase(first) is Phase.JUDGING
    assert confirm.phase(second) is Phase.MEASURING and confirm.wants(second)  # 2.5x by its search run
    assert confirm.twin_judged(slow) is first and not confirm.wants(slow)  # 1.1x: no faster than its twin
    # measured, the second layout holds the twin's runs and is judged on them first
    _set(store, second, [1.6, 1.55, 1.62], [])
    confirm.adopt_twin(second)
    assert second.quality_eval_ne == first.quality_eval_ne and second.quality_runs_of == first.number
    assert confirm.focus() is second and confirm.quality_seed(base) == 2  # seed 3: the baseline's first


def test_quality_runs_go_first_to_a_slower_candidate_only_where_its_pass_would_spare_the_fastest(
        tmp_path: Path) -> None:
    """The same `make tune`: with the fp16-comm model at 1.60x (pairs 1.17-1.66x, two seeds in), stacks at
    1.38x and 1.32x took 7 quality runs first, each cheaper to start, though a pass of either could not have
    spared 1.60x (over 1.1x their medians). The fastest is judged first now; a candidate as fast (within its
    reach, not measurably slower) still comes first where its verdict is cheaper. (The verdict logic alone.)"""
    confirm, store, (base, fast, slower, near) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 300.0), ({"emb_lr": 0.00011}, 290.0),
                         ({"emb_lr": 0.00012}, 280.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:2], quality_eval_auc=[0.7] * 2)
    _set(store, fast, [1.17, 1.60, 1.66], [0.001, 0.003])
    _set(store, slower, [1.38, 1.37, 1.39], [])
    confirm.screened = [fast, slower]
    assert confirm.phase(fast) is confirm.phase(slower) is Phase.JUDGING
    assert confirm.turn(slower) < confirm.turn(fast)  # cheaper to start: no seed of its own yet
    assert confirm.focus() is fast and confirm.quality_seed(base) == 2 and confirm.quality_seed(slower) is None
    _set(store, near, [1.58, 1.55, 1.62], [])  # as fast by its pairs: its pass would spare the fastest
    confirm.screened = [fast, slower, near]
    assert confirm.focus() is near and confirm.quality_seed(near) == 0


def test_a_candidate_the_re_measurements_cannot_tell_faster_than_one_that_passed_gets_no_more_quality_runs(
        tmp_path: Path) -> None:
    """`make tune` spent 8 quality runs on a stack (comm=bf16) that ended "not resolved" beside one as fast
    (comm=fp16) that passed: the winner's name could change, its speed not. A candidate still being judged is
    now spared once its re-measurements are not measurably faster than those of one that passed (before they are
    all in: the best of them and its search run within that one's range), and its verdict says so; one
    measurably faster goes on. Its pairs come first: a candidate quality runs judge wants all its re-measurements.
    (The verdict logic alone: the records are set, nothing is trained.)"""
    confirm, store, (base, passed, cand) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 260.0), ({"emb_lr": 0.00011}, 300.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    _set(store, passed, [2.5, 2.6, 2.4], [0.0001, -0.0001, 0.0])
    _set(store, cand, [2.55], [0.001, 0.003])  # +0.2% +- : straddles the 0.2% tolerance
    confirm.screened = [passed, cand]
    assert confirm.verdict(passed) is True
    # one pair: at most 3.0x (its search run), over the 2.4-2.6x that passed: still open, and its pairs come first
    assert confirm.verdict(cand) is None and confirm.cannot_win(cand) is None and confirm.wants(cand)
    _set(store, cand, [2.55, 2.45, 2.58], [0.001, 0.003])  # final: 2.55x, within 2.4-2.6x
    out = confirm.cannot_win(cand)
    assert out is not None and out.lead is passed and out.speedup == pytest.approx(2.55)
    assert confirm.verdict(cand) is False and confirm.quality_seed(cand) is None and not confirm.wants(cand)
    ok, why = confirm.gate(cand)
    assert not ok and f"2.55x re-measured, not measurably faster than #{passed.number}'s 2.40-2.60x" in why, why
    assert "no further quality run" in why and cand.quality_verdict == "slower"
    confirm.tell_spared(cand), confirm.tell_spared(cand)  # the log says so, once
    assert confirm.ctx.view.console.export_text().count(f"confirm: #{cand.number} 2.55x re-measured") == 1
    # measurably faster (Welch, 90%; a candidate not said spared): confirmed on three more pairs, then its
    # next seed is due
    confirm.spared.clear()
    _set(store, cand, [2.75, 2.8, 2.78], [0.001, 0.003])
    assert confirm.cannot_win(cand) is None and confirm.verdict(cand) is None
    assert confirm.wants(cand) and confirm.quality_seed(cand) is None
    _set(store, cand, [2.75, 2.8, 2.78, 2.77, 2.79, 2.76], [0.001, 0.003])
    assert confirm.quality_seed(base) is None and confirm.quality_seed(cand) == 2


def test_the_stack_make_tune_judged_for_8_quality_runs_is_not_measurably_faster_than_the_one_that_passed() -> None:
    """The pairs of a `make tune` (2026-12-03): #16 (comm=bf16) re-measured at 2.42x, median above the 2.37x of
    #27 (comm=fp16, passed), and judged for 8 more quality runs, to "not resolved". Their pairs cannot tell #16
    faster; a candidate 15% faster they can."""
    from cubic.tune.candidates import told_faster

    passed = [54_937 / 23_223, 53_011 / 23_613, 57_636 / 24_148]
    judged = [58_321 / 24_116, 55_264 / 23_628, 58_578 / 22_321]
    assert statistics.median(judged) > max(passed)  # above the passed one's whole range...
    assert not told_faster(judged, passed, 0.9)  # ...and still not measurably faster
    assert told_faster([r * 1.15 for r in passed], passed, 0.9)
    assert not told_faster(passed, [r * 1.15 for r in passed], 0.9)


def test_quality_runs_go_to_the_fastest_candidate_first_and_among_those_as_fast_to_the_cheapest_seed(
        tmp_path: Path) -> None:
    """One candidate at a time gets quality runs: the fastest by its re-measured speed-up, except that among
    the candidates the measurements cannot tell slower than it the one whose next seed needs no new baseline
    seed goes first; a measurably slower one waits. (The verdict logic alone.)"""
    confirm, store, (base, a, b, c) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 300.0), ({"emb_lr": 0.00011}, 290.0),
                         ({"emb_lr": 0.00012}, 280.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:2], quality_eval_auc=[0.7] * 2)
    _set(store, a, [2.5, 2.4, 2.6], [0.001, 0.003])  # the fastest, straddling: its seed 3 needs the baseline's
    _set(store, b, [2.45, 2.3, 2.55], [])  # as fast within its range, its first seeds: the baseline has them
    _set(store, c, [2.0, 2.1, 2.05], [])  # clearly slower
    confirm.screened = [a, b, c]
    assert confirm.focus() is b
    assert [confirm.quality_seed(t) for t in (base, a, b, c)] == [None, None, 0, None]
    _set(store, b, [2.45, 2.3, 2.55], [0.0012, 0.0032])  # b's seeds straddle too, no likelier: a's turn
    assert confirm.focus() is a
    assert [confirm.quality_seed(t) for t in (base, a, b, c)] == [2, None, None, None]  # the baseline's seed 3
    store.update(base, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    assert [confirm.quality_seed(t) for t in (base, a, b, c)] == [None, 2, None, None]


def test_a_candidate_as_fast_whose_verdict_may_come_sooner_gets_its_pairs_and_quality_runs_first(
        tmp_path: Path) -> None:
    """The runs of a `make tune` (2026-12-03, seed 0): #12 (comm=bf16), re-measured in full and at +0.04% +-
    0.1% after the two seeds of a check while searching, took 8 quality runs to "not resolved" (0.10%
    tolerance); #26 (comm=fp16), as fast on its first pair, waited, then passed after 3 and was crowned.
    Now a candidate whose pairs are not all in, that may be as fast and whose next seed is cheaper, gets its
    pairs first; then, as fast, its seeds; at equal cost the likelier pass goes first; its pass spares #12.
    (The verdict logic alone: the records are set, nothing is trained.)"""
    confirm, store, (base, stack, other) = confirm_over(
        tmp_path, RACE.replace("tolerance: 0.002", "tolerance: 0.001"),
        [({}, 26_567.0), ({"emb_lr": 0.0001}, 75_584.0), ({"emb_lr": 0.00011}, 67_431.0)])
    bne = [0.83724, 0.83521, 0.88837]
    store.update(base, confirm_qps=[27_008.0, 25_921.0, 25_737.0, 26_298.0], quality_eval_ne=bne[:2],
                 quality_eval_auc=[0.7] * 2)

    def runs(t: TrialRecord, qps: list[float], beside: list[float], ne: list[float]) -> None:
        store.update(t, confirm_qps=qps, confirm_base_qps=beside, quality_eval_ne=ne,
                     quality_eval_auc=[0.7] * len(ne))

    runs(stack, [66_097.0, 66_793.0, 63_385.0], [27_008.0, 25_921.0, 25_737.0], [0.83696, 0.83618])
    runs(other, [65_706.0], [26_298.0], [])
    confirm.screened = [stack, other]
    assert confirm.phase(stack) is confirm.phase(other) is Phase.JUDGING
    # its next seed needs no baseline seed, and its first pair and search run reach #12's pairs
    assert confirm.focus() is None and confirm.next_judged() is other and confirm.wants(other)
    assert not confirm.wants(stack) and confirm.quality_seed(stack) is None
    runs(other, [65_706.0, 72_906.0, 68_933.0], [26_298.0, 29_666.0, 28_175.0], [])
    assert confirm.focus() is other and confirm.quality_seed(other) == 0
    runs(other, other.confirm_qps, other.confirm_base_qps, [0.83712, 0.83543])
    # both want the baseline's seed 3 now: the likelier pass (+0.006% +- 0.03%) is judged first
    assert confirm.turn(other)[0] < confirm.turn(stack)[0]
    assert confirm.focus() is other and confirm.quality_seed(base) == 2
    store.update(base, quality_eval_ne=bne, quality_eval_auc=[0.7] * 3)
    assert confirm.quality_seed(other) == 2 and confirm.quality_seed(stack) is None
    runs(other, other.confirm_qps, other.confirm_base_qps, [0.83712, 0.83543, 0.88851])
    assert confirm.verdict(other) is True
    out = confirm.cannot_win(stack)  # 2.46x beside 2.46x that passed: spared, 6 quality runs fewer
    assert out is not None and out.lead is other and confirm.verdict(stack) is False


def test_a_lead_over_the_would_be_winner_is_confirmed_on_more_pairs_before_its_quality_runs(
        tmp_path: Path) -> None:
    """The runs of a `make tune` (2026-12-03, seed 0): #29 (comm=fp16) passed at 2.33-2.46x; #18, a layout
    of the stack at the tolerance, read 2.48-2.61x on three pairs (the baseline in a slow spell), just
    measurably faster, and its 7 quality runs ended "not resolved". A candidate whose pairs tell it faster
    than the would-be winner now gets up to 3 more before any quality run: where they bring it back within
    reach it is spared; where it stays faster its seeds are due. (The verdict logic alone.)"""
    confirm, store, (base, passed, stack) = confirm_over(
        tmp_path, RACE.replace("tolerance: 0.002", "tolerance: 0.001"),
        [({}, 24_030.0), ({"emb_lr": 0.0001}, 52_776.0), ({"emb_lr": 0.00011}, 52_978.0)])
    bne = [0.83724, 0.83521, 0.88837]
    store.update(base, confirm_qps=[21_452.0, 22_227.0, 22_188.0], quality_eval_ne=bne,
                 quality_eval_auc=[0.7] * 3)

    def runs(t: TrialRecord, qps: list[float], beside: list[float], ne: list[float]) -> None:
        store.update(t, confirm_qps=qps, confirm_base_qps=beside, quality_eval_ne=ne,
                     quality_eval_auc=[0.7] * len(ne))

    runs(passed, [51_536.0, 51_383.0, 52_050.0], [21_431.0, 22_094.0, 21_142.0], [0.83712, 0.83543, 0.88851])
    fast = ([52_828.0, 49_207.0, 52_822.0], [20_275.0, 19_775.0, 21_303.0])
    runs(stack, *fast, [0.83696, 0.83618])
    confirm.screened = [passed, stack]
    assert confirm.would_win() is passed and confirm.cannot_win(stack) is None
    assert confirm.reps_of(stack) == 6 and confirm.wants(stack)
    assert confirm.focus() is None and confirm.quality_seed(stack) is None
    # three more pairs at the pass's speed: not measurably faster, spared without a quality run
    runs(stack, fast[0] + [50_500.0, 51_000.0, 50_800.0], fast[1] + [21_300.0, 21_200.0, 21_400.0],
         [0.83696, 0.83618])
    assert confirm.reps_of(stack) == 3 and confirm.final(stack)
    out = confirm.cannot_win(stack)
    assert out is not None and out.lead is passed and confirm.verdict(stack) is False
    # three more as fast as the first: its seed 3 is due
    runs(stack, fast[0] * 2, fast[1] * 2, [0.83696, 0.83618])
    assert confirm.final(stack) and confirm.cannot_win(stack) is None
    assert confirm.focus() is stack and confirm.quality_seed(stack) == 2


def test_the_walk_ends_where_the_rest_of_the_ranking_cannot_beat_the_one_that_passed(tmp_path: Path) -> None:
    """The ranking is by search run, a measurement picked for being high: once the next candidate's search run
    (over the baseline's re-measured median) is within the pairs of the fastest that passed, neither it nor any
    after it can win, and the walk screens no more of them, though fewer than confirm_top_k passed. A search run
    above those pairs is screened. (The verdict logic alone: the records are set, nothing is trained.)"""
    confirm, store, (base, passed, near, far) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 300.0), ({"emb_lr": 0.00011}, 270.0),
                         ({"emb_lr": 0.00012}, 255.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    _set(store, passed, [2.5, 2.6, 2.4], [0.0001, -0.0001, 0.0])
    confirm.screened, confirm.walked = [passed], 1
    assert confirm.would_win() is passed
    assert confirm.beyond_reach(near) is None  # 2.7x by its search run: above 2.4-2.6x
    assert confirm.beyond_reach(far) is passed  # 2.55x: within
    confirm.walked = 2
    assert confirm.reached_end() and confirm.walked == 3
    assert f"confirm: #{far.number} and the 0 after it in the ranking" in confirm.ctx.view.console.export_text()


def test_two_layouts_spared_as_slower_are_not_shown_as_one_judged_model(tmp_path: Path) -> None:
    """Two layouts of one model, each spared for its own speed with the same words (a `make tune`: "at most
    2.64x ..."), are each their own row in the summary, not "same model as #N": no quality run judged them."""
    from cubic.tune.summary import confirmed_rows

    slow = {"emb_lr": 0.00011}
    confirm, store, (base, passed, one, other) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 300.0), ({**slow, "pipeline_depth": 1}, 250.0),
                         (slow, 250.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    _set(store, passed, [2.5, 2.6, 2.4], [0.0001, -0.0001, 0.0])
    for t in (one, other):
        _set(store, t, [2.3], [0.001, 0.003])
    confirm.screened = [passed, one, other]
    for t in confirm.judge_all():
        assert t is base or t is passed or (t.quality_verdict == "slower" and "at most 2.50x" in t.quality_reason)
    assert one.quality_reason == other.quality_reason
    rows = confirmed_rows(confirm.ctx, [passed, one, other], 100.0)
    assert [r.same_model_as for r in rows] == [None, None, None]


def test_two_models_pooled_as_one_are_shown_as_one_judged_model(tmp_path: Path) -> None:
    """A `make tune`'s summary showed #15 (comm=bf16) and #27 (comm=fp32), whose runs the confirm pooled as
    one model, as two rows with one verdict: the row keyed on the numerics. It keys on the quality runs that
    judged them, so the pooled one reads "same model as"; a model with its own runs does not. (The verdict
    logic alone: the records are set, nothing is trained.)"""
    from cubic.tune.summary import confirmed_rows

    confirm, store, (base, one, pooled, own) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 300.0), ({"emb_lr": 0.00011}, 290.0),
                         ({"emb_lr": 0.00012}, 280.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    ok = [0.0001, -0.0001, 0.0]
    for t, ratios in ((one, [3.0, 3.0, 3.0]), (pooled, [2.9, 2.9, 2.9]), (own, [2.8, 2.8, 2.8])):
        _set(store, t, ratios, ok)
    store.update(own, quality_eval_ne=[math.nextafter(x, 1.0) for x in own.quality_eval_ne])
    confirm.screened = [one, pooled, own]
    confirm.judge_all()
    assert confirm.ctx.space.numerics_key(one.params) != confirm.ctx.space.numerics_key(pooled.params)
    rows = confirmed_rows(confirm.ctx, [one, pooled, own], 100.0)
    assert [r.same_model_as for r in rows] == [None, one.number, None]


def test_layouts_of_one_open_model_count_once_so_the_walk_screens_another_model(tmp_path: Path) -> None:
    """A `make tune`'s first five candidates were layouts of one stack: counted as five open candidates they
    filled confirm_top_k, the walk screened no other model, and that stack alone was judged (8 quality runs, "not
    resolved"). Layouts of one model pass or fail together, so they count once, and the walk goes on to another
    model. (The verdict logic alone: the records are set, nothing is trained.)"""
    stack = {"emb_lr": 0.0001}
    confirm, store, (base, a, b, c, other) = confirm_over(
        tmp_path, RACE.replace("pipeline_depth: [0, 1]", "pipeline_depth: [0, 1, 2]"),
        [({}, 100.0), ({**stack, "pipeline_depth": 1}, 300.0), (stack, 290.0),
         ({**stack, "pipeline_depth": 2}, 280.0), ({"emb_lr": 0.00011}, 270.0)])
    assert len({confirm.ctx.space.config(t.params).key() for t in (a, b, c)}) == 3  # three layouts
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:2], quality_eval_auc=[0.7] * 2)
    while confirm.screen_next(3, 9):
        confirm.screened.append(confirm.cands[confirm.walked])
        confirm.walked += 1
    assert other in confirm.screened, [t.number for t in confirm.screened]


def test_open_candidates_get_their_other_pairs_one_at_a_time_and_a_pass_spares_the_slower_on_its_first(
        tmp_path: Path) -> None:
    """A `make tune` re-measured every open candidate in full before any quality run: 78 runs, and the pass
    that came then spared most of those candidates. Every candidate gets its first pair; then one at a time,
    the fastest by its pairs so far, its other pairs and its quality runs. Once it passes, a slower one whose
    first pair and search run are within its range is spared without its other pairs. (The verdict logic
    alone: the records are set, nothing is trained.)"""
    confirm, store, (base, fast, slow) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 260.0), ({"emb_lr": 0.00011}, 250.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:2], quality_eval_auc=[0.7] * 2)
    _set(store, fast, [2.5], [])
    _set(store, slow, [2.4], [])
    confirm.screened = [fast, slow]
    assert confirm.phase(fast) is confirm.phase(slow) is Phase.JUDGING
    assert confirm.wants(fast) and not confirm.wants(slow)  # the fastest first pair's other pairs first
    _set(store, fast, [2.5, 2.6, 2.4], [])
    assert confirm.focus() is fast and not confirm.wants(slow)  # then its quality runs
    assert confirm.quality_seed(fast) == 0
    _set(store, fast, [2.5, 2.6, 2.4], [0.0001, -0.0001])
    assert confirm.verdict(fast) is True
    assert confirm.verdict(slow) is False and not confirm.wants(slow)  # 2.5x at most: within 2.4-2.6x
    assert len(slow.confirm_qps) == 1


def test_a_layout_that_passed_but_cannot_beat_the_would_be_winner_is_not_re_measured_further(
        tmp_path: Path) -> None:
    """A `make tune` re-measured four layouts of the model that passed three times each (16 runs), though after
    one pair each was within the would-be winner's range. One that passed now gets its other re-measurements
    only while the best of its search run and its pairs so far is above that range (`Candidates.outpaced`),
    and says so once; a faster one goes on. (The verdict logic alone: the records are set, nothing is
    trained.)"""
    stack = {"emb_lr": 0.0001}
    confirm, store, (base, passed, twin, layout) = confirm_over(
        tmp_path, RACE, [({}, 100.0), (stack, 260.0), ({**stack, "pipeline_depth": 1}, 250.0),
                         ({"pipeline_depth": 1}, 300.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    ok = [0.0001, -0.0001, 0.0]
    _set(store, passed, [2.5, 2.6, 2.4], ok)
    _set(store, twin, [], ok)
    confirm.screened = [passed, twin, layout]
    assert confirm.would_win() is passed and confirm.wants(twin)  # its first pair
    _set(store, twin, [2.55], ok)
    assert confirm.phase(twin) is Phase.PASSED and not confirm.wants(twin)  # 2.55x: within 2.4-2.6x
    confirm.tell_spared(twin)
    assert (f"#{twin.number} passed, at most 2.55x (its search run and pairs so far), within "
            f"#{passed.number}'s 2.40-2.60x" in confirm.ctx.view.console.export_text())
    assert confirm.phase(layout) is Phase.PASSED and confirm.wants(layout)  # its search run: 3.0x
    # crowned over all its pairs: the spared one's single 2.55x is no verdict on its speed
    from cubic.tune.summary import winner

    confirm.screened = [passed, twin]
    w = winner(confirm.ctx, confirm.checks, confirm.judge_all(), "cubic", 100.0)
    assert twin.quality_ok and w is not None and w.trial == passed.number


def test_layouts_walked_before_their_model_passed_leave_the_walk_unpaired_where_they_cannot_win(
        tmp_path: Path) -> None:
    """While a model's verdict is out the walk screens its slower layouts (they add no open model). A
    `make tune` then gave 14 of them a first pair each after the model passed, every one within the
    winner's range by its search run alone. Such a layout, holding only its twin's runs, now leaves the
    walk without a pair, as the rest of the ranking does; one whose search run is above that range, or
    that holds quality runs of its own, stays. (The verdict logic alone: nothing is trained.)"""
    stack = {"emb_lr": 0.0001}
    confirm, store, (base, passed, fast, slow, own) = confirm_over(
        tmp_path, RACE, [({}, 100.0), (stack, 280.0), ({**stack, "pipeline_depth": 1}, 270.0),
                         ({"emb_lr": 0.00011}, 250.0), ({"emb_lr": 0.00012}, 240.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    ok = [0.0001, -0.0001, 0.0]
    _set(store, passed, [2.5, 2.6, 2.4], ok)
    for t in (fast, slow):  # layouts that hold the model's runs from the one that passed
        store.update(t, **passed.heldout(verdict=False))
    _set(store, own, [], ok)  # its own runs: a twin may read them
    confirm.screened = [passed, fast, slow, own]
    assert confirm.would_win() is passed
    confirm.leave_unreachable()
    assert confirm.screened == [passed, fast, own]  # 2.7x by its search run stays; 2.5x goes
    assert confirm.wants(fast) and not slow.confirm_qps
    text = confirm.ctx.view.console.export_text()
    assert (f"confirm: #{slow.number} ran at most 250 qps in the search, within the pairs re-measured "
            f"for #{passed.number}, which passed: not re-measured") in text
    assert slow.quality_ok is None and passed.number in {r.number for r in confirm.judge_all()}


def test_a_candidate_spared_stays_spared_when_the_baselines_median_drifts(tmp_path: Path) -> None:
    """A `make tune` spared seven candidates on their first pair and search run, said so, then re-measured each
    twice more: the baseline's median drifted down with the machine, and the search runs' bound rose over the
    would-be winner's pairs and back. What was said stays: no run is spent on it. (The verdict logic alone.)"""
    confirm, store, (base, passed, cand, twin) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 300.0), ({"emb_lr": 0.00011}, 250.0),
                         ({"emb_lr": 0.0001, "pipeline_depth": 1}, 255.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    ok = [0.0001, -0.0001, 0.0]
    _set(store, passed, [2.5, 2.6, 2.4], ok)
    _set(store, cand, [2.3], [0.001, 0.003])
    _set(store, twin, [2.35], ok)
    confirm.screened = [passed, cand, twin]
    assert confirm.verdict(cand) is False and not confirm.wants(cand)  # 2.5x at most: within 2.4-2.6x
    assert confirm.phase(twin) is Phase.PASSED and not confirm.wants(twin)
    for t in (cand, twin):
        confirm.tell_spared(t)
    store.update(base, confirm_qps=[100.0, 100.0, 100.0, 90.0, 90.0, 90.0, 90.0])  # the median drifts to 90
    assert confirm.best_so_far(cand) == pytest.approx(250 / 90)  # 2.78x by its search run now
    assert confirm.verdict(cand) is False and not confirm.wants(cand)
    assert not confirm.wants(twin)


def test_a_candidate_far_above_a_noisy_would_be_winners_median_is_judged_not_spared(tmp_path: Path) -> None:
    """A `make tune` crowned a 2D layout at 1.64x: one baseline run in a slow spell gave it the pairs
    1.46-2.56x, and every stack at 2.4-2.5x was within that range and not measurably faster, so spared. A
    candidate more than REACH x the would-be winner's median is judged however noisy the pairs, before its
    pairs are all in and after; one a few percent faster is still spared. (The verdict logic alone: the
    records are set, nothing is trained.)"""
    confirm, store, (base, noisy, stack, close) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({"emb_lr": 0.0001}, 170.0), ({"emb_lr": 0.00011}, 230.0),
                         ({"emb_lr": 0.00012}, 175.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    _set(store, noisy, [1.64, 1.46, 2.56], [0.0001, -0.0001, 0.0])
    _set(store, stack, [2.39], [])
    _set(store, close, [1.70, 1.66, 1.72], [0.001, 0.003])
    confirm.screened = [noisy, stack, close]
    assert confirm.would_win() is noisy
    assert confirm.cannot_win(stack) is None  # 2.39x (and 2.30x searched): over 1.1 x 1.64x
    _set(store, stack, [2.39, 2.54, 2.55], [])
    assert confirm.cannot_win(stack) is None and confirm.verdict(stack) is None
    out = confirm.cannot_win(close)  # 1.70x: within 1.1 x 1.64x, not measurably faster
    assert out is not None and out.lead is noisy


def test_a_layout_of_a_model_that_passed_takes_its_verdict_before_its_speed_is_weighed(tmp_path: Path) -> None:
    """A `make tune` spared four layouts of the model that passed as "not judged" (one re-measured at 2.60x, over
    the winner's 2.43x): quality runs go to one candidate at a time, and they waited for a turn that the spare
    rule never gave them. A layout takes its twin's runs and verdict as soon as the twin holds more of them.
    (The verdict logic alone: the records are set, nothing is trained.)"""
    stack = {"emb_lr": 0.0001}
    confirm, store, (base, passed, layout) = confirm_over(
        tmp_path, RACE, [({}, 100.0), ({**stack, "pipeline_depth": 1}, 300.0), (stack, 290.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:3], quality_eval_auc=[0.7] * 3)
    _set(store, passed, [2.5, 2.6, 2.4], [0.0001, -0.0001, 0.0])
    _set(store, layout, [2.55, 2.5, 2.6], [])
    confirm.screened = [passed, layout]
    assert confirm.verdict(passed) is True and confirm.verdict(layout) is False  # spared while it waits
    confirm.adopt_twin(layout)
    assert layout.quality_eval_ne == passed.quality_eval_ne and layout.quality_runs_of == passed.number
    assert confirm.verdict(layout) is True
    assert f"#{layout.number} trains what #{passed.number} trains" in confirm.ctx.view.console.export_text()


def test_the_tune_decides_nothing_while_the_run_it_waits_on_is_still_running(tmp_path: Path) -> None:
    """A run that takes many polls to end costs the loops no pass of their decisions meanwhile: the search
    reads the study (`budget_used`) and the confirm walks its candidates (`screen_next`) as often whether each
    run ends at the first poll or the fortieth (a pass at every poll took 3% of a core from the ranks)."""
    from rich.console import Console

    from cubic.execution.sim_runner import SimRunner
    from cubic.tune import Tuner
    from cubic.tune.confirm import Confirm
    from cubic_harness.sim.cluster import load_cluster, shipped_cluster

    class PolledSim(SimRunner):
        """The simulator, each run ending only at its `polls`-th wait."""

        def __init__(self, polls: int) -> None:
            super().__init__(load_cluster(shipped_cluster("h100-8.yaml")))
            self.polls, self.waits = polls, 0

        def has_room(self, pending: list) -> bool:
            return not pending

        def wait(self, pending: list, timeout: float = 1.0) -> list:
            self.waits += 1
            return super().wait(pending) if self.waits % self.polls == 0 else []

    def passes(polls: int) -> tuple[int, int, int]:
        space, where = load_space(ROOT / "search_spaces" / "dlrm_gpu.yaml"), tmp_path / str(polls)
        where.mkdir()
        store = Store(space, open_storage(storage_url(where, must_exist=False)), where)
        reads, walks = [0], [0]
        used, screen_next = store.budget_used, Confirm.screen_next

        def count_reads() -> int:
            reads[0] += 1
            return used()

        def count_walks(self, *a: Any) -> bool:
            walks[0] += 1
            return screen_next(self, *a)

        store.budget_used = count_reads  # type: ignore[method-assign]
        runner = PolledSim(polls)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Confirm, "screen_next", count_walks)
            Tuner(space, store, runner, budget=5, console=Console(record=True, width=200), live=False).run()
        return reads[0], walks[0], runner.waits

    reads1, walks1, waits1 = passes(1)
    reads40, walks40, waits40 = passes(40)
    assert waits40 > 20 * waits1  # the runs did take many polls
    assert (reads40, walks40) == (reads1, walks1)


COVERED = """\
name: covered
workload: {preset: tiny}
baseline: {world_size: 2, sharding: table_wise, batch_size: 64, kernel: torch}
knobs:
  emb_precision: [fp32, fp16]
  dense_precision: [fp32, bf16]
  comm_precision: [fp32, bf16]
quality: {samples: 4096, eval_samples: 2048, seeds: 2, tolerance: 0.002}
trial: {warmup_steps: 1, measure_steps: 3, windows: 1, timeout_s: 300, repeats: 1}
budget: {trials: 3, confirm_top_k: 1}
"""


def test_the_back_off_from_a_stack_with_a_change_ruled_out_alone_keeps_it_only_beside_its_cover(
        tmp_path: Path) -> None:
    """The confirm backs off from the fastest stack (fp16 tables, bf16 dense and comm), rejected while
    searching, after the screen ruled bf16 comm out alone: its plan keeps bf16 comm only beside bf16
    dense math, and its note names the ruled-out change and where it may still be kept."""
    from cubic.quality.screen import Screened
    from cubic.tune.confirm import Confirm

    d, e, c = "dense_precision", "emb_precision", "comm_precision"
    stack = {e: "fp16", d: "bf16", c: "bf16"}
    confirm, store, recs = confirm_over(tmp_path, COVERED, [({}, 100.0), (stack, 300.0)])
    store.update(recs[1], quality_heldout_ok=False)
    checks = confirm.checks
    checks.screen = [Screened(c, "bf16", {**store.space.baseline_params(), c: "bf16"}, [0.9], [0.7],
                              False, "x")]
    confirm = Confirm(confirm.ctx, checks)
    plan = confirm.backoff_plan()
    assert plan is not None
    kept = {v.kept for v in plan.order}
    assert frozenset({d, c}) in kept and frozenset({e, c}) not in kept and frozenset({c}) not in kept
    note = confirm.ctx.view.console.export_text()
    assert "none keeps comm_precision=bf16, but with dense_precision=bf16" in note, note


def test_quality_runs_go_first_to_the_likelier_pass_where_a_stack_costs_its_screened_changes_sum(
        tmp_path: Path) -> None:
    """`make tune`'s confirm judged a stack of bf16 dense and fp16 comm (+0.06% and +0.07% alone in
    the screen, +0.12% summed) before the winner's model beside it, as fast, for its cheaper first
    seed: three runs to "not resolved". The stack's chance before its own pairs now comes from its
    screened changes, so the likelier pass per run goes first; with no screen to go by, the cheaper
    seed still does. (The verdict logic alone.)"""
    from cubic.quality.screen import Screened

    two_lrs = RACE.replace("  pipeline_depth: [0, 1]",
                           "  dense_lr: [0.05, 0.01]\n  pipeline_depth: [0, 1]")
    confirm, store, (base, stack, other) = confirm_over(
        tmp_path, two_lrs,
        [({}, 100.0), ({"emb_lr": 0.00011, "dense_lr": 0.01}, 300.0), ({"emb_lr": 0.0001}, 290.0)])
    store.update(base, confirm_qps=[100.0] * 3, quality_eval_ne=BNE[:2], quality_eval_auc=[0.7] * 2)
    _set(store, stack, [2.5, 2.6, 2.4], [])
    _set(store, other, [2.45, 2.55, 2.5], [0.0005, 0.0012])  # straddles 0.2%, likely to pass
    confirm.screened = [stack, other]
    assert confirm.phase(stack) is confirm.phase(other) is Phase.JUDGING
    # no screen to go by: the cheaper seed first
    assert confirm.focus() is stack and confirm.quality_seed(stack) == 0

    def alone(knob: str, value: float, diffs: list[float]) -> Screened:
        ne = [b * (1 + d) for b, d in zip(BNE[:2], diffs, strict=True)]
        return Screened(knob, value, {}, ne, [0.7] * 2)

    confirm.checks.screen = [alone("emb_lr", 0.00011, [0.0011, 0.0013]),
                             alone("dense_lr", 0.01, [0.0010, 0.0014])]
    # +0.24% summed: unlikely to pass, at one run or two
    assert confirm.turn(other) < confirm.turn(stack)
    assert confirm.focus() is other and confirm.quality_seed(base) == 2
    assert confirm.quality_seed(stack) is None
