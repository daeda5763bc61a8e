"""Process groups of a trial and the embedding all-to-all (with communication precision).

Each kind of traffic has its own process group so that collectives issued in
different orders (DDP's bucketed all-reduce inside backward, the embedding
all-to-all, 2D replica sync, the pipelined input distribution running on a
background thread) never interleave on one group.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from cubic_harness.sharding.plan import group_ranks
from cubic_harness.timers import TIMERS


@dataclass
class Groups:
    rank: int
    world: int
    group_size: int
    mp: ProcessGroup | None  # model-parallel group of this rank (G ranks)
    mp_input: ProcessGroup | None  # same ranks, for the input distribution (may run on a thread)
    replica: ProcessGroup | None  # ranks at the same position in every group (2D sync)
    world_pg: ProcessGroup | None  # DDP's dense-gradient all-reduce and end-of-trial statistics
    dp_pg: ProcessGroup | None  # data-parallel tables' sparse gradient sync (inside backward, beside DDP's)
    pos: int = 0  # this rank's position in its sharding group (which shards it holds)

    @property
    def replicas(self) -> int:
        return self.world // self.group_size


def make_groups(rank: int, world: int, group_size: int, placement: str = "intra_node") -> Groups:
    """Create every sub-group on every rank (torch.distributed requires all ranks to call new_group)."""
    G = group_size
    groups = group_ranks(world, G, placement)
    mine: dict = {}
    for kind in ("mp", "mp_input"):
        for ranks in groups:
            pg = dist.new_group(ranks) if world > 1 else None
            if rank in ranks:
                mine[kind] = pg
                mine["pos"] = ranks.index(rank)
    for p in range(G):
        ranks = sorted(grp[p] for grp in groups)
        pg = dist.new_group(ranks) if world > 1 else None
        if rank in ranks:
            mine["replica"] = pg
    world_pg = dist.new_group(list(range(world))) if world > 1 else None
    dp_pg = dist.new_group(list(range(world))) if world > 1 else None
    return Groups(rank, world, G, mine["mp"], mine["mp_input"], mine["replica"], world_pg, dp_pg, mine["pos"])


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group, n: int) -> None:
    """all_to_all_single that degrades to a copy in a group of one."""
    if n == 1:
        out.copy_(inp)
        return
    with TIMERS.phase("comm"):
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


class PooledAllToAll(torch.autograd.Function):
    """Send row blocks of pooled embeddings; gradients come back the same way.

    Values are cast to the communication dtype before sending and restored
    after, in both directions, so bf16/fp16 really quantize the traffic. A group of one sends
    nothing, so it casts nothing either. Gradients are multiplied by `grad_scale` (a power of two:
    exact) before the cast and divided after: those of a loss averaged over B samples are ~1/B
    small, and fp16 flushed a fifth of them to zero at B=1024 (TorchRec's QComms scales the
    backward loss likewise).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group, n: int, dtype: torch.dtype,
                grad_scale: float = 1.0):
        dtype = x.dtype if n == 1 else dtype
        ctx.meta = (send, recv, group, n, dtype, x.dtype, x.shape, grad_scale if dtype == torch.float16 else 1.0)
        src = x.reshape(-1).to(dtype)
        out = torch.empty(sum(recv), dtype=dtype, device=x.device)
        all_to_all(out, src, recv, send, group, n)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send, recv, group, n, dtype, xdtype, xshape, scale = ctx.meta
        src = (grad * scale if scale != 1.0 else grad).contiguous().to(dtype)
        out = torch.empty(sum(send), dtype=dtype, device=grad.device)
        all_to_all(out, src, send, recv, group, n)
        back = out.to(xdtype)
        return (back / scale if scale != 1.0 else back).view(xshape), None, None, None, None, None, None


class InFlight:
    """One pooled all-to-all run beside compute (`comm_overlap`), forward and backward, in four steps:

    1. `PooledStart` (forward) casts the pooled rows and launches the all-to-all; the caller computes what does
       not need its result (the bottom MLP).
    2. `PooledWait` (forward) waits for it: only this wait is exposed communication.
    3. `PooledWait` (backward) receives the pooled rows' gradient, the first the backward makes, and launches
       the reverse all-to-all; with `backward=True` it returns at once, so autograd runs the branch that does not
       need it (the bottom MLP's backward, whose DDP buckets launch their all-reduce) meanwhile.
    4. `PooledStart` (backward) waits for it and hands the kernel its gradients.

    The values sent are those PooledAllToAll sends (same casts, same gradient scale): the losses are equal.
    Timed apart: `comm` is the waits (exposed), `comm_hidden` the time the collective ran before its wait began.
    """

    def __init__(self, send: list[int], recv: list[int], group, n: int, dtype: torch.dtype, scale: float,
                 backward: bool) -> None:
        self.send, self.recv, self.group, self.n, self.backward = send, recv, group, n, backward
        self.dtype, self.scale = dtype, scale
        self.work: dict[str, Any] = {}
        self.kept: dict[str, torch.Tensor] = {}  # what a running collective reads or writes: alive until its wait
        self.xdtype, self.xshape = torch.float32, torch.Size()

    def launch(self, name: str, out: torch.Tensor, src: torch.Tensor, out_splits: list[int],
               in_splits: list[int]) -> None:
        self.kept[name], self.kept[name + "_src"] = out, src
        if self.n == 1:
            out.copy_(src)
            return
        done: list[float] = []
        work = dist.all_to_all_single(out, src, out_splits, in_splits, group=self.group, async_op=True)
        work.get_future().add_done_callback(lambda _: done.append(time.perf_counter()))
        self.work[name] = (work, time.perf_counter(), done)

    def wait(self, name: str) -> torch.Tensor:
        if name in self.work:
            work, launched, done = self.work.pop(name)
            began = time.perf_counter()
            TIMERS.add("comm_hidden", (done[0] if done else began) - launched)
            with TIMERS.phase("comm"):
                work.wait()
        self.kept.pop(name + "_src", None)
        return self.kept.pop(name)


class PooledStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fl: InFlight):
        ctx.fl = fl
        fl.xdtype, fl.xshape = x.dtype, x.shape
        fl.launch("fwd", torch.empty(sum(fl.recv), dtype=fl.dtype, device=x.device), x.reshape(-1).to(fl.dtype),
                  fl.recv, fl.send)
        return fl.kept["fwd"]

    @staticmethod
    def backward(ctx, _launched: torch.Tensor):
        fl = ctx.fl
        back = fl.wait("bwd").to(fl.xdtype)
        return (back / fl.scale if fl.scale != 1.0 else back).view(fl.xshape), None


class PooledWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, fl: InFlight):
        ctx.fl = fl
        return fl.wait("fwd").to(fl.xdtype, copy=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        fl = ctx.fl
        src = (grad * fl.scale if fl.scale != 1.0 else grad).contiguous().to(fl.dtype).reshape(-1)
        fl.launch("bwd", torch.empty(sum(fl.send), dtype=fl.dtype, device=grad.device), src, fl.send, fl.recv)
        if not fl.backward:
            fl.kept["bwd"] = fl.wait("bwd")  # waited here: nothing runs beside it
        return src, None  # (PooledStart's backward reads the reverse all-to-all's result, not this)


def grad_scale(batch_size: int) -> float:
    """The power of two nearest the per-rank batch: undoes the loss's 1/B on the wire (see above)."""
    return float(2 ** round(math.log2(max(1, batch_size))))


def all_gather_varlen(x: torch.Tensor, group, n: int) -> list[torch.Tensor]:
    """All-gather 1-D tensors of different lengths (gloo's all_gather needs equal sizes)."""
    if n == 1:
        return [x]
    size = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
    sizes = [torch.empty_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    m = int(max(int(s) for s in sizes))
    padded = torch.zeros(m, dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    outs = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(outs, padded, group=group)
    return [o[: int(s)] for o, s in zip(outs, sizes, strict=True)]
