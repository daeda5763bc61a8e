"""A TorchRec job as plain data: the tables, each table's exact placement from cubic's plan, the
model, 2D's DMPCollection settings and DDP's all-reduce precision.

The TorchRec trial trains it (`torchrec_train`) and `cubic export --format torchrec` writes the same
keys, so this module imports neither torch nor TorchRec: an export is plain JSON and pays for
neither.
"""

from __future__ import annotations

from typing import Any

from cubic_harness.config import TORCHREC_TYPES, TrialConfig
from cubic_harness.workload import Workload


def placement_of(tp: dict[str, Any], kind: str, group: int, ranks_per_node: int) -> dict[str, Any]:
    """Exact placement of one table for torchrec.distributed.sharding_plan's generators
    (table_wise(rank), row_wise(), column_wise(ranks, size_per_rank), table_row_wise(host_index),
    data_parallel()), so a job can reproduce the measured plan instead of re-planning."""
    shards = sorted(tp.get("shards") or [],
                    key=lambda s: (s["col_start"], s["row_start"], s["rank"]))
    ranks = [int(s["rank"]) for s in shards]
    out: dict[str, Any] = {"sharding_type": kind}
    if kind == "table_wise" and ranks:
        out["rank"] = ranks[0]
    elif kind == "column_wise":
        out["ranks"] = ranks
        out["size_per_rank"] = [int(s["col_end"]) - int(s["col_start"]) for s in shards]
    elif kind == "row_wise":
        out["ranks"] = ranks
        out["rows_per_rank"] = [int(s["row_end"]) - int(s["row_start"]) for s in shards]
    elif kind == "table_row_wise" and ranks:
        out["host_index"] = ranks[0] // max(1, min(ranks_per_node, group))
        out["ranks"] = ranks
    return out


def torchrec_model(wl: Workload, notes: list[str]) -> dict[str, Any] | None:
    """TorchRec's model class and constructor arguments for the workload's family
    (torchrec.models.dlrm): DLRM for `dot`, DLRM_DCN (LowRankCrossNet: the same x_0 * (W (V x) +
    b) + x layers) for `dcn`. Wukong has no TorchRec model: None, and a note (the tables, plan
    and optimizers still apply)."""
    args = {"dense_in_features": wl.dense_features, "dense_arch_layer_sizes": list(wl.bottom_mlp),
            "over_arch_layer_sizes": list(wl.top_mlp)}
    if wl.interaction == "dot":
        return {"class": "torchrec.models.dlrm.DLRM", **args}
    if wl.interaction == "dcn":
        rank = wl.dcn_rank
        if rank == 0:  # LowRankCrossNet has no full-rank form; rank = width: at least its capacity
            rank = wl.num_features * wl.dim
            notes.append("dcn_rank=0 (full-rank cross layers) has no TorchRec form: DLRM_DCN's "
                         f"LowRankCrossNet with dcn_low_rank_dim={rank} (the input width) can "
                         "express it, with twice the weights")
        return {"class": "torchrec.models.dlrm.DLRM_DCN", **args, "dcn_num_layers": wl.dcn_layers,
                "dcn_low_rank_dim": rank}
    notes.append(f"interaction={wl.interaction!r} (Wukong) has no TorchRec model class: build its "
                 "dense arch from 'dense' (the layers of harness/model.py's WukongStack) around "
                 "TorchRec's EmbeddingBagCollection; the tables, sharding plan, pipeline and "
                 "optimizers below apply as they are")
    return None


def torchrec_job(cfg: TrialConfig, plan: list[dict], notes: list[str]) -> dict[str, Any]:
    """What TorchRec builds for `cfg` with cubic's `plan` (ShardingPlan.to_list()): the keys the
    TorchRec trial's ranks read, which the export (cubic/deploy/export.py) writes beside its own."""
    wl = cfg.workload
    by_name = {p.get("name") or wl.tables[p["table"]].name: p for p in plan}
    dtype = TORCHREC_TYPES[cfg.emb_precision]
    tables, placements = [], {}
    for i, t in enumerate(wl.tables):
        tables.append({"name": t.name, "num_embeddings": t.rows, "embedding_dim": t.dim,
                       "feature_names": t.features or [f"f{i}"], "data_type": dtype})
        tp = by_name.get(t.name)
        if tp is not None:
            placements[t.name] = placement_of(tp, tp["kind"], cfg.group_size, cfg.ranks_per_node)
    two_d = cfg.group_size < cfg.world_size
    # DMPCollection(use_inter_host_allreduce=True) keeps a sharding group's ranks contiguous
    # (intra_node)
    dmp_collection = ({"sharding_group_size": cfg.group_size, "world_size": cfg.world_size,
                       "use_inter_host_allreduce": cfg.group_placement == "intra_node",
                       "group_placement": cfg.group_placement,
                       "sync_interval_batches": cfg.sparse_sync_interval} if two_d else None)
    return {"tables": tables, "placements": placements,
            "model": None if wl.factory else torchrec_model(wl, notes),
            "factory": wl.factory or None,
            "dmp_collection": dmp_collection,
            "ddp": {"allreduce_comm_precision": cfg.allreduce_comm_precision}}
