"""TorchRec models for `cubic calibrate --framework torchrec`'s collection step: the tiny workload's tables in
one EmbeddingBagCollection (`one`) and split over two (`two`), with the same small dense part. A factory is
named MODULE:FACTORY, so they live where a TorchRec trial's ranks can import them."""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from cubic_harness.workload import Workload

DENSE_FEATURES = 8


class Probe(nn.Module):
    """The tiny workload's tables over `parts` collections, each pooled bag beside a one-layer dense tower."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        cfg = [EmbeddingBagConfig(name=t.name, num_embeddings=t.rows, embedding_dim=t.dim, feature_names=[t.name])
               for t in Workload.tiny().tables]
        per = -(-len(cfg) // parts)
        self.colls = nn.ModuleList(EmbeddingBagCollection(tables=cfg[i:i + per]) for i in range(0, len(cfg), per))
        width = cfg[0].embedding_dim
        self.tower = nn.Sequential(nn.Linear(DENSE_FEATURES, width), nn.ReLU())
        self.head = nn.Linear(width * (1 + len(cfg)), 1)

    def forward(self, dense: torch.Tensor, kjt: object) -> torch.Tensor:
        return self.head(torch.cat([self.tower(dense), *(c(kjt).values() for c in self.colls)], dim=1))


def one() -> nn.Module:
    return Probe(1)


def two() -> nn.Module:
    return Probe(2)
