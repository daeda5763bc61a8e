"""The model families (dot, DCN-v2, Wukong): against references written from the papers' equations, their
cost counts against torch's own, their workload keys, and real multi-rank trials that learn."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from cubic_harness.config import TrialConfig
from cubic_harness.dense_cost import dense_cost
from cubic_harness.errors import ConfigError
from cubic_harness.model import CrossNet, WukongLayer, build_dense_arch
from cubic_harness.sim.backend import simulate
from cubic_harness.trial import run_trial
from cubic_harness.workload import Workload
from tests.helpers import fixture_cluster, reference, tiny_cfg, train

DCN = {"preset": "tiny", "interaction": "dcn", "dcn_layers": 2, "dcn_rank": 12}
DCN_FULL = {**DCN, "dcn_rank": 0}
WUKONG = {"preset": "tiny", "interaction": "wukong", "wukong_layers": 2, "wukong_fm_embs": 3,
          "wukong_lcb_embs": 2, "wukong_rank": 4, "wukong_mlp": [24]}  # 7 features -> 5: a residual projection
WUKONG_SQUARE = {**WUKONG, "wukong_fm_embs": 4, "wukong_lcb_embs": 3}  # 7 -> 7: identity residual
FAMILIES = {"dcn": DCN, "dcn_full": DCN_FULL, "wukong": WUKONG, "wukong_square": WUKONG_SQUARE}


# ---------------------------------------------------------------------------------------------- references
def _lin(x: torch.Tensor, P: dict, name: str) -> torch.Tensor:
    b = P.get(f"{name}.bias")
    return x @ P[f"{name}.weight"].T + (0 if b is None else b)


def _mlp(x: torch.Tensor, P: dict, prefix: str, n: int, final_relu: bool) -> torch.Tensor:
    for i in range(n):
        x = _lin(x, P, f"{prefix}.{2 * i}")
        if i < n - 1 or final_relu:
            x = torch.relu(x)
    return x


def ref_logits(wl: Workload, P: dict, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """The whole dense model from the equations, as plain tensor algebra over the weights in P."""
    B, d = dense.shape[0], wl.dim
    x = _mlp(dense, P, "bottom", len(wl.bottom_mlp), True)
    X = torch.cat([x, pooled], 1).view(B, wl.num_features, d)  # [B, n, d]
    if wl.interaction == "dot":
        n = wl.num_features
        z = torch.einsum("bid,bjd->bij", X, X)
        i, j = zip(*[(i, j) for i in range(n) for j in range(i)], strict=True)
        h = torch.cat([x, z[:, list(i), list(j)]], 1)
    elif wl.interaction == "dcn":  # x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l  |  x_0 * (W_l x_l + b_l) + x_l
        x0 = xl = X.reshape(B, -1)
        for layer in range(wl.dcn_layers):
            p = f"inter.layers.{layer}"
            if wl.dcn_rank:
                inner = (xl @ P[f"{p}.V.weight"].T) @ P[f"{p}.U.weight"].T + P[f"{p}.U.bias"]
            else:
                inner = xl @ P[f"{p}.W.weight"].T + P[f"{p}.W.bias"]
            xl = x0 * inner + xl
        h = xl
    else:  # X_{i+1} = LN(concat(MLP(LN(flat(X X^T Y))), W_L X) + res(X))
        for layer in range(wl.wukong_layers):
            p = f"inter.layers.{layer}"
            n = X.shape[1]
            Y = P[f"{p}.fm_proj.weight"].T  # [n, k]
            fm = torch.einsum("bnd,bmd,mk->bnk", X, X, Y).reshape(B, -1)
            fm = F.layer_norm(fm, fm.shape[1:], P[f"{p}.fm_norm.weight"], P[f"{p}.fm_norm.bias"])
            fm = _mlp(fm, P, f"{p}.fm_mlp", len(wl.wukong_mlp) + 1, False).view(B, wl.wukong_fm_embs, d)
            lcb = torch.einsum("ln,bnd->bld", P[f"{p}.lcb.weight"], X)
            m = wl.wukong_fm_embs + wl.wukong_lcb_embs
            res = X if n == m else torch.einsum("mn,bnd->bmd", P[f"{p}.res.weight"], X)
            X = F.layer_norm(torch.cat([fm, lcb], 1) + res, (d,), P[f"{p}.norm.weight"], P[f"{p}.norm.bias"])
        h = X.reshape(B, -1)
    return _mlp(h, P, "top", len(wl.top_mlp), False).squeeze(-1)


def _inputs(wl: Workload, B: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(B, wl.dense_features, generator=g)
    pooled = torch.randn(B, wl.num_tables * wl.dim, generator=g) * 0.5
    labels = (torch.rand(B, generator=g) < 0.4).float()
    return dense, pooled, labels


@pytest.mark.parametrize("fam", ["dot", *FAMILIES])
def test_forward_and_one_training_step_match_the_equations(fam: str) -> None:
    wl = Workload.from_dict(FAMILIES.get(fam, {"preset": "tiny"}))
    model = build_dense_arch(wl, seed=3)
    P = {k: v.detach().clone().requires_grad_(True) for k, v in model.named_parameters()}
    dense, pooled, labels = _inputs(wl)
    pooled_m, pooled_r = pooled.clone().requires_grad_(True), pooled.clone().requires_grad_(True)

    y = model(dense, pooled_m)
    y_ref = ref_logits(wl, P, dense, pooled_r)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)

    opt, opt_ref = torch.optim.Adagrad(model.parameters(), lr=0.05), torch.optim.Adagrad(P.values(), lr=0.05)
    F.binary_cross_entropy_with_logits(y, labels).backward()
    F.binary_cross_entropy_with_logits(y_ref, labels).backward()
    torch.testing.assert_close(pooled_m.grad, pooled_r.grad, rtol=1e-5, atol=1e-7)  # what the tables receive
    opt.step()
    opt_ref.step()
    for k, v in model.named_parameters():
        torch.testing.assert_close(v, P[k], rtol=1e-5, atol=1e-6, msg=k)
    with torch.no_grad():
        torch.testing.assert_close(model(dense, pooled), ref_logits(wl, P, dense, pooled), rtol=1e-5, atol=1e-6)


def test_low_rank_fm_at_rank_n_with_identity_projection_is_the_full_fm() -> None:
    n, d = 7, 8
    layer = WukongLayer(n, d, n_fm=3, n_lcb=4, rank=n, widths=[16])
    with torch.no_grad():
        layer.fm_proj.weight.copy_(torch.eye(n))
    X = torch.randn(5, n, d)
    full_fm = X @ X.transpose(1, 2)  # [B, n, n]: every pairwise dot product
    torch.testing.assert_close(torch.bmm(X, layer.fm_proj(X.transpose(1, 2))), full_fm)
    fm = layer.fm_mlp(layer.fm_norm(full_fm.flatten(1))).view(5, 3, d)
    want = layer.norm(torch.cat([fm, layer.lcb(X.transpose(1, 2)).transpose(1, 2)], 1) + X)
    torch.testing.assert_close(layer(X), want)


def test_dcn_rank_0_is_the_full_rank_cross_network() -> None:
    net = CrossNet(n=3, dim=4, layers=2, rank=0)
    X = torch.randn(5, 3, 4)
    x0 = x = X.flatten(1)
    for layer in net.layers:
        assert not hasattr(layer, "U") and layer.W.weight.shape == (12, 12)  # a full 12 x 12 matrix
        x = x0 * (x @ layer.W.weight.T + layer.W.bias) + x
    torch.testing.assert_close(net(X), x)


# ---------------------------------------------------------------------------------------------- cost counts
@pytest.mark.parametrize("wl", [Workload.small(), Workload.preset("mlperf-dcnv2-mini"), Workload.preset("wukong-mini"),
                                *(Workload.from_dict(f) for f in FAMILIES.values())],
                         ids=lambda w: f"{w.name}-{w.interaction}-{getattr(w, 'dcn_rank', '')}")
def test_performance_model_counts_flops_and_parameters_exactly(wl: Workload) -> None:
    """The analytic counts (what the cost model and simulator price) equal torch's own on the real module."""
    model = build_dense_arch(wl, 0)
    B = 3
    pooled = torch.randn(B, wl.num_tables * wl.dim, requires_grad=True)  # the tables' output needs a gradient
    with FlopCounterMode(display=False) as fwd:
        y = model(torch.randn(B, wl.dense_features), pooled)
    with FlopCounterMode(display=False) as bwd:
        y.sum().backward()
    c = dense_cost(wl)
    assert fwd.get_total_flops() == B * c.flops_fwd
    assert bwd.get_total_flops() == B * c.flops_bwd
    assert sum(p.numel() for p in model.parameters()) == c.params


def test_simulator_prices_the_heavier_dense_families() -> None:
    """Same tables and batch: the predicted dense time and DDP traffic grow with the family's FLOPs and
    parameters (the cross network's dense FLOPs are ~3x the dot interaction's at these sizes)."""
    base = TrialConfig(workload=Workload.preset("criteo-mlperf-mini"), batch_size=512)
    dot = simulate(base, fixture_cluster())
    dcn = simulate(base.replace(workload=Workload.preset("mlperf-dcnv2-mini")), fixture_cluster())
    ratio = dense_cost(Workload.preset("mlperf-dcnv2-mini")).flops / dense_cost(base.workload).flops
    assert ratio > 3
    assert dcn.breakdown_ms["dense"] > 0.8 * ratio * dot.breakdown_ms["dense"]
    assert dcn.extra["sim"]["comm_ms"]["ddp_allreduce"] > dot.extra["sim"]["comm_ms"]["ddp_allreduce"]


# ---------------------------------------------------------------------------------------------- workload keys
@pytest.mark.parametrize("d,needle", [
    ({"preset": "tiny", "interaction": "dcn", "dcn_rank": 113}, "dcn_rank=113 must be 0 (full rank) or 1..112"),
    ({"preset": "tiny", "interaction": "dcn", "dcn_layers": 0}, "dcn_layers=0 must be >= 1"),
    ({"preset": "tiny", "dcn_rank": 8}, "dcn_rank applies to interaction 'dcn' only"),
    ({"preset": "tiny", "interaction": "wukong", "wukong_mlp": [0]}, "wukong_mlp must be a list of positive"),
    ({"preset": "tiny", "interaction": "wukong", "wukong_rank": 0}, "wukong_rank=0 must be >= 1"),
    ({"preset": "tiny", "interaction": "wukong", "wukong_layers": "3"}, "wukong_layers='3' must be an integer"),
    ({"preset": "tiny", "interaction": "fm"}, "choose one of ['dot', 'dcn', 'wukong']"),
    ({"preset": "tiny", "interaction": "wukong", "bottom_mlp": [32, 8]}, "bottom_mlp must end in the embedding dim"),
    ({"tables": [{"rows": 10, "dim": 8}, {"rows": 10, "dim": 16}], "interaction": "dcn", "bottom_mlp": [8]},
     "interaction 'dcn' needs one embedding dim"),
])
def test_bad_family_keys_are_one_line_errors(d: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        Workload.from_dict(d)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_family_keys_in_both_formats_and_round_trip() -> None:
    anchor = {"tables": 4, "rows": 100, "dim": 8, "pooling": 2, "dense": 5, "bottom_mlp": [16, 8],
              "top_mlp": [16, 1], "interaction": "wukong", "wukong_layers": 1, "wukong_rank": 3, "wukong_mlp": [8]}
    wl, _ = Workload.from_anchor_dict(anchor)
    assert (wl.interaction, wl.wukong_layers, wl.wukong_rank, wl.wukong_mlp) == ("wukong", 1, 3, [8])
    d = wl.to_dict()
    assert "dcn_rank" not in d and d["wukong_rank"] == 3  # only the family's own keys
    assert Workload.from_dict(d) == wl
    assert "dcn_rank" not in Workload.small().to_dict()  # dot workloads' dicts (and stored config keys) unchanged
    # a preset's family is overridable: the old family's keys go with it
    assert Workload.from_dict({"preset": "mlperf-dcnv2-mini", "interaction": "dot"}).interaction == "dot"
    cfg = TrialConfig(workload=Workload.preset("mlperf-dcnv2-mini"))
    assert TrialConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))).key() == cfg.key()


def test_cli_bad_family_workload_exits_2_with_one_line(tmp_path) -> None:
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"tables": 2, "rows": 50, "dim": 8, "pooling": 1, "dense": 3, "bottom_mlp": [8],
                             "top_mlp": [4, 1], "interaction": "dcn", "dcn_rank": 99}))
    r = subprocess.run([sys.executable, "-m", "cubic", "trial", "--workload", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "dcn_rank=99" in lines[0] and str(f) in lines[0]


# ---------------------------------------------------------------------------------------------- real trials
@pytest.mark.parametrize("fam", ["dcn", "wukong"])
def test_multi_rank_trial_matches_the_single_process_run(fam: str) -> None:
    """2 ranks (tables sharded row-wise, dense arch under DDP) compute what one process does on the same
    global batches: the losses and every table match."""
    cfg = tiny_cfg(world_size=2, sharding="row_wise", workload=Workload.from_dict(FAMILIES[fam]))
    losses, tables = train(cfg)
    ref_losses, ref_tables = reference(cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert max(float(np.abs(tables[t] - ref_tables[t]).max()) for t in tables) < 1e-4


@pytest.mark.parametrize("fam", ["dcn", "wukong"])
def test_families_learn_the_teacher(fam: str) -> None:
    """Over 60 steps of the synthetic stream the loss falls and NE ends clearly below 1 (1 = predicting the
    base rate); the same config in bf16 dense with fp16 tables, 2D weight averaging and pipelining trains too."""
    wl = Workload.from_dict({**FAMILIES[fam], "preset": "tiny"})
    cfg = TrialConfig(workload=wl, world_size=2, batch_size=128, warmup_steps=20, measure_steps=40, windows=2,
                      kernel="native", emb_lr=0.05, dense_lr=0.02, timeout_s=120)
    r = run_trial(cfg)
    assert r.status == "ok", r.error
    assert r.ne < 0.95 and r.loss_last < r.loss_first, (r.ne, r.loss_first, r.loss_last)
    r2 = run_trial(cfg.replace(dense_precision="bf16", emb_precision="fp16", comm_precision="bf16",
                               sharding="column_wise", pipeline_depth=2, sharding_group_size=1,
                               sparse_sync="weight_avg"))
    assert r2.status == "ok", r2.error
    assert r2.ne < 0.97, r2.ne


def test_fp8_probe_names_every_interaction_layer() -> None:
    """fp8_all swaps the DCN cross layers too; on CPU fp8_auto swaps none (emulated fp8 cannot be faster)."""
    cfg = tiny_cfg(world_size=2, workload=Workload.from_dict(DCN), dense_precision="fp8_all")
    r = run_trial(cfg)
    assert r.status == "ok", r.error
    names = {p["name"]: p["mlp"] for p in r.extra["fp8_probe"]}
    for layer in range(DCN["dcn_layers"]):
        assert names[f"inter.layers.{layer}.V"] == names[f"inter.layers.{layer}.U"] == "inter"
    assert {"bottom", "inter", "top"} == set(names.values())
    auto = run_trial(cfg.replace(dense_precision="fp8_auto"))
    assert auto.status == "ok" and not any(p["use_fp8"] for p in auto.extra["fp8_probe"])
