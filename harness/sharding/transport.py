"""The 2D replica merge's transport rule, written once for the harness (`replica_sync.ReplicaSync.sync`) and the
simulator (`cubic_harness.sim.perf`), which prices what the harness runs.

A merge of R replicas moves one of three things (`replica_sync`'s docstring):
- union: where the plain rule averages in place (`averages_in_place`), the rows any replica touched, gathered
  and all-reduced (a ring moves 2 (R - 1) / R of them; replicas on one host read each other's in shared memory,
  `host_mean_bytes`);
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


# The union transport's cost per row over the dense in-place merge's: gathering and scattering scattered rows
# against streaming a contiguous shard. Measured as above, the union forced beside the dense merge in place:
# 2.45 on the default task (37% of rows in the union at k = 8: 336 ms against 367 per sync) and 2.10 on the
# uniform workload (81%: 654 ms against 386, where the whole shard is the cheaper).
UNION_ROW_COST = 2.3


def union_pays(union_rows: int, rows: int) -> bool:
    """Whether a shard merges cheaper at its union's rows (gathered, all-reduced, scattered back) than whole."""
    return UNION_ROW_COST * union_rows < rows


def host_mean_bytes(nbytes: float, replicas: int) -> float:
    """The bytes a rank's memory moves in `host_reduce`'s mean of an nbytes buffer among replicas on one host, beyond
    gathering into its slot and reading the result back (the merge's own work): its chunk of each of the R slots
    read, and its chunk of the result written. No wire: the link is the memory."""
    return nbytes * (1 + 1 / replicas)


def averages_in_place(momentum_scaled: bool, fp32_wire: bool, fp32_weights: bool) -> bool:
    """The plain rule with fp32 weights on an fp32 wire: the replicas' mean is that of the rows themselves, so the
    merge all-reduces the rows where they live (`ReplicaSync._average_union`)."""
    return not momentum_scaled and fp32_wire and fp32_weights


def choose_transport(replicas: int, touched_bytes: float, shard_bytes: float, in_place: bool) -> str:
    """The merge's transport: "union" where the rule averages in place, else "sparse" where its bytes, at
    SPARSE_BYTE_COST each, are the fewer, else "dense". `touched_bytes` is the most any replica sends (ids and
    payloads of its touched rows), `shard_bytes` the shard's payload a dense all-reduce reduces."""
    if in_place:
        return "union"
    r = replicas
    return "sparse" if SPARSE_BYTE_COST * r * touched_bytes < 2 * (r - 1) * shard_bytes / r else "dense"
