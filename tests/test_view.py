"""The tune's final summary (cubic/tune/view.py `print_summary`), rendered from a tune's `Summary`
(built here from its plain form, `Summary.from_dict`)."""

from __future__ import annotations

from rich.console import Console

from cubic.quality.rules import NOT_RESOLVED
from cubic.tune.outcome import Summary
from cubic.tune.view import print_summary


def _confirmed(trial: int, qps: float, verdict: str, ok: bool) -> dict:
    return {"trial": trial, "short_config": f"cfg{trial}", "qps": qps, "confirm_qps": [qps, qps * 0.98, qps * 1.01],
            "quality_ok": ok, "quality_verdict": verdict, "quality_eval_diff": 0.0007, "quality_ci": [-0.0001, 0.0015],
            "quality_reason": f"{verdict.upper()} after 6 paired seeds" if verdict == NOT_RESOLVED else verdict}


def test_configurations_faster_than_the_winner_left_unresolved_are_named_once_the_fastest_first() -> None:
    """Many faster candidates may end "not resolved" (a change at the edge of the tolerance, in many layouts):
    the summary names the fastest and counts the others in one line, not one line each."""
    confirmed = [_confirmed(0, 40_000, "passed", True), _confirmed(19, 46_000, "passed", True),
                 *(_confirmed(n, 50_000 + 1000 * n, NOT_RESOLVED, False) for n in (2, 6, 8)),
                 _confirmed(3, 45_000, NOT_RESOLVED, False)]  # slower than the winner: not in the line
    s = {"study": "s", "trials": 10, "ok": 10, "failed": 0, "searcher": "cubic", "proxy_tau": None, "screen": [],
         "quality_runs": {"ran": 7, "reused": 12}, "confirmed": confirmed, "best_measured": None,
         "winner": {"trial": 19, "short_config": "cfg19", "qps": 46_000.0, "qps_spread": [45_080.0, 46_460.0],
                    "speedup": 1.15, "speedup_spread": [1.1, 1.2]},
         "storage": "sqlite:///x", "run_dir": None}
    console = Console(width=400, record=True)
    print_summary(console, Summary.from_dict(s))
    out = console.export_text()
    lines = [ln for ln in out.splitlines() if ln.startswith("not resolved:")]
    assert len(lines) == 1, out
    assert lines[0].startswith("not resolved: trial #8 (cfg8) re-measured 58,000 qps")
    assert lines[0].endswith("(2 more faster than the winner are not resolved either)")
    assert "quality runs: 7 trained, 12 reused from the quality store" in out
    assert "winner: trial #19 (cfg19): 46,000 qps" in out and "1.15x the baseline" in out


def test_the_quality_cell_is_one_short_line_and_a_model_judged_once_is_shown_once() -> None:
    """Three layouts of one model share one judgement: the summary gives its numbers once (the first row)
    and points the others at it, and no cell carries the judgement's prose (the report has it)."""
    prose = ("passed: eval NE +0.054% vs baseline over 4 paired seed(s) (per seed +0.026%..+0.088%) <= 0.10%; "
             "90% interval +0.021%..+0.087% (paired s.e. 0.014%); baseline seed-to-seed sd 3.118% (changes "
             "emb_precision, dense_precision, comm_precision)")
    rows = [{**_confirmed(n, 30_000.0 - n, "passed", True), "quality_eval_diff": 0.00054,
             "quality_ci": [0.00021, 0.00087], "quality_seeds": 4, "quality_confidence": 0.9,
             "quality_reason": prose, "same_model_as": None if n == 14 else 14} for n in (14, 10, 19)]
    rows.append({**_confirmed(41, 28_000.0, "passed", True), "quality_reason": "numerics unchanged (only "
                 "layout/kernel/pipelining knobs differ): no quality run needed", "quality_eval_diff": None})
    s = {"study": "s", "trials": 10, "ok": 10, "failed": 0, "searcher": "cubic", "proxy_tau": None, "screen": [],
         "quality_runs": None, "confirmed": rows, "best_measured": None, "winner": None,
         "storage": "sqlite:///x", "run_dir": None}
    console = Console(width=300, record=True)
    print_summary(console, Summary.from_dict(s))
    out = console.export_text()
    cells = {n: next(ln for ln in out.splitlines() if ln.lstrip().startswith(f"{n} ")) for n in (14, 10, 19, 41)}
    assert cells[14].rstrip().endswith("ok: eval NE +0.054%, 90% CI +0.02%..+0.09%, 4 seeds"), cells[14]
    assert cells[10].rstrip().endswith("ok: same model as #14") and cells[19].rstrip().endswith("same model as #14")
    assert cells[41].rstrip().endswith("ok: numerics unchanged: no quality run needed"), cells[41]
    assert "seed-to-seed" not in out and "paired s.e." not in out


def test_the_live_line_shows_one_quality_signal_the_held_out_verdict_before_the_estimate() -> None:
    """A trial the in-run estimate puts past the tolerance but held-out runs passed shows no failure: the
    searcher goes by the held-out verdict (`TrialRecord.feasible`), and so does what the reader sees."""
    import optuna

    from cubic.study.record import TrialRecord
    from cubic.tune.view import quality_flag

    ft = optuna.trial.create_trial(params={}, distributions={}, value=1.0)
    assert quality_flag(TrialRecord(ft, quality_est_ok=False, quality_heldout_ok=True)) == ""
    assert quality_flag(TrialRecord(ft, quality_est_ok=False)) == "in-run NE estimate past the tolerance"
    assert quality_flag(TrialRecord(ft, quality_est_ok=True, quality_heldout_ok=False)) == \
        "held-out eval NE fails the gate"
