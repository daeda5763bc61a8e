"""Re-judge a finished tune's quality verdicts on seeds the tune never used.

The confirm's verdict is sequential (`cubic.quality.rules.sequential`): paired seeds 0, 1, ... until the
interval of the mean eval-NE difference clears the tolerance, or the seed budget says "not resolved".
Does the verdict hold on data it never saw? This trains the baseline and each confirmed candidate that
changes numerics (the winner first) on `--seeds` fresh seeds (from `--first-seed`, far past any the
tune ran) with the tune's own quality budget, and judges them by the same rule and confidence.

    python benchmarks/bench_rejudge.py runs/dlrm_cpu [--seeds 4] [--first-seed 100] [--winner-only]

Writes benchmarks/data/rejudge.json: per candidate the tune's verdict (seeds, mean difference, interval)
beside the re-judgement's (per-seed differences, mean, interval, verdict) and whether they agree:
a pass re-judged as not failed (its fresh interval's lower end within the tolerance), a failure as
not passed, a "not resolved" as anything but its opposite certainty.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cubic.quality.rules import NOT_RESOLVED, Verdict, judge, paired_mean, sequential  # noqa: E402
from cubic.results import analysis  # noqa: E402
from cubic.space.quality_runs import QualityRuns  # noqa: E402
from cubic_harness.config import TrialConfig  # noqa: E402
from cubic_harness.trial import run_trial  # noqa: E402


def agrees(tune: str, fresh: dict) -> bool:
    """The fresh seeds do not contradict the tune's verdict (see the module docstring)."""
    if tune == Verdict.PASSED:
        return fresh["ci"][0] <= fresh["tolerance"]
    if tune == Verdict.FAILED:
        return fresh["ci"][1] > fresh["tolerance"]
    return True  # not resolved: the fresh seeds may land either side; reported, not scored


def candidates(df: Any, winner: dict, qr: QualityRuns, bne_tune: list[float],
               winner_only: bool, run_dir: str) -> tuple[Any, dict[int, tuple]]:
    """The confirmed candidates to re-judge, one per model (layouts of one model train to the
    same eval NE), the winner first, and each one's verdict in the tune."""
    base_number = analysis.baseline_rows(df).iloc[0]["number"]

    def tune_verdict(r: Any) -> tuple[str, list[float] | None]:
        """The verdict as stored, or (its confirm still running) the rule's on the seeds so far."""
        if isinstance(r.quality_verdict, str):
            return r.quality_verdict, r.quality_ci
        state, j = sequential(r.quality_eval_ne, bne_tune, qr)
        return state, (j.ci if j else None)

    verdicts = {r.number: tune_verdict(r) for r in df.itertuples()
                if r.number != base_number and len(r.quality_eval_ne) >= qr.seeds
                and None not in r.quality_eval_ne}
    decided = (Verdict.PASSED, Verdict.FAILED, NOT_RESOLVED)
    judged = df[df["number"].isin([n for n, (v, _) in verdicts.items() if v in decided])]
    judged = judged.assign(first=judged["number"] == winner.get("trial"),
                           model=judged["quality_eval_ne"].map(lambda xs: tuple(xs[:qr.seeds])))
    judged = judged.sort_values(["first", "confirm_qps_median"], ascending=False)
    judged = judged.drop_duplicates("model")
    if winner_only:
        judged = judged[judged["first"]]
        if judged.empty:
            raise SystemExit(f"{run_dir}: the winner (trial {winner.get('trial')}) has no quality "
                             "verdict to re-judge (its numerics are the baseline's, or no winner)")
    return judged, verdicts


def print_table(console: Console, rows: list[dict], seeds: list[int], qr: QualityRuns) -> None:
    t = Table(title=f"quality verdicts re-judged on seeds {seeds[0]}..{seeds[-1]} "
                    f"({qr.samples:,} samples, {qr.eval_samples:,} held-out, tolerance "
                    f"{qr.tolerance:.2%}, {qr.confidence:.0%} interval)", header_style="bold")
    for col in ("trial", "tune: seeds", "tune: diff [interval]", "tune verdict", "fresh: per seed",
                "fresh: diff [interval]", "fresh verdict", "agrees"):
        t.add_column(col)
    for x in rows:
        tu, fr = x["tune"], x["fresh"]
        t.add_row(f"#{x['trial']}" + (" (winner)" if x["winner"] else ""), str(tu["seeds"]),
                  f"{tu['diff']:+.3%} [{tu['ci'][0]:+.3%}..{tu['ci'][1]:+.3%}]", tu["verdict"],
                  ", ".join(f"{d:+.3%}" for d in fr["diffs"]),
                  f"{fr['diff']:+.3%} [{fr['ci'][0]:+.3%}..{fr['ci'][1]:+.3%}]", fr["verdict"],
                  "yes" if x["agrees"] else "NO")
    console.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--first-seed", type=int, default=100)
    ap.add_argument("--winner-only", action="store_true", help="re-judge the tune's winner alone")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "data" / "rejudge.json"))
    a = ap.parse_args()
    console = Console()
    study = analysis.open_study(a.run_dir)
    df = analysis.load_study(a.run_dir)
    winner = study.user_attrs.get("winner") or {}
    quality = (study.user_attrs.get("space") or {}).get("quality") or {}
    qr = QualityRuns(**{k: quality[k] for k in QualityRuns.__dataclass_fields__ if k in quality})
    base_row = analysis.baseline_rows(df).iloc[0]
    bne_tune = list(base_row["quality_eval_ne"])
    judged, verdicts = candidates(df, winner, qr, bne_tune, a.winner_only, a.run_dir)
    seeds = list(range(a.first_seed, a.first_seed + a.seeds))

    def eval_ne(cfg: dict, progress: Progress, task: int, what: str) -> list[float]:
        out = []
        for s in seeds:
            progress.update(task, description=f"{what} seed {s}")
            res = run_trial(qr.config(TrialConfig.from_dict(cfg), s))
            if res.status != "ok":
                raise SystemExit(f"{what} seed {s}: {res.status}: {res.error}")
            out.append(res.extra["eval_ne"])
            progress.advance(task)
        return out

    rows = []
    with Progress(console=console) as progress:
        task = progress.add_task("quality runs", total=(1 + len(judged)) * len(seeds))
        bne = eval_ne(base_row["config"], progress, task, "baseline")
        for r in judged.itertuples():
            ne = eval_ne(r.config, progress, task, f"#{r.number}")
            j = judge(ne, bne, qr.tolerance, qr.confidence)
            fresh = {"seeds": seeds, "eval_ne": ne, "diffs": j.diffs, "diff": j.diff, "ci": j.ci,
                     "verdict": j.verdict, "tolerance": qr.tolerance}
            verdict, ci = verdicts[r.number]
            n = min(len(r.quality_eval_ne), len(bne_tune))
            tune = {"seeds": len(r.quality_eval_ne),
                    "diff": paired_mean(r.quality_eval_ne[:n], bne_tune[:n]),
                    "ci": ci, "verdict": verdict}
            changes = {k: v for k, v in r.config.items()
                       if k != "workload" and base_row["config"].get(k) != v}
            rows.append({"trial": int(r.number), "winner": bool(r.first), "changes": changes,
                         "tune": tune, "fresh": fresh, "agrees": agrees(verdict, fresh)})
    print_table(console, rows, seeds, qr)
    Path(a.out).write_text(json.dumps({"run_dir": a.run_dir, "quality": qr.to_dict(),
                                       "baseline_eval_ne": bne, "candidates": rows}, indent=1) + "\n")
    console.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
