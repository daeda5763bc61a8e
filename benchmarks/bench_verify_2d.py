"""2D in both frameworks: cubic's harness vs TorchRec's DMPCollection on the same configurations, side by side.

The default CPU space's baseline (2 ranks, table-wise, FBGEMM) and 2D variants of it (sharding groups of 1
rank, so each rank holds every table and the 2 replicas merge by weight averaging every k steps), each run
in cubic's harness and then in TorchRec (harness/torchrec_trial.py: DMPCollection with the exported plan),
alternating `--repeats` times. Prints median samples/s, spread and each framework's speed-up over the
baseline; writes benchmarks/data/verify_2d.json.

    python benchmarks/bench_verify_2d.py [--repeats 3] [--workload small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cubic.deploy import export  # noqa: E402
from cubic_harness.config import TrialConfig, TrialResult  # noqa: E402
from cubic_harness.planning import plan_for  # noqa: E402
from cubic_harness.torchrec_trial import run_torchrec_trial  # noqa: E402
from cubic_harness.trial import run_trial  # noqa: E402
from cubic_harness.workload import Workload  # noqa: E402

CONFIGS = {
    "baseline (table-wise)": {},
    "2D G=1, merge every step": dict(sharding_group_size=1, sparse_sync="weight_avg", sparse_sync_interval=1),
    "2D G=1, merge every 8": dict(sharding_group_size=1, sparse_sync="weight_avg", sparse_sync_interval=8),
}


def _export(cfg: TrialConfig) -> dict:
    res = TrialResult(qps=1.0, config=cfg.to_dict(), plan=plan_for(cfg).to_list())
    return export.to_torchrec_dict({"study": "bench", "storage": "", "trial": 0, "attrs": {}, "result": res.to_dict(),
                                    "winner": {}, "config": cfg.to_dict(), "confirmed": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workload", default="small")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "verify_2d.json")
    a = ap.parse_args()
    base = TrialConfig(workload=Workload.from_dict({"preset": a.workload}), world_size=2, sharding="table_wise",
                       kernel="fbgemm", batch_size=1024, warmup_steps=3, measure_steps=16, windows=4, timeout_s=300)
    cfgs = {name: base.replace(**kw).validate() for name, kw in CONFIGS.items()}
    runs: dict[str, dict[str, list[float]]] = {n: {"cubic": [], "torchrec": []} for n in cfgs}
    con = Console()
    for rep in range(a.repeats):
        for name, cfg in cfgs.items():  # alternating: drift hits every configuration alike
            con.log(f"repeat {rep + 1}/{a.repeats}: {name}")
            r = run_trial(cfg)
            if r.status == "ok":
                runs[name]["cubic"].append(r.qps)
            t = run_torchrec_trial(cfg, _export(cfg))
            if t["status"] == "ok":
                runs[name]["torchrec"].append(t["qps"])
            else:
                con.log(f"  torchrec {t['status']}: {t['error']}")
    med = {n: {f: statistics.median(v) if v else float("nan") for f, v in d.items()} for n, d in runs.items()}
    b = med["baseline (table-wise)"]
    tab = Table(title=f"2D: cubic vs TorchRec DMPCollection ({a.workload}, 2 gloo ranks, {a.repeats} alternating)")
    for c in ("config", "cubic samples/s", "speed-up", "TorchRec samples/s", "speed-up"):
        tab.add_column(c)
    rows = []
    for n, d in runs.items():
        row = {"config": n, **{f"{f}_runs": d[f] for f in d}, **{f"{f}_median": med[n][f] for f in d},
               "speedup_cubic": med[n]["cubic"] / b["cubic"], "speedup_torchrec": med[n]["torchrec"] / b["torchrec"]}
        rows.append(row)
        tab.add_row(n, f"{med[n]['cubic']:,.0f} ({min(d['cubic'], default=0):,.0f}-{max(d['cubic'], default=0):,.0f})",
                    f"{row['speedup_cubic']:.2f}x",
                    f"{med[n]['torchrec']:,.0f} ({min(d['torchrec'], default=0):,.0f}-"
                    f"{max(d['torchrec'], default=0):,.0f})", f"{row['speedup_torchrec']:.2f}x")
    con.print(tab)
    a.out.write_text(json.dumps({"workload": a.workload, "repeats": a.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
