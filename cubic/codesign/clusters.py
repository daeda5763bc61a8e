"""The clusters a co-design study chooses among (`ClusterChoice`), built from a space's `codesign:`
section.

Each is a node preset (or file) at a size in GPUs on a named fabric, composed the way a cluster file
is (`base:` plus what differs): the node's figures as its file states them, `nodes` from the size,
the network from the fabric's preset with the fabric's own keys over it. Built once per study; the
figures a proxy or a reader compares clusters by are `figures`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cubic.space.codesign import CodesignSection
from cubic_harness.errors import ConfigError
from cubic_harness.sim.cluster import Cluster, cluster_from_dict, cluster_mapping, cluster_path

# a study's cluster parameters (SITES only where the section lists more than one site)
NODE, GPUS, FABRIC, SITES = "cluster.node", "cluster.gpus", "cluster.fabric", "cluster.sites"


@dataclass(frozen=True)
class ClusterChoice:
    """One value of the cluster knobs: a node at a size on a fabric, and its GPU-hour price."""

    node: str
    gpus: int
    fabric: str
    cluster: Cluster
    price_per_gpu_hour: float | None
    sites: int = 1  # data centers the nodes are split between
    unfit: str = ""  # why this cluster cannot be built (its trials fail with it); "" where it can

    @property
    def label(self) -> str:
        return f"{self.node} x{self.gpus} {self.fabric}" + (
            f" {self.sites} sites" if self.sites > 1 else ""
        )

    @property
    def ranks_per_node(self) -> int:
        return min(self.cluster.devices_per_node, self.gpus)

    def figures(self) -> dict[str, float]:
        """What tells clusters apart, as numbers: a proxy's features and a reader's columns."""
        c, d = self.cluster, self.cluster.device
        return {
            "gpus": float(self.gpus),
            "nvlink_domain": float(c.devices_per_node),
            "nodes": float(c.nodes),
            "memory_gb": d.memory_gb,
            "mem_bw_gbs": d.mem_bw_gbs,
            "dense_tflops": max(d.dense_gflops.values()) / 1e3,
            "intra_node_gbs": c.intra_node.bandwidth_gbs,
            "network_gbs": c.network.bandwidth_gbs,
            "network_latency_us": c.network.latency_us,
            "in_network_reduction": float(c.network.in_network_reduction),
            "oversubscription": c.network.oversubscription,
            "sites": float(self.sites),
            "dci_gbs": c.datacenters.bandwidth_gbs if c.datacenters else c.network.bandwidth_gbs,
        }


def build_choice(
    section: CodesignSection, node: str, gpus: int, fabric: str, sites: int = 1
) -> ClusterChoice:
    """`node` at `gpus` GPUs on `fabric`, split between `sites` data centers (ConfigError, one
    line, where a file does not load). Sites that cannot split the nodes evenly give a choice that
    says why (`unfit`): a study's trial of it fails with that reason."""
    where = f"codesign: {node} x{gpus} {fabric}" + (f" {sites} sites" if sites > 1 else "")
    base: dict[str, Any] = dict(cluster_mapping(cluster_path(node)))
    fab = section.fabrics[fabric]
    net = fab.apply(
        cluster_mapping(cluster_path(fab.from_))["network"] if fab.from_ else base["network"]
    )
    base.pop("datacenters", None)  # one site: a tier above the pods is not one of these knobs
    dpn = int(base["devices_per_node"])
    d = {
        **base,
        "name": f"{node}-{gpus}-{fabric}".replace(" ", "_").replace("'", ""),
        "nodes": math.ceil(gpus / dpn),
        "network": net,
        "about": f"{where}: {gpus} GPUs of {node}'s nodes",
    }
    if section.price_per_gpu_hour.get(node) is not None:
        d["price_per_gpu_hour"] = section.price_per_gpu_hour[node]
    price = section.price_per_gpu_hour.get(node)
    one_site = cluster_from_dict(d, where)
    if sites == 1:
        return ClusterChoice(node, gpus, fabric, one_site, price)
    if d["nodes"] % sites:
        why = f"{d['nodes']} node(s) of {node} cannot be split evenly between {sites} sites"
        return ClusterChoice(node, gpus, fabric, one_site, price, sites, why)
    dci = dict(cluster_mapping(cluster_path(section.interconnect_from or ""))["datacenters"])
    d["datacenters"] = {**dci, "count": sites}
    d["network"] = {k: v for k, v in net.items() if k != "pod_nodes"}  # pods inside a site
    return ClusterChoice(node, gpus, fabric, cluster_from_dict(d, where), price, sites)


def choices(section: CodesignSection) -> dict[tuple[str, int, str, int], ClusterChoice]:
    """Every cluster of the section, by (node, gpus, fabric, sites)."""
    return {
        (n, g, f, k): build_choice(section, n, g, f, k)
        for n in section.nodes_from
        for g in section.gpus
        for f in section.fabrics
        for k in section.sites
    }


def check(section: CodesignSection, key: str = "codesign") -> None:
    """ConfigError (one line) where a node or a fabric's file does not load, naming the entry."""
    for i, n in enumerate(section.nodes_from):
        try:
            cluster_mapping(cluster_path(n))
        except ConfigError as e:
            raise ConfigError(f"{key}.nodes_from[{i}]: {n!r}: {e}") from None
    for name, fab in section.fabrics.items():
        if fab.from_:
            try:
                net = cluster_mapping(cluster_path(fab.from_)).get("network")
            except ConfigError as e:
                raise ConfigError(f"{key}.fabrics.{name}.from: {fab.from_!r}: {e}") from None
            if not isinstance(net, dict):
                raise ConfigError(f"{key}.fabrics.{name}.from: {fab.from_!r} has no network")
    if section.interconnect_from:
        try:
            dcs = cluster_mapping(cluster_path(section.interconnect_from)).get("datacenters")
        except ConfigError as e:
            raise ConfigError(
                f"{key}.interconnect_from: {section.interconnect_from!r}: {e}"
            ) from None
        if not isinstance(dcs, dict):
            raise ConfigError(
                f"{key}.interconnect_from: {section.interconnect_from!r} has no "
                "datacenters: (h100-16384-4dc has)"
            )
