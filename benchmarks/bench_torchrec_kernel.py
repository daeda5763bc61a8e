"""A study's baseline and winner in TorchRec with FBGEMM's fused TBE and with cubic's own kernel inside TorchRec's
sharded tables (harness/torchrec_kernel.py), side by side: what the winner's speed-up becomes in TorchRec once
TorchRec runs the kernel the harness measured.

Each configuration runs as `cubic verify` runs it (its TorchRec export, with what TorchRec cannot run here
substituted and named), once with `kernel=fbgemm` and once with the configuration's own kernel, alternating,
`--repeats` times; the harness's own run of each beside them. Medians, spread and speed-ups over the baseline in
the same column. Writes benchmarks/data/torchrec_kernel.json.

    python benchmarks/bench_torchrec_kernel.py RUN_DIR [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "data" / "torchrec_kernel.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from cubic.deploy.verify import _candidate
    from cubic.results import analysis
    from cubic_harness.torchrec_trial import run_torchrec_trial
    from cubic_harness.trial import run_trial

    df = analysis.load_study(args.run_dir)
    base = analysis.baseline_rows(df).iloc[0]
    win = df[df["number"] == df.attrs["winner"]["trial"]].iloc[0]
    cands = [_candidate(df, base, "baseline", df.attrs["study"]), _candidate(df, win, "winner", df.attrs["study"])]
    cols = ("harness", "torchrec_fbgemm", "torchrec_own_kernel")
    runs = {c["label"]: {k: [] for k in cols} for c in cands}
    subs = {}
    with Progress(console=Console(stderr=True)) as prog:
        task = prog.add_task("harness, TorchRec + FBGEMM, TorchRec + its own kernel", total=args.repeats * len(cands))
        for _ in range(args.repeats):
            for c in cands:
                cfg, r = c["config"], runs[c["label"]]
                res = run_trial(cfg)
                r["harness"].append(res.qps if res.status == "ok" else None)
                for col, kcfg in (("torchrec_fbgemm", cfg.replace(kernel="fbgemm")), ("torchrec_own_kernel", cfg)):
                    t = run_torchrec_trial(kcfg, c["export"])
                    r[col].append(t["qps"] if t["status"] == "ok" else None)
                    subs[(c["label"], col)] = t["substitutions"]
                    if t["status"] != "ok":
                        Console(stderr=True).print(f"{c['label']} {col}: {t['error']}")
                prog.advance(task)
    med = {lab: {k: statistics.median([x for x in v if x]) if any(v) else None for k, v in r.items()}
           for lab, r in runs.items()}
    out = {"run_dir": str(args.run_dir), "repeats": args.repeats,
           "kernels": {c["label"]: c["config"].kernel for c in cands}, "runs": runs, "median": med,
           "speedup": {k: med["winner"][k] / med["baseline"][k] for k in cols
                       if med["winner"][k] and med["baseline"][k]},
           "substitutions": {f"{lab} {col}": s for (lab, col), s in subs.items()}}
    OUT.write_text(json.dumps(out, indent=1))
    t = Table(title=f"{df.attrs['study']}: baseline (kernel={out['kernels']['baseline']}) and winner "
                    f"(kernel={out['kernels']['winner']}), median of {args.repeats}")
    t.add_column("")
    for k in cols:
        t.add_column(k, justify="right")
    for lab in ("baseline", "winner"):
        t.add_row(lab, *(f"{med[lab][k]:,.0f}" if med[lab][k] else "-" for k in cols))
    t.add_row("speed-up", *(f"{out['speedup'][k]:.2f}x" if k in out["speedup"] else "-" for k in cols))
    Console().print(t)
    for key, s in out["substitutions"].items():
        if s:
            Console().print(f"{key}: " + "; ".join(s))


if __name__ == "__main__":
    main()
