"""What the fork server saves a TorchRec tune: trials' wall time with ranks forked from a server that preloaded
TorchRec (`trial.rank_context`, a TorchRec tune's process) beside ranks spawned afresh (`trial.spawned_ranks`),
each mode in its own fresh process, alternating.

Each process runs `--trials` short TorchRec trials of the tiny workload on 2 ranks, as a tune's worker runs its
trials one after another; the first trial of a forked process also starts the server. Reports per mode the median
wall and start-up (trial start to first step) of the trials after the first, and of the first, with the spread
over repeats. Writes benchmarks/data/torchrec_start.json.

    .venv/bin/python benchmarks/bench_torchrec_start.py [--trials 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import contextlib, json, sys
from cubic_harness.config import TrialConfig
from cubic_harness.torchrec_trial import run_torchrec
from cubic_harness.trial import spawned_ranks
from cubic_harness.workload import Workload

mode, n = sys.argv[1], int(sys.argv[2])
cfg = TrialConfig(workload=Workload.tiny(), world_size=2, batch_size=256, kernel="fbgemm", warmup_steps=2,
                  measure_steps=6, windows=1, timeout_s=300)
out = []
for _ in range(n):
    with spawned_ranks() if mode == "spawn" else contextlib.nullcontext():
        r = run_torchrec(cfg)
    assert r.status == "ok", r.error
    out.append({k: r.env[k] for k in ("wall_s", "startup_s", "rank_start")})
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "torchrec_start.json")
    a = ap.parse_args()
    console = Console()
    runs: dict[str, list[list[dict]]] = {"forkserver": [], "spawn": []}
    with console.status("timing") as status:
        for r in range(a.repeats):
            for mode in runs:
                status.update(f"repeat {r + 1}/{a.repeats}: {mode}, {a.trials} TorchRec trials")
                p = subprocess.run([sys.executable, "-c", CHILD, mode, str(a.trials)], capture_output=True, text=True,
                                   timeout=1200, cwd=ROOT)
                if p.returncode != 0:
                    sys.exit(f"error: {mode}: {(p.stderr.strip().splitlines() or ['no output'])[-1]}")
                trials = json.loads(p.stdout.strip().splitlines()[-1])
                if {t["rank_start"] for t in trials} != {mode}:
                    sys.exit(f"error: {mode}: ranks started by {sorted({t['rank_start'] for t in trials})}")
                runs[mode].append(trials)
    summary = {}
    for mode, reps in runs.items():
        first = [rep[0] for rep in reps]
        later = [t for rep in reps for t in rep[1:]]
        summary[mode] = {
            f"{which}_{k}": {"median": round(statistics.median(t[k] for t in ts), 2),
                             "range": [min(t[k] for t in ts), max(t[k] for t in ts)]}
            for which, ts in (("first", first), ("later", later)) for k in ("wall_s", "startup_s")}
    ratio = round(summary["forkserver"]["later_wall_s"]["median"] / summary["spawn"]["later_wall_s"]["median"], 2)
    table = Table(title=f"TorchRec trials (tiny, 2 ranks), {a.trials} a process, {a.repeats} alternating repeats")
    for col in ("ranks", "first trial wall s", "later trials wall s", "later start-up s"):
        table.add_column(col, justify="right")
    for mode, s in summary.items():
        table.add_row(mode, f"{s['first_wall_s']['median']:.2f}", f"{s['later_wall_s']['median']:.2f} "
                      f"({s['later_wall_s']['range'][0]:.2f}-{s['later_wall_s']['range'][1]:.2f})",
                      f"{s['later_startup_s']['median']:.2f}")
    console.print(table)
    console.print(f"a later trial's wall time, forked / spawned: {ratio}x")
    a.out.write_text(json.dumps({"trials": a.trials, "repeats": a.repeats, "summary": summary,
                                 "later_wall_ratio_forked_over_spawned": ratio, "runs": runs}, indent=1) + "\n")
    console.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
