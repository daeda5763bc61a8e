"""The CUDA path of the harness (skipped without CUDA; run on a GPU machine by benchmarks/gpu_suite.sh).

Real multi-process trials on the GPU: the `triton` kernel trains like the `torch` reference, two ranks
on one GPU fall back to gloo, the allocator's peak memory is reported, and `fp8_auto` records a timed
probe per layer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cubic_harness.trial import run_trial
from tests.helpers import require, tiny_cfg, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_triton_trial_trains_like_the_torch_reference_on_the_gpu() -> None:
    losses = {}
    tables = {}
    for k in ("torch", "triton"):
        losses[k], tables[k] = train(tiny_cfg(device="cuda", world_size=1, kernel=k))
    np.testing.assert_allclose(losses["triton"], losses["torch"], rtol=1e-4, atol=1e-5)
    for t in tables["torch"]:
        np.testing.assert_allclose(tables["triton"][t], tables["torch"][t], rtol=1e-4, atol=1e-5)


def test_tables_behind_a_uvm_cache_train_as_device_resident_ones() -> None:
    """FBGEMM's UVM cache (`uvm_cache_load_factor`: a tenth of each table's rows on the device, the rest in
    host memory): the same losses and tables as FBGEMM's tables in device memory; the numbers read back are
    the cache's (flushed), not stale host rows."""
    require("fbgemm_gpu")  # make installs it: absent under CI is a broken install, not a skip
    base = tiny_cfg(device="cuda", world_size=1, kernel="fbgemm", batch_size=256, measure_steps=8)
    device, dev_tables = train(base)
    cached, uvm_tables = train(base.replace(uvm_cache_load_factor=0.1))
    np.testing.assert_allclose(cached, device, rtol=1e-5, atol=1e-6)
    for t in dev_tables:
        np.testing.assert_allclose(uvm_tables[t], dev_tables[t], rtol=1e-5, atol=1e-6)


def test_two_ranks_on_one_gpu_fall_back_to_gloo_and_match_one_rank() -> None:
    one, t1 = train(tiny_cfg(device="cuda", world_size=1, batch_size=64, kernel="triton"))
    two, t2 = train(tiny_cfg(device="cuda", world_size=2, batch_size=32, kernel="triton",
                             sharding="row_wise"))
    np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5)
    for t in t1:
        np.testing.assert_allclose(t2[t], t1[t], rtol=1e-4, atol=1e-5)


def test_cuda_trial_reports_allocator_memory_and_the_gpu() -> None:
    res = run_trial(tiny_cfg(device="cuda", world_size=1, kernel="triton", measure_steps=6, windows=2))
    assert res.status == "ok", res.error
    assert res.qps > 0 and res.peak_mem_mb > 0
    # autograd runs the embedding update on its CUDA worker thread: it must still be in the breakdown
    assert res.breakdown_ms["emb_bwd"] > 0 and res.breakdown_ms["emb_fwd"] > 0
    assert res.env["device_name"] == torch.cuda.get_device_name(0)


def test_fp8_auto_trial_records_a_timed_probe_per_layer() -> None:
    res = run_trial(tiny_cfg(device="cuda", world_size=1, kernel="triton", dense_precision="fp8_auto",
                             measure_steps=4, windows=1))
    assert res.status == "ok", res.error
    probe = res.extra["fp8_probe"]
    assert {p["mlp"] for p in probe} == {"bottom", "top"}
    for p in probe:
        assert p["err_fp8_tensorwise"] is not None and p["reason"]
        if p["t_fp8_ms"] is not None:  # timed where the GEMM is fp8-eligible (dims % 16)
            assert p["use_fp8"] == (p["t_fp8_ms"] * 1.05 < p["t_bf16_ms"] and p["scaling"] is not None)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rowwise", [False, True])
def test_fused_fp8_quantisation_equals_torch_ops_bit_for_bit(dtype: torch.dtype, rowwise: bool) -> None:
    """kernels/fp8_quant.py: one pass gives exactly what the torch-op quantisation gives (CPU path)."""
    from cubic_harness.fp8 import _quant, _scale
    from cubic_kernels.fp8_quant import quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(300, 200, device="cuda", generator=gen) * 3).bfloat16()
    x[7, 11] = 3e4  # an outlier: most values land in the format's subnormals
    s, st = _scale(x, dtype, rowwise), _scale(x, dtype, False)
    q, qt = quantize(x, dtype, s, st)
    assert torch.equal(q.view(torch.uint8), _quant(x, dtype, s).view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), _quant(x, dtype, st).t().contiguous().view(torch.uint8))


def test_a_dense_step_replayed_as_a_cuda_graph_computes_what_the_eager_one_does() -> None:
    """`cubic calibrate` times the dense part's device work as a graph's replay (`calibrate.graphed`):
    the replay must run the step itself, so its gradients are an eager step's (a replay that ran
    nothing would leave them zero)."""
    from cubic_harness.model import build_dense_arch
    from cubic_harness.sim.calibrate import graphed
    from cubic_harness.workload import Workload

    wl, dev = Workload.small(), torch.device("cuda", 0)
    arch = build_dense_arch(wl, 0).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(512, wl.dense_features, device=dev, generator=g)
    pooled = torch.randn(512, wl.num_tables * wl.dim, device=dev, generator=g, requires_grad=True)
    y = torch.rand(512, device=dev, generator=g)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            logits = arch(x, pooled)
        torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), y).backward()

    def grads() -> list[torch.Tensor]:
        return [p.grad.clone() for p in (*arch.parameters(), pooled)]

    def zero() -> None:  # in place: the graph writes into these very tensors
        for p in (*arch.parameters(), pooled):
            if p.grad is not None:
                p.grad.zero_()

    step()
    zero()
    step()
    eager = grads()
    replay = graphed(step, dev)
    zero()
    replay()
    torch.cuda.synchronize()
    for a, b in zip(grads(), eager, strict=True):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)
