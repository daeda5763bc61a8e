"""2D sparse parallelism's replica sync under `sparse_sync: weight_avg`.

Each replica of a sharding group trains its copy of the group's table shards on its own samples; every
`sparse_sync_interval` = k steps (and after a trial's last step) the R replicas of a shard merge into one.
The sync keeps the shard as it was at the last sync (w0, s0), so what a replica did since is a delta
that is zero on every row it did not touch: it travels sparse (the touched rows' ids and deltas,
all-gathered) where that moves fewer bytes than a dense all-reduce of the whole shard, else dense.
Payloads travel in the comm precision (fp16 under a shared power-of-two scale, so small values are not
flushed to zero). After a sync every replica holds the same bits.

Two merge rules (the `emb_optimizer`), with Δ_k = w_k - w0, inc_k = s_k - s0 replica k's changes:

* `rowwise_adagrad` / `sgd`: TorchRec DMPCollection's sync, the mean of the replicas:
      w = w0 + sum_k Δ_k / R,   s = s0 + sum_k inc_k / R.
  A row only one replica touched moves 1/R of that replica's step and its accumulator grows 1/R as
  fast: the embedding learning rate shrinks with the replica count.
* `momentum_scaled_rowwise_adagrad`: the replicas' steps re-solved as one row-wise AdaGrad step on the
  accumulator full model parallelism would have. Replica k's interval is inverted to the one gradient
  that, from (w0, s_k), gives its delta:
      u_k = -Δ_k (sqrt(s_k) + eps) / lr          (exactly its gradient when it touched the row once)
  and the merge applies their sum G = sum_k u_k:
      s = s0 + sum_k inc_k + (mean(G^2) - sum_k mean(u_k^2))
      w = w0 - lr G / (sqrt(s) + eps)
  with s at least s0, and sqrt(s) + eps at least lr rms(G) / M, M = sum_k rms(Δ_k).
  Why each term. Full model parallelism's accumulator grows by mean(g^2) per step, g the row's gradient
  summed over the step's samples: by the sum of the replicas' increments (not their mean, so the step
  does not shrink with R), plus the cross terms of the summed gradient, positive where replicas push a
  row the same way and negative where they push against each other. At k = 1, u_k is replica k's
  gradient and inc_k = mean(u_k^2), so s = s0 + mean(G^2) and w is exactly full model parallelism's
  step (tests hold it to 1e-6; dropping the negative cross terms cost 3% NE on the small workload). A
  row one replica touched, at any k, keeps that replica's result bit for bit (G = u_k, s = s_k, w = w_k):
  it trained at the full learning rate. The last floor is a trust region: the merged row moves at most
  as far as the replicas moved it together. It never binds at k = 1 (AdaGrad's step
  lr x / (sqrt(s0 + x^2) + eps) is subadditive in x) nor for rows one replica touched; without it, rows
  that both replicas touched several times in an interval and pushed against each other have large,
  cancelling u_k, s fell to s0 (~0 early on) and lr G / eps diverged (NE 1.7 at k = 8).
  The approximation, at k > 1, is in rows several replicas touched within one interval: their u_k are
  interval sums (a row a replica pushed the same way m times has u_k ~ m x its gradient), so their
  cross terms are those of one step, not of m. For such a hot row pushed alike by 2 replicas, full
  model parallelism moves it ~2 sqrt(m) lr and this merge ~2.8 sqrt(m) lr. Rescaling each u_k to the
  increments it made (u_k sqrt(inc_k / mean(u_k^2)), the pair's cosine times sqrt(inc_j inc_k)) moves
  exactly 2 sqrt(m) lr there, but measured no better NE (k = 8, small-zipf: 0.9250 vs 0.9247), sent twice
  the bytes, and lost exactness at k = 1 where a replica's fp32 delta rounds to 0; so it is not used.
  (The rule before scaled each local step by R and averaged: the same at k = 1 for rows one replica
  touched, but rows two replicas touched in a step moved up to R times too far while the accumulator
  was small, which cost 5% NE on the small workload; and at k > 1 every replica's own copy drifted at
  R times the learning rate between syncs.)

Which rows changed is recorded from the ids each backward updates (`record`), so neither transport
reads a whole shard to find them. `CUBIC_REPLICA_SYNC=sparse|dense|union` forces a transport (benchmarks).

Three transports (`cubic_harness.sharding.transport` decides which):
* union (the plain rule on an fp32 wire, `averages_in_place`): w0 + sum_k Δ_k / R is sum_k w_k / R, so no delta
  is needed, nor w0 kept (fp16 and bf16 weights are summed in fp32 and rounded once, as the deltas' merge rounds).
  A row no replica touched since the last sync holds w0 on every replica already; the replicas agree on which
  rows any of them touched (one max all-reduce of a byte per row), gather those rows' weights and state into one
  buffer, all-reduce it and divide by R, and write it back to the kernel. Dense at the bytes of the union: at
  k = 8 on the default task, ~30% of the rows;
* sparse: each replica's touched rows' ids and payloads all-gathered, summed per row (any rule);
* dense: every row's payload all-reduced (any rule; the plain rule's union of every row is the same).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cubic_harness.sharding.host_reduce import host_reduce
from cubic_harness.sharding.transport import averages_in_place, choose_transport, union_pays
from cubic_kernels.base import EmbeddingBagKernel

FP16_HEADROOM = 2.0 ** 14  # sums of R fp16 payloads stay below fp16's max (65504) for R <= 4; more: scaled down


@dataclass
class SyncStats:
    """What the syncs cost and moved (for TrialResult.extra["replica_sync"])."""

    syncs: int = 0
    sparse: int = 0
    seconds: list[float] = field(default_factory=list)
    touched_frac: list[float] = field(default_factory=list)
    union_frac: list[float] = field(default_factory=list)  # the union transport: rows any replica touched
    # where a sync's time goes, summed over the syncs: waiting for the slowest replica to reach it (`wait`: the
    # ranks' imbalance, not the merge's work), building the payloads (`payload`), the collectives (`wire`, with
    # the casts to and from the comm precision), the sum over the replicas' rows and writing the merged rows
    # back (`apply`)
    parts: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("wait", "payload", "wire", "apply"), 0.0))
    # what the transport rule weighed, summed over the syncs: the touched rows' payload bytes (before
    # SPARSE_BYTE_COST) and the dense all-reduce's bytes; with `parts` they measure a sparse byte's cost
    rule_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("sparse", "dense"), 0.0))

    def to_dict(self, interval: int, measured_steps: int, measured_s: float) -> dict:
        s = sorted(self.seconds)
        return {"interval": interval, "syncs": self.syncs, "sparse_syncs": self.sparse,
                "dense_syncs": self.syncs - self.sparse,
                "sync_ms_p50": s[len(s) // 2] * 1e3 if s else 0.0,
                "sync_ms_per_step": measured_s * 1e3 / max(1, measured_steps),
                "touched_frac_max": max(self.touched_frac, default=0.0),
                "union_frac_max": max(self.union_frac, default=0.0),
                "ms_per_sync": {k: v * 1e3 / max(1, self.syncs) for k, v in self.parts.items()},
                "rule_mb_per_sync": {k: v / 2**20 / max(1, self.syncs) for k, v in self.rule_bytes.items()}}


def _elements(live: torch.Tensor, rows: torch.Tensor | None) -> int:
    """The elements of `live` at `rows` (None: all of it)."""
    return live.numel() if rows is None else rows.numel() * live[0].numel()




class _Clock:
    """Adds the time since the last mark to one of SyncStats.parts."""

    def __init__(self, parts: dict[str, float]) -> None:
        self.parts, self.t = parts, time.perf_counter()

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] += now - self.t
        self.t = now


class ReplicaSync:
    """Merges the R replicas of this rank's shards (held by `kernel`) every `interval` steps."""

    def __init__(self, kernel: EmbeddingBagKernel, replicas: int, group, interval: int, momentum_scaled: bool,
                 comm_dtype: torch.dtype, transport: str = "") -> None:
        self.kernel, self.R, self.group, self.k = kernel, replicas, group, interval
        self.momentum_scaled = momentum_scaled
        self.adagrad = kernel.optim.kind == "rowwise_adagrad"
        self.lr, self.eps = kernel.optim.lr, kernel.optim.eps
        self.dtype = comm_dtype
        self.device = kernel.device
        self.transport = transport or os.environ.get("CUBIC_REPLICA_SYNC", "auto")
        # The shard as of the last sync, for the transports that build deltas. Averaging in place never reads
        # it (the union and the whole-shard all-reduce average the rows themselves), so there it is not kept:
        # a copy of every table less, and a merge that writes each row once instead of twice.
        self.keeps_base = not self._averages_in_place() or self.transport == "sparse"
        self.w0 = [w.detach().clone() for w in kernel.weights()] if self.keeps_base else []
        self.s0 = [s.detach().clone() for s in kernel.states()] if self.adagrad and self.keeps_base else []
        # averaging in place moves whole rows: between replicas on one host, through shared memory
        self.host = None if self.keeps_base else host_reduce(group, replicas, self.device)
        self.touched = [torch.zeros(r, dtype=torch.bool, device=self.device) for r in kernel.rows]
        # payload columns per row: the delta (or u), the state increment, then (momentum) mean(u^2), rms(delta)
        self.widths = [d + (1 if self.adagrad else 0) + (2 if self.momentum_scaled else 0) for d in kernel.dims]
        self.stats = SyncStats()

    def due(self, step: int, last: bool) -> bool:
        """Sync after every k-th step and after the last one (nothing is measured or exported unsynced)."""
        return last or (step + 1) % self.k == 0

    def record(self, ids: torch.Tensor, offsets: torch.Tensor) -> None:
        """Mark the rows an update touched (kernel layout: shard-major bags)."""
        nb = (offsets.numel() - 1) // len(self.touched)
        bounds = offsets[::nb].tolist()
        for i, t in enumerate(self.touched):
            t[ids[bounds[i]:bounds[i + 1]]] = True

    # ------------------------------------------------------------------ the merge
    def _payload(self, i: int, rows: torch.Tensor | None) -> torch.Tensor:
        """This replica's change to shard i since the last sync, at `rows` (None: all), [rows, width].

        Built in one buffer with in-place ops: a sync at k = 8 touches most of a 200k-row shard, and
        every whole-shard temporary costs ~20 ms on one core."""
        def take(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t.index_select(0, rows)

        d = self.kernel.dims[i]
        w = take(self.kernel.weights()[i])
        out = torch.empty(w.shape[0], self.widths[i], device=self.device)
        delta = out[:, :d]
        delta.copy_(w)
        delta.sub_(take(self.w0[i]))
        if not self.adagrad:
            return out
        s = take(self.kernel.states()[i])
        torch.sub(s, take(self.s0[i]), out=out[:, d])
        if self.momentum_scaled:
            root = s.sqrt().add_(self.eps)
            msq_delta = torch.linalg.vector_norm(delta, dim=1).square_().div_(d)
            delta.mul_((root / -self.lr).unsqueeze(1))  # delta becomes u
            out[:, d + 1] = msq_delta * root.square() / self.lr**2  # mean(u^2)
            out[:, d + 2] = msq_delta.sqrt_()  # rms(delta)
        return out

    def _apply(self, i: int, total: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Write the merged rows (`rows`: their ids, or None for the whole shard) into the kernel and w0/s0.
        `total` (the replicas' payloads summed) is consumed."""
        w, w0 = self.kernel.weights()[i], self.w0[i]
        d = self.kernel.dims[i]

        def take(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t.index_select(0, rows)

        def put(dst: torch.Tensor, val: torch.Tensor) -> None:
            dst.copy_(val) if rows is None else dst.index_copy_(0, rows, val.to(dst.dtype))

        step = total[:, :d]  # becomes the merged delta, in place
        if not self.adagrad:
            step.div_(self.R)
        else:
            s0 = take(self.s0[i])
            if self.momentum_scaled:  # the rule and why each term: the module docstring
                g2 = torch.linalg.vector_norm(step, dim=1).square_().div_(d)  # mean(G^2)
                moved = total[:, d + 2]  # M = sum_k rms(delta_k)
                # lr rms(G) / (sqrt(s) + eps) <= M  <=>  sqrt(s) >= lr rms(G) / M - eps (eps counts: rows' s ~1e-10)
                floor = (self.lr * g2.sqrt() / moved.clamp_min(1e-30) - self.eps).clamp_min_(0).square_()
                floor = torch.where(moved > 0, floor, torch.zeros_like(floor))
                new_s = torch.maximum(torch.maximum(s0 + total[:, d] + g2 - total[:, d + 1], s0), floor)
                step.mul_((-self.lr / (new_s.sqrt() + self.eps)).unsqueeze(1))
            else:
                new_s = s0 + total[:, d] / self.R
                step.div_(self.R)
            put(self.kernel.states()[i], new_s)
            put(self.s0[i], new_s)
        new_w = step.add_(take(w0))
        put(w, new_w)
        put(w0, take(w) if w.dtype != torch.float32 else new_w)

    def _scale(self, payloads: list[torch.Tensor]) -> float:
        """A power of two shared by all replicas that puts fp16 payloads (and their sums) in range."""
        if self.dtype != torch.float16:
            return 1.0
        amax = torch.tensor([max((float(p.abs().max()) for p in payloads if p.numel()), default=0.0)],
                            device=self.device)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        a = float(amax) * self.R
        return 2.0 ** math.floor(math.log2(FP16_HEADROOM / a)) if a > 0 else 1.0

    def _to_wire(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if scale != 1.0:
            x = x * scale
        return x.to(self.dtype) if self.dtype != x.dtype else x

    def _from_wire(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        x = x.float()
        return x.div_(scale) if scale != 1.0 else x

    @torch.no_grad()
    def sync(self) -> None:
        """Merge now, by the transport `transport.choose_transport` picks (or CUBIC_REPLICA_SYNC forces)."""
        t0 = time.perf_counter()
        clock = _Clock(self.stats.parts)
        ids = [t.nonzero().squeeze(1) for t in self.touched]
        counts = torch.tensor([x.numel() for x in ids], dtype=torch.int64, device=self.device)
        most = counts.sum().reshape(1)
        clock.mark("payload")
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)  # the first collective: every replica here
        clock.mark("wait")
        cb = torch.finfo(self.dtype).bits // 8
        rows = self.kernel.rows
        touched_bytes = int(most) * (8 + max(self.widths) * cb)
        shard_bytes = sum(r * w for r, w in zip(rows, self.widths, strict=True)) * cb
        self.stats.rule_bytes["sparse"] += touched_bytes
        self.stats.rule_bytes["dense"] += shard_bytes
        in_place = self._averages_in_place()
        how = self.transport if self.transport != "auto" else choose_transport(
            self.R, touched_bytes, shard_bytes, in_place)
        clock.mark("payload")
        if how == "sparse":
            self._sparse(ids, counts, clock)
            self.stats.sparse += 1
        elif in_place:  # union, or dense: the union of every row
            self._average_union(clock, self.transport)  # auto: per shard, union or whole
        else:
            payloads = [self._payload(i, None) for i in range(len(rows))]
            clock.mark("payload")
            scale = self._scale(payloads)
            for i, p in enumerate(payloads):  # one all-reduce per shard: no whole-collection copy
                buf = self._to_wire(p, scale)
                dist.all_reduce(buf, group=self.group)
                total = self._from_wire(buf, scale)
                clock.mark("wire")
                self._apply(i, total, None)
                clock.mark("apply")
        for t in self.touched:
            t.zero_()
        self.stats.syncs += 1
        self.stats.seconds.append(time.perf_counter() - t0)
        self.stats.touched_frac.append(float(counts.sum()) / max(1, sum(rows)))

    def _averages_in_place(self) -> bool:
        return averages_in_place(self.momentum_scaled, self.dtype == torch.float32)

    def _average_union(self, clock: _Clock, how: str) -> None:
        """The plain rule in place (`averages_in_place`), on the rows any replica touched (the module docstring):
        1. The union: each replica's touched marks, one byte per row of every shard, max-all-reduced.
        2. Each shard's weights and state at those rows: where the replicas share a host, gathered straight into
           this rank's shared-memory slot, as many shards at once as fit a call's `budget` (HOST_BATCH_BYTES or
           less), whose means (`host_reduce`: summed in fp32, rounded once into the rows' precision) are written
           back to the kernel (no w0/s0: `keeps_base`); else each gathered into a buffer widened to fp32, all-reduced by
           the group, divided by R and written back. Where gathering and scattering the union would cost more
           than streaming the whole shard (`transport.union_pays`; `how` "union" or "dense" forces one, "auto"
           decides per shard), the shard itself is averaged.
        The sums are the dense transport's, row for row (the same R values added)."""
        union: list[torch.Tensor | None] = [None] * len(self.touched)
        if how != "dense":
            marks = torch.cat(self.touched).to(torch.uint8)
            dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=self.group)
            union = [m.nonzero().squeeze(1) for m in marks.split(self.kernel.rows)]
            self.stats.union_frac.append(sum(u.numel() for u in union) / max(1, marks.numel()))
            clock.mark("payload")
        parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (the live tensor, its rows; None: all)
        for i, w in enumerate(self.kernel.weights()):
            rows = union[i]
            if rows is not None and rows.numel() == 0:
                continue
            whole = rows is None or rows.numel() == w.shape[0] or (
                how == "auto" and not union_pays(rows.numel(), w.shape[0]))
            for live in [w] + ([self.kernel.states()[i]] if self.adagrad else []):
                parts.append((live, None if whole else rows))
        budget = self.host.budget if self.host is not None else 0  # through the process group: a part a call
        batch: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        held = 0  # the batch's bytes
        for live, rows in parts:
            nbytes = _elements(live, rows) * live.element_size()
            if batch and held + nbytes > budget:
                self._average_parts(batch, clock)
                batch, held = [], 0
            batch.append((live, rows))
            held += nbytes
        if batch:
            self._average_parts(batch, clock)

    def _average_parts(self, parts: list[tuple[torch.Tensor, torch.Tensor | None]], clock: _Clock) -> None:
        """The replicas' mean of each (live, rows) part written back in place (`_average_union`'s step 2)."""
        slots = self.host.slot(*((_elements(*p), p[0].dtype) for p in parts)) if self.host is not None else None
        if slots is None:
            for live, rows in parts:
                buf = (live if rows is None else live.index_select(0, rows)).float()  # fp32 rows: no copy
                clock.mark("payload")
                dist.all_reduce(buf, group=self.group)
                clock.mark("wire")
                self._put(live, rows, buf.div_(self.R))
                clock.mark("apply")
            return
        for (live, rows), slot in zip(parts, slots, strict=True):
            slot = slot.view(-1, *live.shape[1:])
            if rows is None:
                slot.copy_(live)
            else:
                torch.index_select(live, 0, rows, out=slot)
        clock.mark("payload")
        means = self.host.mean()  # (divided by R)
        clock.mark("wire")
        for (live, rows), mean in zip(parts, means, strict=True):
            self._put(live, rows, mean.view(-1, *live.shape[1:]))
        clock.mark("apply")

    @staticmethod
    def _put(live: torch.Tensor, rows: torch.Tensor | None, mean: torch.Tensor) -> None:
        """Write the mean into `live` at `rows` (None: all of it), rounded once to its precision."""
        if mean is not live:
            live.copy_(mean) if rows is None else live.index_copy_(0, rows, mean.to(live.dtype))

    def _sparse(self, ids: list[torch.Tensor], counts: torch.Tensor, clock: _Clock) -> None:
        """All-gather every replica's touched rows and payloads; sum them per row; apply to the union.

        1. Each replica's row counts per shard (one small all-gather) size everything after it: the ids and the
           payloads then travel in one all-gather each, written straight into the padded send buffer.
        2. Per shard, the union of the replicas' rows in ascending order from a mark per row (a cumulative sum
           gives each row its place), not a sort of the gathered ids.
        3. Each replica's payload is added at its rows' places in replica order: the same sums, in the same
           order, as one add over them all."""
        payloads = [self._payload(i, x) for i, x in enumerate(ids)]
        clock.mark("payload")
        scale = self._scale(payloads)
        all_counts = [torch.empty_like(counts) for _ in range(self.R)]
        dist.all_gather(all_counts, counts, group=self.group)
        per = [c.tolist() for c in all_counts]
        all_ids = self._gather(ids, [sum(c) for c in per], torch.int64)
        cast = scale != 1.0 or self.dtype != torch.float32  # else the fp32 payloads go as they are
        all_vals = self._gather([p.reshape(-1) for p in payloads],
                                [sum(n * w for n, w in zip(c, self.widths, strict=True)) for c in per],
                                self.dtype, (lambda x: self._to_wire(x, scale)) if cast else None)
        clock.mark("wire")
        ids_of = [all_ids[r].split(per[r]) for r in range(self.R)]
        vals_of = [all_vals[r].split([n * w for n, w in zip(per[r], self.widths, strict=True)])
                   for r in range(self.R)]
        for i, rows in enumerate(self.kernel.rows):
            mark = torch.zeros(rows, dtype=torch.bool, device=self.device)
            for r in range(self.R):
                mark[ids_of[r][i]] = True
            union = mark.nonzero().squeeze(1)
            place = mark.cumsum(0).sub_(1)
            total = torch.zeros(union.numel(), self.widths[i], device=self.device)
            for r in range(self.R):
                total.index_add_(0, place[ids_of[r][i]], self._from_wire(vals_of[r][i].view(-1, self.widths[i]),
                                                                           scale))
            self._apply(i, total, union)
        clock.mark("apply")

    def _gather(self, parts: list[torch.Tensor], sizes: list[int], dtype: torch.dtype,
                wire: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Every replica's `parts`, concatenated (`sizes[r]` elements from replica r, known beforehand): gloo's
        all-gather needs equal sizes, so each sends a buffer of the largest size. Without a cast on the way
        (`wire`: to the comm precision) the parts are written into it directly."""
        buf = torch.zeros(max(sizes), dtype=dtype, device=self.device)
        n = sum(p.numel() for p in parts)
        if wire is None:
            torch.cat(parts, out=buf[:n])
        elif n:
            buf[:n] = wire(torch.cat(parts))
        outs = [torch.empty_like(buf) for _ in range(self.R)]
        dist.all_gather(outs, buf, group=self.group)
        return [o[:k] for o, k in zip(outs, sizes, strict=True)]
