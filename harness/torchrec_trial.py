"""One configuration trained by TorchRec itself: the production check behind `cubic verify`.

Takes the TrialConfig and its TorchRec export (`cubic export --format torchrec`, plain JSON) and trains
TorchRec's own model (DLRM, or DLRM_DCN for DCN workloads) under DistributedModelParallel with the
export's exact placements (a ShardingPlan built by torchrec.distributed.sharding_plan's generators),
FBGEMM's fused row-wise AdaGrad or SGD for the tables and Adagrad for the dense part, on cubic's own
synthetic batches (harness/data.py: the same samples as the harness trial), in real gloo ranks. Warm-up
steps are excluded; samples/s is the median of the measured windows, as in harness trials.

What TorchRec cannot run as cubic measured it on this device is substituted, and every substitution is
named (`substitutions`): row-wise kinds on CPU, cubic's native/torch kernels, comm precision on gloo,
the input pipeline, bf16 tables on CPU, fp8, and in 2D gradient all-reduce sync or the momentum-scaled
merge (DMPCollection averages). Wukong has no TorchRec model: `UnsupportedConfig`.

2D runs TorchRec's own DMPCollection (its sharding/replica DeviceMesh, ShardingEnv2D, sync()). TorchRec
1.8.0 opens DMPCollection.__init__ with `assert device.type in ("cuda", "mtia")`, but nothing after it is
CUDA-specific (DeviceMesh takes the device type, sync() is an all-reduce over the replica group); so 2D
ranks start with PYTHONOPTIMIZE=1, which skips that assert, and average through `custom_all_reduce` (a
gloo SUM, then / replicas: gloo has no ReduceOp.AVG, which sync() would ask for). Its plan remap
also writes CUDA-style shard placements ("cpu:1") that CPU tensors ("cpu") never match; the subclass
below writes them back without the index.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cubic_harness.config import TrialConfig
from cubic_harness.trial import _environ, rank_env


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
    if knob == "kernel" and value != "fbgemm":
        return "TorchRec's model-parallel tables run FBGEMM's fused TBE"
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
    if knob == "comm_precision" and value != "fp32" and cpu:
        return "QComms codecs are not run on gloo here"
    if knob == "allreduce_comm_precision" and value == "bf16" and cpu:
        return "torch's bf16 compress hook (TorchRec's DefaultDataParallelWrapper) needs NCCL"
    if knob == "pipeline_depth" and value and cpu:
        return "TorchRec's sparse-dist train pipelines are not run on CPU here"
    if knob == "emb_precision" and value == "bf16" and cpu:
        return "FBGEMM's CPU TBE holds fp32/fp16 tables only"
    if knob == "dense_precision" and value in ("fp8_auto", "fp8_all"):
        return "TorchRec's models have no fp8 layers"
    return None


# What runs instead, for each knob value `torchrec_unsupported` refuses (the placements are handled per table)
INSTEAD = {"kernel": "TorchRec ran FBGEMM's fused TBE", "comm_precision": "the all-to-all ran in fp32",
           "allreduce_comm_precision": "the dense gradients were all-reduced in fp32",
           "pipeline_depth": "TorchRec's plain training loop ran", "emb_precision": "fp32 tables ran",
           "dense_precision": "bf16 autocast ran",
           "sparse_sync": "DMPCollection averaged the replicas' weights and optimizer state after every step",
           "emb_optimizer": "row-wise AdaGrad ran, its replicas merged by DMPCollection's averaging"}
TWO_D_KNOBS = ("sparse_sync", "emb_optimizer")  # substitutions only where replicas exist


def plan_for_torchrec(cfg: TrialConfig, export: dict[str, Any]) -> tuple[dict[str, dict], list[str]]:
    """The placements TorchRec will run here, and what differs from what cubic measured (one line each): the
    rules are `torchrec_unsupported`'s, what ran instead is `INSTEAD`'s."""
    if export.get("model") is None:
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


def run_torchrec_trial(cfg: TrialConfig, export: dict[str, Any]) -> dict[str, Any]:
    """Train `cfg` in TorchRec on `cfg.world_size` gloo ranks: {status, error, qps, window_qps, substitutions,
    placements (the plan TorchRec applied: sharding type, ranks, shard widths per table)}."""
    placements, subs = plan_for_torchrec(cfg, export)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # the parent owns the rendezvous on an OS-chosen port, as harness/trial.py does (no port to race for)
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=cfg.timeout_s),
                          wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_rank, args=(cfg.to_dict(), export, placements, r, port, q), daemon=True)
             for r in range(cfg.world_size)]
    env = rank_env(cfg)  # the same rank environment as the harness trial (oversubscribed: PASSIVE)
    if export.get("dmp_collection") and cfg.device != "cuda":
        env["PYTHONOPTIMIZE"] = "1"  # DMPCollection's CUDA-only assert (module docstring)
    with _environ(env):
        for p in procs:
            p.start()
    out: dict[str, Any] = {"status": "error", "error": "no rank reported", "qps": 0.0, "window_qps": [],
                           "substitutions": subs}
    try:
        got = [q.get(timeout=cfg.timeout_s) for _ in procs]
        bad = [g for g in got if g.get("error")]
        if bad:
            out["error"] = f"rank {bad[0]['rank']}: {bad[0]['error']}"
        else:
            r0 = next(g for g in got if g["rank"] == 0)
            out.update(status="ok", error="", **{k: r0[k] for k in (
                "qps", "window_qps", "placements", "omp_wait_policy", "model_parallel", "syncs", "sharding_group",
                "ddp_hooks")},
                       checksums={g["rank"]: g["checksum"] for g in got})
    except Exception as e:  # a queue timeout: a hung or dead rank
        out["status"], out["error"] = "timeout", f"TorchRec ranks did not report within {cfg.timeout_s:.0f} s ({e!r})"
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return out


def _cpu_dmp_collection() -> type:
    """DMPCollection whose remapped shard placements name the CPU the way CPU tensors do (module docstring)."""
    from torch.distributed.remote_device import _remote_device
    from torchrec.distributed.model_parallel import DMPCollection

    class CpuDMPCollection(DMPCollection):
        def _remap_sharding_plan(self, plan, *args, **kwargs) -> None:  # noqa: ANN001
            super()._remap_sharding_plan(plan, *args, **kwargs)
            if self._device.type != "cpu":
                return
            for module_plan in plan.plan.values():
                for ps in module_plan.values():
                    for shard in getattr(ps.sharding_spec, "shards", None) or []:
                        shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")

    return CpuDMPCollection


def _rank(cfg_dict: dict, export: dict, placements: dict, rank: int, port: int, q) -> None:
    if not os.environ.get("CUBIC_TORCHREC_DEBUG"):  # TorchRec's and DDP's warnings; errors come back via q
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    try:
        q.put({"rank": rank, **_train(TrialConfig.from_dict(cfg_dict), export, placements, rank, port)})
    except Exception as e:  # reported, never a hang
        q.put({"rank": rank, "error": " ".join(f"{type(e).__name__}: {e}".split())[:300]})


def _train(cfg: TrialConfig, export: dict, placements: dict, rank: int, port: int) -> dict:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models import dlrm
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.types import DataType

    from cubic_harness.data import rank_batches

    W, B, wl = cfg.world_size, cfg.batch_size, cfg.workload
    torch.set_num_threads(cfg.threads_per_rank)
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=cfg.timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    device = torch.device("cpu")
    dtype = "FP32" if cfg.emb_precision == "bf16" else export["tables"][0]["data_type"]
    ebc = EmbeddingBagCollection(device=torch.device("meta"), tables=[
        EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                           feature_names=t["feature_names"][:1], data_type=DataType[dtype]) for t in export["tables"]])
    m = export["model"]
    model = getattr(dlrm, m["class"].rsplit(".", 1)[1])(ebc, **{k: v for k, v in m.items() if k != "class"},
                                                        dense_device=device)
    if cfg.emb_optimizer == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": cfg.emb_lr})
    else:
        apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": cfg.emb_lr})
    gens = {name: {"table_wise": lambda p=p: sp.table_wise(rank=p["rank"]),
                   "column_wise": lambda p=p: sp.column_wise(ranks=p["ranks"], size_per_rank=p["size_per_rank"]),
                   "data_parallel": lambda p=p: sp.data_parallel()}[p["sharding_type"]]()
            for name, p in placements.items()}
    dc = export.get("dmp_collection")
    G = dc["sharding_group_size"] if dc else W  # the export's placements are a sharding group's (ranks 0..G-1)
    module_plan = sp.construct_module_sharding_plan(ebc, gens, local_size=G, world_size=G, device_type="cpu")
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan})
    sharders = [EmbeddingBagCollectionSharder()]
    ar = export.get("ddp", {}).get("allreduce_comm_precision")
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
                            use_inter_host_allreduce=dc["use_inter_host_allreduce"], custom_all_reduce=average,
                            data_parallel_wrapper=ddp)
        replica_pg.append(dmp._default_ctx.replica_pg)
        mine = dmp._default_ctx.device_mesh["shard"].mesh.tolist()  # this rank's sharding group, global ranks
        # grad_allreduce keeps the replicas equal after every step: DMPCollection's nearest is sync() every step
        every = dc["sync_interval_batches"] if cfg.sparse_sync == "weight_avg" else 1
    else:
        dmp = DistributedModelParallel(model, plan=plan, device=device, sharders=sharders, data_parallel_wrapper=ddp)
        mine, every = list(range(W)), 0
    # the plan TorchRec applied, in group positions (DMPCollection remaps them to this group's global ranks)
    applied = {name: {"sharding_type": ps.sharding_type, "ranks": [mine.index(r) for r in ps.ranks or []],
                      "widths": [sh.shard_sizes[1] for sh in ps.sharding_spec.shards] if ps.sharding_spec else []}
               for name, ps in dmp.plan.plan["sparse_arch.embedding_bag_collection"].items()}
    dense_opt = KeyedOptimizerWrapper(dict(dmp.named_parameters()),
                                      lambda ps: torch.optim.Adagrad(ps, lr=cfg.dense_lr))
    keys = [t["feature_names"][0] for t in export["tables"]]  # the harness pools a table's features as one bag
    total = cfg.warmup_steps + cfg.measure_steps
    batches = [(b.dense, KeyedJaggedTensor.from_offsets_sync(keys=keys, values=b.ids, offsets=b.offsets), b.labels)
               for b in rank_batches(wl, cfg.seed, rank, B, W, total)]
    lossf = torch.nn.BCEWithLogitsLoss()
    autocast = cfg.dense_precision != "fp32"
    step_s, syncs = [], 0
    for step in range(total):
        dense, kjt, labels = batches[step % len(batches)]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = dmp(dense, kjt).squeeze(-1)
        loss = lossf(logits.float(), labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        if every and ((step + 1) % every == 0 or step == total - 1):
            dmp.sync()  # replicas merge (2D): weights and optimizer state, inside the timed step
            syncs += 1
        if step >= cfg.warmup_steps:
            step_s.append(time.perf_counter() - t0)
    # a fingerprint of this rank's table shards: after the last sync a position's replicas hold the same numbers
    # (the tensors DMPCollection's sync() merges)
    shards = [t for ts in dmp._default_ctx.weights_by_dtype.values() for t in ts] if dc else []
    checksum = float(sum(t.double().abs().sum() for t in shards))
    n = max(1, len(step_s) // cfg.windows)
    windows = [W * B * n / sum(step_s[i * n:(i + 1) * n]) for i in range(cfg.windows)]
    dist.barrier()
    dist.destroy_process_group()
    return {"qps": statistics.median(windows), "window_qps": windows, "placements": applied,
            "model_parallel": type(dmp).__name__, "syncs": syncs, "sharding_group": mine, "checksum": checksum,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
            # the dense gradients' comm hooks DDP runs (allreduce_comm_precision: torch's fp16/bf16_compress_hook)
            "ddp_hooks": [h.__name__ for h, _ in getattr(dmp._dmp_wrapped_module, "_comm_hooks", [])]}
