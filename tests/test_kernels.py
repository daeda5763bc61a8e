"""fbgemm (FBGEMM TBE) and the torch reference: same forward, same updated rows and state."""

from __future__ import annotations

import pytest
import torch

from cubic_kernels import OptimSpec, make_kernel
from tests.helpers import require

require("fbgemm_gpu")


def _batch(rows, B, gen, max_len=6, hot=None):
    lengths = torch.randint(0, max_len, (len(rows) * B,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    ids = []
    for t, r in enumerate(rows):
        n = int(lengths[t * B:(t + 1) * B].sum())
        hi = min(r, hot) if hot else r  # few distinct rows -> many duplicates
        ids.append(torch.randint(0, hi, (n,), generator=gen))
    return torch.cat(ids), offsets


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("opt", ["rowwise_adagrad", "sgd"])
@pytest.mark.parametrize("hot", [None, 3])
def test_fbgemm_matches_torch_reference(dtype, opt, hot):
    gen = torch.Generator().manual_seed(1)
    rows, dims, B = [100, 37, 5, 64], [8, 16, 8, 4], 16
    ks = [make_kernel(n, rows, dims, weight_dtype=dtype, optim=OptimSpec(opt, 0.1)) for n in ("torch", "fbgemm")]
    init = [torch.rand(r, d, generator=gen) - 0.5 for r, d in zip(rows, dims, strict=True)]
    for k in ks:
        k.load(init)
    # fp16: a few ulps apart (FBGEMM rounds lr*g to fp16 before subtracting for SGD; hot rows compound it)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == "fp32" else {"atol": 1e-2, "rtol": 1e-2}
    for _ in range(4):
        ids, offsets = _batch(rows, B, gen, hot=hot)
        outs = [k.forward(ids, offsets) for k in ks]
        torch.testing.assert_close(outs[0], outs[1], **tol)
        g = torch.randn(B, sum(dims), generator=gen)
        for k in ks:
            k.backward_update(ids, offsets, g)
        for a, b in zip(ks[0].weights(), ks[1].weights(), strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tol)
        for a, b in zip(ks[0].states(), ks[1].states(), strict=True):
            if a.numel():
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    moved = sum(float((w.float() - i).abs().sum()) for w, i in zip(ks[1].weights(), init, strict=True))
    assert moved > 0.1, "the fused optimizer must have updated rows"


def test_fbgemm_recomputes_forward_for_a_different_batch():
    """backward_update on bags other than the last forward's still updates exactly those bags."""
    gen = torch.Generator().manual_seed(2)
    rows, dims, B = [50, 20], [8, 8], 8
    ks = [make_kernel(n, rows, dims, optim=OptimSpec("rowwise_adagrad", 0.1)) for n in ("torch", "fbgemm")]
    init = [torch.rand(r, d, generator=gen) for r, d in zip(rows, dims, strict=True)]
    for k in ks:
        k.load(init)
    a, b = _batch(rows, B, gen), _batch(rows, B, gen)
    ks[1].forward(*a)
    g = torch.randn(B, 16, generator=gen)
    for k in ks:
        k.backward_update(*b, g)
    for x, y in zip(ks[0].weights(), ks[1].weights(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
