"""A mean all-reduce among ranks on one host, through shared memory instead of gloo's TCP loopback.

Gloo sends every byte of an all-reduce through the kernel's TCP stack even when the ranks share a machine
(~1 GB/s here, measured by `cubic calibrate`), where reading the other replicas' rows straight from memory runs
at memory speed. What NCCL's SHM transport and DeepSpeed's CPU `shm_comm` do for co-located ranks, for the one
collective that moves whole tables: the 2D replica merge (`replica_sync.ReplicaSync`, averaging in place).

Each of the R ranks owns a slot, and the group shares one result buffer, all mapped from /dev/shm by every rank:
1. A rank writes its rows into its own slot (`slot`: the caller gathers straight into it, no copy of its own).
2. Barrier: every slot is written.
3. Rank r sums chunk r of the slots in replica order and divides by R, into the result's chunk r: each
   element is computed by one rank, so every replica reads the same bits. For R = 2 these are gloo's sums
   ((a + b) / R), bit for bit. The slots hold the rows' own precision: fp16 and bf16 rows are summed in fp32
   a cache-sized block at a time and rounded once into the result, the bits gloo's sum of the rows widened to
   fp32 gives once rounded back, at half the bytes through memory (the merge is memory-bound here).
4. Barrier: the result is whole; each rank reads it (`mean`) until its next `slot` call. A rank writes the
   result again only after the next call's first barrier, which no rank passes before it has finished
   reading, so two barriers a call suffice.
The files are unlinked as soon as every rank has mapped them: a crashed rank leaves nothing in /dev/shm.
Capacity grows by doubling (up to the `budget` a call may hold) when a call needs more (every rank asks for the
same size: the replicas of a shard agree on its rows), which costs two more barriers that once. The files' pages
are reserved when they are made (posix_fallocate): a /dev/shm too small for them (a container's default is 64 MB)
is an error then, on which every rank agrees, and the merge goes on through the process group; written into
unreserved, a full tmpfs would kill the rank with SIGBUS.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from cubic_harness.sharding.transport import HOST_BATCH_BYTES

SHM = Path("/dev/shm")
BLOCK = 1 << 16  # elements of a half-precision mean summed at once: 256 kB of fp32, in L2
ALIGN = 64  # bytes: each part of a slot starts on a cache line


def _host_id() -> str:
    """This machine, as the ranks on it agree: the host name and the kernel's boot id."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return socket.gethostname() + ":" + (boot.read_text().strip() if boot.exists() else "")


def host_reduce(group, replicas: int, device: torch.device, shm: Path = SHM) -> HostReduce | None:
    """The shared-memory mean for `group` where all its `replicas` ranks are CPU processes on this host, else
    None (the caller all-reduces through the process group). Collective: every rank of `group` calls it."""
    if replicas < 2 or device.type != "cpu":
        return None
    hosts: list[object] = [None] * replicas
    # (where this rank is, a token for the files); a rank without the folder names no host, so none matches it
    where = _host_id() if shm.is_dir() else uuid.uuid4().hex
    dist.all_gather_object(hosts, (where, uuid.uuid4().hex), group=group)
    if len({h for h, _ in hosts}) != 1:
        return None
    return HostReduce(group, replicas, dist.get_rank(group), token=hosts[0][1], shm=shm)


class HostReduce:
    """The R ranks' means of buffers through /dev/shm (the module docstring's steps). A call averages several
    parts at once, each in its own precision, between one pair of barriers: a merge's every shard in one call
    instead of one call each, whose barriers (and the wait for the slowest replica each brings) cost as much
    as the means themselves on small shards. The files are sized in bytes, so one mapping serves any mix."""

    def __init__(self, group, replicas: int, rank: int, token: str, shm: Path = SHM) -> None:
        self.group, self.R, self.rank, self.token, self.shm = group, replicas, rank, token, shm
        # what one call may hold, in bytes: HOST_BATCH_BYTES, less where /dev/shm is small, so that the R slots and
        # the result fill at most half of it (a container's default 64 MB: ~10 MB calls at R = 2) and other
        # groups' files fit beside. From the mount's size, not its free space: every rank computes the same.
        fs = os.statvfs(shm)
        self.budget = min(HOST_BATCH_BYTES, fs.f_blocks * fs.f_frsize // (2 * (replicas + 1)))
        self.capacity = 0  # bytes per slot; -1: /dev/shm could not hold them, the process group carries
        self.generation = 0
        self.slots: list[torch.Tensor] = []  # uint8, viewed as each part's dtype
        self.result = torch.empty(0, dtype=torch.uint8)
        self.parts: list[tuple[int, int, torch.dtype]] = []  # (byte offset, elements, dtype) of the last `slot`

    def slot(self, *parts: tuple[int, torch.dtype]) -> list[torch.Tensor] | None:
        """This rank's slot as one view per part (n elements of its dtype, laid one after another at
        ALIGN-byte boundaries), to write its rows into (step 1); None where /dev/shm cannot hold them (every
        rank gets None alike: the caller all-reduces through the process group)."""
        self.parts, end = [], 0
        for n, dtype in parts:
            self.parts.append((end, n, dtype))
            end += -(-n * dtype.itemsize // ALIGN) * ALIGN
        if end > self.capacity >= 0 and not self._grow(max(end, min(2 * self.capacity, self.budget))):
            self.capacity, self.slots, self.result = -1, [], torch.empty(0, dtype=torch.uint8)
        if self.capacity < end:
            return None
        return [self._view(self.slots[self.rank], part) for part in self.parts]

    def mean(self) -> list[torch.Tensor]:
        """Steps 2-4: the replicas' mean of each part of the last `slot` call (read-only, valid until `slot`)."""
        dist.barrier(group=self.group)
        for part in self.parts:
            slots = [self._view(s, part) for s in self.slots]
            result = self._view(self.result, part)
            n = part[1]
            lo, hi = self.rank * n // self.R, (self.rank + 1) * n // self.R
            if part[2] == torch.float32:  # nothing to widen: summed where the result lives, in one pass
                out = result[lo:hi]
                torch.add(slots[0][lo:hi], slots[1][lo:hi], out=out)
                for q in range(2, self.R):
                    out.add_(slots[q][lo:hi])
                out.div_(self.R)
                continue
            for a in range(lo, hi, BLOCK):  # summed in fp32 a block at a time (it stays in cache), rounded once
                b = min(a + BLOCK, hi)
                acc = slots[0][a:b].float()
                for q in range(1, self.R):
                    acc.add_(slots[q][a:b])
                result[a:b].copy_(acc.div_(self.R))
        dist.barrier(group=self.group)
        return [self._view(self.result, part) for part in self.parts]

    @staticmethod
    def _view(buf: torch.Tensor, part: tuple[int, int, torch.dtype]) -> torch.Tensor:
        at, n, dtype = part
        return buf[at:at + n * dtype.itemsize].view(dtype)

    def _grow(self, capacity: int) -> bool:
        """Every rank makes its own slot file (rank 0 the result's too) with its pages reserved; if all could,
        each maps everyone's; then each unlinks its own. False (on every rank) where some rank could not."""
        self.generation += 1
        name = f"cubic-merge-{self.token}-{self.generation}"
        mine = [self.shm / f"{name}-{self.rank}"] + ([self.shm / f"{name}-result"] if self.rank == 0 else [])
        made = torch.ones(1, dtype=torch.int32)
        try:
            for path in mine:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.posix_fallocate(fd, 0, capacity)
                finally:
                    os.close(fd)
        except OSError:  # ENOSPC: a tmpfs too small for the rows
            made.zero_()
        dist.all_reduce(made, op=dist.ReduceOp.MIN, group=self.group)
        try:
            if made.item():
                self.slots = [torch.from_file(str(self.shm / f"{name}-{q}"), shared=True, size=capacity,
                                              dtype=torch.uint8) for q in range(self.R)]
                self.result = torch.from_file(str(self.shm / f"{name}-result"), shared=True, size=capacity,
                                              dtype=torch.uint8)
                self.capacity = capacity
        finally:
            dist.barrier(group=self.group)
            for path in mine:
                path.unlink(missing_ok=True)
        return bool(made.item())
