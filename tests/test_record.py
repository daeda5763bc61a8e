"""The trial record (`cubic.study.record`): cubic's findings in its own table, Optuna's tables through Optuna's API
only, and stores written before that table existed still read, reported and resumed."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from cubic.results import analysis
from cubic.study import record, tables
from cubic.study.store import open_storage

ROOT = Path(__file__).resolve().parents[1]
# Written by `cubic tune` at commit 84b28a1 (the last one that kept cubic's findings in Optuna's user attrs):
# tests/data/store_84b28a1.yaml with --searcher grid --trials 2: the screen's runs, 2 trials and a confirm.
OLD_STORE = ROOT / "tests" / "data" / "store_84b28a1.db"
OLD_SPACE = ROOT / "tests" / "data" / "store_84b28a1.yaml"


def test_cubic_uses_no_private_optuna_api() -> None:
    """Optuna's private modules and attributes change without notice; every stored study depends on them not."""
    pattern = re.compile(r"optuna\.storages\._|\._storage\b|\._trial_id\b|\._study_id\b")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "cubic").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits


def test_a_record_reads_a_field_written_by_either_layout_with_the_table_winning(tmp_path: Path) -> None:
    rdb = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = optuna.create_study(study_name="s", storage=rdb)
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"quality_ok": False, "confirm_ne": 0.5,
                                                                     "phase": "grid"}))
    tables.ensure(rdb.engine)
    [old] = record.load(rdb.engine, "s", study.get_trials())
    assert old.quality_ok is False and old.confirm_ne == [0.5] and old.run["phase"] == "grid"  # one number -> list
    record.write(rdb.engine, "s", 0, {"quality_ok": True, "confirm_qps": [3.0]})
    [new] = record.load(rdb.engine, "s", study.get_trials())
    assert new.quality_ok is True and new.confirm_qps == [3.0] and new.confirm_ne == [0.5]
    with pytest.raises(TypeError, match="quality_okay"):
        record.write(rdb.engine, "s", 0, {"quality_okay": True})


def test_the_verdicts_precedence_is_held_out_over_the_estimate() -> None:
    t = optuna.trial.create_trial(value=1.0)
    assert record.TrialRecord(t).feasible is None
    assert record.TrialRecord(t, quality_est_ok=False).feasible is False
    assert record.TrialRecord(t, quality_est_ok=False, quality_heldout_ok=True).feasible is True
    assert record.TrialRecord(t, quality_est_ok=True, quality_heldout_ok=False).feasible is False


# ~40 s, in the default tier: one new trial, the old ones' verdicts and re-measurements kept
def test_a_store_written_by_the_previous_layout_reports_and_resumes(tmp_path: Path) -> None:
    from tests.test_analysis import cubic_cli

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(OLD_STORE, run / "study.db")
    before = {r.number: r for r in analysis.records(run)}
    assert len(before) == 2 and before[0].quality_ok is True and len(before[0].quality_eval_ne) == 2
    assert before[1].confirm_qps and "numerics unchanged" in before[1].quality_reason  # read from Optuna's attrs
    rep = cubic_cli("report", str(run))
    assert rep.returncode == 0, rep.stderr
    assert "winner: trial #0" in rep.stdout and "ruled out global_batch=512" in rep.stdout, rep.stdout

    r = cubic_cli("tune", "--space", str(OLD_SPACE), "--run-dir", str(run), "--searcher", "grid", "--trials", "3",
                  "--no-live")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    after = {x.number: x for x in analysis.records(run)}
    ran = [x for x in after.values() if x.ran]
    assert len(ran) == 3
    assert " alone, seed " not in r.stdout  # the screen's runs were kept: it decided nothing again
    for n, old in before.items():  # nothing stored was lost or changed, findings included
        assert after[n].value == old.value and after[n].config_key == old.config_key
        assert after[n].quality_eval_ne == old.quality_eval_ne and after[n].confirm_qps[:len(old.confirm_qps)] == \
            old.confirm_qps
    new = [x for x in ran if x.number not in before]
    assert len(new) == 1 and new[0].state == TrialState.COMPLETE
    # what this tune learned went to cubic's table; Optuna's rows of the new trial hold none of it
    engine = open_storage(f"sqlite:///{run / 'study.db'}").engine
    assert tables.exists(engine, tables.TRIAL_ATTRS) and record.read(engine, "screen")
    assert not any(set(record.FIELDS) & set(x.run) for x in new)
    assert analysis.open_study(run).user_attrs["winner"]["trial"] in after
