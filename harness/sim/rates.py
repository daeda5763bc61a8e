"""What one configuration runs at on a cluster: its ranks' copy and compute speeds after threads and
shared cores (`speeds`), a kernel phase's and a GEMM's time at those speeds, and where its groups
sit (`spans`). The rates every price of the performance model divides by."""

from __future__ import annotations

from dataclasses import dataclass, field

from cubic_harness.config import TrialConfig
from cubic_harness.dense_cost import DenseCost
from cubic_harness.sharding.plan import group_ranks
from cubic_harness.sim import collectives as coll
from cubic_harness.sim.cluster import Cluster, KernelEff


class ModelError(ValueError):
    """The cluster cannot run this configuration at all (too few devices, an uncalibrated backend).
    """


@dataclass(frozen=True)
class Speeds:
    """Per-rank rates for one config on one cluster (GB/s and GFLOP/s after threads and contention).
    """

    copy_gbs: float
    eff: KernelEff
    emb_speed: float
    dense_speed: float
    ranks_per_node: int
    effs: dict[tuple[str, int], float] = field(default_factory=dict)  # (phase, width) -> efficiency
    # phase -> a weighted table's time over an unweighted one's
    weighted: dict[str, float] = field(default_factory=dict)


def speeds(cfg: TrialConfig, c: Cluster) -> Speeds:
    eff = c.device.kernel(cfg.kernel, cfg.emb_precision)
    if eff is None:
        raise ModelError(f"cluster {c.name}: kernel={cfg.kernel} "
                         f"(emb_precision={cfg.emb_precision}) is not calibrated; it has "
                         f"{sorted(c.device.embedding)}")
    rpn = min(cfg.world_size, c.devices_per_node)
    if c.device.type == "cpu":
        t, cores = cfg.threads_per_rank, c.device.cores
        # cores in use beyond the first, as a fraction of the rest: 0 alone, 1 when the node is full
        busy = (min(rpn * t, cores) - 1) / (cores - 1) if cores > 1 else 0.0
        share = {k: 1.0 - (1.0 - c.device.shared_speed.get(k, 1.0)) * busy
                 for k in ("dense", "embedding")}
        exp = c.device.thread_exp
        emb = _thread_speed(t, rpn, cores, exp.get(cfg.kernel, 0.0)) * share["embedding"]
        dense = _thread_speed(t, rpn, cores, exp.get("dense", 0.0)) * share["dense"]
    else:
        emb = dense = 1.0
    return Speeds(c.device.mem_bw_gbs, eff, emb, dense, rpn,
                  weighted=c.device.weighted_cost.get(cfg.kernel, {}))


def _thread_speed(threads: int, ranks: int, cores: int, exp: float) -> float:
    """A CPU rank's speed with `threads` threads beside `ranks` - 1 others on `cores` cores, over
    one thread alone.

    Alone its work runs min(t, cores) ** exp times faster (`thread_exp`, calibrated): that many
    cores' worth of it is busy at once. The ranks together then ask for ranks x that many cores, and
    past `cores` each gets its share, so a rank runs at min(its speed-up, cores / ranks). A kernel
    that does not parallelise (FBGEMM's CPU kernel: exp ~0) keeps one core busy whatever its thread
    count, and its idle threads cost nothing; dividing by ranks x threads / cores instead charged
    them as if they ran, half the speed at 2 x 2 on 2 cores where the trials lose ~7%
    (OMP_WAIT_POLICY=PASSIVE: `trial.rank_env`)."""
    return min(min(threads, cores) ** exp, cores / ranks)


def emb_ms(nbytes: float, phase: str, dim: int, s: Speeds, weighted: bool = False) -> float:
    """A kernel phase's time for its bytes at this width; a weighted table's times the backend's
    measured `weighted_cost` (its scores' bytes are few; what they cost is the kernel's extra work).
    """
    key = (phase, dim)
    eff = s.effs.get(key)
    if eff is None:  # a few widths per config, asked per shard: interpolate each once
        eff = s.effs[key] = s.eff.at(phase, dim)
    return (nbytes / (s.copy_gbs * 1e6 * eff * s.emb_speed)
            * (s.weighted.get(phase, 1.0) if weighted else 1.0))


def gemm_rate(mflop: float, peak_gflops: float, half_mflop: float) -> float:
    """Achieved GFLOP/s of one GEMM of `mflop` MFLOP: peak x size / (size + half) (roofline-like
    ramp)."""
    return peak_gflops * mflop / (mflop + half_mflop)


def gemm_ms(dc: DenseCost, B: int, peak: float, half: float) -> tuple[float, float]:
    fwd = bwd = 0.0
    for f, b in dc.gemms:
        mf = B * f / 1e6
        fwd += mf / gemm_rate(mf, peak, half)
        # the backward's GEMMs are of the forward's size (one or two of them)
        bwd += (B * b / 1e6) / gemm_rate(mf, peak, half)
    return fwd, bwd  # MFLOP / (GFLOP/s) = ms


# (cluster id, W, G, placement) -> (the cluster, its spans): the planner's table costs and the
# step's estimate, for every configuration of a tune, read the same few

_SPANS: dict[tuple, tuple] = {}


def spans(W: int, G: int, placement: str, c: Cluster) -> tuple[coll.Span, coll.Span, coll.Span]:
    """Where a group, a position's replicas and the world sit: a walk over every rank (16,384 of
    them at the largest scale) that a tune of many configurations on one cluster asks for again and
    again."""
    key = (id(c), W, G, placement)
    hit = _SPANS.get(key)
    if hit is None or hit[0] is not c:
        if len(_SPANS) >= 256:  # clusters made on the fly (a fit's scaled copies): keep it small
            _SPANS.clear()
        groups = group_ranks(W, G, placement)
        hit = _SPANS[key] = (c, (coll.span(groups[0], c), coll.span([g[0] for g in groups], c),
                                 coll.span(list(range(W)), c)))
    return hit[1]


def overlapped(inp: float, latency: float, cfg: TrialConfig, c: Cluster,
               s: Speeds) -> tuple[float, float]:
    """The pipelined input distribution runs beside the previous step's compute: (what it adds to
    the step, what runs beside it). On a GPU its copy engines and NICs run it apart from the
    kernels: hidden as long as it takes no longer than the step it runs beside. On CPU cores that
    the ranks already fill, its byte copying still takes them (only the waiting, the latency, is
    hidden)."""
    if c.device.type == "gpu":
        return 0.0, inp
    busy = min(1.0, s.ranks_per_node * cfg.threads_per_rank / c.device.cores)
    return max(0.0, inp - latency) * busy, 0.0
