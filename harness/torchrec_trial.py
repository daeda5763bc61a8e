"""One configuration trained by TorchRec itself: a trial backend (`--backend torchrec`) and the production
check behind `cubic verify`.

A TorchRec job (`torchrec_job`: the tables, each table's exact placement from cubic's plan, the model, 2D's
DMPCollection settings, DDP's all-reduce precision; `cubic export --format torchrec` writes the same keys)
is trained in real gloo ranks: the user's own model (the workload's `factory`, MODULE:FACTORY), or
TorchRec's DLRM / DLRM_DCN built from the workload, under DistributedModelParallel (DMPCollection for 2D)
with a ShardingPlan built by torchrec.distributed.sharding_plan's generators, FBGEMM's fused row-wise
AdaGrad or SGD for the tables and Adagrad for the dense part, on cubic's own batches (harness/data.py: the
same samples and ids, synthetic, profiled or replayed, as the harness trial). Warm-up steps are excluded;
samples/s is the median of the measured windows, as in harness trials.

Two callers, two policies for what TorchRec cannot run as cubic's harness measures it on this device
(`torchrec_unsupported`): the backend (`run_torchrec`) refuses such a configuration (ConfigError: bad
input, or a failed trial with the reason), since its result must be of the config it was given; verify
(`run_torchrec_trial`) substitutes and names every substitution (`substitutions`): row-wise kinds on CPU,
the input pipeline, bf16 tables on CPU, fp8, and in 2D gradient all-reduce sync or the momentum-scaled merge
(DMPCollection averages). Wukong has no TorchRec model unless the workload names the user's own factory:
`UnsupportedConfig`.

2D runs TorchRec's own DMPCollection (its sharding/replica DeviceMesh, ShardingEnv2D, sync()). TorchRec
(1.8.0 through 1.9.2) opens DMPCollection.__init__ with `assert device.type in ("cuda", "mtia")`, but nothing after
it is CUDA-specific (DeviceMesh takes the device type, sync() is an all-reduce over the replica group); so 2D
ranks start with PYTHONOPTIMIZE=1, which skips that assert, and average through `custom_all_reduce` (a
gloo SUM, then / replicas: gloo has no ReduceOp.AVG, which sync() would ask for). Its plan remap
also writes CUDA-style shard placements ("cpu:1") that CPU tensors ("cpu") never match; the subclass
below writes them back without the index. Its sync() also averages cubic's kernels (harness/torchrec_kernel.py),
whose tensors DMPCollection does not find: the same tensors (weights, row-wise AdaGrad state), averaged the same
way over the same replica group, grouped by dtype as DMPCollection groups FBGEMM's.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cubic_harness import torchrec_compat as compat
from cubic_harness.config import CHOICES, SHARDING_TYPES, TORCHREC_TYPES, TrialConfig, TrialResult
from cubic_harness.errors import ConfigError, debugging
from cubic_harness.trial import (
    TORCHREC_PRELOAD,
    _environ,
    adopt_trial_env,
    check_config,
    env_info,
    rank_context,
    rank_env,
    summarize,
)
from cubic_harness.workload import Workload


class UnsupportedConfig(ValueError):
    """The configuration has no TorchRec form at all (not a substitution)."""


def torchrec_available() -> bool:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        return False
    return True


def torchrec_unsupported(knob: str, value: Any, device: str) -> str | None:
    """Why TorchRec cannot run `knob=value` as cubic's harness measures it on `device`; None where it can.
    The rules a `target: torchrec` search space restricts its knobs by (and `plan_for_torchrec` substitutes)."""
    cpu = device != "cuda"
    if knob == "kernel" and value == "triton":
        return "cubic's Triton kernel is not wired into TorchRec's sharded tables (its CPU kernels are)"
    if knob == "kernel" and value != "fbgemm" and not cpu:
        return "on CUDA TorchRec's sharded tables run FBGEMM's fused TBE (cubic's sharder takes its CPU kernels)"
    if knob == "sharding":
        if value == "data_parallel" or value == "auto":
            return ("TorchRec syncs data-parallel tables by a dense gradient all-reduce, not cubic's sparse sync"
                    + (" (auto may choose it)" if value == "auto" else ""))
        if cpu and value in ("row_wise", "table_row_wise"):
            return "row-wise kinds need CUDA in TorchRec"
    if knob == "sparse_sync" and value == "grad_allreduce":
        return "TorchRec's 2D (DMPCollection) syncs by weight averaging only"
    if knob == "emb_optimizer" and value == "momentum_scaled_rowwise_adagrad":
        return "DMPCollection averages replica weights and state (plain row-wise AdaGrad)"
    if knob == "allreduce_comm_precision" and value == "bf16" and cpu:
        return "torch's bf16 compress hook (TorchRec's DefaultDataParallelWrapper) needs NCCL"
    if knob == "pipeline_depth" and value == 2 and cpu:
        return "PrefetchTrainPipelineSparseDist prefetches on CUDA streams"
    if knob == "emb_precision" and value == "bf16" and cpu:
        return "FBGEMM's CPU TBE holds fp32/fp16 tables only"
    if knob == "dense_precision" and value in ("fp8_auto", "fp8_all"):
        return "TorchRec's models have no fp8 layers"
    if knob == "comm_overlap" and value != "none":
        return ("TorchRec's sharded modules return the all-to-all as an awaitable, waited on where the model "
                "reads the embeddings: no setting runs it beside the bottom MLP")
    return None


def torchrec_kinds(device: str) -> tuple[str, ...]:
    """The sharding kinds TorchRec runs here as cubic measures them: what `sharding: plan` chooses among."""
    return tuple(k for k in SHARDING_TYPES if not torchrec_unsupported("sharding", k, device))


# What runs instead, for each knob value `torchrec_unsupported` refuses (the placements are handled per table)
INSTEAD = {"kernel": "TorchRec ran FBGEMM's fused TBE",
           "allreduce_comm_precision": "the dense gradients were all-reduced in fp32",
           "pipeline_depth": "TrainPipelineSparseDist ran (one batch's input distribution ahead)",
           "emb_precision": "fp32 tables ran",
           "dense_precision": "bf16 autocast ran",
           "comm_overlap": "the all-to-all was waited on where the model reads the embeddings",
           "sparse_sync": "DMPCollection averaged the replicas' weights and optimizer state after every step",
           "emb_optimizer": "row-wise AdaGrad ran, its replicas merged by DMPCollection's averaging"}
TWO_D_KNOBS = ("sparse_sync", "emb_optimizer")  # substitutions only where replicas exist


def plan_for_torchrec(cfg: TrialConfig, export: dict[str, Any]) -> tuple[dict[str, dict], list[str]]:
    """The placements TorchRec will run here, and what differs from what cubic measured (one line each): the
    rules are `torchrec_unsupported`'s, what ran instead is `INSTEAD`'s."""
    if export.get("model") is None and not export.get("factory"):
        raise UnsupportedConfig(f"interaction={cfg.workload.interaction!r} has no TorchRec model class")
    subs: list[str] = []
    placements, moved = {}, []
    for name, p in export["placements"].items():
        if p["sharding_type"] != "data_parallel" and torchrec_unsupported("sharding", p["sharding_type"], cfg.device):
            moved.append(f"{name} ({p['sharding_type']})")  # row-wise kinds on CPU: whole tables instead
            p = {"sharding_type": "table_wise", "rank": p["ranks"][0]}
        placements[name] = dict(p)
    if moved:
        subs.append(f"row-wise kinds need CUDA in TorchRec: {', '.join(moved)} ran table-wise on the first shard's "
                    "rank")
    if any(p["sharding_type"] == "data_parallel" for p in placements.values()):
        subs.append("data-parallel tables: TorchRec all-reduces their dense gradients (cubic: a sparse all-gather of "
                    "ids and pooled gradients)")
    two_d = cfg.group_size < cfg.world_size
    for knob, instead in INSTEAD.items():
        if knob in TWO_D_KNOBS and not two_d:
            continue  # one replica: the same training as plain model parallelism
        why = torchrec_unsupported(knob, getattr(cfg, knob), cfg.device)
        if why:
            subs.append(f"{knob}={getattr(cfg, knob)}: {why}; {instead}")
    return placements, subs


# ------------------------------------------------------------------------------------------------ the job
def placement_of(tp: dict[str, Any], kind: str, group: int, ranks_per_node: int) -> dict[str, Any]:
    """Exact placement of one table for torchrec.distributed.sharding_plan's generators
    (table_wise(rank), row_wise(), column_wise(ranks, size_per_rank), table_row_wise(host_index),
    data_parallel()), so a job can reproduce the measured plan instead of re-planning."""
    shards = sorted(tp.get("shards") or [], key=lambda s: (s["col_start"], s["row_start"], s["rank"]))
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
    """TorchRec's model class and constructor arguments for the workload's family (torchrec.models.dlrm):
    DLRM for `dot`, DLRM_DCN (LowRankCrossNet: the same x_0 * (W (V x) + b) + x layers) for `dcn`.
    Wukong has no TorchRec model: None, and a note (the tables, plan and optimizers still apply)."""
    args = {"dense_in_features": wl.dense_features, "dense_arch_layer_sizes": list(wl.bottom_mlp),
            "over_arch_layer_sizes": list(wl.top_mlp)}
    if wl.interaction == "dot":
        return {"class": "torchrec.models.dlrm.DLRM", **args}
    if wl.interaction == "dcn":
        rank = wl.dcn_rank
        if rank == 0:  # LowRankCrossNet has no full-rank form; rank = width has at least its capacity
            rank = wl.num_features * wl.dim
            notes.append(f"dcn_rank=0 (full-rank cross layers) has no TorchRec form: DLRM_DCN's LowRankCrossNet "
                         f"with dcn_low_rank_dim={rank} (the input width) can express it, with twice the weights")
        return {"class": "torchrec.models.dlrm.DLRM_DCN", **args, "dcn_num_layers": wl.dcn_layers,
                "dcn_low_rank_dim": rank}
    notes.append(f"interaction={wl.interaction!r} (Wukong) has no TorchRec model class: build its dense "
                 "arch from 'dense' (the layers of harness/model.py's WukongStack) around TorchRec's "
                 "EmbeddingBagCollection; the tables, sharding plan, pipeline and optimizers below apply as "
                 "they are")
    return None


def torchrec_job(cfg: TrialConfig, plan: list[dict], notes: list[str]) -> dict[str, Any]:
    """What TorchRec builds for `cfg` with cubic's `plan` (ShardingPlan.to_list()): the keys `_train` reads,
    which the export (cubic/deploy/export.py) writes beside its own."""
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
    return {"tables": tables, "placements": placements,
            "model": None if wl.factory else torchrec_model(wl, notes), "factory": wl.factory or None,
            # DMPCollection(use_inter_host_allreduce=True) keeps a sharding group's ranks contiguous (intra_node)
            "dmp_collection": ({"sharding_group_size": cfg.group_size, "world_size": cfg.world_size,
                                "use_inter_host_allreduce": cfg.group_placement == "intra_node",
                                "group_placement": cfg.group_placement,
                                "sync_interval_batches": cfg.sparse_sync_interval} if two_d else None),
            "ddp": {"allreduce_comm_precision": cfg.allreduce_comm_precision}}


INSTALL_HINT = "`make` installs it (.[cpu,dev,torchrec], then the Makefile's torchrec pin with --no-deps)"


def check_runs_in_torchrec(cfg: TrialConfig, cwd: str | None = None) -> None:
    """ConfigError naming the first knob value TorchRec does not run here as the config says (the rules a
    `target: torchrec` space restricts its knobs by), or a model factory (imported from `cwd`) that does not
    build; the backend runs no substitute."""
    if not torchrec_available():
        raise ConfigError(f"--backend torchrec needs TorchRec: {INSTALL_HINT}")
    compat.check()
    if cfg.device != "cpu":  # its ranks run gloo on CPU tensors (`_train`): a CUDA config would not run as named
        raise ConfigError(f"device={cfg.device}: the TorchRec backend trains on CPU (gloo); on CUDA use cubic's "
                          "harness (--backend real) and `cubic export -f torchrec`")
    if cfg.workload.interaction == "wukong" and not cfg.workload.factory:
        raise ConfigError("interaction='wukong' has no TorchRec model: import your own with `cubic workload "
                          "from-torchrec MODULE:FACTORY`")
    if cfg.workload.factory:  # the user's model builds (on the meta device: no memory) before ranks start for it
        from cubic_harness.torchrec_import import load_factory

        load_factory(cfg.workload.factory, cwd)
    weighted = [t.name for t in cfg.workload.tables if t.weighted]
    if weighted and not cfg.workload.factory:
        raise ConfigError(f"table(s) {', '.join(weighted)}: weighted, and TorchRec's DLRM built from a workload has "
                          "one unweighted collection; import the model that has them with `cubic workload "
                          "from-torchrec MODULE:FACTORY`")
    if cfg.workload.collections > 1 and not cfg.workload.factory:
        raise ConfigError(f"collections={cfg.workload.collections}: TorchRec's DLRM built from a workload has "
                          "one collection; import the model that has them with `cubic workload from-torchrec "
                          "MODULE:FACTORY`")
    seq = [t.name for t in cfg.workload.tables if t.pooling_type == "none"]
    if seq:
        raise ConfigError(f"table(s) {', '.join(seq)}: sequence tables (an EmbeddingCollection) are not trained by "
                          "the TorchRec backend; it shards pooled ones (EmbeddingBagCollection)")
    two_d = cfg.group_size < cfg.world_size
    for knob in ("kernel", "sharding", *INSTEAD):
        if knob in TWO_D_KNOBS and not two_d:
            continue
        why = torchrec_unsupported(knob, getattr(cfg, knob), cfg.device)
        if why:
            choices = [v for v in CHOICES.get(knob, ()) if not torchrec_unsupported(knob, v, cfg.device)]
            raise ConfigError(f"{knob}={getattr(cfg, knob)!r} does not run in TorchRec on {cfg.device}: {why}"
                              + (f"; choose one of {choices}" if choices else ""))


def run_torchrec(cfg: TrialConfig, cwd: str | None = None) -> TrialResult:
    """The TorchRec trial backend: `cfg` trained in TorchRec, as a TrialResult like the harness's (qps over
    windows, step times, peak RSS, losses and NE, held-out NE with eval_samples; no phase breakdown:
    TorchRec's step is one call). The ranks import the workload's MODULE:FACTORY from the folder `cwd`
    (default: this process's). Never raises for a failing trial."""
    env = {**env_info(cfg), "backend": "torchrec", "torchrec": package_version("torchrec")}
    try:
        cfg.validate("config")
        check_runs_in_torchrec(cfg, cwd)
        check_config(cfg)
        from cubic_harness.planning import plan_for

        plan = plan_for(cfg, allowed=torchrec_kinds(cfg.device))
        rowwise = [t.name for t in plan.tables if torchrec_unsupported("sharding", t.kind, cfg.device)]
        if rowwise:
            raise ConfigError(f"sharding={cfg.sharding} planned {', '.join(rowwise)} row-wise: "
                              f"{torchrec_unsupported('sharding', 'row_wise', cfg.device)}")
        job = torchrec_job(cfg, plan.to_list(), [])
    except ConfigError as e:
        from cubic_harness.sharding.planner import PlanError

        status = "oom" if isinstance(e, PlanError) and "mem_cap" in str(e) else "error"
        return TrialResult.failed(status, str(e), cfg, env=env)
    t0, started_at = time.perf_counter(), time.time()
    env.update(placement="local", nodes=1, rank_nodes=[platform.node()] * cfg.world_size,
               rank_start=_start(cfg, job)[0].get_start_method())
    status, error, got = _launch(cfg, job, job["placements"], cwd)
    env["wall_s"] = round(time.perf_counter() - t0, 2)
    if status != "ok":
        return TrialResult.failed(status, error, cfg, env=env)
    r0 = got[0]
    env["startup_s"] = round(r0["first_step_at"] - started_at, 2)
    env.update(model_parallel=r0["model_parallel"], kernel=r0["kernel"])
    res = summarize(cfg, {**r0, "plan_json": plan.to_json()}, env)
    if res.status == "ok":  # what TorchRec applied, per table: the plan as its sharded modules hold it
        res.extra["placements"] = {name: {**p, "shards": r0["placed"][name]} for name, p in r0["placements"].items()}
    return res


def package_version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def run_torchrec_trial(cfg: TrialConfig, export: dict[str, Any]) -> dict[str, Any]:
    """Verify's run: `cfg` from its export, with substitutions, on `cfg.world_size` gloo ranks: {status, error,
    qps, window_qps, substitutions, placements (the plan TorchRec applied: sharding type, ranks, shard widths
    per table)}."""
    placements, subs = plan_for_torchrec(cfg, export)
    out: dict[str, Any] = {"status": "error", "error": "no rank reported", "qps": 0.0, "window_qps": [],
                           "substitutions": subs}
    try:
        compat.check()
    except ConfigError as e:
        out["error"] = str(e)
        return out
    status, error, got = _launch(cfg, export, placements)
    if status != "ok":
        out.update(status=status, error=error)
        return out
    r0 = got[0]
    out.update(status="ok", error="", **{k: r0[k] for k in (
        "qps", "window_qps", "placements", "omp_wait_policy", "model_parallel", "kernel", "syncs", "sharding_group",
        "ddp_hooks")}, checksums={r: g["checksum"] for r, g in got.items()})
    return out


def _start(cfg: TrialConfig, job: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """How the ranks start and the environment variables they add to this process's: the harness's rank
    environment (oversubscribed: PASSIVE), forked from a fork server that preloaded TorchRec where
    `trial.rank_context` allows it. 2D on CPU is always spawned: its ranks run with PYTHONOPTIMIZE=1 (DMPCollection's
    CUDA-only assert, module docstring), which a forked interpreter cannot take."""
    extra = rank_env(cfg)
    if job.get("dmp_collection") and cfg.device != "cuda":
        return mp.get_context("spawn"), {**extra, "PYTHONOPTIMIZE": "1"}
    return rank_context({**os.environ, **extra}, TORCHREC_PRELOAD), extra


def _launch(cfg: TrialConfig, job: dict[str, Any], placements: dict[str, dict],
            cwd: str | None = None) -> tuple[str, str, dict[int, dict]]:
    """Start `cfg.world_size` ranks training `job` (in the folder `cwd`) and wait: (status, one-line error,
    {rank: output})."""
    ctx, extra = _start(cfg, job)
    q = ctx.Queue()
    # the parent owns the rendezvous on an OS-chosen port, as harness/trial.py does (no port to race for)
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=cfg.timeout_s),
                          wait_for_workers=False)
    env = {**os.environ, **extra}
    procs = [ctx.Process(target=_rank, args=(cfg.to_dict(), job, placements, r, store.port, q, cwd or os.getcwd(),
                                             env), daemon=True) for r in range(cfg.world_size)]
    with _environ(extra):  # a spawned rank inherits it; a forked one installs `env` first
        for p in procs:
            p.start()
    try:
        got: dict[int, dict] = {}
        while len(got) < len(procs):
            g = q.get(timeout=cfg.timeout_s)
            if g.get("error"):  # the first rank to fail says why; the others would only hang on it
                return g.get("status", "error"), f"rank {g['rank']}: {g['error']}", got
            got[g["rank"]] = g
        return "ok", "", got
    except Exception as e:  # a queue timeout: a hung or dead rank
        return "timeout", f"TorchRec ranks did not report within {cfg.timeout_s:.0f} s ({type(e).__name__})", {}
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def _cpu_dmp_collection() -> type:
    """DMPCollection whose remapped shard placements name the CPU the way CPU tensors do (module docstring)."""
    from torch.distributed.remote_device import _remote_device
    from torchrec.distributed.model_parallel import DMPCollection

    class CpuDMPCollection(DMPCollection):
        def __init__(self, *args: Any, also_sync: Callable[[bool], list[torch.Tensor]] = lambda _: [],
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.also_sync = also_sync  # tensors sync() averages beside FBGEMM's: cubic's kernels' (their sharder's)
            self.average = kwargs["custom_all_reduce"]  # the merge FBGEMM's tensors get, over the replica group

        def sync(self, include_optimizer_state: bool = True) -> None:
            """DMPCollection's merge of FBGEMM's tables, then the same merge of `also_sync`'s tensors."""
            super().sync(include_optimizer_state)
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in self.also_sync(include_optimizer_state):
                by_dtype.setdefault(t.dtype, []).append(t)
            for tensors in by_dtype.values():  # one coalesced all-reduce per dtype, as DMPCollection groups them
                self.average(tensors)

        def _remap_sharding_plan(self, plan, *args, **kwargs) -> None:  # noqa: ANN001
            super()._remap_sharding_plan(plan, *args, **kwargs)
            if self._device.type != "cpu":
                return
            for module_plan in plan.plan.values():
                for ps in module_plan.values():
                    for shard in getattr(ps.sharding_spec, "shards", None) or []:
                        shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")

    return CpuDMPCollection


def _rank(cfg_dict: dict, job: dict, placements: dict, rank: int, port: int, q, cwd: str,
          env: dict[str, str]) -> None:
    adopt_trial_env(env)
    if not debugging():  # TorchRec's and DDP's warnings; errors come back via q
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    try:
        os.chdir(cwd)  # MODULE:FACTORY is imported from the folder the trial was started in
        q.put({"rank": rank, **_train(TrialConfig.from_dict(cfg_dict), job, placements, rank, port)})
    except Exception as e:  # reported, never a hang
        status = "oom" if isinstance(e, MemoryError) else "error"
        q.put({"rank": rank, "status": status, "error": " ".join(f"{type(e).__name__}: {e}".split())[:300]})


def _model(cfg: TrialConfig, job: dict, device: torch.device) -> tuple[torch.nn.Module, list[str]]:
    """The model to shard, built on the meta device (DistributedModelParallel allocates and initialises it
    where it runs), and the paths of its EmbeddingBagCollections: the user's factory's, or TorchRec's DLRM."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models import dlrm
    from torchrec.types import DataType

    from cubic_harness.torchrec_import import collections, load_factory

    dtype = DataType["FP32" if cfg.emb_precision == "bf16" else job["tables"][0]["data_type"]]
    if job.get("factory"):
        model = load_factory(job["factory"])
        found = collections(model)
        seq = [n for n, m in found if not isinstance(m, EmbeddingBagCollection)]
        if seq:
            raise UnsupportedConfig(f"{job['factory']}: sequence tables ({', '.join(seq)}: EmbeddingCollection) "
                                    "are not trained by the TorchRec backend; pooled ones are")
        for _, ebc in found:  # the emb_precision knob: every table's data type
            for c in ebc.embedding_bag_configs():
                c.data_type = dtype
        return model, [n for n, _ in found]
    ebc = EmbeddingBagCollection(device=torch.device("meta"), tables=[
        EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                           feature_names=t["feature_names"][:1], data_type=dtype) for t in job["tables"]])
    m = job["model"]
    model = getattr(dlrm, m["class"].rsplit(".", 1)[1])(ebc, **{k: v for k, v in m.items() if k != "class"},
                                                        dense_device=device)
    return model, ["sparse_arch.embedding_bag_collection"]


def _pipeline_parts() -> tuple[type, type]:
    """What TorchRec's train pipelines take: a batch they can move (Pipelineable), and the model as a module of
    one batch returning (loss, output) - here (the loss over B, (the batch's BCE sum, the logits))."""
    from dataclasses import dataclass

    from torchrec.streamable import Pipelineable

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
            loss_sum = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels,
                                                                            reduction="sum")
            return loss_sum / self.batch_size, (loss_sum.detach(), logits.detach())

    return PipelineBatch, OneBatch


def _features(model: torch.nn.Module, paths: list[str]) -> tuple[list[list[str]], list[bool]]:
    """Each table's features and whether its collection is weighted, in the workload's table order (the
    collections' order, then each one's)."""
    found = [model.get_submodule(p) for p in paths]
    return ([list(c.feature_names) for ebc in found for c in ebc.embedding_bag_configs()],
            [ebc.is_weighted() for ebc in found for _ in ebc.embedding_bag_configs()])


def _kjt(b: Any, features: list[list[str]]) -> Any:
    """The batch's bags as a KeyedJaggedTensor, its ids' scores (weighted tables) as its weights. The harness
    pools a table's features as one bag; a table looked up by n features gets each sample's bag cut into n
    consecutive pieces, one per feature."""
    from torchrec import KeyedJaggedTensor

    B, scores = b.batch_size, b.scores
    if all(len(f) == 1 for f in features):
        return KeyedJaggedTensor.from_offsets_sync(keys=[f[0] for f in features], values=b.ids, offsets=b.offsets,
                                                   weights=scores)
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


def _train(cfg: TrialConfig, job: dict, placements: dict, rank: int, port: int) -> dict:
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from cubic_harness.data import eval_batches, rank_batches
    from cubic_harness.train import eval_metrics, rss_mb

    W, B, wl = cfg.world_size, cfg.batch_size, cfg.workload
    torch.set_num_threads(cfg.threads_per_rank)
    torch.manual_seed(cfg.seed)  # the dense part's initial weights: the same on every rank, as DDP needs
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=cfg.timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    device = torch.device("cpu")
    model, paths = _model(cfg, job, device)
    features, weighted = (_features(model, paths) if job.get("factory")
                          else ([t["feature_names"][:1] for t in job["tables"]], [False] * len(job["tables"])))
    differ = [t.name for t, w in zip(wl.tables, weighted, strict=True) if t.weighted != w]
    if differ:  # the batches carry scores for the workload's weighted tables; the model weights its own
        raise UnsupportedConfig(f"{job['factory']}: table(s) {', '.join(differ)} weighted in the model and not in the "
                                "workload, or the reverse; import it again with `cubic workload from-torchrec`")
    for p in paths:
        params = model.get_submodule(p).parameters()
        if cfg.emb_optimizer == "sgd":
            apply_optimizer_in_backward(torch.optim.SGD, params, {"lr": cfg.emb_lr})
        else:
            apply_optimizer_in_backward(RowWiseAdagrad, params, {"lr": cfg.emb_lr})
    autocast = cfg.dense_precision != "fp32"
    if cfg.pipeline_depth:  # TorchRec's TrainPipelineSparseDist: the model as a module of one batch
        PipelineBatch, OneBatch = _pipeline_parts()
        model, paths = OneBatch(model, B, autocast), [f"model.{p}" for p in paths]
    gens = {name: {"table_wise": lambda p=p: sp.table_wise(rank=p["rank"]),
                   "column_wise": lambda p=p: sp.column_wise(ranks=p["ranks"], size_per_rank=p["size_per_rank"]),
                   "data_parallel": lambda p=p: sp.data_parallel()}[p["sharding_type"]]()
            for name, p in placements.items()}
    dc = job.get("dmp_collection")
    G = dc["sharding_group_size"] if dc else W  # the job's placements are a sharding group's (ranks 0..G-1)
    plan = ShardingPlan({})
    for p in paths:
        ebc = model.get_submodule(p)
        mine_gens = {c.name: gens[c.name] for c in ebc.embedding_bag_configs()}
        plan.plan[p] = sp.construct_module_sharding_plan(ebc, mine_gens, local_size=G, world_size=G,
                                                         device_type="cpu")
    # the tables' kernel: cubic's own through its sharder where TorchRec runs it (CPU), else FBGEMM's
    kernel = "fbgemm" if torchrec_unsupported("kernel", cfg.kernel, cfg.device) else cfg.kernel
    # the pooled all-to-all's precision, forward and backward: TorchRec's QComms codecs (they run on gloo too)
    comm = CommType[TORCHREC_TYPES[cfg.comm_precision]]
    qcomms = None if cfg.comm_precision == "fp32" else get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=comm, backward_precision=comm), device=device)
    if kernel == "fbgemm":
        sharders = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomms)]
    else:
        from cubic_harness.torchrec_kernel import cubic_sharder

        sharders = [cubic_sharder(kernel, qcomms)]
    ar = job.get("ddp", {}).get("allreduce_comm_precision")
    ddp = DefaultDataParallelWrapper(allreduce_comm_precision=None if torchrec_unsupported(
        "allreduce_comm_precision", ar, cfg.device) or ar == "fp32" else ar)
    if dc:
        replica_pg: list[dist.ProcessGroup] = []  # set once DMPCollection has built its DeviceMesh

        def average(tensors: list[torch.Tensor]) -> None:  # sync()'s ReduceOp.AVG, which gloo lacks
            R = dist.get_world_size(replica_pg[0])
            replica_pg[0].allreduce_coalesced(tensors).wait()  # SUM
            for t in tensors:
                t.div_(R)

        dmp = _cpu_dmp_collection()(module=model, device=device, plan=plan, world_size=W, sharding_group_size=G,
                                    global_pg=dist.group.WORLD, sharders=sharders,
                                    use_inter_host_allreduce=dc["use_inter_host_allreduce"],
                                    custom_all_reduce=average, data_parallel_wrapper=ddp,
                                    also_sync=sharders[0].replica_state if kernel != "fbgemm" else lambda _: [])
        ctx = compat.dmp_context(dmp)
        replica_pg.append(ctx.replica_pg)
        mine = ctx.device_mesh["shard"].mesh.tolist()  # this rank's sharding group, global ranks
        # grad_allreduce keeps the replicas equal after every step: DMPCollection's nearest is sync() every step
        every = dc["sync_interval_batches"] if cfg.sparse_sync == "weight_avg" else 1
    else:
        dmp = DistributedModelParallel(model, plan=plan, device=device, sharders=sharders, data_parallel_wrapper=ddp)
        mine, every = list(range(W)), 0
    # the plan TorchRec applied, in group positions (DMPCollection remaps them to this group's global ranks)
    applied = {name: {"sharding_type": ps.sharding_type, "ranks": [mine.index(r) for r in ps.ranks or []],
                      "widths": [sh.shard_sizes[1] for sh in ps.sharding_spec.shards] if ps.sharding_spec else []}
               for p in paths for name, ps in dmp.plan.plan[p].items()}
    # each shard as (group position, first row, first column, rows, columns): the plan held, shard for shard
    placed = {name: sorted([mine.index(sh.placement.rank()), *sh.shard_offsets, *sh.shard_sizes]
                           for sh in (ps.sharding_spec.shards if ps.sharding_spec else []))
              for p in paths for name, ps in dmp.plan.plan[p].items()}
    dense_opt = KeyedOptimizerWrapper(dict(dmp.named_parameters()),
                                      lambda ps: torch.optim.Adagrad(ps, lr=cfg.dense_lr))
    total = cfg.warmup_steps + cfg.measure_steps
    batches = [(b.dense, _kjt(b, features), b.labels) for b in rank_batches(wl, cfg.seed, rank, B, W, total)]
    lossf = torch.nn.BCEWithLogitsLoss(reduction="sum")
    step_s, losses, syncs = [], [], 0
    bce_sum = torch.zeros(3, dtype=torch.float64)  # sum BCE, sum labels, count over measured steps
    pipe = None
    if cfg.pipeline_depth:  # the next batch's input distribution runs before this one's forward; 2D syncs inside
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipe = TrainPipelineSparseDist(dmp, dense_opt, device, dmp_collection_sync_interval_batches=every or None)
        feed = iter([PipelineBatch(*batches[s % len(batches)]) for s in range(total)])
    first_step_at = time.time()
    for step in range(total):
        dense, kjt, labels = batches[step % len(batches)]
        t0 = time.perf_counter()
        if pipe is not None:
            loss_sum, _ = pipe.progress(feed)
            syncs += bool(every and (step + 1) % every == 0)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = dmp(dense, kjt).reshape(-1)
            loss_sum = lossf(logits.float(), labels)
            dense_opt.zero_grad()
            (loss_sum / B).backward()
            dense_opt.step()
            if every and ((step + 1) % every == 0 or step == total - 1):
                dmp.sync()  # replicas merge (2D): weights and optimizer state, inside the timed step
                syncs += 1
        losses.append(loss_sum.item() / B)
        if step >= cfg.warmup_steps:
            step_s.append(time.perf_counter() - t0)
            bce_sum += torch.tensor([loss_sum.item(), labels.sum().item(), B], dtype=torch.float64)
        if cfg.mem_cap_mb and rss_mb() > cfg.mem_cap_mb:
            raise MemoryError(f"rank {rank} peak RSS {rss_mb():.0f} MB exceeds mem_cap_mb={cfg.mem_cap_mb:.0f}")
    evaluation = None
    if cfg.eval_samples:  # held-out NE and AUC, as the harness's evaluate: every rank scores its share
        if pipe is not None:
            pipe.detach()  # the sharded modules' own forwards back: evaluation calls the model directly
        scored = []
        with torch.no_grad():
            for b in eval_batches(wl, cfg.seed, rank, B, W, cfg.eval_samples):
                if pipe is not None:
                    out = dmp(PipelineBatch(b.dense, _kjt(b, features), b.labels))[1][1].float()
                else:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        out = dmp(b.dense, _kjt(b, features)).float().reshape(-1)
                scored.append(torch.stack([out, b.labels.reshape(-1)]))
        mine_scores = torch.cat(scored, dim=1).to(torch.float64)
        parts = [torch.empty_like(mine_scores) for _ in range(W)]
        dist.all_gather(parts, mine_scores)
        both = torch.cat(parts, dim=1)
        evaluation = eval_metrics(both[0].numpy(), both[1].numpy())
    # a fingerprint of this rank's table shards: after the last sync a position's replicas hold the same numbers
    # (the tensors DMPCollection's sync() merges)
    shards = [*(t for ts in compat.dmp_context(dmp).weights_by_dtype.values() for t in ts),
              *dmp.also_sync(False)] if dc else []
    checksum = float(sum(t.double().abs().sum() for t in shards))
    loss_t, peak = torch.tensor(losses, dtype=torch.float64), torch.tensor([rss_mb()], dtype=torch.float64)
    dist.all_reduce(loss_t)
    dist.all_reduce(bce_sum)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    bce, pos, n = bce_sum.tolist()
    p = min(max(pos / n, 1e-12), 1 - 1e-12)
    n_w = max(1, len(step_s) // cfg.windows)
    windows = [W * B * n_w / sum(step_s[i * n_w:(i + 1) * n_w]) for i in range(cfg.windows)]
    dist.barrier()
    dist.destroy_process_group()
    return {"qps": statistics.median(windows), "window_qps": windows, "placements": applied, "placed": placed,
            "model_parallel": type(dmp).__name__, "kernel": kernel, "syncs": syncs, "sharding_group": mine,
            "checksum": checksum,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            # the dense gradients' comm hooks DDP runs (allreduce_comm_precision: torch's fp16/bf16_compress_hook)
            "ddp_hooks": compat.ddp_hook_names(dmp),
            # what summarize() reads, as a harness rank reports it
            "step_s": step_s, "losses": (loss_t / W).tolist(), "peak_mem_mb": float(peak.item()),
            "ne": (bce / n) / -(p * math.log(p) + (1 - p) * math.log(1 - p)), "breakdown_ms": {},
            "first_step_at": first_step_at, "eval": evaluation}
