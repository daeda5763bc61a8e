"""What the dense part of a workload costs per sample: GEMM FLOPs (forward, backward), parameters, activations.

Counted from the workload alone (the equations in harness/model.py), never from a built module, so the
performance model prices a 4,096-GPU configuration without building anything; tests hold the counts
equal to `torch.utils.flop_counter` and `numel()` on the real modules.

The rules, per GEMM y = x W^T of m x k by k x n: forward 2mkn; backward 2mkn for the weight gradient
plus 2mkn for the input gradient when the input needs one. Only the bottom MLP's first layer has an
input (the dense features) that needs none. Elementwise work (ReLU, LayerNorm, the cross layer's
product, bias adds) is not counted: it is bandwidth, not FLOPs, and small beside the GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

from cubic_harness.workload import Workload


@dataclass(frozen=True)
class DenseCost:
    """Per sample: GEMM FLOPs forward / backward, activation floats kept for backward; parameters in total."""

    flops_fwd: int
    flops_bwd: int
    params: int
    act_floats: int
    gemms: tuple[tuple[int, int], ...] = ()  # per GEMM: (forward, backward) FLOPs per sample, in order
    # What autograd really keeps for the backward (memory, not time): each saved tensor once (a layer's output is
    # the next one's input), floats per sample; `kept` runs in bf16 under autocast, `kept_fp32` stays fp32
    kept: tuple[int, ...] = ()
    kept_fp32: tuple[int, ...] = ()

    @property
    def flops(self) -> int:
        return self.flops_fwd + self.flops_bwd


class _Count:
    """Accumulates GEMMs and parameters as the model's layers are walked in order."""

    def __init__(self) -> None:
        self.fwd = self.bwd = self.act = self.params = 0
        self.gemms: list[tuple[int, int]] = []
        self.kept: list[int] = []
        self.kept_fp32: list[int] = []

    def keep(self, *floats: int, fp32: bool = False) -> None:
        """Tensors of `floats` per sample each that autograd saves for the backward (`fp32`: even under autocast)."""
        (self.kept_fp32 if fp32 else self.kept).extend(f for f in floats if f)

    def linear(self, rows: int, k: int, n: int, bias: bool = True, input_grad: bool = True) -> None:
        """`rows` rows of a k -> n Linear per sample."""
        f = 2 * rows * k * n
        self.fwd += f
        self.bwd += f * (2 if input_grad else 1)
        self.gemms.append((f, f * (2 if input_grad else 1)))
        self.act += rows * (k + n)
        self.params += k * n + (n if bias else 0)

    def mlp(self, sizes: list[int], n_in: int, first_input_grad: bool = True) -> int:
        for i, s in enumerate(sizes):
            self.linear(1, n_in, s, input_grad=first_input_grad or i > 0)
            n_in = s
        return n_in

    def bmm(self, m: int, k: int, n: int) -> None:
        f = 2 * m * k * n
        self.fwd += f
        self.bwd += 2 * f  # both operands are activations
        self.gemms.append((f, 2 * f))
        self.act += m * k + k * n + m * n

    def norm(self, width: int) -> None:
        """A LayerNorm over `width` features (its input is counted where it was produced)."""
        self.params += 2 * width


def dense_cost(wl: Workload) -> DenseCost:
    """Exact GEMM FLOPs and parameters of `cubic_harness.model.DenseArch(wl)` per sample."""
    c = _Count()
    n, d = wl.num_features, wl.dim
    c.mlp(list(wl.bottom_mlp), wl.dense_features, first_input_grad=False)
    c.keep(*wl.bottom_mlp)  # the bottom MLP's ReLU outputs (its input is the batch's dense features)
    if wl.interaction == "dot":
        c.bmm(n, d, n)
        c.keep(n * d)  # the feature matrix, both of the bmm's operands; its gather keeps only indices
        top_in = d + n * (n - 1) // 2
    elif wl.interaction == "dcn":
        w, r = n * d, wl.dcn_rank
        c.keep(w)  # x_0, kept by every layer's product (one tensor)
        for i in range(wl.dcn_layers):
            if r:
                c.linear(1, w, r, bias=False)
                c.linear(1, r, w)
            else:
                c.linear(1, w, w)
            c.act += 2 * w  # x_0 * (.) keeps both factors
            # the layer's input (x_0 itself for the first), V's output, and U's output (the product's factor)
            c.keep(w if i else 0, r, w)
        top_in = w
    else:
        n_fm, n_lcb, k = wl.wukong_fm_embs, wl.wukong_lcb_embs, wl.wukong_rank
        for _ in range(wl.wukong_layers):
            c.linear(d, n, n_lcb, bias=False)  # LCB: d rows of n -> n_L
            c.linear(d, n, k, bias=False)  # X^T Y
            c.bmm(n, d, k)  # X (X^T Y)
            c.norm(n * k)  # the FM block's LayerNorm before its MLP
            c.mlp([*wl.wukong_mlp, n_fm * d], n * k)
            # the layer's input X and a contiguous copy of X^T that the projections read (the residual's
            # projection one more), X^T Y, the FM block's MLP input and ReLU outputs; the LayerNorms' inputs in
            # fp32 (autocast runs them in fp32)
            c.keep(n * d, n * d, n * d if n != n_fm + n_lcb else 0, d * k, n * k, *wl.wukong_mlp)
            c.keep(n * k, fp32=True)
            if n != n_fm + n_lcb:
                c.linear(d, n, n_fm + n_lcb, bias=False)
            n = n_fm + n_lcb
            c.norm(d)
            c.act += n * d
            c.keep(n * d, fp32=True)
        top_in = n * d
    c.mlp(list(wl.top_mlp), top_in)
    c.keep(top_in, *wl.top_mlp[:-1])  # the top MLP's input and ReLU outputs
    return DenseCost(c.fwd, c.bwd, c.params, c.act, tuple(c.gemms), tuple(c.kept), tuple(c.kept_fp32))
