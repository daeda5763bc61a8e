"""Startup of a trial whose ranks span Ray nodes vs the same trial on one node, side by side.

A real 3-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head without CPUs and two worker
nodes of 2 CPUs). The same 4-rank trial runs through cubic's Ray runner with ranks_per_node=4 (one node:
a Ray task that spawns the ranks) and ranks_per_node=2 (two nodes: a placement group and one Ray actor
per rank, cubic/execution/multinode.py), alternating `--repeats` times. Reported: startup (trial start to the first
training step, env.startup_s), the whole trial from submission, and whether the losses match.

    python benchmarks/bench_multinode.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "multinode_startup.json")
    a = ap.parse_args()
    from ray.cluster_utils import Cluster

    from cubic.execution.runner import RayRunner
    from cubic_harness.config import TrialConfig
    from cubic_harness.workload import Workload

    con = Console()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "object_store_memory": 100 * 2**20})
    for _ in range(2):
        c.add_node(num_cpus=2, object_store_memory=100 * 2**20)
    c.wait_for_nodes()
    runner = RayRunner(address=c.address, isolation="cores").start()
    base = TrialConfig(workload=Workload.tiny(), kernel="torch", world_size=4, batch_size=64, warmup_steps=1,
                       measure_steps=4, windows=2, timeout_s=120).validate()
    cfgs = {"1 node": base.replace(ranks_per_node=4), "2 nodes": base.replace(ranks_per_node=2)}
    rows: dict[str, dict[str, list]] = {k: {"startup_s": [], "trial_s": [], "nodes": [], "losses": []} for k in cfgs}
    try:
        for rep in range(a.repeats):
            for name, cfg in cfgs.items():
                t0 = time.perf_counter()
                p = runner.submit(cfg)
                while not (done := runner.wait([p], timeout=0.5)):
                    pass
                res = done[0][1]
                dt = time.perf_counter() - t0
                con.log(f"repeat {rep + 1}/{a.repeats} {name}: {res.status} startup {res.env.get('startup_s')} s, "
                        f"trial {dt:.1f} s, nodes {res.env.get('nodes')}")
                if res.status == "ok":
                    for k, v in (("startup_s", res.env["startup_s"]), ("trial_s", dt), ("nodes", res.env["nodes"]),
                                 ("losses", res.losses)):
                        rows[name][k].append(v)
    finally:
        runner.stop()
        c.shutdown()
    tab = Table(title=f"4-rank trial startup, one node vs two (median, min-max of {a.repeats})")
    for col in ("placement", "nodes", "startup to first step (s)", "whole trial (s)"):
        tab.add_column(col)
    for name, r in rows.items():
        tab.add_row(name, str(set(r["nodes"])), f"{statistics.median(r['startup_s']):.2f} "
                    f"({min(r['startup_s']):.2f}-{max(r['startup_s']):.2f})",
                    f"{statistics.median(r['trial_s']):.2f} ({min(r['trial_s']):.2f}-{max(r['trial_s']):.2f})")
    con.print(tab)
    same = all(x == rows["1 node"]["losses"][0] for x in rows["2 nodes"]["losses"])
    con.print(f"losses identical on 1 and 2 nodes: {same}")
    a.out.write_text(json.dumps({"repeats": a.repeats, "losses_identical": same,
                                 **{n: {k: v for k, v in r.items() if k != "losses"} for n, r in rows.items()}},
                                indent=1))


if __name__ == "__main__":
    main()
