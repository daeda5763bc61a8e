"""`make tune` before and after a change, side by side: each fresh clone's tune wall time, its trials, the quality
runs it trained, and its winner with the paired speed-up and its spread.

Run `make tune` in each fresh clone one after the other on the same machine (nothing else running), timing it:

    git clone REPO /tmp/before && cd /tmp/before && git checkout OLD && make .venv/.installed
    /usr/bin/time -v make tune > /tmp/before_tune.log 2>&1     # then the same in /tmp/after at NEW

then read both runs:

    .venv/bin/python benchmarks/bench_make_tune.py /tmp/before:OLD:/tmp/before_tune.log \\
        /tmp/after:NEW:/tmp/after_tune.log                       # -> data/make_tune.json

Each argument is CLONE:LABEL:LOG[:RUN_DIR]; the wall time is the tune's own (`/usr/bin/time`'s elapsed line in
LOG, the install excluded), the rest is read from the clone's study (RUN_DIR, `runs/dlrm_cpu` by default: `make
tune SEED=1 RUN_DIR=runs/seed1` keeps another) and quality store. `--out` names the data file.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA = ROOT / "benchmarks" / "data" / "make_tune.json"


def wall_s(log: Path) -> float | None:
    """The elapsed time `/usr/bin/time -v` wrote ("h:mm:ss" or "m:ss.ss")."""
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", log.read_text())
    if not m:
        return None
    parts = [float(x) for x in m[1].split(":")]
    return sum(p * 60 ** k for k, p in enumerate(reversed(parts)))


def one(clone: Path, label: str, log: Path, run_dir: str = "runs/dlrm_cpu") -> dict:
    from cubic.results import analysis

    df = analysis.load_study(clone / run_dir)
    s = analysis.summary(df)
    win = df.attrs.get("winner") or {}
    text = log.read_text()
    said = re.search(r"^quality runs: (\d+) trained, (\d+) reused", text, re.M)
    if said:  # the tune's own count: the clone's store also holds the runs of its later tunes
        trained, reused = int(said[1]), int(said[2])
    else:
        with sqlite3.connect(clone / "runs" / "quality.db") as con:
            trained, reused = con.execute("select count(*) from cubic_quality_runs").fetchone()[0], 0
    screen = len(re.findall(r"^quality screen: .* alone, seed ", text, re.M))
    return {"label": label, "clone": str(clone), "wall_s": wall_s(log), "trials": s["trials"],
            "quality_runs_trained": trained, "quality_runs_reused": reused, "screen_runs": screen,
            "winner_trial": win.get("trial"), "winner": win.get("short_config"),
            "speedup": win.get("speedup"), "speedup_spread": win.get("speedup_spread"),
            "vs_torchrec_planner": (win.get("vs_torchrec_planner") or {}).get("speedup")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="CLONE:LABEL:LOG[:RUN_DIR], one per make tune")
    ap.add_argument("--out", type=Path, default=DATA, help="the data file [default: data/make_tune.json]")
    args = ap.parse_args()
    rows = []
    for arg in args.runs:
        clone, label, log, *run_dir = arg.split(":")
        rows.append(one(Path(clone), label, Path(log), *run_dir))
    print(f"{'run':<12} {'wall':>8} {'trials':>6} {'quality runs':>12} {'screen':>6}  winner")
    for r in rows:
        spread = r["speedup_spread"] or [float("nan")] * 2
        print(f"{r['label']:<12} {r['wall_s'] / 60:7.1f}m {r['trials']:>6} {r['quality_runs_trained']:>12} "
              f"{r['screen_runs']:>6}  #{r['winner_trial']} {r['winner']}: {r['speedup']:.2f}x "
              f"({spread[0]:.2f}-{spread[1]:.2f}x)")
    if len(rows) > 1 and rows[0]["wall_s"] and rows[-1]["wall_s"]:
        print(f"wall time: {rows[-1]['wall_s'] / rows[0]['wall_s']:.2f}x the first")
    out = args.out.resolve()
    out.write_text(json.dumps({"made": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "runs": rows},
                              indent=1) + "\n")
    print(f"-> {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
