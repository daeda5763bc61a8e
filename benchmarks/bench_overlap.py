"""comm_overlap on this machine: the pooled all-to-all beside the bottom MLP, measured against `none`, and the
simulator's prediction of the same ratio (issue 33 item 1).

Each setting runs as a real trial (2 gloo ranks on this CPU) of `make tune`'s baseline (search_spaces/dlrm_cpu.yaml:
small-zipf, table-wise, batch 1024 per rank) and of a wider-bottom variant where the bottom MLP is long enough to
hide the collective, in 3 alternating repeats (none, forward, forward_backward, none, ...), so the machine's drift
falls on every setting alike. Reported per setting: the median qps and its range, the ratio to `none`, the exposed
`comm` and the hidden `comm_hidden_ms` per step; beside it the simulator's ratio on this machine's calibrated
cluster (`overlap_hidden`: the share of a collective beside compute that `cubic calibrate` measured hidden).

    .venv/bin/python benchmarks/bench_overlap.py [--repeats 3] [--out benchmarks/data/overlap_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cubic.space.search_space import load_space  # noqa: E402
from cubic_harness.sim.backend import simulate  # noqa: E402
from cubic_harness.sim.cluster import local_cluster  # noqa: E402
from cubic_harness.trial import run_trial  # noqa: E402
from cubic_harness.workload import Workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "forward", "forward_backward")


def configs() -> dict:
    base = load_space(ROOT / "search_spaces" / "dlrm_cpu.yaml").baseline.replace(
        warmup_steps=5, measure_steps=30, windows=3, timeout_s=600)
    wide = Workload.from_dict({**base.workload.to_dict(), "name": "small-zipf-wide-bottom",
                               "bottom_mlp": [1024, 1024, 64]})
    return {"dlrm_cpu baseline": base, "wide bottom MLP": base.replace(workload=wide)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "data" / "overlap_cpu.json"))
    args = ap.parse_args()
    console = Console()
    cluster = local_cluster()
    out: dict = {"repeats": args.repeats, "cluster_overlap_hidden": cluster.device.overlap_hidden if cluster else None,
                 "rows": {}}
    for label, cfg in configs().items():
        runs: dict[str, list] = {m: [] for m in MODES}
        with console.status(f"{label}: measuring") as st:
            for rep in range(args.repeats):
                for m in MODES:
                    st.update(f"{label}: repeat {rep + 1}/{args.repeats}, comm_overlap={m}")
                    r = run_trial(cfg.replace(comm_overlap=m))
                    if r.status != "ok":
                        raise SystemExit(f"{label} {m}: {r.status}: {r.error}")
                    runs[m].append({"qps": r.qps, "comm_ms": r.breakdown_ms["comm"],
                                    "hidden_ms": r.extra.get("comm_hidden_ms", 0.0)})
        sim = {m: simulate(cfg.replace(comm_overlap=m), cluster).qps if cluster else None for m in MODES}
        base = statistics.median(x["qps"] for x in runs["none"])
        rows = {}
        for m in MODES:
            q = [x["qps"] for x in runs[m]]
            rows[m] = {"qps": q, "median": statistics.median(q), "ratio": statistics.median(q) / base,
                       "ratio_range": [min(q) / base, max(q) / base],
                       "comm_ms": statistics.median(x["comm_ms"] for x in runs[m]),
                       "hidden_ms": statistics.median(x["hidden_ms"] for x in runs[m]),
                       "sim_ratio": sim[m] / sim["none"] if sim["none"] else None}
        out["rows"][label] = rows
        t = Table(title=f"{label}: comm_overlap beside none ({args.repeats} alternating repeats)")
        for c in ("comm_overlap", "qps (median)", "ratio", "range", "exposed comm ms", "hidden ms", "simulator"):
            t.add_column(c)
        for m, r in rows.items():
            t.add_row(m, f"{r['median']:,.0f}", f"{r['ratio']:.3f}",
                      f"{r['ratio_range'][0]:.3f}-{r['ratio_range'][1]:.3f}", f"{r['comm_ms']:.2f}",
                      f"{r['hidden_ms']:.2f}", f"{r['sim_ratio']:.3f}" if r["sim_ratio"] else "-")
        console.print(t)
    Path(args.out).write_text(json.dumps(out, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
