"""The quality screen (cubic/quality/screen.py): each numerics change judged alone before the search; configurations
with a change that fails are never proposed, and the confirm does not consider them."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from cubic.quality.rules import MORE, NOT_RESOLVED, sequential
from cubic.quality.screen import ATTR, Screened, cell, decide, single_changes
from cubic.search.samplers import make_sampler
from cubic.search.samplers.base import Observations, distributions
from cubic.space.quality_runs import QualityRuns
from cubic.space.search_space import SearchSpace, load_space
from tests.test_eval_quality import LARGE_BATCH

ROOT = Path(__file__).resolve().parents[1]

SCREEN = LARGE_BATCH.replace("name: lb", "name: screen").replace("  batch_size: [64, 256]\n", """\
  dense_precision: [fp32, bf16]    # passes alone
  pipeline_depth: [0, 1]           # layout only: never screened
  batch_size: [64, 256]            # 4x the batch at the baseline's rates: fails alone
""").replace("tolerance: 0.002}", "tolerance: 0.002, max_seeds: 3}") + """trial: {warmup_steps: 1, \
measure_steps: 3, windows: 1, timeout_s: 300, repeats: 1}
budget: {trials: 4, confirm_top_k: 2}
"""


@functools.cache
def default_space() -> SearchSpace:
    return load_space(ROOT / "search_spaces" / "dlrm_cpu.yaml")


def test_the_default_space_screens_each_numerics_change_once() -> None:
    """dlrm_cpu.yaml: one change per numerics-changing knob value (the sharding types that keep the baseline's
    optimizer state are one change, column-wise another; layout knobs such as kernel or pipelining none)."""
    space = default_space()
    labels = [s.label for s in single_changes(space)]
    assert labels == ["sharding=column_wise", "emb_optimizer=sgd", "global_batch=1024",
                      "global_batch=4096", "global_batch=8192", "emb_precision=fp16", "dense_precision=bf16",
                      "comm_precision=bf16", "comm_precision=fp16"]
    for s in single_changes(space):
        assert space.numerics_changes(s.params) == {s.change}


def test_no_screen_without_quality_runs_where_it_is_off_or_for_a_batch_beside_learning_rate_knobs(
        tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(SCREEN.replace("quality: {", "quality: {screen: false, "))
    assert single_changes(load_space(tmp_path / "a.yaml")) == []
    (tmp_path / "b.yaml").write_text(SCREEN.replace("  batch_size: [64, 256]", "  batch_size: [64, 256]\n"
                                                    "  emb_lr: [0.01, 0.04]"))
    labels = [s.label for s in single_changes(load_space(tmp_path / "b.yaml"))]
    assert labels == ["dense_precision=bf16", "emb_lr=0.04"]  # the batch's verdict depends on its rates
    (tmp_path / "d.yaml").write_text(SCREEN.replace("  pipeline_depth: [0, 1]", "  pipeline_depth: [0, 1]\n"
                                                    "  allreduce_comm_precision: [fp32, bf16]"))
    labels = [s.label for s in single_changes(load_space(tmp_path / "d.yaml"))]
    assert "allreduce_comm_precision=bf16" in labels  # the dense gradients' wire precision is a numerics change
    (tmp_path / "c.yaml").write_text(SCREEN.replace("quality: {", "quality: {screen: 2, "))
    from cubic_harness.errors import ConfigError
    with pytest.raises(ConfigError, match="quality.screen"):
        load_space(tmp_path / "c.yaml")


def test_one_seed_decides_a_clear_change_and_an_ambiguous_one_takes_the_paired_judgement() -> None:
    qr = QualityRuns(seeds=2, tolerance=0.001)
    base = [0.8000, 0.8100]
    s = Screened("x", 1, {}, [0.8004], [0.7])  # +0.05%: passes for now
    assert decide(s, base, qr)[0] is True
    s.eval_ne = [0.8100]  # +1.25%: far past 3x the tolerance
    assert decide(s, base, qr)[0] is False
    s.eval_ne = [0.8016]  # +0.2%: between, needs the second seed
    assert decide(s, base, qr) == (None, "")
    s.eval_ne = [0.8016, 0.8116]  # +0.2% twice: fails the paired judgement
    ok, why = decide(s, base, qr)
    assert ok is False and "paired" in why
    s.eval_ne = [None]
    assert decide(s, base, qr)[0] is False


def test_the_summary_shows_each_screened_change_in_one_short_line() -> None:
    """The summary's screen cell: the verdict, the paired eval NE difference over the runs that decided it, the
    interval where two seeds ran, and the seeds; a change ruled out with another names it. The gate's full
    reason (per-seed range, s.e., the baseline's spread) stays in the study and the report."""
    qr = QualityRuns(seeds=2, tolerance=0.001)
    base = [0.8000, 0.8100]

    def decided(s: Screened) -> Screened:
        s.ok, s.reason = decide(s, base, qr)
        return s

    far = decided(Screened("x", 1, {}, [0.8100], [0.7]))
    assert cell(far, base, qr) == "ruled out: eval NE +1.250%, 1 seed, over 3x the tolerance"
    two = decided(Screened("x", 1, {}, [0.8016, 0.8117], [0.7, 0.7]))
    line = cell(two, base, qr)
    assert re.fullmatch(r"ruled out: eval NE \+0\.20\d%, 90% CI \+0\.\d\d%\.\.\+0\.\d\d%, 2 seeds", line), line
    assert "paired s.e." in two.reason and "paired s.e." not in line and len(line) < len(two.reason) / 2
    near = decided(Screened("x", 1, {}, [0.8004], [0.7]))
    assert cell(near, base, qr) == "passes: eval NE +0.050%, 1 seed"
    implied = Screened("global_batch", 8192, {}, [], [], False,
                       "as global_batch=4096 is, without a run of its own (a larger global batch takes fewer steps)")
    assert cell(implied, base, qr) == "ruled out: as global_batch=4096 is, without a run of its own"
    assert cell(decided(Screened("x", 1, {}, [None], [None])), base, qr) == "ruled out: a quality run failed"
    assert cell(Screened("x", 1, {}, [], []), base, qr) == "not run"


def test_the_screen_states_its_interval_at_the_spaces_confidence() -> None:
    """The stored reason and the summary's line give one interval, at the confidence the space sets."""
    base = [0.8000, 0.8100]
    s = Screened("x", 1, {}, [0.8016, 0.8117], [0.7, 0.7])
    for conf in (0.8, 0.99):
        qr = QualityRuns(seeds=2, tolerance=0.001, confidence=conf)
        s.ok, s.reason = decide(s, base, qr)
        ci = re.search(r"\d+% CI [-+]\d\.\d\d%\.\.[-+]\d\.\d\d%", cell(s, base, qr))
        assert ci and ci.group().startswith(f"{conf:.0%} CI"), cell(s, base, qr)
        assert f"{conf:.0%}" in s.reason, s.reason


@pytest.mark.parametrize("searcher", ["cubic", "random", "grid", "tpe", "ds-xgb"])
def test_no_searcher_proposes_a_configuration_with_a_change_the_screen_failed(searcher: str) -> None:
    """The verdict lives in the study (what a resumed tune and every searcher read), not in one sampler."""
    space = default_space()  # (one load: enumerating it is most of each case's time)
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(ATTR, [Screened("emb_optimizer", "sgd", {}, [0.9], [0.7], False, "x").to_dict(),
                               Screened("global_batch", 8192, {}, [0.9], [0.7], False, "x").to_dict(),
                               Screened("dense_precision", "bf16", {}, [0.8], [0.7], True, "x").to_dict()])
    study.sampler = make_sampler(searcher, space, seed=1)
    dists = distributions(space)
    for i in range(12):
        t = study.ask(dists)
        cfg = space.config(t.params)
        assert cfg.emb_optimizer != "sgd" and cfg.global_batch != 8192, (searcher, i, t.params)
        study.tell(t, 1000.0 + i)
    obs = Observations.of(study, space)
    assert obs.ruled_out == {("emb_optimizer", "sgd"), ("global_batch", 8192)}
    assert obs.excluded and obs.excluded <= obs.seen


# ~1 min, in the default tier: CI's one real tune with a quality section (held-out runs, the screen, a
# rejection and a confirm): 1 + 2 quality runs for the baseline and the screen, 4 trials
def test_the_screen_rules_a_harmful_change_out_before_the_search_spends_a_trial_on_it(tmp_path: Path) -> None:
    """Grid order would try 4x the batch second; the screen's one run of it alone fails held-out quality
    (far past the tolerance) before the search starts, so no trial uses it, and bf16 dense, which passes,
    is tried; the verdicts are in the study and the run's output."""
    from cubic.results import analysis
    from tests.test_analysis import cubic_cli

    (tmp_path / "s.yaml").write_text(SCREEN)
    r = cubic_cli("tune", "--space", str(tmp_path / "s.yaml"), "--run-dir", str(tmp_path / "run"),
                  "--searcher", "grid", "--no-live")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "quality screen: global_batch=512 alone fails" in r.stdout, r.stdout
    row = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("global_batch=512 "))
    assert re.search(r"ruled out: eval NE \+\d+\.\d{3}%, 1 seed", row) and "vs baseline" not in row, row
    study = analysis.open_study(tmp_path / "run")
    w = study.user_attrs["winner"]  # (its speed-up over the baseline, whose reason quotes its eval NE)
    assert w["speedup"] is not None and w["baseline_qps"] > 0, w
    screen = {s["name"]: s for s in study.user_attrs[ATTR]}
    assert screen["global_batch"]["ok"] is False and len(screen["global_batch"]["eval_ne"]) == 1
    assert screen["dense_precision"]["ok"] is True
    df = analysis.load_study(tmp_path / "run")
    assert len(df) == 4 and (df["batch_size"] == 64).all()
    assert (df["dense_precision"] == "bf16").any()
    rep = cubic_cli("report", str(tmp_path / "run"))
    assert rep.returncode == 0, rep.stderr
    assert "quality screen (each change alone" in rep.stdout and "ruled out global_batch=512" in rep.stdout
    html = (tmp_path / "run" / "report.html").read_text()
    assert "Quality screen: each numerics change alone" in html
    # every confirmed bf16 candidate is judged by its quality runs or spared for its speed, which the timing
    # decides (one pair each: a candidate measured no faster than the layout that passed cannot win); the
    # verdicts are sequential: each seed past the first two was asked for by an interval that straddled the
    # tolerance, and the verdict stored is the rule's on the seeds that ran
    qr = load_space(tmp_path / "s.yaml").quality_runs
    bne = list(analysis.baseline_rows(df)["quality_eval_ne"].iloc[0])
    stacks = df[(df["dense_precision"] == "bf16") & df["quality_verdict"].notna()]
    judged = stacks[stacks["quality_verdict"].isin(["passed", "failed", NOT_RESOLVED])
                    & stacks["quality_reason"].str.contains("interval")]
    spared = stacks[(stacks["quality_verdict"] == "slower") & stacks["quality_reason"].str.contains("cannot win")]
    shown = df[["number", "quality_verdict", "quality_reason"]].to_string()
    assert len(stacks) and len(judged) + len(spared) == len(stacks), shown
    for r in judged.itertuples():
        ne = list(r.quality_eval_ne)
        assert qr.seeds <= len(ne) <= qr.max_seeds and len(bne) >= len(ne), (ne, bne)
        assert sequential(ne, bne, qr)[0] == r.quality_verdict, r.quality_reason
        if len(ne) > qr.seeds:
            assert sequential(ne[:-1], bne, qr)[0] == MORE
    assert "Quality verdicts of the confirmed configurations" in html
    e = cubic_cli("export", str(tmp_path / "run"), "-f", "json", "-o", str(tmp_path / "w.json"))
    assert e.returncode == 0, e.stderr
    assert json.loads((tmp_path / "w.json").read_text())["quality"]["quality_verdict"] == "passed"
    # a second tune (another study, another searcher seed) reuses the kept quality runs: its screen trains nothing
    # and reaches the same verdicts on the same eval NE (the first tune's check of a change's own model, where
    # the bf16 trial led, added seeds to that change's runs: the second's are their first)
    r2 = cubic_cli("tune", "--space", str(tmp_path / "s.yaml"), "--run-dir", str(tmp_path / "run2"), "--seed", "1",
                   "--searcher", "grid", "--trials", "1", "--quality-store", str(tmp_path / "run"), "--no-live")
    assert r2.returncode == 0, r2.stderr[-3000:]
    lines = r2.stdout.splitlines()
    screened = [ln for ln in lines if ln.startswith("quality screen: ") and " alone, seed " in ln]
    assert screened and all(ln.endswith("reused from the quality store, not trained again") for ln in screened), \
        r2.stdout
    again = {s["name"]: s for s in analysis.open_study(tmp_path / "run2").user_attrs[ATTR]}
    assert {k: v["ok"] for k, v in again.items()} == {k: v["ok"] for k, v in screen.items()}
    assert all(v["eval_ne"] and v["eval_ne"] == screen[k]["eval_ne"][:len(v["eval_ne"])]
               for k, v in again.items()), (again, screen)
    m = re.search(r"quality runs: (\d+) trained, (\d+) reused from the quality store", r2.stdout)
    assert m and int(m[2]) >= len(screened) + qr.seeds, r2.stdout


SLOWER = """\
name: slower
workload: {preset: tiny}
baseline: {world_size: 2, sharding: table_wise, batch_size: 64, kernel: torch}
knobs:
  batch_size: [64, 4]              # 16x smaller batches: far slower, and another global batch (numerics)
quality: {samples: 4096, eval_samples: 2048, seeds: 2, tolerance: 0.002, screen: false}
trial: {warmup_steps: 1, measure_steps: 3, windows: 1, timeout_s: 300, repeats: 1}
budget: {trials: 2, confirm_top_k: 1}
"""


# ~1 min, in the default tier: 2 trials, the baseline's 2 quality runs and 2 re-measurements, run in-process
def test_the_confirm_spends_no_quality_run_on_a_candidate_that_cannot_beat_the_baseline(tmp_path: Path) -> None:
    """A numerics change measured slower than the baseline, in its search run and its re-measurement, cannot
    be the winner: it is failed with that reason and none of its quality runs is trained."""
    from rich.console import Console

    from cubic.results import analysis
    from cubic.study.store import Store, open_storage, storage_url
    from cubic.tune import Tuner
    from tests.test_memory import InlineRunner

    (tmp_path / "s.yaml").write_text(SLOWER)
    space = load_space(tmp_path / "s.yaml")
    runner = InlineRunner()
    Tuner(space, Store(space, open_storage(storage_url(tmp_path, must_exist=False)), tmp_path), runner, searcher="grid",
          console=Console(record=True, width=200), live=False).run()
    small = {r.params["batch_size"]: r for r in analysis.records(tmp_path)}[4]
    assert small.confirm_qps and small.quality_ok is False and "cannot win" in small.quality_reason, \
        small.quality_reason
    assert not small.quality_eval_ne
    trained = [c.batch_size for c in runner.submitted if c.eval_samples > 0]
    assert trained and set(trained) == {64}  # the baseline's pairs and noise floor only


ON_DEMAND_SPACE = LARGE_BATCH.replace("name: lb", "name: od").replace("  batch_size: [64, 256]\n", """\
  batch_size: [64, 256, 4]         # 4x: faster, fails alone; 16x smaller: far slower, never the incumbent
  pipeline_depth: [0, 1]           # layout only: trials for the incumbent to outlast
""").replace("tolerance: 0.002}", "tolerance: 0.002, screen: on_demand}") + """trial: {warmup_steps: 1, \
measure_steps: 3, windows: 1, timeout_s: 300, repeats: 1}
budget: {trials: 6, confirm_top_k: 1}
"""


# ~1 min, in the default tier: 6 trials, run in-process with small quality runs
def test_an_on_demand_screen_judges_only_the_changes_an_incumbent_carries(tmp_path: Path) -> None:
    """`screen: on_demand`: the 4x batch, once its trial has outlasted the next two, is screened alone and
    ruled out (its trials fail with it); the 16x smaller batch, which no incumbent carries, costs no run."""
    from rich.console import Console

    from cubic.results import analysis
    from cubic.study.store import Store, open_storage, storage_url
    from cubic.tune import Tuner
    from tests.test_memory import InlineRunner

    (tmp_path / "s.yaml").write_text(ON_DEMAND_SPACE)
    space = load_space(tmp_path / "s.yaml")
    assert space.quality_runs.screen == "on_demand"
    assert {s.label for s in single_changes(space)} == {"global_batch=8", "global_batch=512"}
    runner = InlineRunner()
    store = Store(space, open_storage(storage_url(tmp_path, must_exist=False)), tmp_path)
    console = Console(record=True, width=200)
    Tuner(space, store, runner, searcher="grid", console=console, live=False).run()
    screen = {s["value"]: s for s in store.study.user_attrs[ATTR]}
    assert screen[512]["ok"] is False and len(screen[512]["eval_ne"]) >= 1, screen[512]
    assert screen[8]["ok"] is None and screen[8]["eval_ne"] == [], screen[8]  # never paid for
    trained = {c.batch_size for c in runner.submitted if c.eval_samples > 0}
    assert 4 not in trained and 256 in trained, trained
    recs = analysis.records(tmp_path)
    assert all(r.quality_heldout_ok is False for r in recs if r.params["batch_size"] == 256)
    assert "(a change of the incumbent #" in console.export_text()


def _on_demand_twins() -> str:
    """test_tune's TWINS with its screen on demand and a second numerics knob (bf16 dense)."""
    from tests.test_tune import TWINS

    return (TWINS.replace("screen: false", "screen: on_demand")
            .replace("  pipeline_depth: [0, 1]", "  pipeline_depth: [0, 1]\n  dense_precision: [fp32, bf16]"))


def test_a_check_that_fails_what_a_change_trains_alone_rules_the_change_out(tmp_path: Path) -> None:
    """`make tune SEED=1`: the screen passed fp16 tables after one seed (-0.080%), the incumbent that trains
    the same model failed its check at the second seed (+0.33%), and the search went on to spend 13 of its
    30 trials on fp16 tables beside other numerics changes. The check's seeds are the change's own runs:
    the screen's verdict follows them, so the change is out of the search, and a finished trial that
    pairs it with another change fails with it. (The verdict logic alone: nothing is trained.)"""
    from cubic.tune.work import CheckRun, ScreenRun
    from cubic_harness.config import TrialResult
    from tests.test_tune import confirm_over

    low = {"emb_lr": 0.0001}
    confirm, store, (base, fast, paired) = confirm_over(
        tmp_path, _on_demand_twins(), [({}, 100.0), ({**low, "pipeline_depth": 1}, 300.0),
                         ({**low, "dense_precision": "bf16"}, 250.0)])
    checks, space = confirm.checks, confirm.ctx.space
    checks.start()
    store.update(base, quality_eval_ne=[0.800, 0.810], quality_eval_auc=[0.7] * 2)
    scr = next(x for x in checks.screen if x.change == ("emb_lr", 0.0001))

    def run(ne: float) -> TrialResult:
        return TrialResult(extra={"eval_ne": ne, "eval_auc": 0.7})

    checks.screened(ScreenRun(scr, 0), run(0.8008))  # +0.10%, within the 0.2% tolerance: passes for now
    assert scr.ok is True and Observations.of(store.study, space).ruled_out == frozenset()
    checks.estimate()  # the incumbent starts from the screen's run of its model
    assert store.records()[fast.number].quality_eval_ne == [0.8008]
    checks.checked(CheckRun(store.records()[fast.number], 1), run(0.8190))  # +1.1%: fails at two seeds
    stored = {s["value"]: s for s in store.study.user_attrs[ATTR]}
    assert stored[0.0001]["ok"] is False and stored[0.0001]["eval_ne"] == [0.8008, 0.8190], stored
    assert Observations.of(store.study, space).ruled_out == {("emb_lr", 0.0001)}
    recs = store.records()
    assert recs[fast.number].quality_heldout_ok is False
    assert recs[paired.number].quality_heldout_ok is False  # another model, out with the change it carries
    assert recs[paired.number].quality_screened_out == ["emb_lr=0.0001"]
    assert "emb_lr=0.0001 alone fails (#1's check of the same model)" in confirm.ctx.view.console.export_text()


def test_an_on_demand_screen_runs_once_every_recent_incumbent_carries_a_change(tmp_path: Path) -> None:
    """`make tune SEED=1` ran six trials in a row with SGD tables, each faster than the last, so no incumbent
    outlasted two trials and the screen waited for the sixth. A change every incumbent carried through the
    last two trials is settled though the incumbent changed: its screen run comes then; a change only the
    newest incumbent carries waits, as does that incumbent's own check. (The decision alone: nothing is
    trained; the runner records what it was asked to start.)"""
    from cubic.tune.checks import leaders, settled_changes
    from cubic.tune.work import ScreenRun
    from tests.test_memory import InlineRunner
    from tests.test_tune import confirm_over

    low = {"emb_lr": 0.0001}
    confirm, store, (base, a, b, c) = confirm_over(
        tmp_path, _on_demand_twins(), [({}, 100.0), (low, 200.0), ({**low, "pipeline_depth": 1}, 210.0),
                         ({**low, "dense_precision": "bf16"}, 220.0)])
    checks, space = confirm.checks, confirm.ctx.space
    confirm.ctx.runner = InlineRunner()
    checks.start()
    store.update(base, quality_eval_ne=[0.800, 0.810], quality_eval_auc=[0.7] * 2)
    done = store.records(TrialState.COMPLETE)
    lead = leaders(done, done[0])
    assert [t.number if t else None for t in lead] == [None, a.number, b.number, c.number]
    assert settled_changes(space, lead) == {("emb_lr", 0.0001)}
    assert settled_changes(space, lead[:-1]) == set()  # the baseline led before #1
    p = checks.next_run([])
    assert isinstance(p.tag, ScreenRun) and p.tag.change.change == ("emb_lr", 0.0001), p
    assert not checks.settled(done[-1], done)  # the newest incumbent itself has outlasted nothing
    scr = p.tag.change
    scr.eval_ne, scr.eval_auc, scr.ok = [0.8001, 0.8102], [0.7] * 2, True  # passed on both seeds
    assert checks.next_run([]) is None  # bf16 dense: only #3 carries it; #3's own check waits too


def test_a_change_every_incumbent_carries_beside_its_cover_is_not_settled_until_one_carries_it_alone(
        tmp_path: Path) -> None:
    """Two `make tune`s screened bf16 communication alone (two runs each, ruled out) while every
    incumbent carried it beside bf16 dense math, where a verdict on it alone rules nothing out
    (`numerics.COVERS`), and crowned that stack. A change each recent incumbent makes beside a cover is
    not settled, so the screen spends nothing on it; once one incumbent carries it with fp32 dense
    math, it is. (The decision alone: nothing is trained.)"""
    from cubic.tune.checks import leaders, settled_changes
    from tests.test_tune import confirm_over

    text = _on_demand_twins().replace("  dense_precision: [fp32, bf16]",
                                      "  dense_precision: [fp32, bf16]\n  comm_precision: [fp32, bf16]")
    both = {"dense_precision": "bf16", "comm_precision": "bf16"}
    confirm, store, (base, *_) = confirm_over(
        tmp_path, text, [({}, 100.0), (both, 200.0), ({**both, "pipeline_depth": 1}, 210.0),
                         (both | {"emb_lr": 0.0001}, 220.0), ({"comm_precision": "bf16"}, 230.0)])
    space = confirm.ctx.space
    done = store.records(TrialState.COMPLETE)
    lead = leaders(done, done[0])
    assert settled_changes(space, lead[:-1]) == {("dense_precision", "bf16")}
    # the newest incumbent carries it with fp32 dense math: a verdict alone would rule that one out
    assert settled_changes(space, lead) == {("comm_precision", "bf16")}


def test_a_change_the_leaders_settle_on_gets_its_second_screen_seed_before_it_passes_for_good(
        tmp_path: Path) -> None:
    """`make tune` passed fp16 tables on one screen seed (-0.08%) while every incumbent carried them; the
    confirm then spent 8 quality runs on fp16-table stacks to end "not resolved" (the change's next seed
    reads +0.33%). On demand, a change that passed on fewer than `seeds` and stays settled gets its next
    seed, and the paired judgement over both decides: a fail rules it out of the search and fails every
    finished trial with it. Upfront, one clear seed still passes a change. (The decision alone.)"""
    from cubic.tune.checks import leaders, settled_changes
    from cubic.tune.work import ScreenRun
    from cubic_harness.config import TrialResult
    from tests.test_memory import InlineRunner
    from tests.test_tune import confirm_over

    low = {"emb_lr": 0.0001}
    confirm, store, (base, a, b, c) = confirm_over(
        tmp_path, _on_demand_twins(), [({}, 100.0), (low, 200.0), ({**low, "pipeline_depth": 1}, 210.0),
                         ({**low, "dense_precision": "bf16"}, 220.0)])
    checks, space = confirm.checks, confirm.ctx.space
    confirm.ctx.runner = InlineRunner()
    checks.start()
    store.update(base, quality_eval_ne=[0.800, 0.810], quality_eval_auc=[0.7] * 2)
    done = store.records(TrialState.COMPLETE)
    assert settled_changes(space, leaders(done, done[0])) == {("emb_lr", 0.0001)}
    p = checks.next_run([])
    assert isinstance(p.tag, ScreenRun) and p.tag.seed == 0
    scr = p.tag.change
    checks.screened(p.tag, TrialResult(extra={"eval_ne": 0.8004, "eval_auc": 0.7}))  # +0.05%: for now
    assert scr.ok is True and Observations.of(store.study, space).ruled_out == frozenset()
    p = checks.next_run([])  # still settled: its second seed
    assert isinstance(p.tag, ScreenRun) and p.tag.change is scr and p.tag.seed == 1
    checks.screened(p.tag, TrialResult(extra={"eval_ne": 0.8190, "eval_auc": 0.7}))  # +1.1%
    assert scr.ok is False and scr.eval_ne == [0.8004, 0.8190]
    assert Observations.of(store.study, space).ruled_out == {("emb_lr", 0.0001)}
    assert all(store.records()[t.number].quality_heldout_ok is False for t in (a, b, c))
    assert "emb_lr=0.0001 alone fails" in confirm.ctx.view.console.export_text()
    # upfront, no change is settled first: a clear first seed passes it for the whole search
    scr.eval_ne, scr.eval_auc, scr.ok = [0.8004], [0.7], True
    for x in checks.screen:
        x.ok = True if x.ok is None else x.ok
    assert checks.due_screen({scr.change}) is scr and checks.due_screen(None) is None


def test_an_incumbent_whose_first_check_equals_a_screened_change_bit_for_bit_takes_its_other_runs(
        tmp_path: Path) -> None:
    """`make tune`: the screen ran bf16 dense alone on two seeds, then the incumbent, bf16 dense with
    bf16 communication, had two checks of its own, each equal to the screen's run of that seed to every
    digit (bf16 dense math reads the bf16 wire: `numerics.COVERS`). After its first check equals the
    screen's first run bit for bit (eval NE and AUC), the incumbent takes the screen's second and its
    verdict with it; a first check one bit off runs its own second seed. (Nothing is trained.)"""
    from cubic.tune.work import CheckRun, ScreenRun
    from cubic_harness.config import TrialResult
    from tests.test_tune import confirm_over

    text = _on_demand_twins().replace("  dense_precision: [fp32, bf16]",
                                      "  dense_precision: [fp32, bf16]\n  comm_precision: [fp32, bf16]")
    both = {"dense_precision": "bf16", "comm_precision": "bf16"}
    confirm, store, (base, same, other) = confirm_over(
        tmp_path, text, [({}, 100.0), (both, 300.0), ({**both, "pipeline_depth": 1, "emb_lr": 0.0001},
                                                      250.0)])
    checks = confirm.checks
    checks.start()
    store.update(base, quality_eval_ne=[0.800, 0.810], quality_eval_auc=[0.7] * 2)
    scr = next(x for x in checks.screen if x.change == ("dense_precision", "bf16"))

    def run(ne: float, auc: float = 0.71) -> TrialResult:
        return TrialResult(extra={"eval_ne": ne, "eval_auc": auc})

    checks.screened(ScreenRun(scr, 0), run(0.8008))
    checks.screened(ScreenRun(scr, 1), run(0.8090))
    assert scr.ok is True and scr.eval_ne == [0.8008, 0.8090]
    checks.checked(CheckRun(store.records()[same.number], 0), run(0.8008))
    rec = store.records()[same.number]
    assert rec.quality_eval_ne == [0.8008, 0.8090] and rec.quality_eval_auc == [0.71, 0.71]
    assert rec.quality_heldout_ok is True and rec.quality_screen_runs == "dense_precision=bf16"
    assert (f"quality: #{same.number}'s first 1 quality run(s) equal dense_precision=bf16 alone's bit "
            "for bit: the same model here, so its other 1 apply") in confirm.ctx.view.console.export_text()
    checks.checked(CheckRun(store.records()[other.number], 0), run(0.8008, auc=0.7100001))
    rec = store.records()[other.number]
    assert rec.quality_eval_ne == [0.8008] and rec.quality_heldout_ok is None  # its own second seed


def test_a_change_ruled_out_alone_stays_searchable_beside_a_change_that_may_cover_it() -> None:
    """bf16 communication failed alone (on the baseline's fp32 dense math); beside bf16 dense math it
    may round nothing more (`numerics.COVERS`), so those configurations stay in the search, the
    confirm's back-off may keep it there, and their own quality runs judge them; with fp32 dense it is
    out."""
    from cubic.quality.screen import excluded_tuples, failing_changes
    from cubic.tune import backoff

    space = default_space()
    out = frozenset({("comm_precision", "bf16")})
    base = space.baseline_params()
    alone = {**base, "comm_precision": "bf16"}
    both = {**base, "comm_precision": "bf16", "dense_precision": "bf16"}
    assert failing_changes(space, alone, out) == ["comm_precision=bf16"]
    assert failing_changes(space, both, out) == []
    ex = excluded_tuples(space, out)
    assert space.tup(space.canonical(alone)) in ex and space.tup(space.canonical(both)) not in ex
    assert all(space.params_of(t)["dense_precision"] == "fp32" for t in ex)
    d, e, c = "dense_precision", "emb_precision", "comm_precision"
    src = {**both, "emb_precision": "fp16"}
    plan = backoff.plan(space, src, [d, e, c], lambda p: None, None, lambda k: 0.0, ruled_out=out)
    kept = {v.kept for v in plan.order}
    assert frozenset({d, c}) in kept and frozenset({c}) not in kept and frozenset({e, c}) not in kept
    assert plan.budget == 3


def test_bf16_communication_beside_bf16_dense_math_trains_the_same_model_bit_for_bit() -> None:
    """The claim `numerics.COVERS` rests on, over real training on 2 gloo ranks (table-wise: every
    pooled embedding crosses the all-to-all): with bf16 dense math, bf16 communication changes no loss
    and no held-out NE, bit for bit; with fp32 dense math it does (the screen's verdict on it alone
    is about that rounding)."""
    from cubic_harness.trial import run_trial
    from tests.helpers import tiny_cfg

    def run(dense: str, comm: str) -> tuple[list[float], float]:
        r = run_trial(tiny_cfg(world_size=2, sharding="table_wise", dense_precision=dense,
                               comm_precision=comm, warmup_steps=4, measure_steps=8,
                               eval_samples=2048))
        assert r.status == "ok", r.error
        return r.losses, r.extra["eval_ne"]

    assert run("bf16", "bf16") == run("bf16", "fp32")
    fp32, rounded = run("fp32", "fp32"), run("fp32", "bf16")
    assert fp32[1] != rounded[1] and fp32[0] != rounded[0], (fp32, rounded)


NEARER = LARGE_BATCH.replace("name: lb", "name: nearer").replace("  batch_size: [64, 256]\n", """\
  batch_size: [64, 128, 256]       # 2x and 4x the global batch at the baseline's rates
  pipeline_depth: [0, 1]           # layout only: trials for the incumbent to outlast
""").replace("tolerance: 0.002}", "tolerance: 0.002, screen: on_demand}")


@pytest.mark.parametrize("rule", ["none", "sqrt"])
def test_a_larger_batch_gives_way_to_a_nearer_one_whose_failure_rules_both_out(
        tmp_path: Path, rule: str) -> None:
    """`make tune` screened 4x the global batch (+3.1%) for one incumbent and then 2x (+0.47%) for a later
    one: two quality runs where one decides both, since at the baseline's learning rates a larger batch
    takes fewer steps over the same samples (`numerics.MONOTONE`). The incumbent carries 4x: the screen
    runs 2x first, and its failure rules 4x out without a run, with the trials that carry it. Where rates
    follow the batch (`lr_scaling: sqrt`) a larger step may make up for fewer: 4x is screened itself.
    (The decision alone: nothing is trained; the runner records what it was asked to start.)"""
    from cubic.tune.work import ScreenRun
    from cubic_harness.config import TrialResult
    from tests.test_memory import InlineRunner
    from tests.test_tune import confirm_over

    confirm, store, (base, big, big2, half) = confirm_over(
        tmp_path, NEARER + f"lr_scaling: {rule}\n",
        [({}, 100.0), ({"batch_size": 256}, 300.0), ({"batch_size": 256, "pipeline_depth": 1}, 310.0),
         ({"batch_size": 128}, 200.0)])
    checks, space = confirm.checks, confirm.ctx.space
    confirm.ctx.runner = runner = InlineRunner()
    checks.start()
    store.update(base, quality_eval_ne=[0.800, 0.810], quality_eval_auc=[0.7] * 2)
    p = checks.next_run([])
    if rule == "sqrt":
        assert p.tag.change.change == ("global_batch", 512)
        return
    scr = p.tag.change
    assert scr.change == ("global_batch", 256), scr  # 2x, though the incumbent carries 4x
    assert "nearer the baseline than the incumbent #2's" in confirm.ctx.view.console.export_text()
    checks.screened(ScreenRun(scr, 0), TrialResult(extra={"eval_ne": 0.8080, "eval_auc": 0.7}))  # +1%
    stored = {s["value"]: s for s in store.study.user_attrs[ATTR]}
    assert stored[256]["ok"] is False and stored[256]["eval_ne"] == [0.8080]
    assert stored[512]["ok"] is False and stored[512]["eval_ne"] == [], stored[512]  # no run of its own
    assert stored[512]["reason"].startswith("as global_batch=256 is, without a run of its own")
    assert "global_batch=512 ruled out as global_batch=256 is" in confirm.ctx.view.console.export_text()
    assert Observations.of(store.study, space).ruled_out == {("global_batch", 256), ("global_batch", 512)}
    recs = store.records()
    assert [recs[t.number].quality_screened_out for t in (big, big2, half)] == [
        ["global_batch=512"], ["global_batch=512"], ["global_batch=256"]]
    assert checks.next_run([]) is None and len(runner.submitted) == 1


def test_a_nearer_batch_that_passes_leaves_the_larger_one_its_own_run(tmp_path: Path) -> None:
    """The other way the nearer change can go: 2x within the tolerance says nothing of 4x, which is
    screened next on its own run. (The decision alone, as above.)"""
    from cubic.tune.work import ScreenRun
    from cubic_harness.config import TrialResult
    from tests.test_memory import InlineRunner
    from tests.test_tune import confirm_over

    confirm, store, (base, *_) = confirm_over(
        tmp_path, NEARER, [({}, 100.0), ({"batch_size": 256}, 300.0),
                           ({"batch_size": 256, "pipeline_depth": 1}, 310.0), ({"batch_size": 128}, 200.0)])
    checks = confirm.checks
    confirm.ctx.runner = InlineRunner()
    checks.start()
    store.update(base, quality_eval_ne=[0.800, 0.810], quality_eval_auc=[0.7] * 2)
    scr = checks.next_run([]).tag.change
    checks.screened(ScreenRun(scr, 0), TrialResult(extra={"eval_ne": 0.8004, "eval_auc": 0.7}))  # +0.05%
    assert scr.ok is True
    assert checks.next_run([]).tag.change.change == ("global_batch", 512)


def configs(space: SearchSpace, **values: object) -> list[tuple]:
    """The space's configurations with these knob values, in one fixed random order (of a copy: the
    space's own `all_tuples`, cached, keeps grid order for the other tests)."""
    import numpy as np

    every = list(space.all_tuples)
    np.random.default_rng(0).shuffle(every)
    return [t for t in every if all(space.params_of(t)[k] == v for k, v in values.items())]


def test_trials_a_ruled_out_change_explains_do_not_teach_the_searcher_their_other_knobs_fail() -> None:
    """Every trial with SGD tables (ruled out alone) also ran bf16 dense math, which passed alone:
    the searcher's feasibility classifier must not learn bf16 dense as infeasible from them (the
    exclusion keeps SGD out already), and the screen's bf16 run counts as a feasible example."""
    from optuna.trial import create_trial

    from cubic.search.samplers import CubicSampler

    space = default_space()

    def where(dense: str, opt: str, n: int) -> list[tuple]:
        return configs(space, dense_precision=dense, emb_optimizer=opt)[:n]

    fine, sgd = where("fp32", "rowwise_adagrad", 12), where("bf16", "sgd", 6)
    alone = {**space.baseline_params(), "dense_precision": "bf16"}
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(ATTR, [
        Screened("emb_optimizer", "sgd", {**space.baseline_params(), "emb_optimizer": "sgd"},
                 [0.9], [0.7], False, "x").to_dict(),
        Screened("dense_precision", "bf16", alone, [0.8], [0.7], True, "x").to_dict()])
    dists = distributions(space)
    for i, t in enumerate(fine + sgd):
        study.add_trial(create_trial(params=space.params_of(t), distributions=dists, value=1000.0 + 10 * i))
    feasible = {i: (False if i >= len(fine) else None) for i in range(len(fine) + len(sgd))}
    obs = Observations.of(study, space, feasible=feasible)
    assert obs.quality_failed == [] and obs.quality_passed == [space.tup(alone)]
    # one failure the screen does not explain stays a negative example
    lone = where("bf16", "rowwise_adagrad", 1)
    study.add_trial(create_trial(params=space.params_of(lone[0]), distributions=dists, value=900.0))
    obs = Observations.of(study, space, feasible={**feasible, len(fine) + len(sgd): False})
    assert obs.quality_failed == lone

    s = CubicSampler(space, feature_fn=None, n_random=50, n_fresh=5, n_tpe=0)
    s.propose(study, study.get_trials(deepcopy=False)[-1], obs)
    bf16 = [t for t in where("bf16", "rowwise_adagrad", 60) if t not in lone]
    assert s.proxy.p_feasible(bf16).mean() > 0.5


def test_a_change_the_screen_passed_alone_stays_feasible_beside_failures_it_is_part_of() -> None:
    """Three trials with bf16 dense math and fp16 communication fail quality, and no trial ran bf16
    dense without fp16 communication: the screen's run of bf16 dense alone, which passed, keeps the
    classifier from blaming bf16 dense (p 0.03 without it, 0.64 with it)."""
    from cubic.search.proxy import Proxy

    space = default_space()
    adagrad = {"emb_optimizer": "rowwise_adagrad"}
    fine = configs(space, dense_precision="fp32", **adagrad)[:12]
    bad = configs(space, dense_precision="bf16", comm_precision="fp16", **adagrad)[:3]
    alone = space.tup({**space.baseline_params(), "dense_precision": "bf16"})
    p = {}
    for passed in ((), (alone,)):
        proxy = Proxy(space, feature_fn=None).fit(fine + bad, [1000.0 + i for i in range(15)], bad,
                                                  passed=passed)
        p[passed] = proxy.p_feasible(
            configs(space, dense_precision="bf16", comm_precision="fp32", **adagrad)[:60]).mean()
    assert p[()] < 0.5 < p[(alone,)], p


def test_a_stacks_expected_cost_sums_what_its_changes_cost_alone_per_seed() -> None:
    """`stacked_diffs`: the screen's paired differences of a stack's changes, summed seed by seed
    (`make tune`'s screen: bf16 dense -0.011% and +0.118%, fp16 comm -0.042% and +0.170%); a change
    the other covers adds nothing; a change with no runs, one seed, or a failed run gives nothing
    to order by."""
    from cubic.quality.screen import stacked_diffs

    base = [0.83708, 0.83463]

    def alone(knob: str, value: str, diffs: list[float]) -> Screened:
        return Screened(knob, value, {}, [b * (1 + d) for b, d in zip(base, diffs, strict=True)],
                        [0.7, 0.7])

    dense = alone("dense_precision", "bf16", [-0.00011, 0.00118])
    comm16 = alone("comm_precision", "fp16", [-0.00042, 0.0017])
    comm_bf16 = alone("comm_precision", "bf16", [0.01, 0.01])
    screen = [dense, comm16, comm_bf16]
    got = stacked_diffs(frozenset({dense.change, comm16.change}), screen, base)
    assert got == pytest.approx([-0.00053, 0.00288], abs=1e-9)
    # bf16 comm beside bf16 dense rounds nothing more (`numerics.COVERS`): bf16 dense's cost alone
    covered = stacked_diffs(frozenset({dense.change, comm_bf16.change}), screen, base)
    assert covered == pytest.approx([-0.00011, 0.00118], abs=1e-9)
    assert stacked_diffs(frozenset({dense.change, ("emb_precision", "fp16")}), screen, base) is None
    assert stacked_diffs(frozenset({dense.change, comm16.change}), screen, base[:1]) is None
    comm16.eval_ne[1] = None
    assert stacked_diffs(frozenset({dense.change, comm16.change}), screen, base) is None
