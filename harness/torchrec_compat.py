"""TorchRec's (and DDP's) private names that cubic's TorchRec backend uses, behind one fence.

Each use is listed once in `PRIVATE`, with what cubic does with it and why no public path serves (TorchRec
1.8.0-1.9.2 offers none for these). The backend reads them only through the accessors below, and `check()`
runs before a TorchRec trial's ranks start (`torchrec_trial.check_runs_in_torchrec`, `run_torchrec_trial`): a
TorchRec whose private names moved fails there, in one line naming its version and the name, instead of with a
traceback deep in a rank. One more dependency on TorchRec's internals is not a name: 2D on CPU starts its ranks
with PYTHONOPTIMIZE=1 to skip `DMPCollection.__init__`'s CUDA-only assert (`torchrec_trial`'s module
docstring says why the rest of DMPCollection runs on CPU).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from cubic_harness.errors import ConfigError

SUPPORTED = "1.8.0-1.9.2"  # the TorchRec versions these names were read from and the suite ran on


@dataclass(frozen=True)
class Private:
    """One private name: `owner` ("module:Class"), the name, whether the class defines it ("class": a method
    cubic calls or overrides) or its constructor sets it ("init": an attribute read from an instance), and why."""

    owner: str
    name: str
    where: str
    why: str

    def present(self) -> bool:
        mod, cls_name = self.owner.split(":")
        cls = getattr(importlib.import_module(mod), cls_name)
        if self.where == "class":
            return hasattr(cls, self.name)
        try:  # an instance attribute: set by the constructor of the class or of a base it inherits from
            return any(f"self.{self.name}" in inspect.getsource(k) for k in cls.__mro__
                       if k.__module__.startswith(("torchrec", "torch", "fbgemm_gpu")))
        except (OSError, TypeError):  # no source installed: nothing to read, the accessors still fail in one line
            return True


DMPC = "torchrec.distributed.model_parallel:DMPCollection"
DMP = "torchrec.distributed.model_parallel:DistributedModelParallel"
LOOKUP = "torchrec.distributed.embedding_lookup:GroupedPooledEmbeddingsLookup"
TW = "torchrec.distributed.sharding.tw_sharding:TwPooledEmbeddingSharding"
BASE_BAG = "torchrec.distributed.batched_embedding_kernel:BaseBatchedEmbeddingBag"
PRIVATE = (
    Private(DMPC, "_remap_sharding_plan", "class", "overridden to name CPU shard placements as CPU tensors do "
            "(TorchRec names them cuda)"),
    Private(DMPC, "_default_ctx", "init", "2D: the replica process group and device mesh (this rank's sharding "
            "group) and the weights sync() averages (the replicas' checksum)"),
    Private(DMP, "_dmp_wrapped_module", "init", "the DDP module, to report which gradient comm hooks ran"),
    Private("torch.nn.parallel:DistributedDataParallel", "_comm_hooks", "init",
            "the hooks registered on DDP (allreduce_comm_precision): reported, never changed"),
    Private(LOOKUP, "_create_embedding_kernel", "class", "overridden to build cubic's kernel for fused CPU "
            "groups: TorchRec has no kernel registry"),
    Private(TW, "_grouped_embedding_configs", "init", "a sharding's table groups, handed to cubic's lookup"),
    Private(TW, "_pg", "init", "a sharding's process group, handed to cubic's lookup"),
    Private(TW, "_device", "init", "a sharding's device, handed to cubic's lookup"),
    Private(TW, "_env", "init", "a sharding's environment, handed to cubic's lookup"),
    Private(BASE_BAG, "_param_per_table", "init",
            "the per-table weights TorchRec's state_dict and optimizer read, set by cubic's kernel module"),
    *(Private(BASE_BAG, n, "init", "the shard's local rows / columns and feature-to-table map, which cubic's "
              "kernel module reads from TorchRec's base to build its kernel")
      for n in ("_local_rows", "_local_cols", "_feature_table_map")),
    Private(DMPC, "_device", "init", "the device in cubic's _remap_sharding_plan override (CPU: rename placements)"),
)
# set by cubic on a weight, read by TorchRec's sharded EmbeddingBagCollection (torch's
# `apply_optimizer_in_backward` sets it too): the mark of a weight its kernel updates in backward
IN_BACKWARD_OPTIMIZERS = "_in_backward_optimizers"
READS_MARK = "torchrec.distributed.embeddingbag"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchrec")
    except PackageNotFoundError:
        return "?"


def missing() -> list[Private]:
    """The private names this TorchRec lacks (empty where all are present)."""
    out = [p for p in PRIVATE if not p.present()]
    try:
        reads = IN_BACKWARD_OPTIMIZERS in inspect.getsource(importlib.import_module(READS_MARK))
    except (OSError, TypeError):
        reads = True
    if not reads:
        out.append(Private(f"{READS_MARK}:ShardedEmbeddingBagCollection", IN_BACKWARD_OPTIMIZERS, "read",
                           "the mark of a weight updated in backward"))
    return out


@functools.cache
def check() -> None:
    """ConfigError, one line, where this TorchRec lacks a private name the backend uses (checked once)."""
    gone = missing()
    if gone:
        names = ", ".join(f"{p.owner.split(':')[1]}.{p.name}" for p in gone)
        raise ConfigError(f"TorchRec {_version()} lacks {names}, which cubic's TorchRec backend uses "
                          f"(harness/torchrec_compat.py); it runs with TorchRec {SUPPORTED}")


def _get(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise ConfigError(f"TorchRec {_version()}: {type(obj).__name__}.{name} is gone, which cubic's TorchRec "
                          f"backend uses (harness/torchrec_compat.py); it runs with TorchRec {SUPPORTED}") from None


# ------------------------------------------------------------------------- the accessors, one per use
def dmp_context(dmp: Any) -> Any:
    """DMPCollection's default context: `replica_pg`, `device_mesh`, `weights_by_dtype`."""
    return _get(dmp, "_default_ctx")


def ddp_hook_names(dmp: Any) -> list[str]:
    """The gradient comm hooks DDP runs under a DistributedModelParallel (empty without DDP or hooks)."""
    ddp = _get(dmp, "_dmp_wrapped_module")
    return [h.__name__ for h, _ in getattr(ddp, "_comm_hooks", [])]


def sharding_lookup_args(sharding: Any) -> dict[str, Any]:
    """What a pooled sharding hands its lookup: its table groups, process group, device and environment."""
    return {"grouped_configs": _get(sharding, "_grouped_embedding_configs"), "pg": _get(sharding, "_pg"),
            "device": _get(sharding, "_device"), "env": _get(sharding, "_env")}


def mark_updated_in_backward(weight: Any, optimizer: Any) -> None:
    """Mark a weight as updated by its kernel in backward, as TorchRec marks FBGEMM's."""
    setattr(weight, IN_BACKWARD_OPTIMIZERS, [optimizer])
