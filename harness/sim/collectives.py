"""Collective costs on the cluster's link tiers: latency + bytes x factor / bandwidth, per tier.

A group of ranks is routed by where its members sit: all on one node -> the intra-node link; across
nodes -> each device's own NIC for the inter-node part (an all-to-all cannot aggregate NICs; its
intra-node part runs on the node link at the same time); bytes that leave a pod cross links
oversubscribed `network.oversubscription` times. In a PCIe server whose switches each hold g devices
(`intra_node.uplink`), an all-to-all's bytes between switches cross each switch's one link to the
host together: g x (m-g)/n of a rank's buffer at the uplink's speed, when that is slower than each
device's own (m-1)/n. Where the node's devices split over host sockets (`intra_node.sockets`), the
bytes between sockets cross the link between them together in the same way (NCCL routes GPU
traffic there through host memory, its SHM transport). A ring all-reduce crosses each such link
once each way, as one edge of the ring, so it runs no faster than the slowest: an uplink faster
than the node's link does not slow it. Bus-bandwidth factors are nccl-tests':
all-to-all / all-gather (n-1)/n of a rank's buffer, all-reduce 2(n-1)/n (ring), hierarchical across
nodes (reduce-scatter in the node, all-reduce of 1/m over the NICs, all-gather in the node); where a link's
switches reduce (`in_network_reduction`: NVLink SHARP, InfiniBand SHARP), each rank sends its buffer once
and receives the sum once on that link, (n-1)/n -> 1/2 of a ring's 2(n-1)/n, in one tree latency. Latency
grows with log2 of the ranks (tree-like schedules; published all-to-all latencies grow ~2.5x from 8 to
256 ranks). Times in ms.

Across data centers (a cluster's `datacenters` tier) the bytes that leave a data center also cross its
interconnect: one device's flow at `datacenters.bandwidth_gbs`, and all the data center's flows together at
its NICs' bandwidth / `datacenters.oversubscription`. An all-to-all's messages fly at once: one one-way
latency between data centers on top of the network's. An all-reduce is hierarchical, as cross-site
training runs it: the all-reduce inside each data center (its reduce-scatter before, its all-gather after),
and between them each of a data center's r ranks reduces its 1/r of the buffer with its peers in the others
(a ring: twice the bytes, 2 log2(d) one-way latencies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cubic_harness.sim.cluster import Cluster


@dataclass(frozen=True)
class Span:
    """Where a group of n ranks sits: m ranks per node on k nodes; q ranks per pod on p pods; r ranks per
    data center on d data centers."""

    n: int
    m: int
    k: int
    q: int = 0
    p: int = 1
    r: int = 0
    d: int = 1


def span(ranks: list[int], cluster: Cluster) -> Span:
    nodes: dict[int, int] = {}
    pods: dict[int, int] = {}
    dcs: dict[int, int] = {}
    for r in ranks:
        nodes[cluster.node_of(r)] = nodes.get(cluster.node_of(r), 0) + 1
        pods[cluster.pod_of(r)] = pods.get(cluster.pod_of(r), 0) + 1
        dcs[cluster.dc_of(r)] = dcs.get(cluster.dc_of(r), 0) + 1
    return Span(len(ranks), max(nodes.values()), len(nodes), max(pods.values()), len(pods),
                max(dcs.values()), len(dcs))


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


def _dci_ms(nbytes: float, flows: float, c: Cluster) -> float:
    """Bytes one device sends to other data centers while `flows` devices of its data center do the same:
    at one flow's rate until they need more than the interconnect's capacity."""
    dc = c.datacenters
    assert dc is not None
    share = max(1.0, flows * dc.oversubscription / c.dc_devices)
    return _ms(nbytes, dc.bandwidth_gbs) * share


def _shared_links(s: Span, c: Cluster) -> list[tuple[int, float]]:
    """The links a node's group of m ranks shares, each as (ranks behind one end, its GB/s per
    direction): a PCIe switch's uplink and the link between host sockets, where the group spans
    more than one. A group that fits behind one is placed there. With more than two sockets, all
    a socket's bytes for the others are priced on one link (pessimistic: each pair may have its
    own)."""
    node, out = c.intra_node, []
    if node.uplink_devices and s.m > node.uplink_devices:
        out.append((node.uplink_devices, node.uplink_gbs))
    if node.sockets and s.m > (per := c.devices_per_node // node.sockets):
        out.append((per, node.socket_gbs))
    return out


def _ring_gbs(s: Span, c: Cluster) -> float:
    """A ring's rate inside a node: its link's, and no faster than a shared link it crosses (once
    each way, as one edge of the ring: every byte of the ring passes it)."""
    return min([c.intra_node.bandwidth_gbs, *(gbs for _, gbs in _shared_links(s, c))])


def all_to_all(bytes_per_rank: float, s: Span, c: Cluster, mean_bytes: float | None = None) -> float:
    """Each rank sends (n-1)/n of its buffer: (m-1)/n to its node's ranks, (n-m)/n through its own NIC, of
    which (n-r)/n also crosses to other data centers. `bytes_per_rank` is the busiest rank's buffer, which its
    own NIC carries at full rate; the links above the NICs (a pod's uplinks, the interconnect) are shared by
    all ranks, so they carry the mean rank's (`mean_bytes`; the busiest's when all send alike) at their share.
    An unbalanced exchange (a few ranks holding hot shards among thousands) waits on the busiest NIC, not on
    every rank sending as much through the oversubscribed links."""
    if s.n <= 1:
        return 0.0
    hot = bytes_per_rank
    mean = hot if mean_bytes is None else min(mean_bytes, hot)
    intra = _ms(hot * (s.m - 1) / s.n, c.intra_node.bandwidth_gbs)
    for g, gbs in _shared_links(s, c):  # g ranks send their bytes for the others at once
        intra = max(intra, _ms(g * mean * (s.m - g) / s.n, gbs))
    if s.k <= 1:
        return intra + _lat(c.intra_node.latency_us, s.n)
    q = s.q or s.n
    inter = max(_ms(hot * (s.n - s.m) / s.n, c.network.bandwidth_gbs),
                _nic_ms(mean * (q - s.m) / s.n, mean * (s.n - q) / s.n, c))
    lat = _lat(c.network.latency_us, s.n)
    if s.d > 1 and c.datacenters is not None:  # every group runs its all-to-all at the same moment of the
        # step: the interconnect carries the mean rank's bytes from every device of the site at once
        cross = (s.n - s.r) / s.n
        inter = max(inter, _ms(hot * cross, c.datacenters.bandwidth_gbs), _dci_ms(mean * cross, c.dc_devices, c))
        lat += c.datacenters.latency_us / 1e3
    return max(intra, inter) + lat


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
    if s.d > 1 and c.datacenters is not None:  # hierarchical: inside each data center, then between them
        dc = c.datacenters
        inside = all_reduce(nbytes, Span(s.r, s.m, -(-s.k // s.d), s.q, -(-s.p // s.d), s.r, 1), c, concurrent)
        wire = 2 * nbytes / s.r * (s.d - 1) / s.d
        return inside + _dci_ms(wire, concurrent * s.r, c) + 2 * _lat(dc.latency_us, s.d)
    node, net, ring = c.intra_node, c.network, _ring_gbs(s, c)
    if s.k <= 1:
        if node.in_network_reduction:
            return _ms(nbytes, node.bandwidth_gbs) + _lat(node.latency_us, s.n)
        return _ms(2 * nbytes * (s.n - 1) / s.n, ring) + 2 * _lat(node.latency_us, s.n)
    t = 0.0
    if s.m > 1:
        t = _ms(nbytes if node.in_network_reduction else 2 * nbytes * (s.m - 1) / s.m, ring)
    # the NICs' part, 1/m of the buffer each: the switches' sum sent and received once, or a ring's twice
    wire = nbytes / s.m if net.in_network_reduction else 2 * nbytes / s.m * (s.k - 1) / s.k
    t += _ms(wire, net.bandwidth_gbs) * (_uplink_share(concurrent * s.m, c) if s.p > 1 else 1.0)
    return t + (1 if net.in_network_reduction else 2) * _lat(net.latency_us, s.n)
