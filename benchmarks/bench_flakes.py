"""The default test tier, several times in a row, with every core kept busy by another process.

A test that passes on a quiet machine and fails on a busy one is a flake: CI machines are shared. This
runs `make test` (CI=true: a missing dependency fails, never skips) `--runs` times while `--load`
processes spin at normal priority, and records each run's outcome, wall time and slowest tests.

    python benchmarks/bench_flakes.py [--runs 3] [--load 2] [--repo /tmp/fresh-clone]

Writes benchmarks/data/flakes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
SPIN = "while True: pass"


def make_test(repo: str) -> tuple[int, str, list[float]]:
    """`make test` in `repo` with CI=true: (exit code, its output, the 1-minute load average every 15 s,
    how busy the machine really was while it ran)."""
    proc = subprocess.Popen(["make", "test"], cwd=repo, env={**os.environ, "CI": "true"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    loads = [os.getloadavg()[0]]
    while proc.poll() is None:
        reader.join(timeout=15)
        loads.append(os.getloadavg()[0])
    reader.join()
    return proc.returncode, "".join(out), loads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2,
                    help="busy processes beside the tests (0: whatever else runs; the load average is recorded)")
    ap.add_argument("--repo", default=str(ROOT), help="the checkout to test (a fresh clone: as CI does)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "data" / "flakes.json"))
    a = ap.parse_args()
    console = Console()
    load = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(a.load)]
    runs = []
    try:
        for i in range(a.runs):
            console.print(f"run {i + 1}/{a.runs}: make test beside {a.load} busy processes")
            t0 = time.monotonic()
            rc, out, loads = make_test(a.repo)
            wall = time.monotonic() - t0
            tail = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
            slow = re.findall(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)", out, flags=re.M)
            runs.append({"run": i + 1, "passed": rc == 0, "returncode": rc,
                         "wall_s": round(wall, 1), "load_avg_median": round(statistics.median(loads), 2),
                         "load_avg_min": round(min(loads), 2), "summary": tail[-1] if tail else "",
                         "failures": re.findall(r"^FAILED (\S+)", out, flags=re.M),
                         "slowest": [{"s": float(s), "when": w, "test": t} for s, w, t in slow[:10]]})
            console.print(f"  {'passed' if rc == 0 else 'FAILED'} in {wall / 60:.1f} min, load average "
                          f"{runs[-1]['load_avg_median']} (median): {runs[-1]['summary']}")
            Path(a.out).with_suffix(f".run{i + 1}.log").write_text(out)
    finally:
        for spinner in load:
            spinner.kill()
    Path(a.out).write_text(json.dumps({"repo": a.repo, "load_processes": a.load, "cpus": os.cpu_count(), "runs": runs,
                                       "passed": sum(r["passed"] for r in runs)}, indent=1) + "\n")
    console.print(f"{sum(r['passed'] for r in runs)}/{len(runs)} runs passed; wrote {a.out}")


if __name__ == "__main__":
    main()
