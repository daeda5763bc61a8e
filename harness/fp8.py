"""FP8 for the dense MLPs, decided per layer by a probe (LoKA-style applicability check).

Why a probe: fp8 (e4m3 activations/weights, e5m2 gradients) only pays where the GEMM is large enough
for the fp8 tensor cores to beat bf16 *after* the quantisation overhead, and it is only safe where
the layer's data fit e4m3's 3 mantissa bits and limited range. Both depend on the model and its
real data (an unnormalised dense feature makes a bottom-MLP layer unsafe; a 1024x1024 top-MLP layer
is usually both safe and faster), so we measure instead of guessing:

* `probe_mlp(mlp, batches)` runs real batches through the model, captures every `nn.Linear`'s real
  inputs, and for each layer records input/weight statistics, the output error of fp8 (tensor-wise
  and row-wise scaling) and of bf16 against an fp32 reference, the e5m2 input-gradient error, and
  (on CUDA) the fwd+bwd time of bf16 vs fp8. `use_fp8` is True only when the error is under the
  threshold AND fp8 was measured faster. On CPU fp8 is emulated (exact fp8 rounding via
  `torch.float8_*` casts), so the error part is real but no speed-up can be shown: `use_fp8` stays
  False and `reason` says so.
* `Fp8Linear` computes a Linear in fp8: on CUDA with `torch._scaled_mm` (dynamic "current" amax
  scaling), elsewhere emulated with the same quantisation so numerics match.
* `apply_fp8(mlp, probes, mode)` swaps Linears for `Fp8Linear`: `fp8_auto` only the layers the probe
  approved, `fp8_all` every Linear.

Error metric: the mean over samples of the per-sample relative error ||y_i - y_ref_i|| / ||y_ref_i||.
A whole-tensor relative error would hide the failure mode that matters: outliers force a scale under
which the ordinary samples/features are crushed into e4m3's subnormals while the few large outputs,
which dominate a Frobenius norm, stay accurate.

Probe results are plain JSON (`LayerProbe.to_dict`) for TrialResult.extra["fp8_probe"].
"""

from __future__ import annotations

import copy
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from cubic_harness.config import json_safe

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
SCALINGS = ("tensorwise", "rowwise")
MODES = ("fp8_auto", "fp8_all")
DEFAULT_THRESHOLD = 0.1  # mean per-sample relative output error; well-scaled e4m3 layers sit near 0.04


# -- capability ---------------------------------------------------------------------------------------
def fp8_supported(device: str | torch.device, scaling: str = "tensorwise") -> tuple[bool, str]:
    """Whether real fp8 GEMMs (`torch._scaled_mm`) can run on `device`; the reason if not."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"no fp8 tensor cores on {device.type}: fp8 is emulated (numerics only, no speed-up)"
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False, "torch has no CUDA / _scaled_mm"
    cap = torch.cuda.get_device_capability(device)
    need = (9, 0) if scaling == "rowwise" else (8, 9)
    if cap < need:
        return False, f"{scaling} fp8 needs compute capability >= {need[0]}.{need[1]}, have {cap[0]}.{cap[1]}"
    return True, "ok"


def _gemm_eligible(in_features: int, out_features: int) -> bool:
    """cuBLASLt fp8 GEMMs need K and N divisible by 16."""
    return in_features % 16 == 0 and out_features % 16 == 0


# -- quantisation and the fp8 GEMM --------------------------------------------------------------------
def _scale(t: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> torch.Tensor:
    """Dequantisation scale (amax / fp8 max), per row `[M, 1]` or per tensor `[]`, fp32 (one pass)."""
    t = t.detach()
    a = (torch.linalg.vector_norm(t, math.inf, dim=1, keepdim=True) if rowwise
         else torch.linalg.vector_norm(t, math.inf))
    return (a.float() / FP8_MAX[dtype]).clamp_min(1e-12)


def _quant(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    m = FP8_MAX[dtype]
    return (t.float() / scale).clamp(-m, m).to(dtype)


def _quant_pair(t: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor,
                scale_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 `t` under `scale` and fp8 `t.T` (contiguous) under the tensor-wise `scale_t`.

    On CUDA one fused pass (kernels/fp8_quant.py); elsewhere torch ops, the same values."""
    if t.is_cuda and os.environ.get("CUBIC_FP8_QUANT", "fused") == "fused":  # =torch: the op path, to compare
        from cubic_kernels.fp8_quant import quantize

        return quantize(t, dtype, scale, scale_t)
    return _quant(t, dtype, scale), _quant(t, dtype, scale_t).t().contiguous()


def _pad_k(t: torch.Tensor, k: int) -> torch.Tensor:
    """Zero-pad the last dim of an fp8 tensor to `k` (zero bits are 0.0 in both fp8 formats)."""
    if t.shape[-1] == k:
        return t
    return torch.nn.functional.pad(t.view(torch.uint8), (0, k - t.shape[-1])).view(t.dtype)


def _mm(a: torch.Tensor, sa: torch.Tensor, b_t: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
        emulate: bool) -> torch.Tensor:
    """(a * sa) @ (b_t * sb).T for fp8 `a [M,K]`, `b_t [N,K]`; sa `[]|[M,1]`, sb `[]|[N,1]`.

    CUDA: `torch._scaled_mm` (fp32 accumulate; K zero-padded to a multiple of 16 as cuBLASLt wants;
    row-wise scales produce bf16, then cast). Emulated: dequantise to fp32 and matmul, the same values
    up to summation order.
    """
    if emulate:
        return ((a.float() * sa) @ (b_t.float() * sb).t()).to(out_dtype)
    k = -(-a.shape[1] // 16) * 16
    a, b_t = _pad_k(a, k), _pad_k(b_t, k)
    rowwise = sa.dim() > 0 or sb.dim() > 0
    y = torch._scaled_mm(a, b_t.t(), scale_a=sa, scale_b=sb.reshape(1, -1) if sb.dim() else sb,
                         out_dtype=torch.bfloat16 if rowwise else out_dtype)
    return y.to(out_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    """y = x W^T (+ b) with e4m3 x and W; backward with e5m2 grad_out (tensor-wise scales).

    Backward scales are tensor-wise whatever the forward used: in grad_w = g^T x the reduction runs
    over the samples, along which per-sample scales cannot be factored out of the GEMM. With
    tensor-wise forward scaling the fp8 copies are saved (1 byte/elem) instead of re-quantised.
    """

    @staticmethod
    def forward(ctx, x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rowwise: bool, emulate: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
        # forward operands under the chosen scaling; the backward's transposed operands (x^T for
        # grad_w, W^T for grad_x) quantised tensor-wise in the same pass and saved (1 byte/elem)
        sx, sw = _scale(x2, E4M3, rowwise), _scale(w, E4M3, rowwise)
        sx_t, sw_t = (sx.amax(), sw.amax()) if rowwise else (sx, sw)
        xq, xq_t = _quant_pair(x2, E4M3, sx, sx_t)
        wq, wq_t = _quant_pair(w, E4M3, sw, sw_t)
        y = _mm(xq, sx, wq, sw, out_dtype, emulate)
        if b is not None:
            y = y + b.to(out_dtype)
        ctx.save_for_backward(xq_t, sx_t, wq_t, sw_t)
        ctx.emulate, ctx.has_bias = emulate, b is not None
        ctx.dtypes = (x2.dtype, w.dtype)
        return y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        xq_t, sx_t, wq_t, sw_t = ctx.saved_tensors
        gy = gy.contiguous()
        sg = _scale(gy, E5M2, False)
        gq, gq_t = _quant_pair(gy, E5M2, sg, sg)
        # grad_x [M,K] = g [M,N] @ W [N,K];  grad_w [N,K] = g^T [N,M] @ x [M,K]
        gx = _mm(gq, sg, wq_t, sw_t, ctx.dtypes[0], ctx.emulate)
        gw = _mm(gq_t, sg, xq_t, sx_t, ctx.dtypes[1], ctx.emulate)
        gb = gy.sum(0, dtype=torch.float32).to(ctx.dtypes[1]) if ctx.has_bias else None
        return gx, gw, gb, None, None, None


class Fp8Linear(nn.Module):
    """A Linear computed in fp8, sharing the wrapped Linear's parameters (weights stay high precision).

    Forward e4m3 x/W with dynamic amax scaling ("tensorwise" or "rowwise": per sample and per output
    feature); backward e5m2 gradients, tensor-wise. Output dtype: the autocast dtype when autocast is
    on, else the input's dtype. `emulate=None` picks real fp8 on a capable GPU and eligible shape,
    emulation otherwise.
    """

    def __init__(self, linear: nn.Linear, scaling: str = "tensorwise", emulate: bool | None = None) -> None:
        super().__init__()
        if scaling not in SCALINGS:
            raise ValueError(f"fp8 scaling {scaling!r}; choose one of {list(SCALINGS)}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.scaling = scaling
        if emulate is None:
            ok, _ = fp8_supported(linear.weight.device, scaling)
            emulate = not (ok and _gemm_eligible(self.in_features, self.out_features))
        self.emulate = emulate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):  # we choose the dtypes; autocast must not recast
            y = _Fp8LinearFn.apply(x.reshape(-1, self.in_features), self.weight, self.bias,
                                   self.scaling == "rowwise", self.emulate, out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"scaling={self.scaling}, emulate={self.emulate}")


# -- the probe ----------------------------------------------------------------------------------------
def tensor_stats(t: torch.Tensor) -> dict[str, float]:
    """absmax, rms, outlier ratio (absmax / rms), kurtosis (4th standardised moment; 3 = Gaussian)
    and channel spread (largest / median per-column absmax: one feature far off the others)."""
    t = t.detach().float().reshape(-1, t.shape[-1])
    absmax = t.abs().max().item()
    rms = t.pow(2).mean().sqrt().item()
    c = t - t.mean()
    var = c.pow(2).mean().item()
    col = t.abs().amax(0)
    return {"absmax": absmax, "rms": rms, "outlier_ratio": absmax / max(rms, 1e-30),
            "kurtosis": c.pow(4).mean().item() / max(var * var, 1e-30),
            "channel_spread": col.max().item() / max(col.median().item(), 1e-30)}


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over rows of ||y_i - ref_i|| / ||ref_i|| (see module docstring for why per row)."""
    y, ref = y.float().reshape(-1, y.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    num = (y - ref).norm(dim=1)
    den = ref.norm(dim=1).clamp_min(1e-30)
    return (num / den).mean().item()


@dataclass
class LayerProbe:
    name: str
    in_features: int
    out_features: int
    act_stats: dict[str, float] = field(default_factory=dict)
    weight_stats: dict[str, float] = field(default_factory=dict)
    err_bf16: float = math.nan
    err_fp8_tensorwise: float = math.nan
    err_fp8_rowwise: float = math.nan
    err_grad_e5m2: float = math.nan  # input-gradient error, synthetic Gaussian upstream gradient
    scaling: str | None = None  # the scaling fp8 would use (lowest error under the threshold)
    t_bf16_ms: float | None = None  # fwd+bwd, median
    t_fp8_ms: float | None = None
    use_fp8: bool = False
    reason: str = ""

    def to_dict(self) -> dict:
        """JSON-safe: non-finite floats become None."""
        return json_safe(asdict(self))


def probes_to_json(probes: Sequence[LayerProbe]) -> list[dict]:
    return [p.to_dict() for p in probes]


def _time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 7, inner: int = 10,
             warmup: int = 3) -> float:
    """Median ms per call with CUDA events (warm-up excluded, `inner` calls per measurement)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def _fwd_bwd(layer: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(True)
        layer(xx).backward(gy)
    return step


@torch.no_grad()
def _errors(lin: nn.Linear, xs: Sequence[torch.Tensor], emulate: bool) -> dict[str, float]:
    errs: dict[str, list[float]] = {"bf16": [], "tensorwise": [], "rowwise": []}
    for x in xs:
        x = x.float()
        ref = torch.nn.functional.linear(x, lin.weight.float(), lin.bias)
        wb = lin.weight.bfloat16()
        bb = None if lin.bias is None else lin.bias.bfloat16()
        errs["bf16"].append(_rel_err(torch.nn.functional.linear(x.bfloat16(), wb, bb), ref))
        for sc in SCALINGS:
            y = Fp8Linear(lin, sc, emulate=emulate or (sc == "rowwise" and not fp8_supported(
                x.device, "rowwise")[0]))(x.bfloat16())
            errs[sc].append(_rel_err(y, ref))
    return {k: statistics.fmean(v) for k, v in errs.items()}


def _grad_err(lin: nn.Linear, x: torch.Tensor, emulate: bool, gen: torch.Generator) -> float:
    x = x.float()
    gy = torch.randn(x.shape[0], lin.out_features, generator=gen).to(x.device)
    ref = gy @ lin.weight.detach().float()
    xx = x.bfloat16().requires_grad_(True)
    Fp8Linear(lin, "tensorwise", emulate=emulate)(xx).backward(gy.bfloat16())
    return _rel_err(xx.grad, ref)


def probe_layers(layers: Sequence[nn.Linear] | dict[str, nn.Linear], inputs: Sequence[Sequence[torch.Tensor]],
                 *, device: str | torch.device = "cpu", threshold: float = DEFAULT_THRESHOLD,
                 time_it: bool = True, min_speedup: float = 1.05) -> list[LayerProbe]:
    """Probe each Linear on its own real inputs: `inputs[i]` is the list of batches fed to layer i.

    Layers are copied (fp32) to `device`; the model is not touched. fp8 must beat bf16 by
    `min_speedup` (a margin over timing noise, so a tie does not flip the decision between runs).
    """
    named = (list(layers.items()) if isinstance(layers, dict)
             else [(f"layer{i}", m) for i, m in enumerate(layers)])
    if len(named) != len(inputs):
        raise ValueError(f"{len(named)} layers but {len(inputs)} input lists")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    out: list[LayerProbe] = []
    for (name, layer), xs in zip(named, inputs, strict=True):
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"{name}: expected nn.Linear, got {type(layer).__name__}")
        lin = copy.deepcopy(layer).float().to(device)
        xs = [x.detach().to(device).reshape(-1, lin.in_features) for x in xs]
        if not xs:
            raise ValueError(f"{name}: no input batches")
        ok_tw, why = fp8_supported(device, "tensorwise")
        eligible = _gemm_eligible(lin.in_features, lin.out_features)
        emulate = not (ok_tw and eligible)
        p = LayerProbe(name, lin.in_features, lin.out_features,
                       act_stats=tensor_stats(torch.cat(xs)), weight_stats=tensor_stats(lin.weight))
        e = _errors(lin, xs, emulate)
        p.err_bf16, p.err_fp8_tensorwise, p.err_fp8_rowwise = e["bf16"], e["tensorwise"], e["rowwise"]
        with torch.enable_grad():
            p.err_grad_e5m2 = _grad_err(lin, xs[0], emulate, gen)
        ok_rw = fp8_supported(device, "rowwise")[0] or emulate
        candidates = [(e["tensorwise"], "tensorwise")] + ([(e["rowwise"], "rowwise")] if ok_rw else [])
        best_err, best = min(candidates)
        safe = best_err <= threshold
        p.scaling = best if safe else None
        acc = (f"fp8 error {best_err:.3g} ({best}) {'<=' if safe else '>'} threshold {threshold:g}"
               f" (bf16 {e['bf16']:.2g})")
        if not safe:
            p.reason = (f"unsafe: {acc}; input outlier ratio {p.act_stats['outlier_ratio']:.3g}, "
                        f"channel spread {p.act_stats['channel_spread']:.3g}")
        elif not ok_tw:
            p.reason = f"safe ({acc}) but not enabled: {why}; fp8_auto needs a measured speed-up"
        elif not eligible:
            p.reason = f"safe ({acc}) but not enabled: in/out features must be multiples of 16 for fp8 GEMMs"
        elif not time_it:
            p.reason = f"safe ({acc}) but not enabled: timing skipped (time_it=False)"
        else:
            x = xs[0].bfloat16()
            gy = torch.randn(x.shape[0], lin.out_features, device=device, dtype=torch.bfloat16)
            p.t_bf16_ms = _time_ms(_fwd_bwd(copy.deepcopy(lin).bfloat16(), x, gy), device)
            p.t_fp8_ms = _time_ms(_fwd_bwd(Fp8Linear(lin, best, emulate=False), x, gy), device)
            p.use_fp8 = p.t_fp8_ms * min_speedup < p.t_bf16_ms
            speed = (f"fwd+bwd fp8 {p.t_fp8_ms:.3g} ms vs bf16 {p.t_bf16_ms:.3g} ms "
                     f"(needs {min_speedup:g}x)")
            p.reason = f"{'fp8' if p.use_fp8 else 'bf16'}: {acc}; {speed}"
        out.append(p)
    return out


def probe_mlp(mlp: nn.Module, batches: Sequence[torch.Tensor | tuple[torch.Tensor, ...]], *,
              device: str | torch.device = "cpu", threshold: float = DEFAULT_THRESHOLD, time_it: bool = True,
              min_speedup: float = 1.05) -> list[LayerProbe]:
    """Run `batches` (the module's real inputs: a tensor, or a tuple of its forward's arguments) through
    `mlp` in fp32 and probe every nn.Linear on the inputs it actually saw, wherever it sits (MLPs, DCN
    cross layers, Wukong blocks); names are the module's qualified names (what `apply_fp8` matches)."""
    device = torch.device(device)
    model = copy.deepcopy(mlp).float().to(device).eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
    hooks = [m.register_forward_pre_hook(lambda _m, args, n=n: seen[n].append(args[0].detach().float()))
             for n, m in linears.items()]
    try:
        with torch.no_grad():
            for b in batches:
                model(*(x.to(device).float() for x in (b if isinstance(b, tuple) else (b,))))
    finally:
        for h in hooks:
            h.remove()
    return probe_layers(linears, [seen[n] for n in linears], device=device, threshold=threshold,
                        time_it=time_it, min_speedup=min_speedup)


def apply_fp8(mlp: nn.Module, probes: Sequence[LayerProbe | dict] | None, mode: str) -> list[str]:
    """Swap nn.Linear children of `mlp` for Fp8Linear in place; returns the swapped names.

    `fp8_auto`: only layers whose probe says `use_fp8` (so nothing on CPU). `fp8_all`: every Linear,
    with the probe's scaling where it chose one, else tensor-wise. Probes may be LayerProbe objects or
    their dicts (e.g. read back from a TrialResult); names are `probe_mlp`'s qualified names.
    """
    if mode not in MODES:
        raise ValueError(f"fp8 mode {mode!r}; choose one of {list(MODES)}")
    by_name = {}
    for p in probes or []:
        d = p.to_dict() if isinstance(p, LayerProbe) else p
        by_name[d["name"]] = d
    if mode == "fp8_auto" and probes is None:
        raise ValueError("fp8_auto needs the probe results")
    swapped = []
    for name, mod in list(mlp.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        d = by_name.get(name)
        if mode == "fp8_auto" and not (d and d["use_fp8"]):
            continue
        if not name:
            raise ValueError("apply_fp8 swaps the Linears inside a module; wrap a bare Linear first")
        parent_name, _, attr = name.rpartition(".")
        parent = mlp.get_submodule(parent_name) if parent_name else mlp
        setattr(parent, attr, Fp8Linear(mod, (d or {}).get("scaling") or "tensorwise"))
        swapped.append(name)
    return swapped
