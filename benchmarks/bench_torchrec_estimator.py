"""Our performance model's table costs beside TorchRec's planner estimator, on the same tables.

TorchRec 1.8's own `EmbeddingEnumerator` + `EmbeddingPerfEstimator` (run here on a meta-device
EmbeddingBagCollection, nothing allocated) price every table of MLPerf's DLRM-DCNv2 table-wise on
8 GPUs at 6,912 samples per GPU (MLPerf's one-node batch); `cubic_harness.sim.perf.TableCosts` prices the
same tables on clusters/h100-8.yaml. Per table and in total: forward and backward compute, and the
pooled all-to-all (forward + backward). Needs TorchRec (`make torchrec`, or the anchors' setup script).

    .venv/bin/python benchmarks/bench_torchrec_estimator.py
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cubic_harness.config import TrialConfig  # noqa: E402
from cubic_harness.sim.cluster import load_cluster, shipped_cluster  # noqa: E402
from cubic_harness.sim.perf import TableCosts  # noqa: E402
from cubic_harness.workload import Workload  # noqa: E402

WORLD, BATCH = 8, 6912


def torchrec_perfs(wl: Workload) -> dict[str, object]:
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    tables = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[f"f{i}"])
              for i, t in enumerate(wl.tables)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    topo = Topology(world_size=WORLD, compute_device="cuda", local_world_size=WORLD)
    cons = {t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"],
                                         pooling_factors=[float(t.pooling)]) for t in wl.tables}
    enum = EmbeddingEnumerator(topology=topo, batch_size=BATCH, constraints=cons,
                               estimator=[EmbeddingPerfEstimator(topo, cons), EmbeddingStorageEstimator(topo, cons)])
    return {o.name: o.shards[0].perf for o in enum.enumerate(ebc, [EmbeddingBagCollectionSharder()])}


def main() -> None:
    wl = Workload.preset("mlperf-dcnv2")
    tr = torchrec_perfs(wl)
    costs = TableCosts(load_cluster(shipped_cluster("h100-8.yaml")))
    cfg = TrialConfig(workload=wl, world_size=WORLD, batch_size=BATCH, device="cuda", kernel="triton",
                      sharding="table_wise", ranks_per_node=8)
    tab = Table(title=f"table-wise on 8 H100, {BATCH} samples per GPU: ms per step, TorchRec estimator / ours")
    for col in ("table", "rows", "pooling", "fwd compute", "bwd compute", "bwd/fwd", "a2a fwd+bwd"):
        tab.add_column(col, justify="right")
    tot = {"tr": [0.0, 0.0, 0.0], "us": [0.0, 0.0, 0.0]}
    rows = []
    for t in wl.tables:
        p = tr[t.name]
        f, b = costs.phases(t, WORLD * BATCH, WORLD * BATCH, cfg)
        c = costs.comm(t, cfg)
        trc = p.fwd_comms + p.bwd_comms
        for k, v in zip(("tr", "us"), ((p.fwd_compute, p.bwd_compute, trc), (f, b, c)), strict=True):
            tot[k] = [a + x for a, x in zip(tot[k], v, strict=True)]
        rows.append({"table": t.name, "torchrec": [p.fwd_compute, p.bwd_compute, trc], "ours": [f, b, c]})
        tab.add_row(t.name, f"{t.rows:,}", str(t.pooling), f"{p.fwd_compute:.3f} / {f:.3f}",
                    f"{p.bwd_compute:.3f} / {b:.3f}", f"{p.bwd_compute / p.fwd_compute:.1f} / {b / f:.1f}",
                    f"{trc:.3f} / {c:.3f}")
    tab.add_row("total", "", "", f"{tot['tr'][0]:.2f} / {tot['us'][0]:.2f}", f"{tot['tr'][1]:.2f} / {tot['us'][1]:.2f}",
                f"{tot['tr'][1] / tot['tr'][0]:.1f} / {tot['us'][1] / tot['us'][0]:.1f}",
                f"{tot['tr'][2]:.2f} / {tot['us'][2]:.2f}")
    Console(width=140).print(tab)
    (Path(__file__).resolve().parent / "data" / "torchrec_estimator.json").write_text(
        json.dumps({"world": WORLD, "batch": BATCH, "totals": tot, "tables": rows}, indent=1))


if __name__ == "__main__":
    main()
