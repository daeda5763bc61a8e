"""Planning wall time at production scale, each sharding planned and priced (one simulated
trial's cost) with repeats: `dlrm-datasets-2022` (788 tables) on 1,024 H100s, the case
`bench_planner.py` runs once. Run it in two clones one after the other to compare commits
(ratios, not seconds, carry across machines):

    .venv/bin/python benchmarks/bench_plan_wall.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_planner import cases, priced  # noqa: E402

SHARDINGS = ("plan", "row_wise", "table_row_wise", "column_wise", "table_wise", "data_parallel",
             "auto", "size_greedy", "lookup_greedy", "size_lookup_greedy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    name, cfg, c = next(x for x in cases(False) if x[0].startswith("dlrm-datasets-2022, 1,024"))
    print(name)
    for s in SHARDINGS:
        walls, r = [], {}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = priced(cfg, c, s)
            walls.append(time.perf_counter() - t0)
        print(f"{s:20s} step {r['step_ms']:8.3f} ms  wall median {statistics.median(walls):.2f} s "
              f"({min(walls):.2f}-{max(walls):.2f})")


if __name__ == "__main__":
    main()
