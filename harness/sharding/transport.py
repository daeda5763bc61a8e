"""The 2D replica merge's transport rule, written once for the harness (`replica_sync.ReplicaSync.sync`) and the
simulator (`cubic_harness.sim.perf`), which prices what the harness runs.

A merge of R replicas moves one of three things (`replica_sync`'s docstring):
- union: where the plain rule averages in place (`averages_in_place`), the rows any replica touched, gathered
  (in fp32) and all-reduced (a ring moves 2 (R - 1) / R of them; replicas on one host read each other's in shared
  memory, `host_mean_bytes`);
- sparse: each replica's touched rows (8 bytes of id plus the row's payload), all-gathered;
- dense: every row's payload, all-reduced.
Sparse moves fewer bytes than dense while few rows were touched, but each of its bytes costs more: the
all-gather's padding to the replica with the most rows, marking the union, indexed reads and writes, where
the all-reduce streams a contiguous buffer. SPARSE_BYTE_COST is that price per byte relative to the dense one.
"""

from __future__ import annotations

# A sparse byte's cost over a dense one's, measured on this machine's 2 gloo ranks by
# `benchmarks/bench_merge.py --transport` (k = 8, each transport forced, 3 alternating repeats, medians;
# benchmarks/data/merge_transport.json) on the default task (small-zipf, 24% of rows touched) and the uniform
# `small` workload (56%), where the dense merge builds payloads (the momentum-scaled rule, or a half-precision
# wire or table): 1.76 and 1.95 (1.80 and 1.91 in an earlier run). Against the plain rule's dense merge in place
# it is 4.24 and 4.36 (4.01 and 3.50): there the union transport replaces sparse.
SPARSE_BYTE_COST = 1.85


# The union transport's cost as a share of the whole shard's merge in place, at a share u of its rows in the union:
# UNION_FIXED + UNION_ROW_COST x u. The fixed part finds the union (every row's touched mark max-all-reduced and
# scanned, whatever few rows it holds); the per-row part gathers and scatters scattered rows where the whole merge
# streams a contiguous shard. Fitted by `benchmarks/bench_merge.py` (through shared memory, 2 ranks, 3 alternating
# repeats, medians; benchmarks/data/merge_speed.json) on the default task's union at k = 1 and 8 (8.6% and 37% of
# its rows: 76 and 196 ms per sync) against the uniform `small`'s whole-shard merge at k = 8 (231 ms). Held out:
# `small` at k = 1 (+0.9%), `small-meta` at k = 1 and 8 (-2.6%, +8.9%), where a price per row alone (2.3 x u)
# erred -15%, -48% and +3%. The union pays below u = 0.46.
UNION_FIXED = 0.17
UNION_ROW_COST = 1.8


def union_cost(union_rows: float, rows: float) -> float:
    """The union transport's time over the whole shard's, for `union_rows` of its `rows` in the union."""
    return UNION_FIXED + UNION_ROW_COST * union_rows / max(1.0, rows)


def union_pays(union_rows: int, rows: int) -> bool:
    """Whether a shard merges cheaper at its union's rows (gathered, all-reduced, scattered back) than whole."""
    return union_cost(union_rows, rows) < 1.0


# The most the union transport averages in one `host_reduce` call: enough that the call's two barriers are a small
# share of it (~0.3 ms each here against ~20 ms of means), few enough that the slots and the result (2.5x this on
# each rank at R = 2) stay a small share of a rank's memory whatever its tables' size.
HOST_BATCH_BYTES = 64 << 20


def host_mean_bytes(nbytes: float, replicas: int) -> float:
    """The bytes a rank's memory moves in `host_reduce`'s mean of an nbytes buffer among replicas on one host, beyond
    gathering into its slot and reading the result back (the merge's own work): its chunk of each of the R slots
    read, and its chunk of the result written. No wire: the link is the memory."""
    return nbytes * (1 + 1 / replicas)


def averages_in_place(momentum_scaled: bool, fp32_wire: bool) -> bool:
    """The plain rule on an fp32 wire: the replicas' mean is that of the rows themselves, so the merge averages the
    rows where they live (`ReplicaSync._average_union`), summed in fp32 whatever the weights' precision. fp16 or
    bf16 weights are then rounded once, from the exact mean of the replicas' rows; the deltas' merge rounds
    w0 + sum_k Δ_k / R, the same number. A narrower wire quantizes deltas instead: the weights themselves would
    lose the bits the wire drops."""
    return not momentum_scaled and fp32_wire


def choose_transport(replicas: int, touched_bytes: float, shard_bytes: float, in_place: bool) -> str:
    """The merge's transport: "union" where the rule averages in place, else "sparse" where its bytes, at
    SPARSE_BYTE_COST each, are the fewer, else "dense". `touched_bytes` is the most any replica sends (ids and
    payloads of its touched rows), `shard_bytes` the shard's payload a dense all-reduce reduces."""
    if in_place:
        return "union"
    r = replicas
    return "sparse" if SPARSE_BYTE_COST * r * touched_bytes < 2 * (r - 1) * shard_bytes / r else "dense"
