"""The dense part of the model: bottom MLP, an interaction (the model family), top MLP.

Families (`Workload.interaction`), each a module over the feature matrix [B, n, d] (the bottom MLP's
output and the n-1 pooled embeddings), written from their papers' equations:
- `dot` (DLRM): the bottom output beside the pairwise dot products of all n features.
- `dcn` (DCN-v2, MLPerf's DLRM-DCNv2): over x_0 = the flattened features (n*d wide), cross layers
  x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l, with V_l: n*d -> r and U_l: r -> n*d (rank r); r = 0 is the
  full-rank layer x_0 * (W_l x_l + b_l) + x_l.
- `wukong` (Wukong, arXiv 2403.02545): layers X_{i+1} = LN(concat(FMB(X_i), LCB(X_i)) + res(X_i)) where
  FMB(X) = MLP(LN(flatten(X (X^T Y)))) reshaped to n_F embeddings (the low-rank FM: Y is n x k, so
  X X^T is never formed; k = n with Y = I is the full FM X X^T), LCB(X) = W_L X (n_L embeddings), and
  res is the identity, or a linear map over the embedding axis when n != n_F + n_L.
Every weight is an nn.Linear (the FP8 probe and dispatch see each one by its qualified name) or a
LayerNorm. The embedding tables are not here: they live in the sharded embedding collection
(harness/sharding), and parallelism is applied to this module by functions (DDP wrapping in
harness/train.py), never woven into it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cubic_harness.workload import Workload


def mlp(sizes: list[int], in_features: int, final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, out in enumerate(sizes):
        layers.append(nn.Linear(in_features, out))
        if i < len(sizes) - 1 or final_relu:
            layers.append(nn.ReLU())
        in_features = out
    return nn.Sequential(*layers)


class DotInteraction(nn.Module):
    """DLRM: [x, pairwise dots of the n features (strictly lower triangle)]."""

    def __init__(self, n: int, dim: int):
        super().__init__()
        self.register_buffer("tri", torch.tril_indices(n, n, offset=-1), persistent=False)
        self.out_features = dim + n * (n - 1) // 2

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        z = torch.bmm(feats, feats.transpose(1, 2))
        return torch.cat([feats[:, 0], z[:, self.tri[0], self.tri[1]]], dim=1)


class CrossLayer(nn.Module):
    """One DCN-v2 cross layer: x_0 * (U (V x) + b) + x, or x_0 * (W x + b) + x at full rank (rank 0)."""

    def __init__(self, width: int, rank: int):
        super().__init__()
        if rank:
            self.V = nn.Linear(width, rank, bias=False)
            self.U = nn.Linear(rank, width)
        else:
            self.W = nn.Linear(width, width)
        self.rank = rank

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * (self.U(self.V(x)) if self.rank else self.W(x)) + x


class CrossNet(nn.Module):
    """DCN-v2's cross network over the flattened features (MLPerf: 3 layers, rank 512)."""

    def __init__(self, n: int, dim: int, layers: int, rank: int):
        super().__init__()
        self.out_features = n * dim
        self.layers = nn.ModuleList(CrossLayer(self.out_features, rank) for _ in range(layers))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x0 = x = feats.flatten(1)
        for layer in self.layers:
            x = layer(x0, x)
        return x


class WukongLayer(nn.Module):
    """FM block (n_F embeddings) beside a linear compression block (n_L), residual, LayerNorm."""

    def __init__(self, n_in: int, dim: int, n_fm: int, n_lcb: int, rank: int, widths: list[int]):
        super().__init__()
        self.n_fm, self.dim = n_fm, dim
        self.lcb = nn.Linear(n_in, n_lcb, bias=False)  # W_L over the embedding axis
        self.fm_proj = nn.Linear(n_in, rank, bias=False)  # Y: X^T Y is [d, k]
        self.fm_norm = nn.LayerNorm(n_in * rank)
        self.fm_mlp = mlp([*widths, n_fm * dim], n_in * rank, final_relu=False)
        self.res = nn.Linear(n_in, n_fm + n_lcb, bias=False) if n_in != n_fm + n_lcb else None
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xt = x.transpose(1, 2)  # [B, d, n]
        fm = torch.bmm(x, self.fm_proj(xt))  # X (X^T Y): [B, n, k]
        fm = self.fm_mlp(self.fm_norm(fm.flatten(1))).view(x.shape[0], self.n_fm, self.dim)
        lcb = self.lcb(xt).transpose(1, 2)
        res = x if self.res is None else self.res(xt).transpose(1, 2)
        return self.norm(torch.cat([fm, lcb], dim=1) + res)


class WukongStack(nn.Module):
    """Wukong's interaction stack; the last layer's embeddings, flattened, feed the top MLP."""

    def __init__(self, wl: Workload):
        super().__init__()
        n, d = wl.num_features, wl.dim
        layers = []
        for _ in range(wl.wukong_layers):
            layers.append(WukongLayer(n, d, wl.wukong_fm_embs, wl.wukong_lcb_embs, wl.wukong_rank,
                                      list(wl.wukong_mlp)))
            n = wl.wukong_fm_embs + wl.wukong_lcb_embs
        self.layers = nn.Sequential(*layers)
        self.out_features = n * d

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.layers(feats).flatten(1)


def make_interaction(wl: Workload) -> nn.Module:
    """The workload's interaction module; its `out_features` is the top MLP's input width."""
    if wl.interaction == "dcn":
        return CrossNet(wl.num_features, wl.dim, wl.dcn_layers, wl.dcn_rank)
    if wl.interaction == "wukong":
        return WukongStack(wl)
    return DotInteraction(wl.num_features, wl.dim)


class DenseArch(nn.Module):
    """logits = top_mlp(interaction([bottom_mlp(dense), pooled embeddings]))."""

    def __init__(self, wl: Workload):
        super().__init__()
        self.bottom = mlp(list(wl.bottom_mlp), wl.dense_features, final_relu=True)
        self.inter = make_interaction(wl)
        self.top = mlp(list(wl.top_mlp), self.inter.out_features, final_relu=False)
        self.num_tables, self.dim = wl.num_tables, wl.dim

    def interact(self, x: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The top MLP's input from the bottom output x [B, d] and pooled [B, T*d] (table-major columns)."""
        feats = torch.cat([x.unsqueeze(1), pooled.view(-1, self.num_tables, self.dim).to(x.dtype)], dim=1)
        return self.inter(feats)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
        """dense [B, F], pooled [B, T*D] (table-major columns) -> logits [B]. `pooled` may be a call that
        waits for the embeddings' all-to-all: made after the bottom MLP, which runs beside it (`comm_overlap`)."""
        x = self.bottom(dense)
        return self.top(self.interact(x, pooled() if callable(pooled) else pooled)).squeeze(-1)


def build_dense_arch(wl: Workload, seed: int) -> DenseArch:
    """Same initial weights on every rank and in the single-process reference."""
    g = torch.random.fork_rng(devices=[])
    with g:
        torch.manual_seed(seed)
        return DenseArch(wl)


@torch.no_grad()
def init_table(seed: int, table: int, rows: int, dim: int, row_start: int = 0, row_end: int | None = None,
               col_start: int = 0, col_end: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """A shard of table `table`'s initial weights, uniform(+-1/sqrt(rows)) as TorchRec does.

    Generated in fixed row blocks seeded by (seed, table, block), so any row/column
    shard equals the same slice of the whole table without materialising it. Each block is written
    into `out` (a fresh fp32 tensor by default; a kernel's own weights, of any dtype and device, when
    given) as it is made: one block beside the shard, never a whole copy of it (an fp32 copy of every
    shard beside the tables was a rank's memory peak, up to twice its tables).
    """
    row_end = rows if row_end is None else row_end
    col_end = dim if col_end is None else col_end
    block = 1 << 15
    bound = (1.0 / rows) ** 0.5
    if out is None:
        out = torch.empty(max(0, row_end - row_start), col_end - col_start)
    g = torch.Generator()
    for b in range(row_start // block, (row_end - 1) // block + 1 if row_end > row_start else 0):
        lo, hi = b * block, min((b + 1) * block, rows)
        g.manual_seed((seed * 1_000_003 + table) * 65_537 + b)
        w = torch.rand(hi - lo, dim, generator=g) * (2 * bound) - bound
        a, z = max(row_start, lo), min(row_end, hi)
        out[a - row_start: z - row_start] = w[a - lo: z - lo, col_start:col_end]
    return out
