"""Winners of several tunes re-measured side by side: are different seeds' answers equally fast?

Takes run directories (or storage URLs) of `cubic tune`, loads each one's confirmed winner and the
baseline, and runs them alternating `--repeats` times (so drift of the machine hits all alike).
Prints median samples/s and spread of each, and each winner's ratio to the fastest winner.

    python benchmarks/bench_winners.py runs/qseed0 runs/qseed1 runs/qseed2 [--repeats 3]
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

from cubic.results import analysis  # noqa: E402
from cubic_harness.config import TrialConfig  # noqa: E402
from cubic_harness.trial import run_trial  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "winners.json")
    a = ap.parse_args()
    con = Console()
    cfgs: dict[str, TrialConfig] = {}
    quality: dict[str, str] = {}
    for run in a.runs:
        df = analysis.load_study(run)
        w = df.attrs.get("winner")
        if not w or not w.get("config"):
            con.print(f"{run}: no confirmed winner")
            continue
        row = df[df["number"] == w["trial"]].iloc[0]
        cfgs[f"{run} #{w['trial']}"] = TrialConfig.from_dict(w["config"])
        quality[f"{run} #{w['trial']}"] = str(row["quality_reason"])
        if "baseline" not in cfgs:
            cfgs["baseline"] = TrialConfig.from_dict(analysis.baseline_rows(df).iloc[0]["config"])
    qps: dict[str, list[float]] = {k: [] for k in cfgs}
    for rep in range(a.repeats):
        for name, cfg in cfgs.items():
            r = run_trial(cfg)
            con.log(f"repeat {rep + 1}/{a.repeats} {name}: {r.status} {r.qps:,.0f}")
            if r.status == "ok":
                qps[name].append(r.qps)
    med = {k: statistics.median(v) for k, v in qps.items() if v}
    best = max(v for k, v in med.items() if k != "baseline")
    tab = Table(title=f"winners side by side ({a.repeats} alternating repeats)")
    for c in ("config", "samples/s median (min-max)", "vs baseline", "vs fastest winner"):
        tab.add_column(c)
    for k, v in qps.items():
        if not v:
            continue
        tab.add_row(k, f"{med[k]:,.0f} ({min(v):,.0f}-{max(v):,.0f})", f"{med[k] / med['baseline']:.2f}x",
                    "" if k == "baseline" else f"{med[k] / best:.3f}")
    con.print(tab)
    a.out.write_text(json.dumps({"repeats": a.repeats, "qps": qps, "quality": quality,
                                 "configs": {k: c.to_dict() for k, c in cfgs.items()}}, indent=1, default=str))


if __name__ == "__main__":
    main()
