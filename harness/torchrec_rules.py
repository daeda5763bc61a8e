"""What TorchRec runs as cubic's harness measures it, and what a TorchRec trial runs instead.

Two callers, two policies for what TorchRec cannot run as cubic's harness measures it on this device
(`torchrec_unsupported`): the backend (`check_runs_in_torchrec`, before `run_torchrec`) refuses such
a configuration (ConfigError: bad input), since its result must be of the config it was given;
verify (`plan_for_torchrec`, before `run_torchrec_trial`) substitutes and names every substitution:
row-wise kinds on CPU, the input pipeline, bf16 tables on CPU, fp8, and in 2D gradient all-reduce
sync or the momentum-scaled merge (DMPCollection averages). Wukong has no TorchRec model unless the
workload names the user's own factory: `UnsupportedConfig`.

Torch-free (TorchRec is imported only to check it is installed), so a search space, the CLI and an
export read the rules without paying for torch.
"""

from __future__ import annotations

from typing import Any

from cubic_harness import torchrec_compat as compat
from cubic_harness.config import CHOICES, SHARDING_TYPES, TrialConfig, inert_knobs
from cubic_harness.errors import ConfigError


class UnsupportedConfig(ValueError):
    """The configuration has no TorchRec form at all (not a substitution)."""


INSTALL_HINT = ("`make` installs it (.[cpu,dev,torchrec], then the Makefile's torchrec pin with "
                "--no-deps)")


def torchrec_available() -> bool:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        return False
    return True


def torchrec_unsupported(knob: str, value: Any, device: str) -> str | None:
    """Why TorchRec cannot run `knob=value` as cubic's harness measures it on `device`; None where
    it can. The rules a `target: torchrec` search space restricts its knobs by (and
    `plan_for_torchrec` substitutes)."""
    cpu = device != "cuda"
    if knob == "kernel" and value == "triton":
        return ("cubic's Triton kernel is not wired into TorchRec's sharded tables (its CPU "
                "kernels are)")
    if knob == "kernel" and value != "fbgemm" and not cpu:
        return ("on CUDA TorchRec's sharded tables run FBGEMM's fused TBE (cubic's sharder takes "
                "its CPU kernels)")
    if knob == "sharding":
        if value == "data_parallel" or value == "auto":
            return ("TorchRec syncs data-parallel tables by a dense gradient all-reduce, not "
                    "cubic's sparse sync" + (" (auto may choose it)" if value == "auto" else ""))
        if cpu and value in ("row_wise", "table_row_wise"):
            return "row-wise kinds need CUDA in TorchRec"
    if knob == "sparse_sync" and value == "grad_allreduce":
        return "TorchRec's 2D (DMPCollection) syncs by weight averaging only"
    if knob == "emb_optimizer" and value == "momentum_scaled_rowwise_adagrad":
        return "DMPCollection averages replica weights and state (plain row-wise AdaGrad)"
    if knob == "allreduce_comm_precision" and value == "bf16" and cpu:
        return ("torch's bf16 compress hook (TorchRec's DefaultDataParallelWrapper) needs "
                "NCCL")
    if knob == "pipeline_depth" and value == 2 and cpu:
        return "PrefetchTrainPipelineSparseDist prefetches on CUDA streams"
    if knob == "emb_precision" and value == "bf16" and cpu:
        return "FBGEMM's CPU TBE holds fp32/fp16 tables only"
    if knob == "dense_precision" and value in ("fp8_auto", "fp8_all"):
        return "TorchRec's models have no fp8 layers"
    if knob == "comm_overlap" and value != "none":
        return ("TorchRec's sharded modules return the all-to-all as an awaitable, waited on where "
                "the model reads the embeddings: no setting runs it beside the bottom MLP")
    return None


def torchrec_kinds(device: str) -> tuple[str, ...]:
    """The sharding kinds TorchRec runs here as cubic measures them: what `sharding: plan` chooses
    among."""
    return tuple(k for k in SHARDING_TYPES if not torchrec_unsupported("sharding", k, device))


# What runs instead, for each knob value `torchrec_unsupported` refuses (the placements: per table)
INSTEAD = {"kernel": "TorchRec ran FBGEMM's fused TBE",
           "allreduce_comm_precision": "the dense gradients were all-reduced in fp32",
           "pipeline_depth": "TrainPipelineSparseDist ran (one batch's input distribution ahead)",
           "emb_precision": "fp32 tables ran",
           "dense_precision": "bf16 autocast ran",
           "comm_overlap": "the all-to-all was waited on where the model reads the embeddings",
           "sparse_sync": ("DMPCollection averaged the replicas' weights and optimizer state after "
                           "every step"),
           "emb_optimizer": ("row-wise AdaGrad ran, its replicas merged by DMPCollection's "
                             "averaging")}


def runs_unchanged(cfg: TrialConfig) -> frozenset[str]:
    """The knobs whose value TorchRec need not run for `cfg`: the inert ones (`inert_knobs`), and
    `emb_optimizer` with one replica, whose one value TorchRec lacks (momentum scaling) is the
    replica merge's rule and trains as row-wise AdaGrad without replicas."""
    return inert_knobs(cfg) | ({"emb_optimizer"} if cfg.replicas == 1 else frozenset())


def plan_for_torchrec(cfg: TrialConfig,
                      export: dict[str, Any]) -> tuple[dict[str, dict], list[str]]:
    """The placements TorchRec will run here, and what differs from what cubic measured (one line
    each): the rules are `torchrec_unsupported`'s, what ran instead is `INSTEAD`'s."""
    if export.get("model") is None and not export.get("factory"):
        raise UnsupportedConfig(f"interaction={cfg.workload.interaction!r} has no TorchRec model "
                                "class")
    subs: list[str] = []
    placements, moved = {}, []
    for name, p in export["placements"].items():
        kind = p["sharding_type"]
        if kind != "data_parallel" and torchrec_unsupported("sharding", kind, cfg.device):
            moved.append(f"{name} ({kind})")  # row-wise kinds on CPU: whole tables instead
            p = {"sharding_type": "table_wise", "rank": p["ranks"][0]}
        placements[name] = dict(p)
    if moved:
        subs.append(f"row-wise kinds need CUDA in TorchRec: {', '.join(moved)} ran table-wise on "
                    "the first shard's rank")
    if any(p["sharding_type"] == "data_parallel" for p in placements.values()):
        subs.append("data-parallel tables: TorchRec all-reduces their dense gradients (cubic: a "
                    "sparse all-gather of ids and pooled gradients)")
    unchanged = runs_unchanged(cfg)
    for knob, instead in INSTEAD.items():
        if knob in unchanged:
            continue  # the same training whatever its value
        why = torchrec_unsupported(knob, getattr(cfg, knob), cfg.device)
        if why:
            subs.append(f"{knob}={getattr(cfg, knob)}: {why}; {instead}")
    return placements, subs


def check_runs_in_torchrec(cfg: TrialConfig, cwd: str | None = None) -> None:
    """ConfigError naming the first knob value TorchRec does not run here as the config says (the
    rules a `target: torchrec` space restricts its knobs by), or a model factory (imported from
    `cwd`) that does not build; the backend runs no substitute."""
    if not torchrec_available():
        raise ConfigError(f"--backend torchrec needs TorchRec: {INSTALL_HINT}")
    compat.check()
    if cfg.device != "cpu":  # ranks run gloo on CPU tensors: a CUDA config would not run as named
        raise ConfigError(f"device={cfg.device}: the TorchRec backend trains on CPU (gloo); on "
                          "CUDA use cubic's harness (--backend real) and `cubic export -f "
                          "torchrec`")
    _check_model(cfg, cwd)
    unchanged = runs_unchanged(cfg)
    for knob in ("kernel", "sharding", *INSTEAD):
        if knob in unchanged:
            continue
        why = torchrec_unsupported(knob, getattr(cfg, knob), cfg.device)
        if why:
            choices = [v for v in CHOICES.get(knob, ())
                       if not torchrec_unsupported(knob, v, cfg.device)]
            raise ConfigError(f"{knob}={getattr(cfg, knob)!r} does not run in TorchRec on "
                              f"{cfg.device}: {why}"
                              + (f"; choose one of {choices}" if choices else ""))


def _check_model(cfg: TrialConfig, cwd: str | None) -> None:
    """ConfigError where the workload has no TorchRec model the backend shards: Wukong without a
    factory, a factory that does not build, or tables a DLRM built from the workload cannot hold."""
    wl = cfg.workload
    if wl.interaction == "wukong" and not wl.factory:
        raise ConfigError("interaction='wukong' has no TorchRec model: import your own with `cubic "
                          "workload from-torchrec MODULE:FACTORY`")
    if wl.factory:  # the user's model builds (on the meta device: no memory) before ranks start
        from cubic_harness.torchrec_import import load_factory

        load_factory(wl.factory, cwd)
    weighted = [t.name for t in wl.tables if t.weighted]
    if weighted and not wl.factory:
        raise ConfigError(f"table(s) {', '.join(weighted)}: weighted, and TorchRec's DLRM built "
                          "from a workload has one unweighted collection; import the model that "
                          "has them with `cubic workload from-torchrec MODULE:FACTORY`")
    if wl.collections > 1 and not wl.factory:
        raise ConfigError(f"collections={wl.collections}: TorchRec's DLRM built from a workload "
                          "has one collection; import the model that has them with `cubic workload "
                          "from-torchrec MODULE:FACTORY`")
    seq = [t.name for t in wl.tables if t.pooling_type == "none"]
    if seq:
        raise ConfigError(f"table(s) {', '.join(seq)}: sequence tables (an EmbeddingCollection) "
                          "are not trained by the TorchRec backend; it shards pooled ones "
                          "(EmbeddingBagCollection)")
