"""Embedding-bag kernels behind one interface (`cubic_kernels.base.EmbeddingBagKernel`).

Backends: `fbgemm` (FBGEMM TBE), `torch` (reference), `native` (CPU, our own),
`triton` (GPU; CPU under TRITON_INTERPRET=1). Knows no model.
"""

from __future__ import annotations

import importlib

from cubic_kernels.base import EmbeddingBagKernel, OptimSpec

BACKENDS = {
    "torch": ("cubic_kernels.torch_backend", "TorchEmbeddingBags"),
    "fbgemm": ("cubic_kernels.fbgemm_backend", "FbgemmEmbeddingBags"),
    "native": ("cubic_kernels.native_backend", "NativeEmbeddingBags"),
    "triton": ("cubic_kernels.triton_backend", "TritonEmbeddingBags"),
}


def make_kernel(backend: str, rows, dims, **kw) -> EmbeddingBagKernel:
    """Instantiate a backend by name (imports lazily: fbgemm/triton are optional)."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel {backend!r}; choose one of {sorted(BACKENDS)}")
    mod, cls = BACKENDS[backend]
    return getattr(importlib.import_module(mod), cls)(rows, dims, **kw)


__all__ = ["BACKENDS", "EmbeddingBagKernel", "OptimSpec", "make_kernel"]
