"""The clusters a co-design study chooses among (`ClusterChoice`), built from a space's `codesign:`
section.

Each is a node preset (or file) at a size in GPUs on a named fabric, composed the way a cluster file
is (`base:` plus what differs): the node's figures as its file states them, `nodes` from the size,
the network from the fabric's preset with the fabric's own keys over it. An NVLink domain larger
than the node's (an NVLink Switch System) is composed as gb200-nvl72 states its rack: the domain is
what the simulator calls a node (`devices_per_node`), on the node's NVLink, with the node's per-GPU
figures. Built once per study; the figures a proxy or a reader compares clusters by are `figures`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from cubic.space.codesign import CodesignSection
from cubic_harness.errors import ConfigError
from cubic_harness.sim.cluster import Cluster, cluster_from_dict, cluster_mapping, cluster_path

# a study's cluster parameters (SITES only where the section lists more than one site, NVLINK only
# where it lists nvlink_domains)
NODE, GPUS, FABRIC, SITES = "cluster.node", "cluster.gpus", "cluster.fabric", "cluster.sites"
NVLINK = "cluster.nvlink_domain"


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
    # GPUs per NVLink domain where the section lists nvlink_domains (`node` resolved, so the node's
    # own and its number are one cluster, priced once); None: no such knob, labels as before
    nvlink_domain: int | None = None

    @property
    def label(self) -> str:
        nvl = f" nvl{self.nvlink_domain}" if self.nvlink_domain is not None else ""
        return f"{self.node} x{self.gpus}{nvl} {self.fabric}" + (
            f" {self.sites} sites" if self.sites > 1 else ""
        )

    @property
    def ranks_per_node(self) -> int:
        return min(self.cluster.devices_per_node, self.gpus)

    def figures(self) -> dict[str, float]:
        """What tells clusters apart, as numbers: a proxy's features and a reader's columns."""
        return {"gpus": float(self.gpus), **self.cluster.features(), "sites": float(self.sites)}


Domain = int | Literal["node"] | None  # a value of nvlink_domains; None: the section has none


def build_choice(
    section: CodesignSection,
    node: str,
    gpus: int,
    fabric: str,
    sites: int = 1,
    nvlink_domain: Domain = None,
) -> ClusterChoice:
    """`node` at `gpus` GPUs on `fabric`, split between `sites` data centers, its GPUs in NVLink
    domains of `nvlink_domain` (ConfigError, one line, where a file does not load or the domain is
    smaller than the node's). Sites that cannot split the nodes evenly give a choice that says why
    (`unfit`): a study's trial of it fails with that reason."""
    base: dict[str, Any] = dict(cluster_mapping(cluster_path(node)))
    dpn = int(base["devices_per_node"])
    dom = dpn if nvlink_domain in (None, "node") else int(nvlink_domain)
    nvl = f" nvl{dom}" if nvlink_domain is not None else ""
    where = f"codesign: {node} x{gpus}{nvl} {fabric}" + (f" {sites} sites" if sites > 1 else "")
    if dom < dpn:
        raise ConfigError(f"{where}: an NVLink domain of {dom} is smaller than the node's {dpn}")
    fab = section.fabrics[fabric]
    net = fab.apply(
        cluster_mapping(cluster_path(fab.from_))["network"] if fab.from_ else base["network"]
    )
    base.pop("datacenters", None)  # one site: a tier above the pods is not one of these knobs
    if dom != dpn:  # the domain is the simulator's node: per GPU, the node's figures
        base["host_memory_gb"] = base["host_memory_gb"] * dom / dpn
        if net.get("pod_nodes"):  # a pod keeps its GPUs, in whole domains
            net = {**net, "pod_nodes": max(1, net["pod_nodes"] * dpn // dom)}
        base["devices_per_node"] = dom
    d = {
        **base,
        "name": f"{node}-{gpus}{nvl.replace(' ', '-')}-{fabric}".replace(" ", "_").replace("'", ""),
        "nodes": math.ceil(gpus / dom),
        "network": net,
        "about": f"{where}: {gpus} GPUs of {node}'s nodes"
        + (f", {dom} to an NVLink domain" if dom != dpn else ""),
    }
    if section.price_per_gpu_hour.get(node) is not None:
        d["price_per_gpu_hour"] = section.price_per_gpu_hour[node]
    price = section.price_per_gpu_hour.get(node)
    dom_of = dom if nvlink_domain is not None else None
    one_site = cluster_from_dict(d, where)
    if sites == 1:
        return ClusterChoice(node, gpus, fabric, one_site, price, nvlink_domain=dom_of)
    if d["nodes"] % sites:
        why = f"{d['nodes']} node(s) of {node}{nvl} cannot be split evenly between {sites} sites"
        return ClusterChoice(node, gpus, fabric, one_site, price, sites, why, dom_of)
    dci = dict(cluster_mapping(cluster_path(section.interconnect_from or ""))["datacenters"])
    d["datacenters"] = {**dci, "count": sites}
    d["network"] = {k: v for k, v in net.items() if k != "pod_nodes"}  # pods inside a site
    return ClusterChoice(
        node, gpus, fabric, cluster_from_dict(d, where), price, sites, nvlink_domain=dom_of
    )


def choices(
    section: CodesignSection,
) -> dict[tuple[str, int, str, int, Domain], ClusterChoice]:
    """Every cluster of the section, by (node, gpus, fabric, sites, NVLink domain)."""
    return {
        (n, g, f, k, v): build_choice(section, n, g, f, k, v)
        for n in section.nodes_from
        for g in section.gpus
        for f in section.fabrics
        for k in section.sites
        for v in section.nvlink_domains or [None]
    }


def check(section: CodesignSection, key: str = "codesign") -> None:
    """ConfigError (one line) where a node or a fabric's file does not load, naming the entry, or
    an NVLink domain is smaller than a node's own (a domain joins nodes; it does not split one)."""
    for i, n in enumerate(section.nodes_from):
        try:
            m = cluster_mapping(cluster_path(n))
        except ConfigError as e:
            raise ConfigError(f"{key}.nodes_from[{i}]: {n!r}: {e}") from None
        dpn = m.get("devices_per_node") if isinstance(m, dict) else None
        for j, dom in enumerate(section.nvlink_domains or []):
            if isinstance(dpn, int) and dom != "node" and dom < dpn:
                raise ConfigError(
                    f"{key}.nvlink_domains[{j}]: {dom}: smaller than {n}'s own NVLink domain "
                    f"({dpn} GPUs); a domain joins nodes, it does not split one (node: the node's "
                    "own)"
                )
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
