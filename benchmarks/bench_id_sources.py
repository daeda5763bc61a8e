"""Does the id source change the winner? The same configurations run for real on uniform ids, on ids drawn
like a profiled sample, and on the sample replayed; Kendall tau between the three rankings, the winners,
and the simulator's predictions of the same three.

The sample is made here to look like label-encoded production logs: per table, Zipf-skewed ids whose
hottest values got the smallest codes (what frequency-sorted vocabularies do), variable bag lengths.
On such data a row-wise shard holding the first rows holds the hot rows; uniform ids cannot show it.

    .venv/bin/python benchmarks/bench_id_sources.py [--rows 30000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table
from scipy.stats import kendalltau

from cubic_harness.config import TrialConfig
from cubic_harness.profile import profile_data
from cubic_harness.sim.backend import simulate
from cubic_harness.sim.cluster import local_cluster
from cubic_harness.trial import run_trial
from cubic_harness.workload import TableSpec, Workload

OUT = Path(__file__).parent / "data" / "id_sources.json"
CONFIGS = [dict(sharding=s, batch_size=b) for s in ("table_wise", "row_wise", "column_wise", "data_parallel",
                                                     "lookup_greedy") for b in (512, 2048)]


def sample(path: Path, rows: int, tables: int) -> None:
    """Label-encoded logs: table i's ids Zipf(alpha_i) with the hottest codes smallest, bags of 0..2*mean."""
    rng = np.random.default_rng(0)
    cols = {}
    for i in range(tables):
        alpha, mean = (1.25, 1.1, 1.05, 1.3)[i % 4], (20, 8, 30, 12)[i % 4]
        lens = rng.integers(0, 2 * mean + 1, rows)
        ids = np.minimum(rng.zipf(alpha, lens.sum()) - 1, 10**9)
        cols[f"f{i}"] = np.split(ids, np.cumsum(lens)[:-1])
    pd.DataFrame({k: [list(x) for x in v] for k, v in cols.items()}).to_parquet(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=30_000, help="data rows in the sample")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tables = [TableSpec(f"t{i}", 200_000, 64, 1, features=[f"f{i}"]) for i in range(8)]
    base = Workload("logs", tables, 13, [256, 128, 64], [512, 256, 1]).validate()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "logs.parquet"
        sample(data, args.rows, len(tables))
        wl = profile_data(data, base, batch_sizes=(512, 2048), trace_path=Path(tmp) / "logs.trace.npz")
        uniform = dataclasses.replace(wl, id_source="synthetic", tables=[
            dataclasses.replace(t, pooling=max(1, round(t.lookups(True)))) for t in wl.tables])
        sources = {"uniform": uniform, "profile": wl, "trace": dataclasses.replace(wl, id_source="trace")}
        qps: dict[str, list[list[float]]] = {s: [[] for _ in CONFIGS] for s in sources}
        console = Console()
        with console.status("trials") as st:
            for rep in range(args.repeats):  # alternate the sources inside each repeat: drift hits all alike
                for ci, knobs in enumerate(CONFIGS):
                    for s, w in sources.items():
                        st.update(f"repeat {rep + 1}/{args.repeats}, config {ci + 1}/{len(CONFIGS)}, {s}")
                        r = run_trial(TrialConfig(workload=w, world_size=2, warmup_steps=3, measure_steps=12,
                                                  kernel="native", timeout_s=300, **knobs))
                        qps[s][ci].append(r.qps if r.status == "ok" else 0.0)
        cl = local_cluster()
        sim = {s: [simulate(TrialConfig(workload=w, world_size=2, kernel="native", **k), cl).qps for k in CONFIGS]
               for s, w in sources.items()} if cl else {}
    med = {s: [statistics.median(x) for x in v] for s, v in qps.items()}
    out = {"configs": CONFIGS, "measured_qps": med, "spread": {s: [max(x) - min(x) for x in v]
                                                                for s, v in qps.items()},
           "simulated_qps": sim, "tau": {}, "winner": {}}
    for kind, table in (("measured", med), ("simulated", sim)):
        for a, b in (("uniform", "profile"), ("uniform", "trace"), ("profile", "trace")):
            if table:
                out["tau"][f"{kind}: {a} vs {b}"] = round(float(kendalltau(table[a], table[b]).statistic), 3)
        for s, v in table.items():
            i = int(np.argmax(v))
            out["winner"][f"{kind}: {s}"] = {**CONFIGS[i], "qps": round(v[i])}
    tab = Table(title="samples/s by id source (median of repeats)")
    for col in ("config", *(f"{s}" for s in sources), *(f"sim {s}" for s in sim)):
        tab.add_column(col, justify="right")
    for i, k in enumerate(CONFIGS):
        tab.add_row(f"{k['sharding']} b{k['batch_size']}", *(f"{med[s][i]:,.0f}" for s in sources),
                    *(f"{sim[s][i]:,.0f}" for s in sim))
    console.print(tab)
    console.print(out["tau"], out["winner"])
    OUT.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
