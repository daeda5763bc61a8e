"""Process groups of a trial and the embedding all-to-all (with communication precision).

Each kind of traffic has its own process group so that collectives issued in
different orders (DDP's bucketed all-reduce inside backward, the embedding
all-to-all, 2D replica sync, the pipelined input distribution running on a
background thread) never interleave on one group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
