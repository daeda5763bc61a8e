"""The embedding-bag-collection kernel interface every backend implements.

A kernel holds several tables (or table shards) and does two things:

* `forward(ids, offsets)`: pooled sums of every bag of every table in one call.
  Layout as FBGEMM TBE: `ids` are local row ids of all tables concatenated
  table-major; `offsets` has `T * B + 1` entries, bag `t * B + b` of table `t`
  spans `ids[offsets[t*B+b] : offsets[t*B+b+1]]`. Output `[B, sum(dims)]`, fp32.
* `backward_update(ids, offsets, grad)`: the backward fused with the table
  optimizer. The weights are updated in place; no gradient tensor is ever
  materialised (this is what makes TBE-style kernels fast).

Both take optional per-sample weights (`per_sample_weights`, fp32, one per id;
TorchRec's weighted features, "id-score lists"): a bag is then the weighted
sum sum_i s_i * W[id_i], and a row's gradient is sum_i s_i * grad[bag(i)],
as FBGEMM's TBE computes them. The weights are inputs, not trained.

Optimizers (exactly as FBGEMM computes them, checked against float64):
  rowwise_adagrad:  g_r = sum of the row's gradients in the batch;
                    state_r += mean(g_r * g_r);  w_r -= lr * g_r / (sqrt(state_r) + eps)
  sgd:              w_r -= lr * g_r
Reduced-precision weights (fp16/bf16) are stored rounded-to-nearest and
updated in fp32.

Kernels know no model and no sharding: the harness wraps them in autograd.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

OPTIMIZERS = ("rowwise_adagrad", "sgd")
# the storage precisions by name; the harness's table of every precision (cubic_harness.config.PRECISIONS)
# names these torch dtypes too, and tests/test_precision.py holds the two together
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class OptimSpec:
    kind: str = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.kind!r}; choose one of {list(OPTIMIZERS)}")


class EmbeddingBagKernel(abc.ABC):
    """Several tables, one pooled-sum forward and one fused backward+optimizer."""

    name = "base"

    def __init__(self, rows: Sequence[int], dims: Sequence[int], *, weight_dtype: str = "fp32",
                 optim: OptimSpec = OptimSpec(), device: str | torch.device = "cpu") -> None:
        if len(rows) != len(dims) or not rows:
            raise ValueError("rows and dims must be non-empty and of equal length")
        if weight_dtype not in DTYPES:
            raise ValueError(f"weight dtype {weight_dtype!r}; choose one of {list(DTYPES)}")
        self.rows = [int(r) for r in rows]
        self.dims = [int(d) for d in dims]
        self.weight_dtype = weight_dtype
        self.optim = optim
        self.device = torch.device(device)
        self.dim_offsets = [0]
        for d in self.dims:
            self.dim_offsets.append(self.dim_offsets[-1] + d)

    @property
    def num_tables(self) -> int:
        return len(self.rows)

    @property
    def total_dim(self) -> int:
        return self.dim_offsets[-1]

    # -- the two hot operations ------------------------------------------------
    @abc.abstractmethod
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled (weighted) sums `[B, sum(dims)]` (fp32) for `T * B` bags."""

    @abc.abstractmethod
    def backward_update(self, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
                        per_sample_weights: torch.Tensor | None = None) -> None:
        """Fused backward + optimizer step for the bags (and weights) of the matching forward."""

    # -- state access (tests, checkpoint, 2D weight averaging) ----------------
    @abc.abstractmethod
    def weights(self) -> list[torch.Tensor]:
        """Per-table weight tensors in storage dtype (live views: writes go through)."""

    @abc.abstractmethod
    def states(self) -> list[torch.Tensor]:
        """Per-table optimizer state (row-wise AdaGrad: `[rows]` fp32; empty for sgd)."""

    def load(self, weights: Sequence[torch.Tensor], states: Sequence[torch.Tensor] | None = None) -> None:
        """Copy initial weights (any float dtype) and optionally optimizer state in."""
        with torch.no_grad():
            for dst, src in zip(self.weights(), weights, strict=True):
                dst.copy_(src.to(dst.dtype))
            if states is not None:
                for dst, src in zip(self.states(), states, strict=True):
                    dst.copy_(src)

    def memory_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights()) + sum(
            s.numel() * s.element_size() for s in self.states())


def check_weights(name: str, ids: torch.Tensor, per_sample_weights: torch.Tensor | None) -> torch.Tensor | None:
    """The per-sample weights as fp32 on the ids' device, or ValueError naming the kernel when they do not
    give one weight per id."""
    if per_sample_weights is None:
        return None
    if per_sample_weights.dim() != 1 or per_sample_weights.numel() != ids.numel():
        raise ValueError(f"{name} kernel: per_sample_weights must be 1-D with one weight per id ({ids.numel()}); "
                         f"got shape {tuple(per_sample_weights.shape)}")
    return per_sample_weights.detach().to(device=ids.device, dtype=torch.float32)


def bag_ids(offsets: torch.Tensor, n_ids: int) -> torch.Tensor:
    """For each id position, the index of the bag it belongs to (offsets -> segment ids)."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                   output_size=n_ids)
