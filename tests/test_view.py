"""The tune's final summary (cubic/tune/view.py `print_summary`), rendered from the summary dict a tune returns."""

from __future__ import annotations

from rich.console import Console

from cubic.quality.rules import NOT_RESOLVED
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
    print_summary(console, s)
    out = console.export_text()
    lines = [ln for ln in out.splitlines() if ln.startswith("not resolved:")]
    assert len(lines) == 1, out
    assert lines[0].startswith("not resolved: trial #8 (cfg8) re-measured 58,000 qps")
    assert lines[0].endswith("(2 more faster than the winner are not resolved either)")
    assert "quality runs: 7 trained, 12 reused from the quality store" in out
    assert "winner: trial #19 (cfg19): 46,000 qps" in out and "1.15x the baseline" in out
