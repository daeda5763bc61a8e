"""One rank's training loop: build the model from a TrialConfig, train, measure.

Parallelism is applied by functions: the sharded embedding collection
(harness/sharding) owns the tables, DDP wraps the dense arch, and the
pipeline keeps `pipeline_depth` batches' input distribution in flight on a
background thread (its own process group) while the current batch computes.
"""

from __future__ import annotations

import math
import resource
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from cubic_harness.config import TrialConfig, load_time_env
from cubic_harness.data import Batch, eval_batches, rank_batches
from cubic_harness.faults import maybe_fault
from cubic_harness.model import DenseArch, build_dense_arch
from cubic_harness.sharding.collection import KernelInput, ShardedEmbeddingCollection
from cubic_harness.sharding.comm import Groups, make_groups
from cubic_harness.sharding.plan import ShardingPlan
from cubic_harness.timers import BACKGROUND, PHASES, TIMERS
from cubic_kernels.base import DTYPES

COMPRESS = {k: v for k, v in DTYPES.items() if k != "fp32"}  # all-reduce hooks: the 16-bit wire formats


def compress_hook(dtype: torch.dtype):
    """DDP comm hook: each gradient bucket all-reduced in `dtype`, torch's fp16/bf16_compress_hook math (divide
    by the ranks first so the sum cannot overflow, decompress into the bucket). Ours because torch's bf16
    hook refuses gloo, which reduces bf16 fine."""

    def hook(pg, bucket):  # no annotations: DDP checks them, and this module's are strings
        buf = bucket.buffer()
        small = buf.to(dtype).div_(dist.get_world_size(pg))
        fut = dist.all_reduce(small, group=pg, async_op=True).get_future()

        def back(f: torch.futures.Future) -> torch.Tensor:
            buf.copy_(f.value()[0])
            return buf

        return fut.then(back)

    return hook


class InputPipeline:
    """Keeps the input distribution of the next `depth` batches running ahead (depth 0: inline)."""

    def __init__(self, coll: ShardedEmbeddingCollection, batches: Sequence[Batch], depth: int) -> None:
        self.coll, self.batches, self.depth = coll, batches, depth
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"{BACKGROUND}-input-dist") if depth else None
        self.inflight: deque[tuple[int, Future]] = deque()
        self.next_step = 0

    def _dist(self, step: int) -> KernelInput:
        b = self.batches[step % len(self.batches)]
        return self.coll.input_dist(b.ids, b.offsets, b.batch_size, b.scores)

    def get(self, step: int) -> KernelInput:
        if not self.pool:
            return self._dist(step)
        while self.next_step <= step + self.depth:
            self.inflight.append((self.next_step, self.pool.submit(self._dist, self.next_step)))
            self.next_step += 1
        s, fut = self.inflight.popleft()
        assert s == step
        t0 = time.perf_counter()
        kin = fut.result()
        TIMERS.add("comm", time.perf_counter() - t0)
        return kin

    def close(self) -> None:
        """Drain what is in flight (every rank issued the same input collectives) and stop."""
        if self.pool:
            for _, fut in self.inflight:
                fut.result()
            self.pool.shutdown()


def rss_mb(now: bool = False) -> float:
    """This process's peak RSS in MB (`now`: its current RSS). Linux's VmHWM starts afresh at exec; ru_maxrss
    does not: a rank spawned by a 1.8 GB notebook or Ray worker would start at that parent's peak (and fail
    mem_cap)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:" if now else "VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class RankModel:
    """What one rank trains (`build`): its process groups, embedding shards, dense arch (wrapped in DDP
    across ranks), optimizer, and the batches it reads (all of them made before the first step, so no
    step waits on data generation)."""

    groups: Groups
    coll: ShardedEmbeddingCollection
    dense: torch.nn.Module
    opt: torch.optim.Optimizer
    batches: list[Batch]
    start_mb: float  # the framework before any model state (the fork server's pages it counts)
    fp8_report: list[dict] | None = None


@dataclass
class StepLog:
    """The step loop's record (`run_steps`): every step's loss, the measured steps' times, and the sums
    NE is computed from (BCE, labels and samples over the measured steps)."""

    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    bce_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    first_step_at: float = 0.0  # wall clock (comparable across processes): a trial's startup ends here


def train_rank(cfg: TrialConfig, plan: ShardingPlan, rank: int, device: torch.device,
               collect_tables: bool = False) -> dict:
    """Run warm-up + measured steps on this rank; return its measurements (rank 0's are the trial's)."""
    m = build(cfg, plan, rank, device)
    log = run_steps(cfg, m, rank, device)
    evaluation = evaluate(cfg, m.coll, m.dense, rank, m.groups, device) if cfg.eval_samples else None
    out = report(cfg, m, log, device)
    if evaluation is not None:
        out["eval"] = evaluation
    if collect_tables:
        out["tables"] = {t: w.numpy() for t, w in m.coll.full_tables().items()}  # by value across processes
    return out


def build(cfg: TrialConfig, plan: ShardingPlan, rank: int, device: torch.device) -> RankModel:
    """This rank's model, optimizer and batches, as `cfg` and `plan` place them."""
    wl, W = cfg.workload, cfg.world_size
    start_mb = rss_mb(now=True)
    groups = make_groups(rank, W, cfg.group_size, cfg.group_placement)
    coll = ShardedEmbeddingCollection(cfg, plan, groups, device)
    dense = build_dense_arch(wl, cfg.seed).to(device)
    total = cfg.warmup_steps + cfg.measure_steps
    batches = [b.to(device) for b in rank_batches(wl, cfg.seed, rank, cfg.batch_size, W, total)]
    fp8_report = None
    if cfg.dense_precision in ("fp8_auto", "fp8_all"):
        fp8_report = apply_fp8_dense(dense, coll, batches, cfg.dense_precision, groups, device)
    if W > 1:
        dense = DDP(dense, device_ids=[device.index] if device.type == "cuda" else None,
                    process_group=groups.world_pg)
        if cfg.allreduce_comm_precision != "fp32":
            dense.register_comm_hook(groups.world_pg, compress_hook(COMPRESS[cfg.allreduce_comm_precision]))
    opt = torch.optim.Adagrad(dense.parameters(), lr=cfg.dense_lr)
    return RankModel(groups, coll, dense, opt, batches, start_mb, fp8_report)


def run_steps(cfg: TrialConfig, m: RankModel, rank: int, device: torch.device) -> StepLog:
    """The warm-up and measured steps: input distribution (pipelined `pipeline_depth` ahead), embedding
    forward, dense forward and backward (bf16 autocast unless fp32), the embeddings' update, the dense
    optimizer. Only the measured steps are timed and count toward NE."""
    B, total = cfg.batch_size, cfg.warmup_steps + cfg.measure_steps
    pipe = InputPipeline(m.coll, m.batches, cfg.pipeline_depth)
    lossf = torch.nn.BCEWithLogitsLoss(reduction="sum")
    autocast = cfg.dense_precision != "fp32"  # bf16 autocast; fp8 layers run inside it
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    TIMERS.cuda = device.type == "cuda"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    log = StepLog(first_step_at=time.time())
    for step in range(total):
        measuring = step >= cfg.warmup_steps
        TIMERS.enabled = measuring
        if sync:
            sync()
        t0 = time.perf_counter()
        b = m.batches[step % len(m.batches)]
        kin = pipe.get(step)
        pooled = m.coll.forward_overlapped(kin, cfg.comm_overlap)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = m.dense(b.dense, pooled)
        loss_sum = lossf(logits.float(), b.labels)
        (loss_sum / B).backward()
        m.coll.after_backward(step, last=step == total - 1)
        with TIMERS.phase("optim"):
            m.opt.step()
            m.opt.zero_grad(set_to_none=True)
        if sync:
            sync()
        dt = time.perf_counter() - t0
        TIMERS.flush()
        log.losses.append(loss_sum.item() / B)
        if measuring:
            log.step_s.append(dt)
            log.bce_sum += torch.tensor([loss_sum.item(), b.labels.sum().item(), B], dtype=torch.float64)
        maybe_fault(cfg, rank, step, rss_mb)  # a test hook (harness/faults.py); nothing unless it is set
        if cfg.mem_cap_mb and rss_mb() > cfg.mem_cap_mb and device.type == "cpu":
            raise MemoryError(f"rank {rank} peak RSS {rss_mb():.0f} MB exceeds mem_cap_mb={cfg.mem_cap_mb:.0f}")
    pipe.close()
    return log


def report(cfg: TrialConfig, m: RankModel, log: StepLog, device: torch.device) -> dict:
    """The rank's measurements, reduced across ranks where they are the trial's (the loss curve, NE, peak
    memory, the phase breakdown): what `trial.summarize` reads from rank 0."""
    W = cfg.world_size
    # Global loss per step (mean of the ranks' means = global mean) and NE over the measured samples.
    loss_t = torch.tensor(log.losses, dtype=torch.float64)
    bce_sum = log.bce_sum
    peak = torch.tensor([rss_mb() if device.type == "cpu" else torch.cuda.max_memory_allocated(device) / 2**20],
                        dtype=torch.float64)
    # the phases, then the communication that ran beside compute (comm_overlap): not a phase of the step
    bd = torch.tensor([TIMERS.totals.get(p, 0.0) for p in (*PHASES, "comm_hidden")], dtype=torch.float64)
    if W > 1:
        pg = m.groups.world_pg
        loss_t = _reduce(loss_t, pg, device) / W
        bce_sum = _reduce(bce_sum, pg, device)
        peak = _reduce(peak, pg, device, dist.ReduceOp.MAX)
        bd = _reduce(bd, pg, device) / W
    bce, pos, n = bce_sum.tolist()
    p = min(max(pos / n, 1e-12), 1 - 1e-12)
    ne = (bce / n) / -(p * math.log(p) + (1 - p) * math.log(1 - p))
    meas = sum(log.step_s)
    *bd_s, hidden_s = bd.tolist()
    bd_ms = {k: v * 1e3 / cfg.measure_steps for k, v in zip(PHASES, bd_s, strict=True)}
    # "dense" is what the other phases do not account for: the MLPs fwd+bwd and the interaction.
    bd_ms["dense"] = max(0.0, meas * 1e3 / cfg.measure_steps - sum(v for k, v in bd_ms.items() if k != "dense"))
    out = {
        "step_s": log.step_s,
        "losses": loss_t.tolist(),
        "ne": ne,
        "peak_mem_mb": float(peak.item()),
        "start_mem_mb": m.start_mb,
        "breakdown_ms": bd_ms,
        "comm_hidden_ms": hidden_s * 1e3 / cfg.measure_steps,
        "plan_json": m.coll.plan.to_json(),
        "first_step_at": log.first_step_at,
        "omp_wait_policy": load_time_env("OMP_WAIT_POLICY"),  # as libgomp read it
    }
    if m.fp8_report is not None:
        out["fp8_probe"] = m.fp8_report
    if m.coll.replica_sync is not None:
        out["replica_sync"] = m.coll.replica_sync.stats.to_dict(cfg.sparse_sync_interval, cfg.measure_steps,
                                                                TIMERS.totals.get("sync", 0.0))
    return out


@torch.no_grad()
def evaluate(cfg: TrialConfig, coll: ShardedEmbeddingCollection, dense: torch.nn.Module, rank: int, groups,
             device: torch.device) -> dict | None:
    """NE and AUC of the trained model on held-out samples (cubic_harness.data.eval_batches: never trained on),
    as MLPerf's DLRM evaluation does: every rank scores its share, rank 0 gathers the scores."""
    W, B = cfg.world_size, cfg.batch_size
    TIMERS.enabled = False  # evaluation is not part of the measured step
    logits, labels = [], []
    for b in eval_batches(cfg.workload, cfg.seed, rank, B, W, cfg.eval_samples):
        b = b.to(device)
        pooled = coll.forward(coll.input_dist(b.ids, b.offsets, B, b.scores))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dense_precision != "fp32"):
            logits.append(dense(b.dense, pooled).float().reshape(-1))
        labels.append(b.labels.reshape(-1))
    mine = torch.stack([torch.cat(logits), torch.cat(labels)]).to(torch.float64)
    if W > 1:  # on the device: NCCL gathers CUDA tensors only
        mine = mine.to(device)
        parts = [torch.empty_like(mine) for _ in range(W)]
        dist.all_gather(parts, mine, group=groups.world_pg)
        mine = torch.cat(parts, dim=1).cpu()
    if rank != 0:
        return None
    return eval_metrics(mine[0].numpy(), mine[1].numpy())


def mean_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, ties sharing their mean rank (scipy's `rankdata`, whose import costs a
    quality run's rank 0 0.3-0.5 s: the fork server does not preload scipy)."""
    order = np.argsort(x, kind="mergesort")
    _, first, counts = np.unique(x[order], return_index=True, return_counts=True)
    ranks = np.empty(x.size)
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)
    return ranks


def eval_metrics(logits: np.ndarray, labels: np.ndarray) -> dict:
    """{ne, auc, samples}: NE = mean log loss / the entropy of the labels' mean; AUC by the rank statistic
    (ties share their mean rank)."""
    p = 1.0 / (1.0 + np.exp(-logits))
    eps = 1e-12
    loss = -np.mean(labels * np.log(np.clip(p, eps, 1)) + (1 - labels) * np.log(np.clip(1 - p, eps, 1)))
    q = min(max(float(labels.mean()), eps), 1 - eps)
    ne = float(loss / -(q * math.log(q) + (1 - q) * math.log(1 - q)))
    pos = labels > 0.5
    npos, nneg = int(pos.sum()), int((~pos).sum())
    auc = ((float(mean_ranks(logits)[pos].sum()) - npos * (npos + 1) / 2) / (npos * nneg)
           if npos and nneg else math.nan)
    return {"ne": ne, "auc": auc, "samples": int(labels.size)}


def _reduce(t: torch.Tensor, group, device: torch.device, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a small CPU tensor (on the device first: NCCL takes only CUDA tensors)."""
    x = t.to(device)
    dist.all_reduce(x, op=op, group=group)
    return x.cpu()


def apply_fp8_dense(dense: DenseArch, coll: ShardedEmbeddingCollection, batches: Sequence[Batch], mode: str,
                    groups: Groups, device: torch.device) -> list[dict]:
    """LoKA-style: probe every Linear of the dense arch (both MLPs and the interaction's: DCN cross
    layers, Wukong's FM and compression blocks) on real batches, then swap in fp8 layers.

    `fp8_all` swaps every layer; `fp8_auto` only layers the probe found both accurate
    enough and faster than bf16 (on CPU never: fp8 is only emulated there). Ranks agree
    on the choice (a layer is fp8 only if every rank's probe says so).
    """
    from cubic_harness.fp8 import apply_fp8, probe_mlp, probes_to_json

    with torch.no_grad():  # every rank runs the same input collectives, so they pair up
        inputs = [(b.dense, coll.forward(coll.input_dist(b.ids, b.offsets, b.batch_size, b.scores)))
                  for b in batches[:2]]
    probes = probe_mlp(dense, inputs, device=device)
    flags = torch.tensor([p.use_fp8 for p in probes], dtype=torch.int32)
    if groups.world > 1:
        flags = _reduce(flags, groups.world_pg, device, dist.ReduceOp.MIN)
    for p, f in zip(probes, flags.tolist(), strict=True):
        p.use_fp8 = bool(f)
    apply_fp8(dense, probes, mode)
    # "mlp" names the part a layer sits in: bottom, inter (the interaction) or top
    return [{"mlp": d["name"].split(".")[0], **d} for d in probes_to_json(probes)]
