"""The performance model: the one place where bytes, FLOPs and collectives become milliseconds.

Three users price with it: the planners (`TableCosts`, one table's cost on a rank), the simulator
backend (`estimate` -> a TrialResult) and the tuner's proxy (`features`, the simulator's prediction
for the local cluster). It takes a plan and never imports the planner (the planner takes a cost).

What one training step of the harness costs, per group position p (every sharding group holds the
same plan, so position p's ranks all carry the same load):

- emb_fwd[p]: the bytes of p's shards' pooled lookups (ids x row bytes read, bags x width written)
  over the copy bandwidth x the backend's measured efficiency at that row width and precision;
- emb_bwd[p]: the fused backward+optimizer's bytes (rows and row state read and written, gradient
  rows read): with 2D `grad_allreduce` the union of the R replicas' bags;
- comm: the input distribution (lengths and ids all-to-all in the group; pipelined, it runs beside
  the previous step: on a GPU hidden up to that step's length, on CPU only its waiting; none where
  the framework reads each rank's ids itself, `reads_own_ids`), the pooled all-to-all forward and
  backward in the comm precision, the data-parallel tables' sparse sync (all-gather of ids and
  pooled gradients over the world), DDP's dense all-reduce in `allreduce_comm_precision` (only what
  the backward does not hide), 2D's replica traffic (`grad_allreduce`: all-gather of the replicas'
  ids and gradients every step; `weight_avg`, every k steps, the harness's transport
  (`cubic_harness.sharding.transport`): the plain rule's in-place all-reduce of the rows any replica
  touched, else the cheaper of a sparse all-gather of the touched rows and a dense all-reduce);
- dense: every GEMM of the dense part at the rate measured for its size and precision;
- optim: the dense Adagrad's bytes; plus the framework's fixed cost per step.

Rule: each phase's time is the maximum over ranks (the all-to-alls synchronise the group every step,
so the slowest rank sets each phase), and the step is a critical path over the rank's compute and
its collectives, in the order the harness runs them (`schedule.py`; `step.py` lists the ops): what
runs beside what (`comm_overlap`'s pooled all-to-all beside the bottom MLP, DDP's buckets beside the
backward) costs the device's measured `overlap_hidden` share of it, and collectives at once share
the links. On CPU the ranks of a node share its cores: with more threads than cores every rank slows
by the oversubscription, and a backend's speed-up with threads is the measured exponent.

The model by role, each a module beside this one, whose public names this module re-exports:
`traffic.py` (the byte formulas and the id laws), `rates.py` (a config's speeds on a cluster),
`costs.py` (`TableCosts`, the planners' prices), `loads.py` (each position's load), `memory.py` (a
rank's buffers), `offload.py` (the host-memory hierarchy) and `step.py` (`estimate`)."""

from cubic_harness.sim.costs import TableCosts
from cubic_harness.sim.loads import Held, Position, ReplicaMerge, ShardLoads, positions, shard_loads
from cubic_harness.sim.memory import GLIBC_MMAP_MAX, MemoryInput, batch_bytes, memory
from cubic_harness.sim.offload import Placed, misses, offload, place, uvm_cache
from cubic_harness.sim.rates import ModelError, Speeds, emb_ms, gemm_ms, gemm_rate, spans, speeds
from cubic_harness.sim.step import (
    DDP_BUCKET_BYTES,
    DP,
    FEATURE_NAMES,
    GROUP,
    MAX_BUCKETS,
    REPLICAS,
    WORLD,
    Estimate,
    estimate,
)
from cubic_harness.sim.traffic import (
    ID_BYTES,
    SCORE_BYTES,
    STATE_BYTES,
    hit_rate,
    id_bytes,
    lookup_bytes,
    rows_touched,
    rows_touched_many,
    update_bytes,
    zipf_cdf,
)

_Held, _offload = Held, offload  # the names tests/test_sim.py reaches for

__all__ = [
    "DDP_BUCKET_BYTES", "DP", "FEATURE_NAMES", "GLIBC_MMAP_MAX", "GROUP", "ID_BYTES", "MAX_BUCKETS",
    "REPLICAS", "SCORE_BYTES", "STATE_BYTES", "WORLD", "Estimate", "Held", "MemoryInput",
    "ModelError", "Placed", "Position", "ReplicaMerge", "ShardLoads", "Speeds", "TableCosts",
    "batch_bytes", "emb_ms", "estimate", "gemm_ms", "gemm_rate", "hit_rate", "id_bytes",
    "lookup_bytes", "memory", "misses", "offload", "place", "positions", "rows_touched",
    "rows_touched_many", "shard_loads", "spans", "speeds", "update_bytes", "uvm_cache", "zipf_cdf",
]
