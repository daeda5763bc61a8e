"""Quality runs paid for once (cubic/quality/store.py): kept by what they train, in a table cubic owns.

The end-to-end reuse (a second tune whose screen trains nothing) is in tests/test_screen.py."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import sqlalchemy as sa

from cubic.quality.store import RUNS, SCHEMA, QualityStore, is_quality_run, run_key
from cubic.space.quality_runs import QualityRuns
from cubic_harness.config import TrialConfig, TrialResult
from cubic_harness.trial import run_trial
from cubic_harness.workload import Workload

QR = QualityRuns(samples=4096, eval_samples=2048, seeds=2)


def _cfg(**kw) -> TrialConfig:
    base = TrialConfig(workload=Workload.tiny(), kernel="torch", world_size=2, batch_size=64, warmup_steps=1,
                       measure_steps=3, windows=1, timeout_s=300).replace(**kw)
    return QR.config(base, 0)


def test_a_quality_run_trains_the_same_model_twice_so_its_result_can_be_kept() -> None:
    """The store's premise: the same quality config, run twice, gives the same held-out NE and AUC."""
    cfg = _cfg()
    a, b = run_trial(cfg), run_trial(cfg)
    assert a.status == b.status == "ok", (a.error, b.error)
    assert a.extra["eval_ne"] == b.extra["eval_ne"] and a.extra["eval_auc"] == b.extra["eval_auc"]
    assert a.losses == b.losses


def test_the_key_is_what_the_run_trains() -> None:
    cfg = _cfg()
    assert is_quality_run(cfg) and not is_quality_run(cfg.replace(eval_samples=0))
    assert run_key(cfg) == run_key(cfg.replace(timeout_s=999))  # how long it may take trains nothing
    for other in (QR.config(cfg, 1), cfg.replace(emb_precision="fp16"), cfg.replace(batch_size=128),
                  cfg.replace(eval_samples=4096), cfg.replace(kernel="native")):
        assert run_key(other) != run_key(cfg)


def test_the_store_keeps_finished_runs_beside_optunas_tables_and_ignores_other_schemas(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(study_name="s", storage=url)  # a trial store: cubic's table goes beside Optuna's
    qs = QualityStore(url)
    cfg = _cfg()
    ok = TrialResult(qps=10.0, extra={"eval_ne": 0.9, "eval_auc": 0.7}, losses=[0.7, 0.69])
    assert qs.get(cfg) is None
    assert not qs.put(cfg, TrialResult.failed("timeout", "under load", cfg))  # may be the machine's: not kept
    assert not qs.put(cfg, TrialResult(qps=10.0))  # no eval NE: not a quality result
    assert qs.put(cfg, ok) and not qs.put(cfg, ok)  # one row per run, however many tuners keep it
    got = QualityStore(url).get(cfg.replace(timeout_s=5))  # another tune, another connection
    assert got is not None and got.extra == ok.extra and got.losses == ok.losses
    assert qs.count() == 1 and qs.get(QR.config(cfg, 1)) is None
    tables = set(sa.inspect(qs.engine).get_table_names())
    assert "cubic_quality_runs" in tables and "trials" in tables
    with qs.engine.begin() as c:  # a row written by another schema version is not read as this one's
        c.execute(RUNS.update().values(schema=SCHEMA + 1))
    assert qs.get(cfg) is None and qs.count() == 0
    with qs.engine.connect() as c:
        stored = json.loads(c.execute(sa.select(RUNS.c.config)).scalar_one())
    assert stored["eval_samples"] == QR.eval_samples and stored["seed"] == 0


def test_the_quality_store_option_takes_a_run_dir_a_url_or_a_new_db_file(tmp_path: Path) -> None:
    """`make tune` passes `--quality-store runs/quality.db` so every run directory shares one."""
    import pytest

    from cubic.quality.store import quality_store_url
    from cubic_harness.errors import ConfigError

    url = quality_store_url(str(tmp_path / "quality.db"))
    assert url == f"sqlite:///{tmp_path / 'quality.db'}" and not (tmp_path / "quality.db").exists()
    QualityStore(url)  # created on first use, beside nothing else
    assert (tmp_path / "quality.db").is_file() and quality_store_url(str(tmp_path / "quality.db")) == url
    with pytest.raises(ConfigError, match=r"^--quality-store /nonexistent/q.db: no such directory /nonexistent$"):
        quality_store_url("/nonexistent/q.db")
    with pytest.raises(ConfigError, match=r"^--quality-store .*/run: no such run directory or storage URL$"):
        quality_store_url(str(tmp_path / "run"))
