"""`fbgemm` backend: FBGEMM's table-batched embedding (TBE) with fused optimizer.

`fbgemm-gpu-cpu` on CPU, `fbgemm-gpu` on CUDA (same module). FBGEMM facts that
shape this file: new TBE tables start all-zero (the harness loads initial
weights), on CPU only EXACT_SGD / EXACT_*ADAGRAD with FP32/FP16 weights work,
and the fused backward lives inside TBE's autograd op, so `forward` keeps the
output's graph and `backward_update` replays it (recomputing only when the
bags differ from the last forward).
"""

from __future__ import annotations

import torch

from cubic_kernels.base import EmbeddingBagKernel, check_weights


def available() -> bool:
    """Whether fbgemm_gpu is installed. Only its absence is False: an installed FBGEMM that fails to load
    (a missing dependency, a library built for another torch) raises, rather than passing for not installed."""
    try:
        import fbgemm_gpu  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "fbgemm_gpu":
            return False
        raise
    return True


class FbgemmEmbeddingBags(EmbeddingBagKernel):
    name = "fbgemm"

    def __init__(self, rows, dims, *, cache_load_factor: float = 0.0, **kw) -> None:
        """`cache_load_factor` > 0 (CUDA only): the tables live in host memory (UVM) behind a device-side
        LRU cache of that share of their rows (FBGEMM's MANAGED_CACHING), as TorchRec's fused_uvm_caching
        kernel runs them. The math is the same; misses cross the host link."""
        super().__init__(rows, dims, **kw)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        if self.weight_dtype not in ("fp32", "fp16"):
            raise ValueError(f"fbgemm: weight dtype {self.weight_dtype!r} unsupported; choose fp32 or fp16")
        cuda = self.device.type == "cuda"
        if cache_load_factor and not cuda:
            raise ValueError("fbgemm: a UVM cache (cache_load_factor > 0) needs a CUDA device")
        self.caching = cache_load_factor > 0
        loc = (EmbeddingLocation.MANAGED_CACHING if self.caching else EmbeddingLocation.DEVICE) if cuda \
            else EmbeddingLocation.HOST
        cdev = ComputeDevice.CUDA if cuda else ComputeDevice.CPU
        opt = {"rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "sgd": EmbOptimType.EXACT_SGD}
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(r, d, loc, cdev) for r, d in zip(self.rows, self.dims, strict=True)],
            optimizer=opt[self.optim.kind],
            learning_rate=self.optim.lr,
            eps=self.optim.eps,
            pooling_mode=PoolingMode.SUM,
            weights_precision=SparseType.FP32 if self.weight_dtype == "fp32" else SparseType.FP16,
            stochastic_rounding=False,
            device=self.device,
            **({"cache_load_factor": cache_load_factor} if self.caching else {}),
        )
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None

    def weights(self) -> list[torch.Tensor]:
        """With a UVM cache, the host copy after the cache's dirty rows are written back (`flush`): what a
        reader (evaluation, a checkpoint) needs. Writes into these land behind the cache: `load` resets it."""
        if self.caching:
            self.tbe.flush()
        return list(self.tbe.split_embedding_weights())

    def load(self, weights, states=None) -> None:
        super().load(weights, states)
        if self.caching:  # the cached copies of the rows just written are stale
            self.tbe.reset_cache_states()

    def states(self) -> list[torch.Tensor]:
        if self.optim.kind == "sgd":
            return [torch.zeros(0) for _ in self.rows]
        return [s[0] for s in self.tbe.split_optimizer_states()]

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        with torch.enable_grad():
            out = self.tbe(ids, offsets, per_sample_weights=check_weights(self.name, ids, per_sample_weights))
        self._last = (ids, offsets, per_sample_weights, out)
        return out.detach()

    def backward_update(self, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
                        per_sample_weights: torch.Tensor | None = None) -> None:
        last = self._last
        self._last = None
        if last is not None and last[0] is ids and last[1] is offsets and last[2] is per_sample_weights:
            out = last[3]
        else:
            with torch.enable_grad():
                out = self.tbe(ids, offsets, per_sample_weights=check_weights(self.name, ids, per_sample_weights))
        out.backward(grad.to(out.dtype))
