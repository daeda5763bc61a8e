"""The performance model's predictions on a fixed set of configurations and clusters, held against a file.

Why: the model is rewritten for speed and shape (vectorised per-shard sums, typed records) while its answers
must stay; a change that moves a prediction shows here with the case and the figure that moved. A deliberate
change of the model rewrites the file, and the diff of `tests/data/sim_golden.json` is its review:

    .venv/bin/python tests/test_sim_golden.py --write
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from cubic_harness.config import TrialConfig
from cubic_harness.planning import plan_for
from cubic_harness.sim.cluster import load_cluster, shipped_cluster
from cubic_harness.sim.perf import estimate
from cubic_harness.workload import Workload

GOLDEN = Path(__file__).parent / "data" / "sim_golden.json"
GPU = dict(device="cuda", kernel="triton", ranks_per_node=8)
FAST = dict(GPU, emb_precision="fp16", dense_precision="bf16", comm_precision="fp16", pipeline_depth=1,
            comm_overlap="forward_backward")
# (name, workload preset, cluster file, knobs): every sharding kind and planner, profiled and Zipf ids, 2D with
# both syncs and placements, the UVM cache, host-memory offload, CPU threads
CASES: list[tuple[str, str, str, dict]] = [
    *[(f"small-meta {k} local", "small-meta", "local", dict(world_size=2, sharding=k, batch_size=512))
      for k in ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "auto")],
    ("small-zipf 2D weight_avg local", "small-zipf", "local",
     dict(world_size=2, sharding="row_wise", sharding_group_size=1, sparse_sync="weight_avg",
          sparse_sync_interval=4)),
    ("small-meta 2D grad_allreduce local", "small-meta", "local",
     dict(world_size=2, sharding="row_wise", sharding_group_size=1, batch_size=512)),
    ("mlperf-dcnv2 2D weight_avg column_wise h100-64", "mlperf-dcnv2", "h100-64",
     dict(FAST, world_size=64, batch_size=2112, sharding="column_wise", sharding_group_size=16,
          sparse_sync="weight_avg", sparse_sync_interval=4)),
    *[(f"dlrm-datasets-2022 2D {s} h100-128", "dlrm-datasets-2022", "h100-128",
       dict(FAST, world_size=128, sharding="table_wise", sharding_group_size=32, sparse_sync=s))
      for s in ("grad_allreduce", "weight_avg")],
    ("small threads local", "small", "local", dict(world_size=2, threads_per_rank=2, sharding="size_greedy")),
    *[(f"criteo-mlperf-mini {k} h100-8", "criteo-mlperf-mini", "h100-8", dict(GPU, world_size=8, sharding=k))
      for k in ("table_wise", "row_wise", "column_wise", "table_row_wise", "lookup_greedy", "plan")],
    ("mlperf-dcnv2 column_wise h100-64", "mlperf-dcnv2", "h100-64",
     dict(FAST, world_size=64, batch_size=2112, sharding="column_wise")),
    ("mlperf-dcnv2 2D grad_allreduce cross_node h100-64", "mlperf-dcnv2", "h100-64",
     dict(FAST, world_size=64, batch_size=2112, sharding="table_row_wise", sharding_group_size=16,
          group_placement="cross_node")),
    ("mlperf-dcnv2 2D weight_avg h100-64", "mlperf-dcnv2", "h100-64",
     dict(FAST, world_size=64, batch_size=2112, sharding="row_wise", sharding_group_size=8,
          sparse_sync="weight_avg", sparse_sync_interval=8)),
    ("mlperf-dcnv2 uvm h100-8", "mlperf-dcnv2", "h100-8",
     dict(FAST, world_size=8, batch_size=4096, sharding="table_wise", uvm_cache_load_factor=0.2)),
    ("mlperf-dcnv2 data_parallel h100-8", "mlperf-dcnv2", "h100-8",
     dict(FAST, world_size=8, batch_size=4096, sharding="data_parallel")),
    *[(f"dlrm-datasets-2022 {k} h100-128", "dlrm-datasets-2022", "h100-128",
       dict(FAST, world_size=128, sharding=k)) for k in ("table_wise", "row_wise", "table_row_wise")],
]


def predict(preset: str, cluster: str, knobs: dict) -> dict:
    """What the model says of one case: the step, each phase, the comm by collective, memory and features."""
    c = load_cluster(shipped_cluster(f"{cluster}.yaml"))
    cfg = TrialConfig(workload=Workload.preset(preset), **knobs)
    est = estimate(cfg, plan_for(cfg, c), c)
    return {"step_ms": est.step_ms, "breakdown_ms": est.breakdown_ms, "comm_ms": est.comm_ms,
            "mem_mb": [max(est.mem_mb), min(est.mem_mb)], "features": est.features,
            "emb_fwd": [max(est.per_rank["emb_fwd"]), min(est.per_rank["emb_fwd"])],
            "offloaded": sum(len(v) for v in est.offload.values()), "hidden_ms": est.comm_hidden_ms}


def _flat(d: object, key: str = "") -> dict[str, float]:
    if isinstance(d, dict):
        return {k: v for n, x in d.items() for k, v in _flat(x, f"{key}.{n}").items()}
    if isinstance(d, list):
        return {k: v for n, x in enumerate(d) for k, v in _flat(x, f"{key}[{n}]").items()}
    return {key: float(d)}


@pytest.mark.parametrize("name,preset,cluster,knobs", CASES, ids=[c[0] for c in CASES])
def test_the_models_predictions_are_unchanged(name: str, preset: str, cluster: str, knobs: dict) -> None:
    want = _flat(json.loads(GOLDEN.read_text())[name])
    got = _flat(predict(preset, cluster, knobs))
    assert got.keys() == want.keys()
    # sums in another order differ in the last bits; anything a model change moves is far larger
    moved = {k: (want[k], got[k]) for k in want if not math.isclose(got[k], want[k], rel_tol=1e-9, abs_tol=1e-12)}
    assert not moved, f"{name}: predictions moved: {moved}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: tests/test_sim_golden.py --write")
    GOLDEN.write_text(json.dumps({n: predict(p, c, k) for n, p, c, k in CASES}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({len(CASES)} cases)")
