"""A simulated tune at production scale: `search_spaces/dlrm_production.yaml` (dlrm-datasets-2022's 788 tables
on 1,024 H100s, the per-table plan among the sharding values), its 300 trials' wall time here, and what each
sharding value's best trial reached (does the per-table plan win, and by how much over the best other value).

    .venv/bin/python benchmarks/bench_production_tune.py [--trials 300] [--seed 0]   # -> data/production_tune_sim.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DATA = ROOT / "benchmarks" / "data" / "production_tune_sim.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from cubic.results import analysis

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "cubic", "tune", "--backend", "sim", "--cluster", "h100-4096", "--space",
               str(ROOT / "search_spaces" / "dlrm_production.yaml"), "--run-dir", tmp, "--no-live",
               "--trials", str(args.trials), "--seed", str(args.seed)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        df = analysis.load_study(tmp)
    ok = df[df["ok"]]
    base = float(ok.loc[ok["number"] == 0, "qps"].iloc[0])
    best = {str(k): float(v) for k, v in ok.groupby("sharding")["qps"].max().sort_values(ascending=False).items()}
    others = max(v for k, v in best.items() if k != "plan")
    shown = " ".join(cmd[1:]).replace(tmp, "RUN_DIR").replace(f"{ROOT}/", "")  # the same in every clone
    out = {"date": time.strftime("%Y-%m-%d"), "command": shown,
           "wall_s": wall, "trials": int(len(df)), "failed": int((~df["ok"]).sum()), "baseline_qps": base,
           "winner": df.attrs["winner"]["short_config"], "winner_speedup": df.attrs["winner"]["speedup"],
           "best_qps_by_sharding": best, "plan_over_best_other": best.get("plan", float("nan")) / others,
           "trials_by_sharding": {str(k): int(v) for k, v in ok["sharding"].value_counts().items()}}
    DATA.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
