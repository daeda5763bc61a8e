"""The sharded embedding collection: every sharding type, 2D sparse parallelism, one code path.

Every model-parallel sharding type is a set of shards (table, rows, columns) on
positions of a sharding group of G ranks:

1. input_dist: each rank sends, to every position q, the ids of its local bags
   for q's shards (a row shard only gets ids in its row range, re-based), as
   two all_to_all_single calls (lengths, then ids). Position q then looks up
   G*B bags per shard in ONE kernel call (bags ordered by source rank).
2. lookup: the kernel's pooled output [G*B, local cols]; row block s goes back
   to source rank s (all-to-all of pooled sums / partial sums, cast to
   comm_precision).
3. assembly: every received column block is index-added into the [B, T*D]
   pooled output: column shards land side by side, row shards' partial sums add
   up (the all-to-all-of-partials form of row-wise).
4. backward: the reverse all-to-all brings the pooled gradients; the kernel's
   fused backward+optimizer updates the rows in place.

Weighted tables (a workload with `weighted` tables: every id carries a score,
1.0 for the unweighted tables' ids): the scores travel beside the ids in a
third all-to-all (the same splits, 4 bytes an id), are masked and moved as the
ids are, and reach the kernel as its per-sample weights, forward and backward.

Gradient scale: every rank's loss is the mean over its B samples; the
single-process reference's loss is the mean over W*B, so embedding gradients
are scaled by 1/W (DDP averages the dense ones the same way).

2D sparse parallelism (G < W, R = W/G replicas of the group):
  grad_allreduce: replicas all-gather their bags' ids and pooled gradients and
      apply ONE fused update with the union of the bags: exactly the full
      model-parallel step (row-wise AdaGrad sums a row's gradients before
      squaring, so the union - not a sum of separate updates - is what matches).
  weight_avg: each replica updates with its own bags at the plain learning rate, and every
      `sparse_sync_interval` steps (and after the last) the replicas merge their shards
      (harness/sharding/replica_sync.py: the rules, and why each scale factor is there). Plain
      row-wise AdaGrad averages weights and state as TorchRec's DMPCollection does (the embedding
      step shrinks by R); `momentum_scaled_rowwise_adagrad` applies one step with the replicas'
      gradients summed and the accumulator full model parallelism would have: exact at interval 1.
  Group placement (`group_placement`): `intra_node` puts a sharding group's G ranks next to each
      other (ranks g*G .. g*G+G-1: inside a node when G <= ranks_per_node, so the all-to-all stays
      on the fast link and the replica sync crosses nodes); `cross_node` strides them (ranks
      g, g+R, g+2R, ...: the group spans the nodes and replicas sit together, DMPCollection's default).

Data-parallel tables are replicated on every rank and held by a second kernel.
Each rank looks up its own B bags; the gradient sync is sparse: ranks
all-gather their bags' ids and pooled gradients and every rank applies the
same fused update with the union (the same exact step as above). That moves
W*B*(ids + dim) values instead of the dense rows*dim gradient all-reduce of
TorchRec's DP sharding (51 MB per 200k x 64 table), which is what makes DP
worth choosing for more than tiny tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cubic_harness.config import TrialConfig
from cubic_harness.model import init_table
from cubic_harness.sharding.comm import (
    Groups,
    InFlight,
    PooledAllToAll,
    PooledStart,
    PooledWait,
    all_gather_varlen,
    all_to_all,
    grad_scale,
)
from cubic_harness.sharding.plan import ShardingPlan
from cubic_harness.sharding.replica_sync import ReplicaSync
from cubic_harness.timers import TIMERS
from cubic_kernels import OptimSpec, make_kernel
from cubic_kernels.base import DTYPES


@dataclass
class KernelInput:
    """One batch after input distribution: the local kernel's bags plus local DP bags."""

    ids: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor  # [n_local_shards * G * B]
    batch_size: int
    dp: KernelInput | None = None  # the data-parallel tables' local bags (B per table)
    scores: torch.Tensor | None = None  # beside ids: the kernel's per-sample weights (weighted tables)


def _segment_counts(mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    cm = torch.zeros(mask.numel() + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(mask, 0, out=cm[1:])
    return cm[offsets[1:]] - cm[offsets[:-1]]


class ShardedEmbeddingCollection:
    def __init__(self, cfg: TrialConfig, plan: ShardingPlan, groups: Groups, device: torch.device):
        wl = cfg.workload
        self.cfg, self.plan, self.g, self.device = cfg, plan, groups, device
        self.G, self.W, self.R = groups.group_size, groups.world, groups.replicas
        self.T, self.D = wl.num_tables, wl.dim
        self.rows = [t.rows for t in wl.tables]
        self.per_pos = [plan.shards_on(q) for q in range(self.G)]
        self.local = self.per_pos[groups.pos]
        self.has_mp = any(self.per_pos)
        self.comm_dtype = DTYPES[cfg.comm_precision]
        self.grad_scale = 1.0 / self.W
        kind = "sgd" if cfg.emb_optimizer == "sgd" else "rowwise_adagrad"
        self.optim = OptimSpec(kind, cfg.emb_lr)
        self.kernel = None
        if self.local:
            uvm = {"cache_load_factor": cfg.uvm_cache_load_factor} if cfg.uvm_cache_load_factor else {}
            self.kernel = make_kernel(cfg.kernel, [s.rows for s in self.local], [s.dim for s in self.local],
                                      weight_dtype=cfg.emb_precision, optim=self.optim, device=device, **uvm)
            # initial weights written into the kernel's own, block by block (harness/model.py init_table): an fp32
            # copy of every shard beside the tables was a rank's memory peak, up to twice its tables
            for s, w in zip(self.local, self.kernel.weights(), strict=True):
                init_table(cfg.seed, s.table, self.rows[s.table], self.D, s.row_start, s.row_end, s.col_start,
                           s.col_end, out=w)
        self.replica_sync = None
        if self.R > 1 and cfg.sparse_sync == "weight_avg" and self.kernel is not None:
            self.replica_sync = ReplicaSync(self.kernel, self.R, groups.replica, cfg.sparse_sync_interval,
                                            cfg.emb_optimizer == "momentum_scaled_rowwise_adagrad", self.comm_dtype)
        self.dp_tables = plan.dp_tables()
        self.dp_kernel = None
        if self.dp_tables:
            self.dp_kernel = make_kernel(cfg.kernel, [self.rows[t] for t in self.dp_tables],
                                         [self.D] * len(self.dp_tables), weight_dtype=cfg.emb_precision,
                                         optim=self.optim, device=device)
            for t, w in zip(self.dp_tables, self.dp_kernel.weights(), strict=True):
                init_table(cfg.seed, t, self.rows[t], self.D, out=w)
        cols: list[int] = []
        for q in range(self.G):
            for s in self.per_pos[q]:
                cols.extend(range(s.table * self.D + s.col_start, s.table * self.D + s.col_end))
        for t in self.dp_tables:
            cols.extend(range(t * self.D, (t + 1) * self.D))
        self.col_index = torch.tensor(cols, dtype=torch.int64, device=device)
        self.recv_dims = [sum(s.dim for s in self.per_pos[q]) for q in range(self.G)]
        self.local_dim = self.recv_dims[groups.pos]
        self._dummy = torch.zeros(0, device=device, requires_grad=True)

    # ------------------------------------------------------------------ input distribution
    def input_dist(self, ids: torch.Tensor, offsets: torch.Tensor, B: int,
                   scores: torch.Tensor | None = None) -> KernelInput:
        """Route every local bag's ids (and their scores) to the positions holding its shards (runs on mp_input)."""
        G, n_me = self.G, len(self.local)
        bounds = offsets[:: B].tolist() if B else [0] * (self.T + 1)
        send_len, send_ids, send_scores, send_counts = [], [], [], []
        for q in range(G):
            cnt = 0
            for s in self.per_pos[q]:
                lo, hi = bounds[s.table], bounds[s.table + 1]
                tid = ids[lo:hi]
                tsc = scores[lo:hi] if scores is not None else None
                toff = offsets[s.table * B: (s.table + 1) * B + 1] - lo
                if s.rows < self.rows[s.table]:
                    mask = (tid >= s.row_start) & (tid < s.row_end)
                    lens = _segment_counts(mask, toff)
                    tid = tid[mask] - s.row_start
                    tsc = tsc[mask] if tsc is not None else None
                else:
                    lens = toff[1:] - toff[:-1]
                send_len.append(lens)
                send_ids.append(tid)
                if tsc is not None:
                    send_scores.append(tsc)
                cnt += tid.numel()
            send_counts.append(cnt)
        empty = torch.zeros(0, dtype=torch.int64, device=ids.device)
        len_send = torch.cat(send_len) if send_len else empty
        len_recv = torch.empty(G * n_me * B, dtype=torch.int64, device=ids.device)
        all_to_all(len_recv, len_send, [n_me * B] * G, [len(self.per_pos[q]) * B for q in range(G)],
                   self.g.mp_input, G)
        L = len_recv.view(G, n_me, B)
        seg = L.sum(2)
        recv_counts = seg.sum(1).tolist()
        ids_recv = torch.empty(sum(recv_counts), dtype=torch.int64, device=ids.device)
        all_to_all(ids_recv, torch.cat(send_ids) if send_ids else empty, recv_counts, send_counts,
                   self.g.mp_input, G)
        order = [src * n_me + sh for sh in range(n_me) for src in range(G)]  # source-major -> shard-major
        sizes = seg.flatten().tolist()  # read once: on CUDA each read waits for the device
        pieces = ids_recv.split(sizes)
        kids = torch.cat([pieces[i] for i in order]) if n_me else empty
        kscores = None
        if scores is not None:
            sc_recv = torch.empty(sum(recv_counts), dtype=torch.float32, device=ids.device)
            all_to_all(sc_recv, torch.cat(send_scores) if send_scores else scores.new_zeros(0), recv_counts,
                       send_counts, self.g.mp_input, G)
            sc_pieces = sc_recv.split(sizes)
            kscores = torch.cat([sc_pieces[i] for i in order]) if n_me else scores.new_zeros(0)
        lengths = L.permute(1, 0, 2).reshape(-1)
        koff = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=ids.device)
        torch.cumsum(lengths, 0, out=koff[1:])
        return KernelInput(kids, koff, lengths, B, self._dp_input(ids, offsets, bounds, B, scores), kscores)

    def _dp_input(self, ids: torch.Tensor, offsets: torch.Tensor, bounds: list[int], B: int,
                  scores: torch.Tensor | None) -> KernelInput | None:
        """The local bags of the data-parallel tables (and their scores), in the DP kernel's layout."""
        if not self.dp_tables:
            return None
        lens = torch.cat([offsets[t * B + 1:(t + 1) * B + 1] - offsets[t * B:(t + 1) * B] for t in self.dp_tables])
        dids = torch.cat([ids[bounds[t]:bounds[t + 1]] for t in self.dp_tables])
        dsc = torch.cat([scores[bounds[t]:bounds[t + 1]] for t in self.dp_tables]) if scores is not None else None
        doff = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=ids.device)
        torch.cumsum(lens, 0, out=doff[1:])
        return KernelInput(dids, doff, lens, B, scores=dsc)

    # ------------------------------------------------------------------ forward
    def forward(self, kin: KernelInput) -> torch.Tensor:
        """Pooled embeddings [B, T*D] (differentiable; backward updates the tables)."""
        return self.forward_overlapped(kin, "none")()

    def forward_overlapped(self, kin: KernelInput, overlap: str) -> Callable[[], torch.Tensor]:
        """Look up and launch the pooled all-to-all; the returned call waits for it and assembles [B, T*D].
        What runs between the two (the bottom MLP: `comm_overlap`) runs beside the collective; with
        `forward_backward` its backward runs beside the gradients' all-to-all too (comm.InFlight)."""
        B, G = kin.batch_size, self.G
        local = _Lookup.apply(self._dummy, self, kin) if self.has_mp else None
        recv_splits = [B * d for d in self.recv_dims]
        send_splits = [B * self.local_dim] * G
        fl = None
        if local is not None and overlap != "none":
            dtype = self.comm_dtype if G > 1 else local.dtype
            fl = InFlight(send_splits, recv_splits, self.g.mp, G, dtype,
                          grad_scale(B) if dtype == torch.float16 else 1.0, backward=overlap == "forward_backward")
            launched = PooledStart.apply(local, fl)
        # the data-parallel tables' lookup: beside the collective when it is in flight, else after it (as always)
        dp = _Lookup.apply(self._dummy, self, kin.dp, True) if kin.dp is not None and fl is not None else None

        def assemble() -> torch.Tensor:
            blocks = []
            if local is not None:
                recv = (PooledWait.apply(launched, fl) if fl is not None else
                        PooledAllToAll.apply(local, send_splits, recv_splits, self.g.mp, G, self.comm_dtype,
                                             grad_scale(B)))
                blocks = [r.view(B, d) for r, d in zip(recv.split(recv_splits), self.recv_dims, strict=True)]
            if kin.dp is not None:
                blocks.append(dp if dp is not None else _Lookup.apply(self._dummy, self, kin.dp, True))
            cat = torch.cat(blocks, dim=1)
            return torch.zeros(B, self.T * self.D, device=cat.device, dtype=cat.dtype).index_add(1, self.col_index,
                                                                                                   cat)
        return assemble

    # ------------------------------------------------------------------ backward / update
    def _update(self, kin: KernelInput, grad: torch.Tensor, data_parallel: bool = False) -> None:
        grad = grad * self.grad_scale
        ids, offsets, scores = kin.ids, kin.offsets, kin.scores
        kernel, n = (self.dp_kernel, len(self.dp_tables)) if data_parallel else (self.kernel, len(self.local))
        if data_parallel and self.W > 1:
            ids, offsets, grad, scores = _gather_union(kin, grad, n, self.g.dp_pg, self.W)
        elif not data_parallel and self.R > 1 and self.cfg.sparse_sync == "grad_allreduce":
            ids, offsets, grad, scores = _gather_union(kin, grad, n, self.g.replica, self.R)
        if kernel is not None:
            with TIMERS.phase("emb_bwd"):
                kernel.backward_update(ids, offsets, grad, scores)
            if not data_parallel and self.replica_sync is not None:
                self.replica_sync.record(ids, offsets)

    def after_backward(self, step: int, last: bool) -> None:
        """2D weight averaging: merge the replicas when the interval (or the trial) ends at this step."""
        if self.replica_sync is not None and self.replica_sync.due(step, last):
            with TIMERS.phase("sync"):
                self.replica_sync.sync()

    # ------------------------------------------------------------------ inspection (tests)
    def full_tables(self) -> dict[int, torch.Tensor]:
        """This rank's view of table slices: {table: weights with NaN where another rank holds them}."""
        out = {}
        if self.kernel is not None:
            for s, w in zip(self.local, self.kernel.weights(), strict=True):
                full = out.setdefault(s.table, torch.full((self.rows[s.table], self.D), float("nan")))
                full[s.row_start:s.row_end, s.col_start:s.col_end] = w.float().cpu()
        if self.dp_kernel is not None:
            for t, w in zip(self.dp_tables, self.dp_kernel.weights(), strict=True):
                out[t] = w.float().cpu()
        return out


class _Lookup(torch.autograd.Function):
    """Kernel forward; its backward is the fused update (no gradient is returned)."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, coll: ShardedEmbeddingCollection, kin: KernelInput,
                data_parallel: bool = False):
        ctx.coll, ctx.kin, ctx.dp = coll, kin, data_parallel
        kernel = coll.dp_kernel if data_parallel else coll.kernel
        if kernel is None:
            return dummy.new_zeros(kin.batch_size * coll.G, 0)
        with TIMERS.phase("emb_fwd"):
            return kernel.forward(kin.ids, kin.offsets, kin.scores)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.coll._update(ctx.kin, grad, ctx.dp)
        ctx.coll = ctx.kin = None
        return None, None, None, None


def _gather_union(kin: KernelInput, grad: torch.Tensor, n: int, group, R: int):
    """All-gather R ranks' bags (n tables each, their scores with them) and pooled gradients into one union batch.

    Row-wise AdaGrad sums a row's gradients before squaring, so one update with the union of
    the bags - not R separate updates - is the exact step of one process training them all.
    """
    with TIMERS.phase("comm"):
        lens = [torch.empty_like(kin.lengths) for _ in range(R)]
        dist.all_gather(lens, kin.lengths, group=group)
        ids_all = all_gather_varlen(kin.ids, group, R)
        sc_all = all_gather_varlen(kin.scores, group, R) if kin.scores is not None else None
        grads = [torch.empty_like(grad) for _ in range(R)]
        dist.all_gather(grads, grad.contiguous(), group=group)
    if n == 0:
        return kin.ids, kin.offsets, grad, kin.scores
    nb = kin.lengths.numel() // n
    splits = [lv.view(n, nb).sum(1).tolist() for lv in lens]
    pieces = [i.split(s) for i, s in zip(ids_all, splits, strict=True)]
    ids = torch.cat([pieces[r][t] for t in range(n) for r in range(R)])
    scores = None
    if sc_all is not None:
        sc_pieces = [x.split(s) for x, s in zip(sc_all, splits, strict=True)]
        scores = torch.cat([sc_pieces[r][t] for t in range(n) for r in range(R)])
    lengths = torch.stack(lens).view(R, n, nb).permute(1, 0, 2).reshape(-1)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return ids, offsets, torch.cat(grads, dim=0), scores
