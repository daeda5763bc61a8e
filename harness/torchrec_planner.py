"""TorchRec's own planner as a plan (`sharding: torchrec_planner`).

TorchRec's `EmbeddingShardingPlanner` (enumerate -> propose -> estimate -> partition, with its own
estimators) plans the workload's tables on a meta device for the sharding group's topology: its world,
ranks per node, each device's and host's memory and bandwidths, the per-rank batch, and the tables'
pooling factors (profiled where the workload has a profile), restricted to the kinds the backend runs.
Its answer is translated shard for shard into cubic's `ShardingPlan`, so both backends run and the
simulator prices exactly what TorchRec's planner chose: the rival a TorchRec user would otherwise get.

Only TorchRec's public planner API is used (torchrec.distributed.planner, its sharder and module
types); `ShardMetadata.placement.rank()` reads each shard's rank.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable

from cubic_harness.config import SHARDING_TYPES, TORCHREC_TYPES, TrialConfig
from cubic_harness.errors import ConfigError
from cubic_harness.sharding.plan import Shard, ShardingPlan, TablePlan, ascending_columns
from cubic_harness.sim.cluster import Cluster

#: TorchRec's sharding types as cubic's kinds: a table-column-wise table is column shards inside one node,
#: which cubic's harness runs as column shards on those ranks.
KINDS = {"table_wise": "table_wise", "row_wise": "row_wise", "column_wise": "column_wise",
         "table_row_wise": "table_row_wise", "data_parallel": "data_parallel", "table_column_wise": "column_wise"}
GB_S_TO_BYTES_MS = 1e9 / 1e3  # cubic's links in GB/s; TorchRec's Topology takes bytes per ms


def torchrec_plan(cfg: TrialConfig, cluster: Cluster | None, allowed: Iterable[str] = SHARDING_TYPES,
                  check_memory: bool = True) -> ShardingPlan:
    """TorchRec's planner's plan for `cfg`'s sharding group on `cluster` (TorchRec's defaults without one).
    ConfigError (one line) where TorchRec is missing or finds no plan."""
    try:
        import torch
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.planner.types import PlannerError
        from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
    except ImportError as e:
        raise ConfigError(f"sharding=torchrec_planner needs TorchRec ({e}); install it with `make`") from None

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    wl = cfg.workload
    dtype = getattr(DataType, TORCHREC_TYPES[cfg.emb_precision])
    configs = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                                  feature_names=[f"{t.name}.f{k}" for k in range(len(t.feature_names))],
                                  data_type=dtype) for t in wl.tables]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    allowed = set(allowed)
    cons = {t.name: ParameterConstraints(  # the backend's kinds, within the table's own constraint
        sharding_types=[k for k, ours in KINDS.items() if ours in allowed & set(t.sharding_types or allowed)],
        pooling_factors=[t.lookups(wl.profiled) / len(t.feature_names)] * len(t.feature_names))
        for t in wl.tables}
    with warnings.catch_warnings():  # its default storage reservation's FutureWarning: the default is the
        warnings.simplefilter("ignore", FutureWarning)  # rival a TorchRec user gets, kept as it is
        planner = EmbeddingShardingPlanner(topology=topology(cfg, cluster, Topology, check_memory),
                                           batch_size=cfg.batch_size, constraints=cons, debug=False)
    logging.disable(logging.WARNING)  # its root-logger line per data-parallel table ("spec not found")
    try:
        got = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    except PlannerError as e:
        from cubic_harness.sharding.planner import PlanError

        raise PlanError(f"sharding=torchrec_planner: TorchRec's planner found no plan that fits mem_cap_mb="
                        f"{cfg.mem_cap_mb:.0f} or the device's memory ({str(e).splitlines()[0][:200]})") from None
    finally:
        logging.disable(logging.NOTSET)
    return from_torchrec(cfg, next(iter(got.plan.values())))


def topology(cfg: TrialConfig, cluster: Cluster | None, Topology: type, check_memory: bool = True):  # noqa: N803
    """The sharding group as TorchRec's `Topology`: its ranks, ranks per node, each device's memory (the
    config's cap where it is lower) and host memory, copy and link bandwidths."""
    G = cfg.group_size
    rpn = min(cfg.ranks_per_node, G)
    device = "cuda" if cfg.device == "cuda" else "cpu"
    if cluster is None:
        return Topology(world_size=G, compute_device=device, local_world_size=rpn)
    d = cluster.device
    rpn = min(cluster.devices_per_node, G)
    mem = cluster.rank_memory_mb(rpn) * 2**20
    if check_memory and cfg.mem_cap_mb > 0:
        mem = min(mem, cfg.mem_cap_mb * 2**20)
    host = cluster.host_memory_gb * 2**30 / cluster.devices_per_node
    return Topology(world_size=G, compute_device=device, local_world_size=rpn,
                    hbm_cap=int(mem) if device == "cuda" else None, ddr_cap=int(host if device == "cuda" else mem),
                    hbm_mem_bw=d.mem_bw_gbs * GB_S_TO_BYTES_MS, ddr_mem_bw=d.mem_bw_gbs * GB_S_TO_BYTES_MS,
                    intra_host_bw=cluster.intra_node.bandwidth_gbs * GB_S_TO_BYTES_MS,
                    inter_host_bw=cluster.network.bandwidth_gbs * GB_S_TO_BYTES_MS)


def from_torchrec(cfg: TrialConfig, params: dict) -> ShardingPlan:
    """TorchRec's per-parameter shardings (`ParameterSharding` by table name) as cubic's plan, shard for
    shard: rows, columns and rank of each."""
    wl = cfg.workload
    tables = []
    for i, t in enumerate(wl.tables):
        ps = params.get(t.name) or params.get(f"embedding_bags.{t.name}.weight")
        if ps is None:
            raise ConfigError(f"TorchRec's plan leaves out table {t.name}")
        kind = KINDS.get(ps.sharding_type)
        if kind is None:
            raise ConfigError(f"TorchRec's plan shards table {t.name} as {ps.sharding_type}, which cubic does not run")
        shards = [] if kind == "data_parallel" else [
            Shard(i, int(m.placement.rank()), int(m.shard_offsets[0]), int(m.shard_offsets[0] + m.shard_sizes[0]),
                  int(m.shard_offsets[1]), int(m.shard_offsets[1] + m.shard_sizes[1]))
            for m in ps.sharding_spec.shards]
        if kind == "column_wise" and len(shards) == 1:  # one shard of every column: a whole table, which
            kind = "table_wise"  # TorchRec's column-wise generator would place on the first rank, not this one
        tables.append(TablePlan(i, t.name, kind, ascending_columns(shards) if kind == "column_wise" else shards))
    return ShardingPlan(cfg.group_size, cfg.world_size, tables, [t.dim for t in wl.tables])
