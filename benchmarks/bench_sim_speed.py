"""How many configurations the simulator prices per second, on one core, at world sizes 2, 64, 4,096 and 16,384.

Each configuration is a whole simulated trial (`cubic_harness.sim.backend.simulate`: plan with the harness's
planner priced on the cluster, the per-position model, memory, the TrialResult), drawn at random from
the knobs that matter at scale (sharding and planners, 2D group size, sync, placement, batch,
precisions, pipelining). World 2 runs on clusters/local.yaml; 64 and 4,096 on a cluster of 8-device
nodes made from it; 16,384 on the h100-16384-4dc preset (4 data centers). Warm-up excluded; median of 3
repeats, with min-max.

    .venv/bin/python benchmarks/bench_sim_speed.py [--n 200]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from cubic_harness.config import TrialConfig  # noqa: E402
from cubic_harness.sim.backend import simulate  # noqa: E402
from cubic_harness.sim.cluster import cluster_from_dict, resolve, shipped_cluster  # noqa: E402
from cubic_harness.workload import Workload  # noqa: E402


def scaled(nodes: int) -> object:
    d = yaml.safe_load(shipped_cluster("local.yaml").read_text())
    d.update(name=f"local-x{nodes * 8}", nodes=nodes, devices_per_node=8)
    d["device"]["type"] = "gpu"
    d["device"]["memory_gb"] = 80
    return cluster_from_dict(d, "scaled")


def configs(world: int, n: int, seed: int, gpu: bool = False) -> list[TrialConfig]:
    rng = random.Random(seed)
    wl = Workload.preset("criteo-mlperf-mini")
    groups = [g for g in (0, 1, 2, 8, 64, 512) if g == 0 or (g < world and world % g == 0)]
    out = []
    for _ in range(n):
        g = rng.choice(groups)
        out.append(TrialConfig(
            workload=wl, world_size=world, sharding_group_size=g,
            sharding=rng.choice(["table_wise", "row_wise", "column_wise", "data_parallel", "size_greedy", "auto"]),
            sparse_sync=rng.choice(["grad_allreduce", "weight_avg"]), sparse_sync_interval=rng.choice([1, 8]),
            group_placement=rng.choice(["intra_node", "cross_node"]), batch_size=rng.choice([512, 1024, 4096]),
            emb_precision=rng.choice(["fp32", "fp16"]), dense_precision=rng.choice(["fp32", "bf16"]),
            comm_precision=rng.choice(["fp32", "bf16", "fp16"]), pipeline_depth=rng.choice([0, 1, 2]),
            ranks_per_node=8 if world >= 8 else world,
            **({"device": "cuda", "kernel": "triton"} if gpu else {})))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    os.sched_setaffinity(0, {0}) if hasattr(os, "sched_setaffinity") else None  # one core
    clusters = {2: cluster_from_dict(yaml.safe_load(shipped_cluster("local.yaml").read_text()), "local"),
                64: scaled(8), 4096: scaled(512), 16384: resolve("h100-16384-4dc")}
    rows = {}
    for world, c in clusters.items():
        cfgs = configs(world, args.n, world, gpu=c.name.startswith("h100"))  # a preset calibrates GPU kernels
        for cfg in cfgs[:5]:
            simulate(cfg, c)  # warm-up
        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            statuses = [simulate(cfg, c).status for cfg in cfgs]
            rates.append(len(cfgs) / (time.perf_counter() - t0))
        rows[world] = {"per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                       "ok": statuses.count("ok"), "n": len(cfgs)}
        print(f"world {world:5d} ({c.name}): {rows[world]['per_s']:8.1f} configurations/s "
              f"(min {min(rates):.1f}, max {max(rates):.1f}); {rows[world]['ok']}/{len(cfgs)} ok, rest oom/error")
    out = Path(__file__).resolve().parent / "data" / "sim_speed.json"
    out.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
                              indent=1))


if __name__ == "__main__":
    main()
