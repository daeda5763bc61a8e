"""One rank of a TorchRec trial: the job (`torchrec_job`) built in TorchRec and trained.

Build (`_build`): the user's model (the workload's `factory`, MODULE:FACTORY) or TorchRec's DLRM /
DLRM_DCN from the job, FBGEMM's fused row-wise AdaGrad or SGD for the tables, the job's exact
placements as a ShardingPlan from torchrec.distributed.sharding_plan's generators, cubic's kernel or
FBGEMM's as the tables' sharder, DistributedModelParallel (`CpuDMPCollection` for 2D), Adagrad for
the dense part, and TorchRec's TrainPipelineSparseDist where the config pipelines.

Measure (`_steps`, `_evaluate`, `_report`): warm-up steps excluded, samples/s over the measured
windows, the losses and NE, held-out NE and AUC, and what TorchRec applied, reported as a harness
rank reports them (`trial.summarize` reads them). Only a TorchRec trial's ranks import this module
(it imports TorchRec).
"""

from __future__ import annotations

import datetime
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.remote_device import _remote_device
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DMPCollection
from torchrec.streamable import Pipelineable

from cubic_harness import torchrec_compat as compat
from cubic_harness.config import TORCHREC_TYPES, TrialConfig, load_time_env
from cubic_harness.torchrec_rules import UnsupportedConfig, torchrec_unsupported


@dataclass(frozen=True)
class _Built:
    """A rank's sharded model and what its steps read."""

    dmp: Any  # DistributedModelParallel, or CpuDMPCollection (2D)
    dense_opt: Any  # the dense part's Adagrad (the tables' optimizer runs in backward)
    pipe: Any  # TrainPipelineSparseDist, or None without pipelining
    paths: list[str]  # the sharded EmbeddingBagCollections' module paths
    features: list[list[str]]  # each table's features, in the workload's table order
    kernel: str  # the tables' kernel: cubic's backend or "fbgemm"
    mine: list[int]  # this rank's sharding group, global ranks
    every: int  # 2D: sync() every this many steps; 0 without replicas
    autocast: bool  # bf16 autocast around the dense part


@dataclass(frozen=True)
class _Steps:
    """What the timed steps measured on this rank."""

    step_s: list[float]  # measured steps' seconds (warm-up excluded)
    losses: list[float]  # every step's mean loss
    bce_sum: torch.Tensor  # sum BCE, sum labels, count over the measured steps
    syncs: int  # replica merges (2D)
    first_step_at: float  # wall clock at the first step: the trial's start-up ends there


def train_rank(cfg: TrialConfig, job: dict, placements: dict, rank: int, port: int) -> dict:
    """Rank `rank` of `cfg.world_size` (rendezvous at `port`) trains `job` with `placements`;
    returns its report."""
    torch.set_num_threads(cfg.threads_per_rank)
    torch.manual_seed(cfg.seed)  # the dense part's initial weights: the same on every rank (DDP)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.world_size,
                            timeout=timeout)
    run = _build(cfg, job, placements, torch.device("cpu"))
    steps = _steps(cfg, run, rank)
    evaluation = _evaluate(cfg, run, rank) if cfg.eval_samples else None
    return _report(cfg, run, steps, evaluation)


# ------------------------------------------------------------------------------------------ build
def _build(cfg: TrialConfig, job: dict, placements: dict, device: torch.device) -> _Built:
    """The model built, its tables' optimizer set, sharded by the job's placements, and its dense
    optimizer and train pipeline."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    model, paths = _model(cfg, job, device)
    features = _features_of(cfg, job, model, paths)
    _optimize_in_backward(cfg, model, paths)
    autocast = cfg.dense_precision != "fp32"
    if cfg.pipeline_depth:  # TorchRec's TrainPipelineSparseDist: the model as a module of one batch
        model, paths = OneBatch(model, cfg.batch_size, autocast), [f"model.{p}" for p in paths]
    dc = job.get("dmp_collection")
    group = dc["sharding_group_size"] if dc else cfg.world_size  # the placements: ranks 0..group-1
    plan = _sharding_plan(model, paths, placements, group)
    kernel, sharders = _sharders(cfg, device)
    dmp, mine, every = _distribute(cfg, job, model, plan, sharders, kernel, device)
    dense_opt = KeyedOptimizerWrapper(dict(dmp.named_parameters()),
                                      lambda ps: torch.optim.Adagrad(ps, lr=cfg.dense_lr))
    pipe = None
    # the next batch's input distribution runs before this one's forward; 2D syncs inside
    if cfg.pipeline_depth:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipe = TrainPipelineSparseDist(dmp, dense_opt, device,
                                       dmp_collection_sync_interval_batches=every or None)
    return _Built(dmp=dmp, dense_opt=dense_opt, pipe=pipe, paths=paths, features=features,
                  kernel=kernel, mine=mine, every=every, autocast=autocast)


def _model(cfg: TrialConfig, job: dict, device: torch.device) -> tuple[torch.nn.Module, list[str]]:
    """The model to shard, built on the meta device (DistributedModelParallel allocates and
    initialises it where it runs), and the paths of its EmbeddingBagCollections: the user's
    factory's, or TorchRec's DLRM."""
    from torchrec.models import dlrm
    from torchrec.types import DataType

    from cubic_harness.torchrec_import import collections, load_factory

    dtype = DataType["FP32" if cfg.emb_precision == "bf16" else job["tables"][0]["data_type"]]
    if job.get("factory"):
        model = load_factory(job["factory"])
        found = collections(model)
        seq = [n for n, m in found if not isinstance(m, EmbeddingBagCollection)]
        if seq:
            raise UnsupportedConfig(f"{job['factory']}: sequence tables ({', '.join(seq)}: "
                                    "EmbeddingCollection) are not trained by the TorchRec backend; "
                                    "pooled ones are")
        for _, ebc in found:  # the emb_precision knob: every table's data type
            for c in ebc.embedding_bag_configs():
                c.data_type = dtype
        return model, [n for n, _ in found]
    ebc = EmbeddingBagCollection(device=torch.device("meta"), tables=[
        EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"],
                           embedding_dim=t["embedding_dim"], feature_names=t["feature_names"][:1],
                           data_type=dtype)
        for t in job["tables"]])
    m = job["model"]
    model_class = getattr(dlrm, m["class"].rsplit(".", 1)[1])
    model = model_class(ebc, **{k: v for k, v in m.items() if k != "class"}, dense_device=device)
    return model, ["sparse_arch.embedding_bag_collection"]


def _features_of(cfg: TrialConfig, job: dict, model: torch.nn.Module,
                 paths: list[str]) -> list[list[str]]:
    """Each table's features (TorchRec's DLRM: one a table, unweighted); UnsupportedConfig where the
    model weights a table the workload does not, or the reverse (the batches carry scores for the
    workload's weighted tables; the model weights its own)."""
    tables = job["tables"]
    features, weighted = (_features(model, paths) if job.get("factory")
                          else ([t["feature_names"][:1] for t in tables], [False] * len(tables)))
    differ = [t.name for t, w in zip(cfg.workload.tables, weighted, strict=True) if t.weighted != w]
    if differ:
        raise UnsupportedConfig(f"{job['factory']}: table(s) {', '.join(differ)} weighted in the "
                                "model and not in the workload, or the reverse; import it again "
                                "with `cubic workload from-torchrec`")
    return features


def _features(model: torch.nn.Module, paths: list[str]) -> tuple[list[list[str]], list[bool]]:
    """Each table's features and whether its collection is weighted, in the workload's table order
    (the collections' order, then each one's)."""
    found = [model.get_submodule(p) for p in paths]
    return ([list(c.feature_names) for ebc in found for c in ebc.embedding_bag_configs()],
            [ebc.is_weighted() for ebc in found for _ in ebc.embedding_bag_configs()])


def _optimize_in_backward(cfg: TrialConfig, model: torch.nn.Module, paths: list[str]) -> None:
    """The tables' optimizer, which TorchRec fuses into their backward (FBGEMM's, or cubic's
    kernel's)."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    for p in paths:
        params = model.get_submodule(p).parameters()
        if cfg.emb_optimizer == "sgd":
            apply_optimizer_in_backward(torch.optim.SGD, params, {"lr": cfg.emb_lr})
        else:
            apply_optimizer_in_backward(RowWiseAdagrad, params, {"lr": cfg.emb_lr})


def _sharding_plan(model: torch.nn.Module, paths: list[str], placements: dict, group: int) -> Any:
    """The job's placements as TorchRec's ShardingPlan, one module plan per EmbeddingBagCollection,
    in positions of a sharding group of `group` ranks."""
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    gens = {name: {"table_wise": lambda p=p: sp.table_wise(rank=p["rank"]),
                   "column_wise": lambda p=p: sp.column_wise(ranks=p["ranks"],
                                                             size_per_rank=p["size_per_rank"]),
                   "data_parallel": lambda p=p: sp.data_parallel()}[p["sharding_type"]]()
            for name, p in placements.items()}
    plan = ShardingPlan({})
    for p in paths:
        ebc = model.get_submodule(p)
        mine_gens = {c.name: gens[c.name] for c in ebc.embedding_bag_configs()}
        plan.plan[p] = sp.construct_module_sharding_plan(ebc, mine_gens, local_size=group,
                                                         world_size=group, device_type="cpu")
    return plan


def _sharders(cfg: TrialConfig, device: torch.device) -> tuple[str, list[Any]]:
    """The tables' kernel (cubic's own through its sharder where TorchRec runs it, CPU; else
    FBGEMM's) and the sharders, their pooled all-to-all in `comm_precision` both ways (TorchRec's
    QComms codecs, which run on gloo too)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )

    kernel = "fbgemm" if torchrec_unsupported("kernel", cfg.kernel, cfg.device) else cfg.kernel
    comm = CommType[TORCHREC_TYPES[cfg.comm_precision]]
    qcomms = None if cfg.comm_precision == "fp32" else get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=comm, backward_precision=comm), device=device)
    if kernel == "fbgemm":
        return kernel, [EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomms)]
    from cubic_harness.torchrec_kernel import cubic_sharder

    return kernel, [cubic_sharder(kernel, qcomms)]


def _distribute(cfg: TrialConfig, job: dict, model: torch.nn.Module, plan: Any, sharders: list[Any],
                kernel: str, device: torch.device) -> tuple[Any, list[int], int]:
    """The model sharded by `plan`: DistributedModelParallel, or for 2D DMPCollection (its replicas
    averaged by a gloo SUM / replicas); with this rank's sharding group (global ranks) and the
    sync interval."""
    from torchrec.distributed.model_parallel import (
        DefaultDataParallelWrapper,
        DistributedModelParallel,
    )

    ar = job.get("ddp", {}).get("allreduce_comm_precision")
    ddp = DefaultDataParallelWrapper(allreduce_comm_precision=None if torchrec_unsupported(
        "allreduce_comm_precision", ar, cfg.device) or ar == "fp32" else ar)
    dc = job.get("dmp_collection")
    W = cfg.world_size
    if not dc:
        dmp = DistributedModelParallel(model, plan=plan, device=device, sharders=sharders,
                                       data_parallel_wrapper=ddp)
        return dmp, list(range(W)), 0
    replica_pg: list[dist.ProcessGroup] = []  # set once DMPCollection has built its DeviceMesh

    def average(tensors: list[torch.Tensor]) -> None:  # sync()'s ReduceOp.AVG, which gloo lacks
        R = dist.get_world_size(replica_pg[0])
        replica_pg[0].allreduce_coalesced(tensors).wait()  # SUM
        for t in tensors:
            t.div_(R)

    also_sync = sharders[0].replica_state if kernel != "fbgemm" else lambda _: []
    dmp = CpuDMPCollection(module=model, device=device, plan=plan, world_size=W,
                           sharding_group_size=dc["sharding_group_size"],
                           global_pg=dist.group.WORLD, sharders=sharders,
                           use_inter_host_allreduce=dc["use_inter_host_allreduce"],
                           custom_all_reduce=average, data_parallel_wrapper=ddp,
                           also_sync=also_sync)
    ctx = compat.dmp_context(dmp)
    replica_pg.append(ctx.replica_pg)
    mine = ctx.device_mesh["shard"].mesh.tolist()  # this rank's sharding group, global ranks
    # grad_allreduce keeps the replicas equal after every step: DMPCollection's nearest is sync()
    # every step
    every = dc["sync_interval_batches"] if cfg.sparse_sync == "weight_avg" else 1
    return dmp, mine, every


class CpuDMPCollection(DMPCollection):
    """DMPCollection whose remapped shard placements name the CPU the way CPU tensors do, and whose
    sync() also averages cubic's kernels' tensors (harness/torchrec_trial.py's module docstring
    says why)."""

    def __init__(self, *args: Any, also_sync: Callable[[bool], list[torch.Tensor]] = lambda _: [],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # tensors sync() averages beside FBGEMM's: cubic's kernels' (their sharder's)
        self.also_sync = also_sync
        self.average = kwargs["custom_all_reduce"]  # FBGEMM's tensors' merge, over the replicas

    def sync(self, include_optimizer_state: bool = True) -> None:
        """DMPCollection's merge of FBGEMM's tables, then the same merge of `also_sync`'s."""
        super().sync(include_optimizer_state)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in self.also_sync(include_optimizer_state):
            by_dtype.setdefault(t.dtype, []).append(t)
        for tensors in by_dtype.values():  # one coalesced all-reduce per dtype, as DMPCollection's
            self.average(tensors)

    def _remap_sharding_plan(self, plan, *args, **kwargs) -> None:  # noqa: ANN001
        super()._remap_sharding_plan(plan, *args, **kwargs)
        if self._device.type != "cpu":
            return
        for module_plan in plan.plan.values():
            for ps in module_plan.values():
                for shard in getattr(ps.sharding_spec, "shards", None) or []:
                    shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")


# What TorchRec's train pipelines take: a batch they can move (Pipelineable), and the model as a
# module of one batch returning (loss, output), here (the loss over B, (the batch's BCE sum, the
# logits)).
@dataclass
class PipelineBatch(Pipelineable):
    dense: torch.Tensor
    sparse: Any
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> Any:
        return PipelineBatch(self.dense.to(device, non_blocking=non_blocking),
                             self.sparse.to(device, non_blocking=non_blocking),
                             self.labels.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: Any) -> None:
        pass


class OneBatch(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, batch_size: int, autocast: bool) -> None:
        super().__init__()
        self.model, self.batch_size, self.autocast = model, batch_size, autocast

    def forward(self, batch: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(batch.dense, batch.sparse).reshape(-1)
        loss_sum = torch.nn.functional.binary_cross_entropy_with_logits(
            logits.float(), batch.labels, reduction="sum")
        return loss_sum / self.batch_size, (loss_sum.detach(), logits.detach())


def _kjt(b: Any, features: list[list[str]]) -> KeyedJaggedTensor:
    """The batch's bags as a KeyedJaggedTensor, its ids' scores (weighted tables) as its weights.
    The harness pools a table's features as one bag; a table looked up by n features gets each
    sample's bag cut into n consecutive pieces, one per feature."""
    B, scores = b.batch_size, b.scores
    if all(len(f) == 1 for f in features):
        return KeyedJaggedTensor.from_offsets_sync(keys=[f[0] for f in features], values=b.ids,
                                                   offsets=b.offsets, weights=scores)
    keys, lengths, starts = [], [], []
    for t, fs in enumerate(features):
        off = b.offsets[t * B:(t + 1) * B + 1]
        L, n = off[1:] - off[:-1], len(fs)
        for k in range(n):
            lo = L * k // n
            keys.append(fs[k])
            lengths.append(L * (k + 1) // n - lo)
            starts.append(off[:-1] + lo)
    lengths_t, starts_t = torch.cat(lengths), torch.cat(starts)
    total = int(lengths_t.sum())
    ends = torch.cumsum(lengths_t, 0)
    idx = torch.arange(total) - torch.repeat_interleave(ends - lengths_t - starts_t, lengths_t)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=b.ids[idx], lengths=lengths_t,
                                               weights=None if scores is None else scores[idx])


# ---------------------------------------------------------------------------------------- measure
def _steps(cfg: TrialConfig, run: _Built, rank: int) -> _Steps:
    """Warm-up and measured steps on this rank's batches; a 2D sync() (replicas merge: weights and
    optimizer state) runs inside the timed step it follows."""
    from cubic_harness.data import rank_batches
    from cubic_harness.train import rss_mb

    W, B, every = cfg.world_size, cfg.batch_size, run.every
    total = cfg.warmup_steps + cfg.measure_steps
    batches = [(b.dense, _kjt(b, run.features), b.labels)
               for b in rank_batches(cfg.workload, cfg.seed, rank, B, W, total)]
    lossf = torch.nn.BCEWithLogitsLoss(reduction="sum")
    step_s, losses, syncs = [], [], 0
    bce_sum = torch.zeros(3, dtype=torch.float64)  # sum BCE, sum labels, count over measured steps
    if run.pipe is not None:
        feed = iter([PipelineBatch(*batches[s % len(batches)]) for s in range(total)])
    first_step_at = time.time()
    for step in range(total):
        dense, kjt, labels = batches[step % len(batches)]
        t0 = time.perf_counter()
        if run.pipe is not None:
            loss_sum, _ = run.pipe.progress(feed)
            syncs += bool(every and (step + 1) % every == 0)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run.autocast):
                logits = run.dmp(dense, kjt).reshape(-1)
            loss_sum = lossf(logits.float(), labels)
            run.dense_opt.zero_grad()
            (loss_sum / B).backward()
            run.dense_opt.step()
            if every and ((step + 1) % every == 0 or step == total - 1):
                run.dmp.sync()
                syncs += 1
        losses.append(loss_sum.item() / B)
        if step >= cfg.warmup_steps:
            step_s.append(time.perf_counter() - t0)
            bce_sum += torch.tensor([loss_sum.item(), labels.sum().item(), B], dtype=torch.float64)
        if cfg.mem_cap_mb and rss_mb() > cfg.mem_cap_mb:
            raise MemoryError(f"rank {rank} peak RSS {rss_mb():.0f} MB exceeds "
                              f"mem_cap_mb={cfg.mem_cap_mb:.0f}")
    return _Steps(step_s=step_s, losses=losses, bce_sum=bce_sum, syncs=syncs,
                  first_step_at=first_step_at)


def _evaluate(cfg: TrialConfig, run: _Built, rank: int) -> dict:
    """Held-out NE and AUC, as the harness's evaluate: every rank scores its share, all gathered."""
    from cubic_harness.data import eval_batches
    from cubic_harness.train import eval_metrics

    if run.pipe is not None:
        run.pipe.detach()  # the sharded modules' own forwards back: evaluation calls the model
    scored = []
    with torch.no_grad():
        for b in eval_batches(cfg.workload, cfg.seed, rank, cfg.batch_size, cfg.world_size,
                              cfg.eval_samples):
            if run.pipe is not None:
                out = run.dmp(PipelineBatch(b.dense, _kjt(b, run.features), b.labels))[1][1].float()
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run.autocast):
                    out = run.dmp(b.dense, _kjt(b, run.features)).float().reshape(-1)
            scored.append(torch.stack([out, b.labels.reshape(-1)]))
    mine_scores = torch.cat(scored, dim=1).to(torch.float64)
    parts = [torch.empty_like(mine_scores) for _ in range(cfg.world_size)]
    dist.all_gather(parts, mine_scores)
    both = torch.cat(parts, dim=1)
    return eval_metrics(both[0].numpy(), both[1].numpy())


def _applied(run: _Built) -> tuple[dict[str, dict], dict[str, list]]:
    """The plan TorchRec applied, in group positions (DMPCollection remaps them to this group's
    global ranks), and each shard as (group position, first row, first column, rows, columns):
    the plan held, shard for shard."""
    mine, plans = run.mine, [run.dmp.plan.plan[p] for p in run.paths]
    applied = {name: {"sharding_type": ps.sharding_type,
                      "ranks": [mine.index(r) for r in ps.ranks or []],
                      "widths": ([sh.shard_sizes[1] for sh in ps.sharding_spec.shards]
                                 if ps.sharding_spec else [])}
               for module_plan in plans for name, ps in module_plan.items()}
    placed = {name: sorted([mine.index(sh.placement.rank()), *sh.shard_offsets, *sh.shard_sizes]
                           for sh in (ps.sharding_spec.shards if ps.sharding_spec else []))
              for module_plan in plans for name, ps in module_plan.items()}
    return applied, placed


def _report(cfg: TrialConfig, run: _Built, steps: _Steps, evaluation: dict | None) -> dict:
    """This rank's report (what `trial.summarize` reads, as a harness rank reports it, and what
    TorchRec applied), the losses, NE and peak memory reduced over the ranks; closes the process
    group."""
    from cubic_harness.train import rss_mb

    W, B = cfg.world_size, cfg.batch_size
    applied, placed = _applied(run)
    # a fingerprint of this rank's table shards: after the last sync a position's replicas hold the
    # same numbers (the tensors DMPCollection's sync() merges)
    shards = [*(t for ts in compat.dmp_context(run.dmp).weights_by_dtype.values() for t in ts),
              *run.dmp.also_sync(False)] if isinstance(run.dmp, CpuDMPCollection) else []
    checksum = float(sum(t.double().abs().sum() for t in shards))
    loss_t = torch.tensor(steps.losses, dtype=torch.float64)
    peak = torch.tensor([rss_mb()], dtype=torch.float64)
    bce_sum = steps.bce_sum
    dist.all_reduce(loss_t)
    dist.all_reduce(bce_sum)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    bce, pos, n = bce_sum.tolist()
    p = min(max(pos / n, 1e-12), 1 - 1e-12)
    n_w = max(1, len(steps.step_s) // cfg.windows)
    windows = [W * B * n_w / sum(steps.step_s[i * n_w:(i + 1) * n_w]) for i in range(cfg.windows)]
    dist.barrier()
    dist.destroy_process_group()
    return {"qps": statistics.median(windows), "window_qps": windows, "placements": applied,
            "placed": placed,
            "model_parallel": type(run.dmp).__name__, "kernel": run.kernel, "syncs": steps.syncs,
            "sharding_group": run.mine, "checksum": checksum,
            "omp_wait_policy": load_time_env("OMP_WAIT_POLICY"),  # as libgomp read it
            # the dense gradients' comm hooks DDP runs (allreduce_comm_precision: torch's
            # fp16/bf16_compress_hook)
            "ddp_hooks": compat.ddp_hook_names(run.dmp),
            # what summarize() reads, as a harness rank reports it
            "step_s": steps.step_s, "losses": (loss_t / W).tolist(),
            "peak_mem_mb": float(peak.item()),
            "ne": (bce / n) / -(p * math.log(p) + (1 - p) * math.log(1 - p)), "breakdown_ms": {},
            "first_step_at": steps.first_step_at, "eval": evaluation}
