"""The dense part of the DLRM: bottom MLP, dot interaction, top MLP.

The embedding tables are not here: they live in the sharded embedding
collection (harness/sharding), and parallelism is applied to this module by
functions (DDP wrapping in harness/train.py), never woven into it.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.workload import Workload


def mlp(sizes: list[int], in_features: int, final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, out in enumerate(sizes):
        layers.append(nn.Linear(in_features, out))
        if i < len(sizes) - 1 or final_relu:
            layers.append(nn.ReLU())
        in_features = out
    return nn.Sequential(*layers)


class DenseArch(nn.Module):
    """logits = top_mlp([bottom_mlp(dense), pairwise dots of (bottom, pooled embeddings)])."""

    def __init__(self, dense_features: int, num_tables: int, dim: int, bottom: list[int], top: list[int]):
        super().__init__()
        self.bottom = mlp(bottom, dense_features, final_relu=True)
        n = num_tables + 1
        self.register_buffer("tri", torch.tril_indices(n, n, offset=-1), persistent=False)
        self.top = mlp(top, dim + n * (n - 1) // 2, final_relu=False)
        self.num_tables, self.dim = num_tables, dim

    def interact(self, x: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The top MLP's input: bottom output and the pairwise dots of all feature vectors."""
        feats = torch.cat([x.unsqueeze(1), pooled.view(-1, self.num_tables, self.dim).to(x.dtype)], dim=1)
        z = torch.bmm(feats, feats.transpose(1, 2))
        return torch.cat([x, z[:, self.tri[0], self.tri[1]]], dim=1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """dense [B, F], pooled [B, T*D] (table-major columns) -> logits [B]."""
        return self.top(self.interact(self.bottom(dense), pooled)).squeeze(-1)


def build_dense_arch(wl: Workload, seed: int) -> DenseArch:
    """Same initial weights on every rank and in the single-process reference."""
    g = torch.random.fork_rng(devices=[])
    with g:
        torch.manual_seed(seed)
        return DenseArch(wl.dense_features, wl.num_tables, wl.dim, list(wl.bottom_mlp), list(wl.top_mlp))


def init_table(seed: int, table: int, rows: int, dim: int, row_start: int = 0, row_end: int | None = None,
               col_start: int = 0, col_end: int | None = None) -> torch.Tensor:
    """A shard of table `table`'s initial weights, uniform(+-1/sqrt(rows)) as TorchRec does.

    Generated in fixed row blocks seeded by (seed, table, block), so any row/column
    shard equals the same slice of the whole table without materialising it.
    """
    row_end = rows if row_end is None else row_end
    col_end = dim if col_end is None else col_end
    block = 1 << 15
    bound = (1.0 / rows) ** 0.5
    parts = []
    g = torch.Generator()
    for b in range(row_start // block, (row_end - 1) // block + 1 if row_end > row_start else 0):
        lo, hi = b * block, min((b + 1) * block, rows)
        g.manual_seed((seed * 1_000_003 + table) * 65_537 + b)
        w = torch.rand(hi - lo, dim, generator=g) * (2 * bound) - bound
        parts.append(w[max(row_start, lo) - lo: min(row_end, hi) - lo, col_start:col_end])
    if not parts:
        return torch.zeros(0, col_end - col_start)
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
