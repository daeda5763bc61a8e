"""`torch` backend: the reference every other backend is tested against.

Plain tensor ops (embedding_bag / index_add), identical math to FBGEMM's TBE.
Works on CPU and CUDA, so it is also the GPU path where fbgemm-gpu is missing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cubic_kernels.base import DTYPES, EmbeddingBagKernel, bag_ids, check_weights


class TorchEmbeddingBags(EmbeddingBagKernel):
    name = "torch"

    def __init__(self, rows, dims, **kw) -> None:
        super().__init__(rows, dims, **kw)
        dt = DTYPES[self.weight_dtype]
        self._w = [torch.zeros(r, d, dtype=dt, device=self.device) for r, d in zip(self.rows, self.dims,
                                                                                    strict=True)]
        n_state = 0 if self.optim.kind == "sgd" else 1
        self._s = [torch.zeros(r * n_state, dtype=torch.float32, device=self.device) for r in self.rows]

    def weights(self) -> list[torch.Tensor]:
        return self._w

    def states(self) -> list[torch.Tensor]:
        return self._s

    def _table_slices(self, offsets: torch.Tensor):
        T = self.num_tables
        B = (offsets.numel() - 1) // T
        bounds = offsets[:: B].tolist() if B else [0] * (T + 1)
        for t in range(T):
            yield t, B, bounds[t], bounds[t + 1]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        psw = check_weights(self.name, ids, per_sample_weights)
        T = self.num_tables
        B = (offsets.numel() - 1) // T
        out = torch.empty(B, self.total_dim, dtype=torch.float32, device=self.device)
        for t, _, lo, hi in self._table_slices(offsets):
            w = self._w[t]
            o = offsets[t * B: (t + 1) * B + 1] - lo
            tid = ids[lo:hi]
            s = None if psw is None else psw[lo:hi]
            d0, d1 = self.dim_offsets[t], self.dim_offsets[t + 1]
            if w.dtype == torch.float32:
                out[:, d0:d1] = F.embedding_bag(tid, w, o, mode="sum", include_last_offset=True,
                                                per_sample_weights=s)
            else:
                rows = w[tid].float()
                acc = torch.zeros(B, d1 - d0, dtype=torch.float32, device=self.device)
                acc.index_add_(0, bag_ids(o, tid.numel()), rows if s is None else rows * s.unsqueeze(1))
                out[:, d0:d1] = acc
        return out

    @torch.no_grad()
    def backward_update(self, ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
                        per_sample_weights: torch.Tensor | None = None) -> None:
        psw = check_weights(self.name, ids, per_sample_weights)
        T = self.num_tables
        B = (offsets.numel() - 1) // T
        lr, eps = self.optim.lr, self.optim.eps
        for t, _, lo, hi in self._table_slices(offsets):
            if hi == lo:
                continue
            tid = ids[lo:hi]
            o = offsets[t * B: (t + 1) * B + 1] - lo
            g_bag = grad[:, self.dim_offsets[t]: self.dim_offsets[t + 1]].float()
            rows, inv = torch.unique(tid, return_inverse=True)
            g = torch.zeros(rows.numel(), g_bag.shape[1], dtype=torch.float32, device=self.device)
            g_id = g_bag[bag_ids(o, tid.numel())]
            g.index_add_(0, inv, g_id if psw is None else g_id * psw[lo:hi].unsqueeze(1))
            w = self._w[t]
            if self.optim.kind == "sgd":
                w[rows] = (w[rows].float() - lr * g).to(w.dtype)
                continue
            s = self._s[t]
            s[rows] += (g * g).mean(dim=1)
            w[rows] = (w[rows].float() - lr * g / (s[rows].sqrt() + eps).unsqueeze(1)).to(w.dtype)
