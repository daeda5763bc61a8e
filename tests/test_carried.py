"""A simulated study crowns a numerics change only as real quality runs of its space judged it
(`cubic.quality.carried`): the runs are real rows of a real quality store, as a real tune keeps
them."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from cubic.cli.tune import TuneRequest, build
from cubic.quality.carried import ANY_SIZE, AS_JUDGED, CARRIES, CarriedVerdicts
from cubic.quality.store import QualityStore
from cubic.space import numerics
from cubic.space.search_space import load_space
from cubic_harness.config import TrialResult

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "search_spaces" / "dlrm_cpu.yaml"
BASE_NE = (0.5000, 0.5010, 0.4990)


def keep(store: QualityStore, sp, params: dict, ne: list[float]) -> None:
    """Keep quality runs of params' model (seeds 0, 1, ...) as a real tune keeps them."""
    qr = sp.quality_runs
    for seed, x in enumerate(ne):
        cfg = qr.config(sp.config(sp.model_params(params)), seed)
        assert store.put(
            cfg, TrialResult(status="ok", qps=1.0, extra={"eval_ne": x, "eval_auc": 0.7})
        )


@pytest.fixture()
def judged(tmp_path: Path):
    """SGD tables failed alone (+4% eval NE), fp16 tables passed alone, bf16 dense never ran."""
    sp = load_space(SPACE)
    store = QualityStore(f"sqlite:///{tmp_path / 'quality.db'}")
    base = sp.baseline_params()
    keep(store, sp, base, list(BASE_NE))
    keep(store, sp, {**base, "emb_optimizer": "sgd"}, [0.52])
    keep(store, sp, {**base, "emb_precision": "fp16"}, [0.50002])
    yield sp, store, tmp_path
    store.close()


def test_a_change_ruled_out_or_never_judged_is_never_crowned(judged) -> None:
    sp, store, _ = judged
    cv = CarriedVerdicts(sp, store, "q")
    base = sp.baseline_params()
    sgd_fp16 = cv.crown({**base, "emb_optimizer": "sgd", "emb_precision": "fp16"})
    assert (
        not sgd_fp16.ok
        and "ruled out" in sgd_fp16.reason
        and "emb_optimizer=sgd" in sgd_fp16.reason
    )
    fp16 = cv.crown({**base, "emb_precision": "fp16"})
    assert fp16.ok and "passed alone" in fp16.reason
    bf16 = cv.crown({**base, "dense_precision": "bf16"})
    assert not bf16.ok and "never judged" in bf16.reason
    layout = {**base, "pipeline_depth": 2}
    assert cv.crown(layout).ok and not sp.numerics_changes(layout)
    assert not CarriedVerdicts(sp, None).crown({**base, "emb_precision": "fp16"}).ok


def test_a_whole_model_judged_in_the_store_decides_over_its_changes(judged) -> None:
    """A combination the store judged whole (a real tune's check or confirm) decides by that."""
    sp, store, _ = judged
    base = sp.baseline_params()
    both = {**base, "emb_precision": "fp16", "dense_precision": "bf16"}
    keep(store, sp, both, [x * 1.0001 for x in BASE_NE])
    c = CarriedVerdicts(sp, store).crown(both)
    assert c.ok and "its model passed over 3 stored real quality run(s)" in c.reason


def test_what_carries_is_one_table_over_every_numerics_aspect() -> None:
    aspects = {numerics.aspect(k).name for k in numerics.NUMERICS}
    assert aspects <= set(CARRIES) and set(CARRIES.values()) == {ANY_SIZE, AS_JUDGED}
    assert CARRIES["emb_precision"] == ANY_SIZE and CARRIES["global_batch"] == AS_JUDGED


def test_a_simulated_tune_of_the_default_space_crowns_only_what_real_runs_passed(judged) -> None:
    """Without the carried verdicts this tune crowns SGD tables at 4x the batch in fp16 (2.14x)."""
    sp, store, tmp = judged
    req = TuneRequest(
        space=SPACE,
        run_dir=tmp / "run",
        backend="sim",
        cluster="local",
        trials=24,
        live=False,
        quality_store=str(tmp / "quality.db"),
    )
    tuner = build(req, Console(record=True, width=200))
    try:
        s = tuner.run()
    finally:
        tuner.runner.stop()
    assert s.carried_from and "quality.db" in s.carried_from
    assert s.winner is not None
    win = next(t for t in tuner.store.records() if t.number == s.winner.trial)
    made = {f"{n}={v}" for n, v in sp.numerics_changes(win.params)}
    assert made <= {"emb_precision=fp16"}
    rows = {r["change"]: r for r in s.screen}
    assert rows["emb_optimizer=sgd"]["ok"] is False and rows["emb_precision=fp16"]["ok"] is True
    assert rows["dense_precision=bf16"]["ok"] is None
    ran = [t.params for t in tuner.store.records() if t.params]
    assert not any(p.get("emb_optimizer") == "sgd" for p in ran)  # the search kept off it


def test_a_simulated_tune_finds_the_real_tunes_quality_store_where_make_tune_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cubic.cli.tune import real_quality_store

    monkeypatch.chdir(tmp_path)
    assert real_quality_store("dlrm_cpu") is None
    (tmp_path / "runs" / "dlrm_cpu").mkdir(parents=True)
    QualityStore(f"sqlite:///{tmp_path / 'runs' / 'dlrm_cpu' / 'study.db'}").close()
    assert real_quality_store("dlrm_cpu").url.endswith("runs/dlrm_cpu/study.db")
    QualityStore(f"sqlite:///{tmp_path / 'runs' / 'quality.db'}").close()
    assert real_quality_store("dlrm_cpu").url.endswith("runs/quality.db")
