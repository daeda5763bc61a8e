"""FP8 probe and Fp8Linear. On CPU fp8 is emulated (exact fp8 rounding through torch.float8_* casts), so
the numerics part of the probe is real; the speed part needs a GPU (one test runs only there)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from cubic_harness.fp8 import (
    DEFAULT_THRESHOLD,
    Fp8Linear,
    apply_fp8,
    fp8_supported,
    probe_layers,
    probe_mlp,
    probes_to_json,
    tensor_stats,
)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def _outlier_layer(gen: torch.Generator, ratio: float = 1e6) -> tuple[nn.Linear, torch.Tensor]:
    """An unnormalised dense feature: channel 0 is `ratio` times larger, its weights `ratio` times
    smaller (as training would make them), so it does not dominate the output; any fp8 scale that
    covers it crushes the other 63 features into e4m3's subnormals."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)
    with torch.no_grad():
        lin.weight[:, 0] /= ratio
    x = torch.randn(256, 64, generator=gen)
    x[:, 0] *= ratio
    return lin, x


def test_probe_flags_outliers_unsafe_and_well_scaled_safe() -> None:
    gen = torch.Generator().manual_seed(0)
    bad, x_bad = _outlier_layer(gen)
    torch.manual_seed(1)
    good = nn.Linear(64, 32)
    x_good = [torch.randn(128, 64, generator=gen) for _ in range(2)]
    p_bad, p_good = probe_layers({"bad": bad, "good": good}, [[x_bad], x_good])

    assert p_bad.name == "bad" and not p_bad.use_fp8 and p_bad.scaling is None
    assert min(p_bad.err_fp8_tensorwise, p_bad.err_fp8_rowwise) > DEFAULT_THRESHOLD
    assert p_bad.reason.startswith("unsafe") and p_bad.act_stats["channel_spread"] > 1e4

    assert p_good.scaling in ("tensorwise", "rowwise")
    assert max(p_good.err_fp8_tensorwise, p_good.err_fp8_rowwise) < 0.06  # e4m3: ~3.7% per sample
    assert p_good.err_bf16 < 0.01 and p_good.err_grad_e5m2 < 0.1
    assert (p_good.in_features, p_good.out_features) == (64, 32)
    # on CPU no speed-up can be shown, so fp8_auto must not turn fp8 on, and says why
    assert not p_good.use_fp8 and p_good.t_fp8_ms is None and p_good.t_bf16_ms is None
    assert "speed-up" in p_good.reason and "cpu" in p_good.reason
    # JSON-serialisable for TrialResult.extra["fp8_probe"] (strict: no NaN/inf)
    back = json.loads(json.dumps(probes_to_json([p_bad, p_good]), allow_nan=False))
    assert back[1]["name"] == "good" and back[1]["use_fp8"] is False


def test_stats_see_outliers() -> None:
    x = torch.randn(1000, 16)
    s0 = tensor_stats(x)
    x[3, 5] = 1e4
    s1 = tensor_stats(x)
    assert 2.5 < s0["kurtosis"] < 3.5 and s0["outlier_ratio"] < 6
    assert s1["outlier_ratio"] > 50 and s1["kurtosis"] > 100


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_linear_forward_close_to_bf16(scaling: str) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    x = torch.randn(32, 7, 128)  # extra leading dims are flattened and restored
    f = Fp8Linear(lin, scaling)
    assert f.emulate  # CPU
    y = f(x)
    ref = lin(x)
    assert y.shape == ref.shape and y.dtype == x.dtype
    y_bf16 = nn.functional.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    assert _rel(y_bf16, ref) < 0.01
    assert _rel(y, ref) < 0.06 and _rel(y, y_bf16) < 0.06
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f(x).dtype == torch.bfloat16
    # the emulation rounds through real fp8: inputs exactly representable in e4m3 at scale 1 give the
    # exact result (the scale is amax/448, so put 448 in the tensor)
    xi = torch.tensor([[448.0, 1.0, -2.0, 0.5]])
    wi = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        wi.weight.copy_(torch.tensor([[448.0, 1.0, 1.0, 1.0], [0.25, -448.0, 0.0, 2.0]]))
    torch.testing.assert_close(Fp8Linear(wi, "tensorwise")(xi), wi(xi))


def test_fp8_linear_gradients_flow() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    ref_lin = nn.Linear(64, 48)
    ref_lin.load_state_dict(lin.state_dict())
    x = torch.randn(96, 64, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    gy = torch.randn(96, 48)
    Fp8Linear(lin)(x).backward(gy)
    ref_lin(xr).backward(gy)
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert _rel(x.grad, xr.grad) < 0.1  # e5m2 gradient: 2 mantissa bits
    assert _rel(lin.weight.grad, ref_lin.weight.grad) < 0.1
    torch.testing.assert_close(lin.bias.grad, ref_lin.bias.grad)


def test_probe_mlp_and_apply_fp8() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32), nn.ReLU()),
                        nn.Linear(32, 1))
    batches = [torch.randn(64, 32) for _ in range(2)]
    probes = probe_mlp(mlp, batches)
    assert [p.name for p in probes] == ["0", "2.0", "3"]
    assert [(p.in_features, p.out_features) for p in probes] == [(32, 64), (64, 32), (32, 1)]
    with torch.no_grad():  # layer 2.0's inputs: the first layer's output after its ReLU, over both batches
        seen = torch.cat([mlp[1](mlp[0](b)) for b in batches])
    assert probes[1].act_stats["absmax"] == pytest.approx(float(seen.abs().max()))
    assert probes[1].act_stats["rms"] == pytest.approx(float(seen.pow(2).mean().sqrt()), rel=1e-5)
    assert isinstance(mlp[0], nn.Linear)  # probing does not touch the model

    auto = apply_fp8(mlp, json.loads(json.dumps(probes_to_json(probes))), "fp8_auto")
    assert auto == [] and isinstance(mlp[0], nn.Linear)  # CPU: nothing proven faster

    ref = mlp(batches[0]).detach()
    swapped = apply_fp8(mlp, probes, "fp8_all")
    assert swapped == ["0", "2.0", "3"]
    assert isinstance(mlp[0], Fp8Linear) and isinstance(mlp[2][0], Fp8Linear)
    out = mlp(batches[0])
    assert _rel(out, ref) < 0.1
    out.sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())
    with pytest.raises(ValueError):
        apply_fp8(mlp, probes, "fp8_sometimes")


@pytest.mark.skipif(not fp8_supported("cuda" if torch.cuda.is_available() else "cpu")[0],
                    reason="needs a GPU with fp8 tensor cores")
def test_cuda_scaled_mm_matches_emulation() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 128).cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for scaling in ("tensorwise", "rowwise"):
        if not fp8_supported("cuda", scaling)[0]:
            continue
        real, emu = Fp8Linear(lin, scaling), Fp8Linear(lin, scaling, emulate=True)
        assert not real.emulate
        torch.testing.assert_close(real(x).float(), emu(x).float(), rtol=2e-2, atol=2e-2)
    p = probe_layers([lin], [[x.detach()]], device="cuda")[0]
    assert p.t_bf16_ms is not None and p.t_fp8_ms is not None and p.reason
