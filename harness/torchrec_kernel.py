"""cubic's CPU kernels (`native`, `torch`) as the compute kernel of TorchRec's sharded EmbeddingBagCollection.

TorchRec 1.8 has no kernel registry: `GroupedPooledEmbeddingsLookup._create_embedding_kernel` builds FBGEMM's
fused TBE for a `fused` table group (and raises for `customized_kernel`), and each sharding's `create_lookup`
names that lookup class. So the path is a sharder whose sharded module makes table-wise and column-wise
shardings create a lookup that builds cubic's kernel for `fused` groups on CPU:

1. `CubicEmbeddingBag` (a BaseBatchedEmbeddingBag, so TorchRec's state_dict, ShardedTensors and
   reset_parameters work from `split_embedding_weights()` as for FBGEMM's): forward is the kernel's pooled
   sum over the group's bags; its backward runs the kernel's fused backward + optimizer update (the way
   FBGEMM's TBE applies the optimizer inside backward), through an autograd function anchored on an empty
   tensor that requires grad. The optimizer TorchRec collects (`fused_optimizer`) does nothing at step():
   the update already happened.
2. `_CubicLookup` builds it for `fused` groups on CPU; any other group as TorchRec would.
3. `_Tw` / `_Cw` shardings create that lookup; `_CubicEBC` creates those shardings; `cubic_sharder(backend)` is
   the EmbeddingBagCollectionSharder (`CubicSharder`) that shards with them. The plan keeps
   `compute_kernel="fused"`, so the planner, checkpoints and loading are TorchRec's own. TorchRec
   builds each of these objects itself, so the sharder's `Kernels` (its backend, the kernels built)
   goes down the chain as a constructor argument.

A group whose tables are looked up by several features, or pooled by mean, goes through `_FeatureLayout`:
TBE takes one bag per (feature, sample) and a feature-to-table map; cubic's kernel takes one bag per (table, sample).
The layout gives the kernel `M` slots a table (M = the most features any table of the group has), so each feature's
bags are a slot of its table and the others are empty; the ids need no moving, since TorchRec orders a group's
features table by table. One kernel call then sums every feature's gradients of a row before the row's update, as
FBGEMM's backward does (a pass per feature would update row-wise AdaGrad's state once per feature instead).

A weighted group (an `is_weighted` collection's tables) passes the features' weights to the kernel as per-sample
weights; they sit beside the ids, so the layout moves neither. What cubic's kernels do not do, refused where the
group is built (`UnsupportedGroup`, a failed trial with the reason): weights with mean pooling, variable batch
sizes.

2D: DMPCollection.sync() merges the weights and row-wise AdaGrad state of the FBGEMM kernels it finds (by type,
walking the sharded modules' lookups), so it never sees cubic's. The sharder keeps the kernels it built, and its
`replica_state()` gives their same tensors, which the TorchRec trial's DMPCollection averages over the replica
group in the same sync (harness/torchrec_train.py).

This module imports TorchRec and FBGEMM: only a TorchRec trial's ranks (and a TorchRec job)
import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule

from cubic_harness import torchrec_compat as compat
from cubic_harness.torchrec_import import DATA_TYPES
from cubic_kernels import OptimSpec, make_kernel


class UnsupportedGroup(ValueError):
    """A table group cubic's kernels cannot compute as TorchRec's would."""


class _FeatureLayout:
    """TorchRec's bags of one group (feature-major: F features x B samples) as cubic's kernel takes them (T tables
    x M slots x B samples), and the kernel's pooled output back as TorchRec's, mean pooling applied.

    1. Slot j of table t holds the bags of t's j-th feature; a table with fewer than M features has empty slots
       (lengths 0), so the kernel's batch is M*B and its offsets are the cumulative sum of the padded lengths.
    2. The kernel's output `[M*B, sum(dims)]` is cut per feature: feature f of table t in slot j is rows
       j*B..(j+1)*B, columns of t. Pieces are concatenated in feature order, TBE's output layout.
    3. Mean pooling divides each bag by its length (an empty bag stays 0, as in FBGEMM). Autograd carries the
       1/length into the gradient the kernel receives, which is FBGEMM's mean-pooling backward.
    """

    def __init__(self, feature_table_map: list[int], dim_offsets: list[int], mean: bool) -> None:
        tables = max(feature_table_map) + 1
        slot: list[int] = []
        for f, t in enumerate(feature_table_map):
            slot.append(slot[-1] + 1 if f and feature_table_map[f - 1] == t else 0)
        self.slots = max(slot) + 1
        self.rows = tables * self.slots
        self.position = torch.tensor([t * self.slots + j for t, j in zip(feature_table_map, slot, strict=True)])
        self.pieces = [(j, dim_offsets[t], dim_offsets[t + 1]) for t, j in zip(feature_table_map, slot, strict=True)]
        self.mean = mean

    @property
    def identity(self) -> bool:
        return self.slots == 1 and not self.mean and len(self.pieces) == self.rows

    def offsets(self, lengths: torch.Tensor) -> torch.Tensor:
        """Kernel offsets (T*M*B + 1) from TorchRec's per-feature lengths (F*B)."""
        per_feature = lengths.view(len(self.pieces), -1)
        padded = lengths.new_zeros(self.rows, per_feature.shape[1])
        padded[self.position] = per_feature
        return torch.cat([lengths.new_zeros(1), torch.cumsum(padded.view(-1), 0)]).to(torch.int64)

    def output(self, pooled: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """TBE's `[B, sum over features of dim]` from the kernel's `[M*B, sum(dims)]`."""
        per_slot = pooled.view(self.slots, -1, pooled.shape[1])
        cuts = [per_slot[j, :, lo:hi] for j, lo, hi in self.pieces]
        if self.mean:
            inv = 1.0 / lengths.view(len(self.pieces), -1).clamp(min=1).to(pooled.dtype)
            cuts = [c * inv[f].unsqueeze(1) for f, c in enumerate(cuts)]
        return torch.cat(cuts, dim=1)


class _Apply(torch.autograd.Function):
    """Pooled forward; backward = the kernel's fused backward + optimizer step (no gradient tensor comes back)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, kernel: Any, ids: torch.Tensor, offsets: torch.Tensor,
                scores: torch.Tensor | None) -> torch.Tensor:
        ctx.kernel, ctx.ids, ctx.offsets, ctx.scores = kernel, ids, offsets, scores
        return kernel.forward(ids, offsets, scores)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None, None]:
        ctx.kernel.backward_update(ctx.ids, ctx.offsets, grad.contiguous(), ctx.scores)
        return None, None, None, None, None


_OPTIMS = {EmbOptimType.EXACT_ROWWISE_ADAGRAD: "rowwise_adagrad", EmbOptimType.EXACT_SGD: "sgd"}


@dataclass(frozen=True)
class Kernels:
    """What one sharder's modules build their kernels with (`backend`), and the kernels they built
    in this process (`built`, for 2D's sync). Handed down sharder -> sharded collection ->
    sharding -> lookup -> kernel module, since TorchRec builds each of those itself."""

    backend: str
    built: list[Any] = field(default_factory=list)


class _Done(FusedOptimizer):
    """What TorchRec collects as the tables' optimizer: the kernel updated them in backward."""

    def __init__(self, kernel: Any, names: list[str], slices: list[torch.Tensor]) -> None:
        state = ({s: {"sum": st} for s, st in zip(slices, kernel.states(), strict=True)}
                 if kernel.optim.kind == "rowwise_adagrad" else {})
        super().__init__({f"{n}.weight": s for n, s in zip(names, slices, strict=True)}, state,
                         [{"params": list(slices), "lr": kernel.optim.lr}])

    def step(self, closure: Any = None) -> None:
        pass

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass


class CubicEmbeddingBag(BaseBatchedEmbeddingBag, FusedOptimizerModule):
    """One fused table group on CPU computed by cubic's kernel (`kernels.backend`), as TorchRec's
    FBGEMM module would: TorchRec reads its weights, state and optimizer through the same
    attributes."""

    def __init__(self, config: Any, pg: Any = None, device: Any = None,
                 sharding_type: Any = None, *, kernels: Kernels) -> None:
        super().__init__(config, pg, device, sharding_type)
        backend = kernels.backend
        names = [t.name for t in config.embedding_tables]
        if config.pooling not in (PoolingType.SUM, PoolingType.MEAN) or (
                config.is_weighted and config.pooling != PoolingType.SUM):
            weights = " with weights" if config.is_weighted else ""
            raise UnsupportedGroup(f"kernel={backend} in TorchRec: tables {names} pool by "
                                   f"{config.pooling.name}{weights}; cubic's kernel sums or "
                                   "averages bags, and sums weighted ones")
        self._cubic_backend = backend
        self._weighted = config.is_weighted
        fp = config.fused_params or {}
        self._kernel = make_kernel(backend, self._local_rows, self._local_cols, device="cpu",
                                   weight_dtype=DATA_TYPES[config.data_type.name],
                                   optim=OptimSpec(_OPTIMS[fp["optimizer"]], fp["learning_rate"],
                                                   fp.get("eps", 1e-8)))
        kernels.built.append(self._kernel)
        self._layout = _FeatureLayout(self._feature_table_map, self._kernel.dim_offsets,
                                      mean=config.pooling == PoolingType.MEAN)
        self._anchor = torch.zeros(0, requires_grad=True)  # makes autograd call _Apply.backward
        slices = []
        for w in self._kernel.weights():
            s = TableBatchedEmbeddingSlice(w.view(-1), 0, w.numel(), w.shape[0], w.shape[1])
            compat.mark_updated_in_backward(s, EmptyFusedOptimizer())
            slices.append(s)
        self._param_per_table = dict(zip(names, slices, strict=True))
        self._optim = _Done(self._kernel, names, slices)
        self.init_parameters()

    @property
    def emb_module(self) -> Any:  # TorchRec reads split_embedding_weights() through it
        return self

    def split_embedding_weights(self) -> list[torch.Tensor]:
        return self._kernel.weights()

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    def forward(self, features: Any, vbe_output: Any = None,
                vbe_output_offsets: Any = None) -> torch.Tensor:
        if vbe_output is not None or features.variable_stride_per_key():
            raise UnsupportedGroup(f"kernel={self._cubic_backend} in TorchRec: variable batch "
                                   "sizes per feature")
        scores = features.weights() if self._weighted else None
        if self._layout.identity:
            return _Apply.apply(self._anchor, self._kernel, features.values(), features.offsets(),
                                scores)
        lengths = features.lengths()
        pooled = _Apply.apply(self._anchor, self._kernel, features.values(),
                              self._layout.offsets(lengths), scores)
        return self._layout.output(pooled, lengths)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Any:
        yield from ()

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Any:
        yield from ()


class _CubicLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's lookup, building cubic's kernel module for `fused` groups on CPU."""

    def __init__(self, *, kernels: Kernels, **kwargs: Any) -> None:
        self.cubic_kernels = kernels  # before TorchRec's __init__, which builds the groups' kernels
        super().__init__(**kwargs)

    def _create_embedding_kernel(self, config: Any, device: Any, pg: Any, sharding_type: Any,
                                 env: Any) -> nn.Module:
        cpu = device is None or device.type == "cpu"
        if config.compute_kernel == EmbeddingComputeKernel.FUSED and cpu:
            return CubicEmbeddingBag(config, pg, device, sharding_type, kernels=self.cubic_kernels)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


class _CubicLookups:
    """A pooled sharding (table-wise or column-wise) whose lookup is `_CubicLookup`."""

    def __init__(self, *args: Any, kernels: Kernels, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cubic_kernels = kernels

    def create_lookup(self, device: Any = None, fused_params: Any = None,
                      feature_processor: Any = None) -> Any:
        args = compat.sharding_lookup_args(self)
        return _CubicLookup(kernels=self.cubic_kernels,
                            **{**args, "device": device if device is not None else args["device"]},
                            feature_processor=feature_processor)


class _Tw(_CubicLookups, TwPooledEmbeddingSharding):
    pass


class _Cw(_CubicLookups, CwPooledEmbeddingSharding):
    pass


class _CubicEBC(ShardedEmbeddingBagCollection):
    """TorchRec's sharded EmbeddingBagCollection, its table- and column-wise shardings cubic's."""

    def __init__(self, *, kernels: Kernels, **kwargs: Any) -> None:
        self.cubic_kernels = kernels  # before TorchRec's __init__, which creates the shardings
        super().__init__(**kwargs)

    def create_embedding_bag_sharding(self, sharding_infos: Any, env: Any, device: Any = None,
                                      permute_embeddings: bool = False,
                                      qcomm_codecs_registry: Any = None) -> Any:
        """TorchRec's (a classmethod there, called on the instance), with this collection's
        kernels."""
        kind = sharding_infos[0].param_sharding.sharding_type
        if kind == ShardingType.TABLE_WISE.value:
            return _Tw(sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry,
                       kernels=self.cubic_kernels)
        if kind == ShardingType.COLUMN_WISE.value:
            return _Cw(sharding_infos, env, device, permute_embeddings=permute_embeddings,
                       qcomm_codecs_registry=qcomm_codecs_registry, kernels=self.cubic_kernels)
        return super().create_embedding_bag_sharding(sharding_infos, env, device,
                                                     permute_embeddings, qcomm_codecs_registry)


class CubicSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder, its table-wise and column-wise shards on CPU run by cubic's `backend`."""

    def __init__(self, backend: str, qcomm_codecs_registry: Any = None) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        self.kernels = Kernels(backend)

    def replica_state(self, include_optimizer_state: bool = True) -> list[torch.Tensor]:
        """What 2D's sync averages across replicas, as DMPCollection does FBGEMM's: every table's
        weights and row-wise AdaGrad's per-row state (live storage: writes go through)."""
        return [t for k in self.kernels.built
                for t in (*k.weights(), *(k.states() if include_optimizer_state else []))]

    def shard(self, module: Any, params: Any, env: Any, device: Any = None,
              module_fqn: Any = None) -> Any:
        return _CubicEBC(kernels=self.kernels, module=module,
                         table_name_to_parameter_sharding=params, env=env,
                         fused_params=self.fused_params, device=device,
                         qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
                         sharded_module_order_overwrite=self._sharded_module_order_overwrite)

    @property
    def sharded_module_type(self) -> type:
        return _CubicEBC


def cubic_sharder(backend: str, qcomm_codecs_registry: Any = None) -> CubicSharder:
    """An EmbeddingBagCollectionSharder whose table-wise and column-wise shards on CPU run cubic's
    `backend` (its all-to-alls quantized by `qcomm_codecs_registry` where given, as TorchRec's
    own sharder's)."""
    return CubicSharder(backend, qcomm_codecs_registry=qcomm_codecs_registry)
