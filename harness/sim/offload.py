"""Neo's memory hierarchy on a GPU with a host link: what does not fit a device lives in host memory
behind a device-side cache (the largest shards move until the rest fits), or every shard does behind
FBGEMM's UVM cache (`uvm_cache_load_factor`); each cache miss moves its row over the host link.
`place` applies it to the step's positions: their embedding times with the misses, their memory with
what stayed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cubic_harness.config import DTYPE_BYTES, TrialConfig
from cubic_harness.sim.cluster import Cluster
from cubic_harness.sim.loads import Held, Position, ShardLoads
from cubic_harness.sim.traffic import hit_rate


@dataclass(slots=True)
class Placed:
    """A position after the hierarchy: its embedding times (with any misses over the host link), its
    peak memory, and the shards in host memory (None where nothing moved). Read only; not frozen
    for the reason `Position` is not."""

    fwd_ms: float
    bwd_ms: float
    mem_mb: float
    offload: list[dict] | None = None


def place(cfg: TrialConfig, c: Cluster, ld: ShardLoads, pos: Sequence[Position], fixed: float,
          held: Sequence[float], mem_limit: float) -> list[Placed]:
    """Each position's `Placed`: `fixed` + `held[p]` bytes beside its shards (`memory.memory`),
    against the rank's `mem_limit` MB."""
    out = [Placed(p.fwd_ms, p.bwd_ms, (fixed + p.shard_bytes + h) / 2**20)
           for p, h in zip(pos, held, strict=True)]
    if c.device.type != "gpu" or c.device.host_link_gbs <= 0:
        return out
    host_per_rank = c.host_memory_gb * 2**30 / c.devices_per_node
    moves: dict[tuple, tuple] = {}  # positions that hold alike move alike
    uvm, wb, wl = cfg.uvm_cache_load_factor, DTYPE_BYTES[cfg.emb_precision], cfg.workload
    for p, (at, h) in enumerate(zip(pos, held, strict=True)):
        if not uvm and out[p].mem_mb <= mem_limit:
            continue
        on_p = ld.on(p, wl)
        others = at.shard_bytes - float(on_p.size.sum())  # data-parallel: on the device
        shards = on_p.key()
        if uvm:  # the knob: every shard in host memory behind its share's cache
            key = ("uvm", *shards)
            if key not in moves:
                moves[key] = uvm_cache(on_p, uvm, wb, host_per_rank, c)
        else:  # Neo's hierarchy: the largest shards move until the rest fits
            room = mem_limit * 2**20 - fixed - h - others
            key = (room, *shards)
            if key not in moves:
                moves[key] = offload(on_p, room, host_per_rank, c)
        extra, off, dev = moves[key]
        out[p] = Placed(at.fwd_ms + extra, at.bwd_ms + extra, (fixed + h + others + dev) / 2**20,
                        off)
    return out


def offload(h: Held, room: float, host_bytes: float, c: Cluster) -> tuple[float, list[dict], float]:
    """Move the largest shards to host memory until the rest fits `room` bytes, the rest of `room`
    is their device-side cache (rows kept by heat, split by the shards' sizes). Returns (ms each of
    the forward and the backward spend on misses over the host link, what moved, bytes left on the
    device)."""
    size = h.size.astype(np.float64)  # whole bytes: exact in float64 below 2**53
    order = np.argsort(-size, kind="stable")
    # bytes left if the first k move
    rest = np.concatenate([np.cumsum(size[order][::-1])[::-1], [0.0]])
    fits = np.flatnonzero(rest <= room * 0.5)  # half the room stays a cache
    moved = order[:int(fits[0]) if fits.size else len(order)]
    dev_bytes = float(rest[len(moved)])
    cache = max(0.0, room - dev_bytes)
    moved_bytes = float(size[moved].sum())
    ms, out = misses(h, moved, cache * (size[moved] / (moved_bytes or 1.0)) / h.row_bytes[moved], c)
    if moved_bytes > host_bytes:  # host memory is the limit too: stays over
        return ms, out, dev_bytes + moved_bytes
    return ms, out, dev_bytes + cache


def uvm_cache(h: Held, load_factor: float, wb: int, host_bytes: float,
               c: Cluster) -> tuple[float, list[dict], float]:
    """FBGEMM's UVM cache (`TrialConfig.uvm_cache_load_factor`): every shard's rows and optimizer
    state in host memory, `load_factor` of its rows cached on the device (weights only: the state
    stays in host memory). Returns (ms each of the forward and the backward spend on misses, the
    shards, device bytes). Where the shards do not fit the rank's host memory the device holds them
    all (the memory check then refuses it)."""
    ms, out = misses(h, np.arange(len(h.rows)), load_factor * h.rows, c)
    total = float(h.size.sum())
    if total > host_bytes:
        return ms, out, total
    return ms, out, float(np.sum(load_factor * h.rows * h.dim * wb))


def misses(h: Held, which: np.ndarray, cached: np.ndarray, c: Cluster) -> tuple[float, list[dict]]:
    """What host-memory shards behind a device cache cost: each shard `which[k]` with `cached[k]`
    rows cached misses the share of its lookups its hottest rows do not serve (`hit_rate`: the
    profiled ids where they are known), and each miss moves its row over the host link, in the
    forward and again in the backward's update. The hottest rows are what an LFU cache keeps; an LRU
    cache (FBGEMM's default) keeps fewer of them, so this is the cache's best case. Each shard gets
    its own share; FBGEMM shares one cache among a kernel's tables, where a small table's few rows
    stay cached even below one row's share."""
    ms, out = 0.0, []
    cached = np.asarray(cached, dtype=np.float64)
    for i, rows_cached in zip(which.tolist(), cached.tolist(), strict=True):
        rows, table = int(h.rows[i]), int(h.table[i])
        hr = hit_rate(rows_cached, rows, h.specs[table], h.profiled)
        ms += float(h.ids[i]) * (1 - hr) * int(h.row_bytes[i]) / (c.device.host_link_gbs * 1e6)
        out.append({"table": table, "rows": rows, "cache_rows": int(rows_cached),
                    "hit_rate": round(hr, 4)})
    return ms, out
