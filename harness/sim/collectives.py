"""Collective costs on the cluster's link tiers: latency + bytes x factor / bandwidth, per tier.

A group of ranks is routed by where its members sit: all on one node -> the intra-node link; across
nodes -> each device's own NIC for the inter-node part (an all-to-all cannot aggregate NICs; its
intra-node part runs on the node link at the same time); bytes that leave a pod cross links
oversubscribed `network.oversubscription` times. Bus-bandwidth factors are nccl-tests':
all-to-all / all-gather (n-1)/n of a rank's buffer, all-reduce 2(n-1)/n (ring), hierarchical across
nodes (reduce-scatter in the node, all-reduce of 1/m over the NICs, all-gather in the node); where a link's
switches reduce (`in_network_reduction`: NVLink SHARP, InfiniBand SHARP), each rank sends its buffer once
and receives the sum once on that link, (n-1)/n -> 1/2 of a ring's 2(n-1)/n, in one tree latency. Latency
grows with log2 of the ranks (tree-like schedules; published all-to-all latencies grow ~2.5x from 8 to
256 ranks). Times in ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cubic_harness.sim.cluster import Cluster


@dataclass(frozen=True)
class Span:
    """Where a group of n ranks sits: m ranks per node on k nodes; q ranks per pod on p pods."""

    n: int
    m: int
    k: int
    q: int = 0
    p: int = 1


def span(ranks: list[int], cluster: Cluster) -> Span:
    nodes: dict[int, int] = {}
    pods: dict[int, int] = {}
    for r in ranks:
        nodes[cluster.node_of(r)] = nodes.get(cluster.node_of(r), 0) + 1
        pods[cluster.pod_of(r)] = pods.get(cluster.pod_of(r), 0) + 1
    return Span(len(ranks), max(nodes.values()), len(nodes), max(pods.values()), len(pods))


def _nic_ms(in_pod: float, out_pod: float, c: Cluster) -> float:
    """Bytes through one device's NIC: those leaving its pod share oversubscribed links."""
    return _ms(in_pod + out_pod * c.network.oversubscription, c.network.bandwidth_gbs)


def _lat(us: float, n: int) -> float:
    return us * max(1.0, math.log2(n)) / 1e3


def _ms(nbytes: float, gbs: float) -> float:
    return nbytes / (gbs * 1e6)


def _uplink_share(rings: int, c: Cluster) -> float:
    """How much slower `rings` flows leaving every pod run than one NIC: 1 until they need more than the
    pod's uplinks (its ranks' NIC bandwidth / oversubscription)."""
    pod_ranks = (c.network.pod_nodes or c.nodes) * c.devices_per_node
    return max(1.0, rings * c.network.oversubscription / pod_ranks)


def all_to_all(bytes_per_rank: float, s: Span, c: Cluster) -> float:
    """Each rank sends (n-1)/n of its buffer: (m-1)/n to its node's ranks, (n-m)/n through its own NIC."""
    if s.n <= 1:
        return 0.0
    intra = _ms(bytes_per_rank * (s.m - 1) / s.n, c.intra_node.bandwidth_gbs)
    if s.k <= 1:
        return intra + _lat(c.intra_node.latency_us, s.n)
    q = s.q or s.n
    inter = _nic_ms(bytes_per_rank * (q - s.m) / s.n, bytes_per_rank * (s.n - q) / s.n, c)
    return max(intra, inter) + _lat(c.network.latency_us, s.n)


def all_gather(bytes_per_rank: float, s: Span, c: Cluster) -> float:
    """Every rank ends with all n buffers: the same bytes on the wire as an all-to-all of n x its buffer."""
    return all_to_all(bytes_per_rank * s.n, s, c)


def all_reduce(nbytes: float, s: Span, c: Cluster, concurrent: int = 1) -> float:
    """Ring inside a node; across nodes the hierarchical form (the m NICs of a node each carry 1/m).

    Oversubscription is a ratio of aggregate capacities: a pod's uplinks carry 1/oversubscription of
    its NICs' bandwidth. An all-to-all saturates them (every NIC sends out of the pod at once), but a
    ring leaves each pod on one edge: the `concurrent` x m rings that run at once (m rails per node,
    `concurrent` groups reducing side by side, e.g. every 2D position's replica sync) need
    concurrent x m NICs' worth of uplink, and slow down only past the pod's share."""
    if s.n <= 1:
        return 0.0
    node, net = c.intra_node, c.network
    if s.k <= 1:
        if node.in_network_reduction:
            return _ms(nbytes, node.bandwidth_gbs) + _lat(node.latency_us, s.n)
        return _ms(2 * nbytes * (s.n - 1) / s.n, node.bandwidth_gbs) + 2 * _lat(node.latency_us, s.n)
    t = 0.0
    if s.m > 1:
        t = _ms(nbytes if node.in_network_reduction else 2 * nbytes * (s.m - 1) / s.m, node.bandwidth_gbs)
    # the NICs' part, 1/m of the buffer each: the switches' sum sent and received once, or a ring's twice
    wire = nbytes / s.m if net.in_network_reduction else 2 * nbytes / s.m * (s.k - 1) / s.k
    t += _ms(wire, net.bandwidth_gbs) * (_uplink_share(concurrent * s.m, c) if s.p > 1 else 1.0)
    return t + (1 if net.in_network_reduction else 2) * _lat(net.latency_us, s.n)
