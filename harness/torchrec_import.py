"""A workload read off the user's own TorchRec model (`cubic workload from-torchrec MODULE:FACTORY`).

1. Import MODULE (the current folder first on the path, as `python -c` would) and call FACTORY under
   `torch.device("meta")`: parameters get shapes and no storage, so a model with a terabyte of tables
   costs nothing to build.
2. Every EmbeddingBagCollection (pooled) and EmbeddingCollection (sequence) in it gives its tables:
   name, rows, dim, the features that look each one up, the data type and the pooling.
3. The dense part. A model TorchRec knows by name (`DLRM`, `DLRM_DCN`) is read as the harness's own
   family: dense features, bottom (dense arch) and top (over arch) widths, the cross network's layers
   and rank. Any other module is measured: its parameters outside the embedding collections, and its
   forward FLOPs per sample counted by `torch.utils.flop_counter` on a small meta batch with every
   embedding collection standing in as zeros of its output shape. A harness trial then trains a
   stand-in of the same FLOPs (a dot-interaction DLRM whose top MLP's width is solved for them),
   and the workload records the measured figures (`dense_model`).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cubic_harness.config import TORCHREC_TYPES
from cubic_harness.dense_cost import dense_cost
from cubic_harness.errors import ConfigError
from cubic_harness.workload import DenseModel, TableSpec, Workload

#: TorchRec's data types and pooling modes in the workload's words (the integer types cubic does not train:
#: named, then refused).
DATA_TYPES = {**{tr: n for n, tr in TORCHREC_TYPES.items()}, "INT8": "int8", "INT4": "int4", "INT2": "int2"}
POOLINGS = {"SUM": "sum", "MEAN": "mean", "NONE": "none"}
FLOP_BATCH = 4  # samples in the meta batch the flop counter sees (FLOPs per sample are its share)


def load_callable(entry: str, what: str = "FACTORY", folder: str | Path | None = None) -> Callable[..., Any]:
    """MODULE:NAME's callable; ConfigError (one line) otherwise. MODULE is looked for in `folder` first (default:
    the current one)."""
    mod_name, sep, fn_name = entry.partition(":")
    if not sep or not mod_name or not fn_name:
        raise ConfigError(f"{entry}: expected MODULE:{what} (e.g. mymodels.ranker:{what.lower()})")
    sys.path.insert(0, str(folder or Path.cwd()))
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # the user's code: any failure to import is bad input, named
        raise ConfigError(f"{entry}: cannot import {mod_name!r}: {type(e).__name__}: {_line(e)}") from None
    finally:
        sys.path.pop(0)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{entry}: {mod_name!r} has no callable {fn_name!r}")
    return fn


def load_factory(entry: str, folder: str | Path | None = None) -> nn.Module:
    """Steps 1: the module FACTORY returns, built on the meta device; ConfigError (one line) otherwise."""
    factory = load_callable(entry, "FACTORY", folder)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:
        raise ConfigError(f"{entry}: the factory raised {type(e).__name__}: {_line(e)}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{entry}: the factory returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or "(no message)"


def collections(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Step 2's modules: every EmbeddingBagCollection / EmbeddingCollection, by path in the model."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    return [(n, m) for n, m in model.named_modules() if isinstance(m, EmbeddingBagCollection | EmbeddingCollection)]


def tables_of(entry: str, model: nn.Module) -> list[TableSpec]:
    """Step 2: the tables, in the order the collections hold them."""
    from torchrec import EmbeddingBagCollection

    found = collections(model)
    if not found:
        raise ConfigError(f"{entry}: the model ({type(model).__name__}) holds no EmbeddingBagCollection or "
                          "EmbeddingCollection; cubic tunes models with TorchRec embedding tables")
    tables = []
    for _, coll in found:
        configs = coll.embedding_bag_configs() if isinstance(coll, EmbeddingBagCollection) else coll.embedding_configs()
        for c in configs:
            pooling = POOLINGS.get(getattr(getattr(c, "pooling", None), "name", "NONE"), "none")
            if not isinstance(coll, EmbeddingBagCollection):
                pooling = "none"
            tables.append(TableSpec(c.name, int(c.num_embeddings), int(c.embedding_dim), 1,
                                    features=list(c.feature_names), pooling_type=pooling,
                                    weighted=isinstance(coll, EmbeddingBagCollection) and coll.is_weighted(),
                                    data_type=DATA_TYPES.get(c.data_type.name, c.data_type.name.lower())))
    return tables


def _linears(m: nn.Module) -> list[nn.Linear]:
    return [x for x in m.modules() if isinstance(x, nn.Linear)]


def known_dense(model: nn.Module) -> dict[str, Any] | None:
    """Step 3 for TorchRec's own DLRM / DLRM_DCN (also inside a wrapper such as DLRMTrain): the workload keys
    of the same model in the harness's families; None for any other model."""
    from torchrec.models import dlrm

    inner = next((m for m in model.modules() if type(m) in (dlrm.DLRM, dlrm.DLRM_DCN)), None)
    if inner is None:
        return None
    bottom, top = _linears(inner.dense_arch), _linears(inner.over_arch)
    keys: dict[str, Any] = {"dense_features": bottom[0].in_features, "bottom_mlp": [x.out_features for x in bottom],
                            "top_mlp": [x.out_features for x in top], "interaction": "dot"}
    if type(inner) is dlrm.DLRM_DCN:
        cross = inner.inter_arch.crossnet
        keys.update(interaction="dcn", dcn_layers=len(cross.V_kernels), dcn_rank=int(cross.V_kernels[0].shape[0]))
    return keys


class _PooledZeros(nn.Module):
    """An embedding collection's output shape with no lookup: what the flop counter's forward sees instead."""

    def __init__(self, coll: nn.Module) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection

        self.pooled = isinstance(coll, EmbeddingBagCollection)
        cfgs = coll.embedding_bag_configs() if self.pooled else coll.embedding_configs()
        self.keys = [f for c in cfgs for f in c.feature_names]
        self.dims = [c.embedding_dim for c in cfgs for _ in c.feature_names]

    def forward(self, features: Any) -> Any:
        from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

        B = features.stride()
        if self.pooled:
            return KeyedTensor(keys=self.keys, length_per_key=self.dims,
                               values=torch.zeros(B, sum(self.dims), device="meta"))
        lengths = torch.ones(B, dtype=torch.int64)
        return {k: JaggedTensor(values=torch.zeros(B, d, device="meta"), lengths=lengths)
                for k, d in zip(self.keys, self.dims, strict=True)}


def measure_dense(entry: str, model: nn.Module, dense_features: int, example_inputs: str = "",
                  guessed: bool = False) -> DenseModel:
    """Step 3 for any other module: parameters outside the collections, forward FLOPs per sample. The forward is
    called as forward(dense, kjt), or with what `example_inputs` (MODULE:FUNCTION) returns for (dense, kjt): a
    tuple of positional arguments or a dict of keyword ones. `guessed`: `dense_features` was read off the
    first Linear, not given."""
    from torch.utils.flop_counter import FlopCounterMode
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    found = collections(model)
    emb = {id(p) for _, c in found for p in c.parameters()}
    params = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    for name, coll in found:  # swap in the stand-ins (the model is a throwaway meta copy)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, _PooledZeros(coll))
    keys = [f for m in model.modules() if isinstance(m, _PooledZeros) for f in m.keys]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.zeros(len(keys) * FLOP_BATCH,
                                                                              dtype=torch.int64),
                                              lengths=torch.ones(len(keys) * FLOP_BATCH, dtype=torch.int64))
    dense = torch.zeros(FLOP_BATCH, dense_features, device="meta")
    args, kwargs = (dense, kjt), {}
    called = f"forward(dense[{FLOP_BATCH}, {dense_features}], KeyedJaggedTensor)"
    if example_inputs:
        fn = load_callable(example_inputs, "FUNCTION")
        try:
            got = fn(dense, kjt)
        except Exception as e:
            raise ConfigError(f"{example_inputs}: raised {type(e).__name__}: {_line(e)}") from None
        if isinstance(got, dict):
            args, kwargs = (), got
        elif isinstance(got, tuple | list):
            args = tuple(got)
        else:
            raise ConfigError(f"{example_inputs}: returned {type(got).__name__}; expected the forward's arguments "
                              "as a tuple (positional) or a dict (keyword)")
        called = f"forward(*{example_inputs}(dense[{FLOP_BATCH}, {dense_features}], KeyedJaggedTensor))"
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.no_grad():
            model(*args, **kwargs)
    except Exception as e:
        fix = ("" if example_inputs else
               "; if it takes another number of dense inputs: --dense-features N (" +
               (f"{dense_features} is the first Linear's width" if guessed else f"{dense_features} given") +
               "); if it takes other arguments (a dict, the KeyedJaggedTensor first): --example-inputs "
               "MODULE:FUNCTION, FUNCTION(dense, kjt) returning them as a tuple or a dict")
        raise ConfigError(f"{entry}: cannot count the dense part's FLOPs: {called} raised {type(e).__name__}: "
                          f"{_line(e)}{fix}") from None
    return DenseModel(params=int(params), flops_per_sample=int(counter.get_total_flops() // FLOP_BATCH),
                      module=f"{type(model).__module__}.{type(model).__qualname__}")


def stand_in_top(wl: Workload, flops_per_sample: int) -> list[int]:
    """The top MLP [h, 1] whose dot-interaction DLRM has the measured forward FLOPs (h by bisection:
    the FLOPs grow with h)."""
    lo, hi = 1, 1 << 16
    while lo < hi:
        h = (lo + hi) // 2
        if dense_cost(dataclasses.replace(wl, top_mlp=[h, 1])).flops_fwd < flops_per_sample:
            lo = h + 1
        else:
            hi = h
    return [lo, 1]


def import_workload(entry: str, name: str = "", dense_features: int = 0, example_inputs: str = "") -> Workload:
    """Steps 1-3: the workload of the model FACTORY builds (pooling 1 and uniform ids until profiled);
    `example_inputs`: `measure_dense`'s."""
    model = load_factory(entry)
    tables, n_colls = tables_of(entry, model), len(collections(model))  # (before measure_dense takes them out)
    dims = sorted({t.dim for t in tables})
    if len(dims) > 1:
        raise ConfigError(f"{entry}: tables of {len(dims)} widths {dims}; cubic's harness pools every table "
                          "into one interaction and needs one embedding dim (pad the narrow ones)")
    wl_name = name or entry.rpartition(":")[2]
    keys = known_dense(model)
    if keys is not None:
        return Workload.from_dict({"name": wl_name, "tables": tables, **keys, "factory": entry,
                                   "collections": n_colls}, where=entry)
    first = next((x for x in model.modules() if isinstance(x, nn.Linear)), None)
    n_dense = dense_features or (first.in_features if first is not None else 0)
    measured = measure_dense(entry, model, n_dense, example_inputs, guessed=not dense_features)
    wl = Workload(wl_name, tables, n_dense, [dims[0]], [1], "dot", factory=entry, dense_model=measured,
                  collections=n_colls)
    wl.top_mlp = stand_in_top(wl, measured.flops_per_sample)
    return wl.validate(entry)
