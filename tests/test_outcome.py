"""The tuner's typed outcomes keep the plain-JSON forms that studies and exports hold: a judgement
(`cubic.quality.rules.Judgement`), the stored winner (`cubic.study.winner.Winner`) and the tune's
summary (`cubic.tune.outcome.Summary`); and a confirm candidate's phase
(`cubic.tune.candidates.Phase`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import optuna

from cubic.quality.rules import Judgement, Verdict, judge, sequential
from cubic.space.quality_runs import QualityRuns
from cubic.study.winner import HEAD, PlannerRef, Winner
from cubic.tune.candidates import Phase
from cubic.tune.outcome import Summary

OLD_STORE = Path(__file__).resolve().parent / "data" / "store_84b28a1.db"


def test_a_judgement_is_the_ten_figures_it_always_was_and_reads_back() -> None:
    j = judge([1.0030, 1.0031, 1.0029], [1.0, 1.0, 1.0], 0.001)
    d = j.to_dict()
    assert list(d) == ["ok", "diff", "diffs", "se", "ci", "confidence", "verdict", "resolved", "noise",
                       "reason"]
    assert j.verdict is Verdict.FAILED and d["verdict"] == "failed" and j.resolved and not j.ok
    assert Judgement.from_dict(json.loads(json.dumps(d))) == j


def test_the_futility_figure_joins_the_judgement_only_where_sequential_computed_it() -> None:
    qr = QualityRuns(seeds=2, max_seeds=6, tolerance=0.001, confidence=0.9)
    state, j = sequential([0.83740, 0.83540, 0.88956], [0.83680, 0.83493, 0.88833], qr)
    assert j is not None and j.pass_chance is not None and list(j.to_dict())[-1] == "pass_chance"
    assert judge([1.0001, 1.0002], [1.0, 1.0], 0.001).pass_chance is None


def test_a_winner_stored_by_an_older_cubic_reads_back_and_a_new_one_round_trips(
        tmp_path: Path) -> None:
    shutil.copy(OLD_STORE, tmp_path / "study.db")
    url = f"sqlite:///{tmp_path / 'study.db'}"
    name = optuna.get_all_study_summaries(url)[0].study_name
    stored = optuna.load_study(study_name=name, storage=url).user_attrs["winner"]
    w = Winner.from_dict(stored)
    assert (w.trial, w.qps, w.speedup, w.config) == (stored["trial"], stored["qps"], stored["speedup"],
                                                     stored["config"])
    new = Winner.from_dict({**stored, "confirm_base_qps": [1.0], "backend": "sim", "cluster": "local",
                            "vs_torchrec_planner": {"trial": 1, "qps": 2.0, "re_measured": True,
                                                    "speedup": 1.5, "baseline_speedup": 1.0}}).to_dict()
    quality = ["quality"] if "quality" in stored else []
    assert list(new) == [*HEAD, "backend", "cluster", *quality, "vs_torchrec_planner"]  # as a tune stores
    again = Winner.from_dict(json.loads(json.dumps(new)))
    assert json.dumps(again.to_dict()) == json.dumps(new)
    assert again.provenance == {"backend": "sim", "cluster": "local"}
    assert isinstance(again.vs_torchrec_planner, PlannerRef) and again.vs_torchrec_planner.speedup == 1.5


def test_a_summary_reads_back_from_its_plain_form_unchanged() -> None:
    plain = {"study": "s", "storage": "sqlite:///x", "best_measured": {"trial": 2, "qps": 5.0,
                                                                      "short_config": "bs=64",
                                                                      "speedup": 1.2},
             "run_dir": None, "searcher": "grid", "budget": 3, "trials": 3, "ok": 3, "failed": 0,
             "proxy_tau": None, "winner": None, "torchrec_planner": None, "screen": [],
             "quality_runs": {"ran": 1, "reused": 2}, "backoff": [],
             "confirmed": [{"trial": 0, "short_config": "baseline", "backoff": False, "qps": 4.0,
                            "confirm_qps": [4.0], "confirm_speedup": 1.0, "quality_ok": True,
                            "quality_verdict": None, "quality_eval_diff": None, "quality_ci": None,
                            "quality_seeds": None, "quality_confidence": None,
                            "quality_reason": "baseline", "same_model_as": None}]}
    assert json.dumps(Summary.from_dict(plain).to_dict()) == json.dumps(plain)


def test_a_phase_is_open_until_the_candidate_passed_or_failed() -> None:
    assert [p for p in Phase if p.open] == [Phase.WAITING, Phase.MEASURING, Phase.JUDGING]
