"""Real trials of the per-table plan against table-wise and TorchRec's planner's plan, in cubic's harness and in
TorchRec, beside the simulator's predicted ratios.

`criteo-mlperf-mini` (MLPerf's 26 unequal tables, rows capped) on 2 gloo ranks of this machine, batch 1024 per
rank, FBGEMM's CPU kernel in both backends. Each plan is made on this machine's cluster file (as a trial plans);
the TorchRec backend plans among the kinds TorchRec runs here (table- and column-wise). 3 rounds, the configs
alternating inside each round (the machine drifts over minutes; a round shares its spell); per config the median
samples/s and its range, and its ratio to table-wise in the same backend; the simulator's predicted ratio
beside it (the local cluster; TorchRec's step by the cluster's `torchrec` profile where it has one).

`--workload` is a preset or a workload file (`cubic workload profile`'s output: its tables carry the data's
own statistics, and the trials draw ids like the sample, `id_source: profile`). `--profile DATA` profiles a
Criteo-layout sample (columns C1..C26, e.g. DeepCTR's `examples/criteo_sample.txt`, 200 rows of Criteo's
display-advertising data) into the preset's 26 tables first, in order. Results go to `planner_trials.json`
for the preset as shipped, else to `planner_trials_<name>.json`.

    .venv/bin/python benchmarks/bench_planner_trials.py [--rounds 3] [--workload criteo-mlperf-mini | FILE.json]
        [--profile criteo_sample.txt]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cubic_harness.config import TrialConfig  # noqa: E402
from cubic_harness.errors import ConfigError  # noqa: E402
from cubic_harness.profile import profile_data  # noqa: E402
from cubic_harness.sim.backend import simulate  # noqa: E402
from cubic_harness.sim.cluster import local_cluster  # noqa: E402
from cubic_harness.workload import Workload  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "planner_trials.json"


def workload(name: str, profile: str | None) -> tuple[Workload, Path]:
    """A preset by name, else a workload file, with where its results go; profiled from `profile` if given."""
    if profile:
        wl = Workload.preset(name)
        fed = dataclasses.replace(wl, tables=[dataclasses.replace(t, features=[f"C{i + 1}"])
                                              for i, t in enumerate(wl.tables)])
        wl = profile_data(Path(profile), fed, batch_sizes=(1024,))
        return wl, DATA.with_name(f"planner_trials_{name}_{Path(profile).stem}.json")
    if name.endswith(".json"):
        wl, _ = Workload.from_json_file(Path(name))
        return wl, DATA.with_name(f"planner_trials_{Path(name).stem}.json")
    out = DATA if name == "criteo-mlperf-mini" else DATA.with_name(f"planner_trials_{name}.json")
    return Workload.preset(name), out
SHARDINGS = ("table_wise", "plan", "torchrec_planner")


def predicted(cfg: TrialConfig, backend: str) -> float | None:
    c = local_cluster()
    if c is None:
        return None
    try:
        c = c.for_framework("torchrec") if backend == "torchrec" else c
    except ConfigError:
        return None
    res = simulate(cfg, c)
    return res.qps if res.status == "ok" else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", default="criteo-mlperf-mini")
    ap.add_argument("--profile", default=None, help="a Criteo-layout sample (C1..C26) to profile the preset from")
    args = ap.parse_args()
    from cubic_harness.torchrec_trial import run_torchrec
    from cubic_harness.trial import run_trial

    wl, out = workload(args.workload, args.profile)
    base = TrialConfig(workload=wl, world_size=2, batch_size=1024, kernel="fbgemm",
                       warmup_steps=5, measure_steps=20, windows=4, timeout_s=600)
    runs = {"harness": run_trial, "torchrec": run_torchrec}
    got: dict[tuple[str, str], list[float]] = {}
    plans: dict[tuple[str, str], list] = {}
    con = Console(width=160)
    for r in range(args.rounds):
        for backend, run in runs.items():
            for sh in SHARDINGS:
                res = run(base.replace(sharding=sh))
                con.print(f"round {r + 1} {backend} {sh}: {res.status} {res.qps:,.0f} samples/s {res.error[:120]}")
                if res.status == "ok":
                    got.setdefault((backend, sh), []).append(res.qps)
                    plans[(backend, sh)] = res.plan
    tab = Table(title=f"{args.workload}, 2 ranks: samples/s (median of {args.rounds}, range), x table-wise")
    for col in ("backend", "plan", "samples/s", "range", "x table-wise", "predicted x", "kinds"):
        tab.add_column(col, justify="right")
    rows = []
    for backend in runs:
        tw = got.get((backend, "table_wise"))
        tw_pred = predicted(base.replace(sharding="table_wise"), backend)
        for sh in SHARDINGS:
            q = got.get((backend, sh))
            if not q:
                tab.add_row(backend, sh, "failed", "", "", "", "")
                continue
            med = statistics.median(q)
            pred = predicted(base.replace(sharding=sh), backend)
            ratio = med / statistics.median(tw) if tw else None
            pred_ratio = pred / tw_pred if pred and tw_pred else None
            kinds: dict[str, int] = {}
            for tp in plans[(backend, sh)]:
                kinds[tp["kind"]] = kinds.get(tp["kind"], 0) + 1
            tab.add_row(backend, sh, f"{med:,.0f}", f"{min(q):,.0f}-{max(q):,.0f}",
                        f"{ratio:.2f}x" if ratio else "-", f"{pred_ratio:.2f}x" if pred_ratio else "-",
                        ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
            rows.append({"backend": backend, "sharding": sh, "qps": q, "median": med, "x_table_wise": ratio,
                         "predicted_x_table_wise": pred_ratio, "kinds": kinds})
    con.print(tab)
    meta = {"date": time.strftime("%Y-%m-%d"), "workload": args.workload, "id_source": wl.id_source,
            "data": wl.data.source if wl.data else None, "sample_rows": wl.data.sample_rows if wl.data else None}
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    con.print(f"wrote {out}")


if __name__ == "__main__":
    main()
