"""Cluster files (`clusters/*.yaml`): the hardware the simulator prices a configuration on.

A cluster is what a configuration runs on, apart from the model (the workload) and the knobs (the
TrialConfig): Calculon's system / model / execution split. One file describes

- `nodes`, `devices_per_node` (a GPU, or on CPU a rank slot: ranks on a node share its `cores`),
- `device`: memory capacity and copy bandwidth; the dense rate per precision and the GEMM size at
  which it reaches half of that (small GEMMs run far below peak); the embedding kernels' achieved
  fraction of the copy bandwidth per backend and precision, forward and backward+optimizer, by row
  width; a fixed framework cost per step; on a GPU, the link to host memory (`host_link_gbs`: tables that
  do not fit live in host memory behind a device-side cache, Neo's hierarchy);
- `intra_node`: the link between devices of a node (bandwidth per direction, latency per collective);
  optionally `uplink` (a PCIe server's switches): `devices` behind each switch share one link of
  `bandwidth_gbs` to the host, which all their bytes to devices behind other switches cross; and
  `sockets` (a PCIe server's host CPUs): the devices split evenly over `count` sockets, and their
  bytes to devices on another socket cross the link between sockets (UPI, xGMI) at `bandwidth_gbs`;
- `network`: each device's own NIC (an all-to-all cannot aggregate NICs), bandwidth and latency;
  optionally `pod_nodes` (nodes per pod, non-blocking inside) and `oversubscription` (above the pod);
- on either link, `in_network_reduction`: its switches reduce (NVLink SHARP in a node, SHARP on InfiniBand):
  an all-reduce sends each buffer once and receives the sum once instead of a ring's twice;
- `host_memory_gb` per node;
- optionally `datacenters`, a tier above the pods: `count` data centers with the nodes split evenly
  between them (node i in data center i // (nodes / count); a pod never straddles two), joined by links
  with their own per-device `bandwidth_gbs`, `latency_ms` and `oversubscription` (a data center's NICs
  over its interconnect's capacity): what crosses it pays milliseconds, not microseconds.

A file may start from a shipped preset (`base: h100-4096`) and state only what differs;
`base: local` starts from this machine's calibration, and `fabric: PRESET` takes a preset's
`network` and `datacenters` (what joins the nodes): `base: local` + `nodes: 8` + `fabric: h100-64`
is eight of the node you have on the fabric you will have. Each figure group's origin, measured or
assumed, is kept (`Cluster.figures`, harness/sim/provenance.py).
Every key is checked at load against the typed model `ClusterFile` (`cubic schema cluster` exports it
as JSON Schema), with one line naming the file, the key and what is allowed (exit 2 at the CLI).
`cubic calibrate` writes these files from measurements; hand-written
presets say where their numbers come from in comments.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, Field, model_validator

from cubic_harness.config import CHOICES
from cubic_harness.errors import ConfigError, read_text
from cubic_harness.schema import Strict, validate
from cubic_harness.sim import provenance

KERNELS = CHOICES["kernel"]
EMB_PRECISIONS = CHOICES["emb_precision"]
DENSE_PRECISIONS = ("fp32", "bf16")
DEVICE_TYPES = ("cpu", "gpu")


@dataclass(frozen=True)
class KernelEff:
    """Achieved fraction of the copy bandwidth of one embedding backend at one precision, by row width:
    `fwd` for the pooled lookup's bytes, `bwd` for the backward+optimizer's (rows and state read and
    written). Between measured widths the fraction is interpolated in log width."""

    fwd: dict[int, float]
    bwd: dict[int, float]

    def at(self, phase: str, dim: int) -> float:
        return log_interp(self.fwd if phase == "fwd" else self.bwd, dim)


def log_interp(curve: dict[int, float], x: float) -> float:
    """A measured curve at x: geometric interpolation in log x, flat beyond the measured range."""
    pts = sorted(curve.items())
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            return y0 * (y1 / y0) ** (math.log(x / x0) / math.log(x1 / x0))
    return pts[-1][1]


@dataclass(frozen=True)
class Device:
    type: str
    memory_gb: float  # per device (GPU HBM); on CPU the node's host memory is shared by its ranks
    mem_bw_gbs: float  # streaming copy bandwidth of one rank (one thread on CPU)
    dense_gflops: dict[str, float]  # large-GEMM rate per dense precision
    gemm_half_mflop: float  # GEMM size (MFLOP) at which the rate is half of the large-GEMM rate
    embedding: dict[str, dict[str, KernelEff]]  # backend -> emb precision -> efficiencies
    thread_exp: dict[str, float]  # CPU: speed-up of a backend with t threads is t ** exp
    step_overhead_ms: float  # framework cost per step (Python, autograd, collective calls)
    cores: int = 0  # CPU: cores of a node, shared by its ranks; 0 on GPU
    process_mb: float = 0.0  # what a rank holds before any model state (a torch + gloo process on CPU)
    spawned_process_mb: float = 0.0  # CPU: the same for a rank spawned afresh instead of forked from a
    #   preloaded server (`config.ranks_spawned`: TorchRec's 2D); 0: as process_mb
    elementwise_gbs: dict[str, dict[int, float]] = field(default_factory=dict)  # dense work beyond GEMMs:
    #   activation bytes per second, per dense precision, by batch size (interpolated in log batch)
    shared_speed: dict[str, float] = field(default_factory=dict)  # CPU: speed a rank keeps (dense, embedding)
    #   when every core of its node runs a rank (shared caches and memory bandwidth)
    glue_ns_per_id: float = 0.0  # the embedding collection's own work (id routing, assembly) per local id
    weighted_cost: dict[str, dict[str, float]] = field(default_factory=dict)  # backend -> phase (fwd, bwd) ->
    #   a weighted table's lookup time over an unweighted one's (per-sample weights); absent: 1, bytes only
    host_link_gbs: float = 0.0  # GPU: device <-> host memory (PCIe) per device; 0 = tables must fit the device
    jitter: float = 0.0  # the wait at a collective per ms of compute before it (ranks drift apart)
    replica_merge_gbs: dict[str, float] = field(default_factory=dict)  # 2D weight_avg merge, beyond its wire:
    #   GB/s of the replicas' payload (rows x (width + state)), per transport (sparse, dense)
    overlap_hidden: float = 0.0  # of a collective run beside compute (comm_overlap), the share of the shorter
    #   of the two that is hidden: 1 = perfectly, 0 = they serialise, < 0 = together they take longer (CPU:
    #   measured by `cubic calibrate`)
    reads_own_ids: bool = False  # the framework's data reader hands each rank the ids of the shards it holds
    dist_overhead_ms: float = 0.0  # a step on several ranks beyond what its collectives' bytes and latency cost:
    #   the framework's own calls around them (TorchRec's input and output distribution; 0 for the harness, whose
    #   collectives the links price)
    collection_ms: float = 0.0  # a step on several ranks, per embedding collection of the model beyond its first
    #   (`Workload.collections`): the framework distributes and looks up each apart (TorchRec; 0 for the harness,
    #   which looks every table up in one)
    dense_replica_merge: bool = False  # 2D weight_avg merges whole shards, never only the rows touched (TorchRec's
    #   DMPCollection.sync() all-reduces every weight and optimizer state)
    #   (HugeCTR's), so no input all-to-all runs; cubic's harness and TorchRec distribute them (False)

    def kernel(self, backend: str, precision: str) -> KernelEff | None:
        per = self.embedding.get(backend) or {}
        return per.get(precision) or (per.get("fp32") if precision != "fp32" else None)


@dataclass(frozen=True)
class Link:
    bandwidth_gbs: float  # per direction, per device
    latency_us: float  # per collective call between two ranks
    pod_nodes: int = 0  # network only: nodes per pod (a non-blocking fabric inside); 0 = one pod
    oversubscription: float = 1.0  # network only: traffic that leaves a pod shares links this much
    in_network_reduction: bool = False  # the switches reduce: an all-reduce's bytes are not doubled
    uplink_devices: int = 0  # intra_node only: devices behind one PCIe switch; 0 = no shared uplink
    uplink_gbs: float = 0.0  # intra_node only: that switch's link to the host, per direction
    sockets: int = 0  # intra_node only: host sockets the devices split over; 0 = not priced
    socket_gbs: float = 0.0  # intra_node only: the link between two sockets, per direction


@dataclass(frozen=True)
class DataCenters:
    """The tier above the pods: `count` data centers of equal size joined by an interconnect (DCI)."""

    count: int
    bandwidth_gbs: float  # per direction, per device: one flow's rate across the DCI
    latency_us: float  # one way between two data centers (fibre: ~5 us per km, plus the switches)
    oversubscription: float = 1.0  # a data center's NIC bandwidth over its DCI capacity


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra_node: Link
    network: Link
    host_memory_gb: float
    about: str = ""
    source: dict[str, Any] = field(default_factory=dict)
    datacenters: DataCenters | None = None  # None: one data center
    # per framework, the Device figures that price its step where they differ from the device's own (which
    # price cubic's harness): `cubic calibrate --framework torchrec` measures them (FRAMEWORK_FIELDS)
    frameworks: dict[str, dict[str, Any]] = field(default_factory=dict)
    framework: str = "harness"  # which framework's step this cluster prices (`for_framework`)
    price_per_gpu_hour: float | None = None  # what one device costs an hour, as its user pays (None: unknown)
    # figure group (`device`, `network`, `device.memory_gb`, ...) -> "measured (FILE, cubic
    # calibrate DATE)" or "assumed (preset NAME)": where each figure came from
    # (harness/sim/provenance.py); not a hardware figure, so clusters of the same figures are equal
    figures: dict[str, str] = field(default_factory=dict, compare=False)

    def for_framework(self, name: str) -> Cluster:
        """This cluster pricing `name`'s step: the harness's is the device's own; another framework's takes its
        profile's figures (ConfigError naming the cluster where it has none)."""
        if name == self.framework:
            return self
        if name == "harness":
            raise ConfigError(f"cluster {self.name} already prices {self.framework}")
        prof = self.frameworks.get(name)
        if prof is None:
            raise ConfigError(f"cluster {self.name} has no {name!r} framework profile (frameworks: "
                              f"{sorted(self.frameworks) or 'none'}); measure this machine's with `cubic calibrate "
                              f"--framework {name}`")
        # a profile that measured one bare process (its ranks all started one way) prices both starts with it
        same = {"spawned_process_mb": prof["process_mb"]} if "process_mb" in prof and \
            "spawned_process_mb" not in prof else {}
        return dataclasses.replace(self, device=dataclasses.replace(self.device, **prof, **same), framework=name)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def features(self) -> dict[str, float]:
        """What tells clusters apart, as numbers: a proxy learning across clusters reads them as
        features, a reader as columns."""
        d = self.device
        return {
            "nvlink_domain": float(self.devices_per_node),
            "nodes": float(self.nodes),
            "memory_gb": d.memory_gb,
            "mem_bw_gbs": d.mem_bw_gbs,
            "dense_tflops": max(d.dense_gflops.values()) / 1e3,
            "intra_node_gbs": self.intra_node.bandwidth_gbs,
            "network_gbs": self.network.bandwidth_gbs,
            "network_latency_us": self.network.latency_us,
            "in_network_reduction": float(self.network.in_network_reduction),
            "oversubscription": self.network.oversubscription,
            "dci_gbs": (self.datacenters.bandwidth_gbs if self.datacenters
                        else self.network.bandwidth_gbs),
        }

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def pod_of(self, rank: int) -> int:
        return self.node_of(rank) // self.network.pod_nodes if self.network.pod_nodes else 0

    def dc_of(self, rank: int) -> int:
        dc = self.datacenters
        return self.node_of(rank) // (self.nodes // dc.count) if dc else 0

    @property
    def dc_devices(self) -> int:
        """Devices in one data center (all of them with one)."""
        return self.devices // (self.datacenters.count if self.datacenters else 1)

    def rank_memory_mb(self, ranks_on_node: int) -> float:
        """What one rank may hold: its device's memory (GPU), or its share of the node's host memory."""
        if self.device.type == "gpu":
            return self.device.memory_gb * 1024
        return self.host_memory_gb * 1024 / max(1, ranks_on_node)


# ---------------------------------------------------------------------- loading
# The file format, once (`cubic_harness.schema`): what the loader accepts and `cubic schema cluster` exports.
Pos = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosInt = Annotated[int, Field(gt=0)]
Curve = Annotated[dict[PosInt, Pos], Field(min_length=1)]  # size (row width, batch) -> measured number
Kernel = Literal[KERNELS]  # type: ignore[valid-type]
EmbPrecision = Literal[EMB_PRECISIONS]  # type: ignore[valid-type]
DensePrecision = Literal[DENSE_PRECISIONS]  # type: ignore[valid-type]


class LinkSpec(Strict):
    bandwidth_gbs: Pos = Field(description="per direction, per device, GB/s")
    latency_us: NonNeg = Field(description="per collective call between two ranks")
    in_network_reduction: bool = Field(False, description="its switches reduce (NVLink SHARP, SHARP): an "
                                       "all-reduce sends and receives each buffer once")


class UplinkSpec(Strict):
    devices: Annotated[int, Field(ge=2)] = Field(description="devices behind one PCIe switch")
    bandwidth_gbs: Pos = Field(description="the switch's link to the host, per direction, GB/s")


class SocketsSpec(Strict):
    count: Annotated[int, Field(ge=2)] = Field(description="host sockets; the devices split evenly")
    bandwidth_gbs: Pos = Field(description="the link between two sockets (UPI, xGMI) as GPU "
                               "traffic through host memory crosses it, per direction, GB/s")


class IntraNodeSpec(LinkSpec):
    uplink: UplinkSpec | None = Field(
        None, description="a PCIe server's switches: what a switch's devices send to devices "
        "behind other switches crosses its one link to the host together; absent: each device "
        "its own link")
    sockets: SocketsSpec | None = Field(
        None, description="a PCIe server's host CPUs: what a socket's devices send to devices on "
        "other sockets crosses the link between them together; absent: not priced (an NVLink "
        "node's traffic never crosses it)")


class NetworkSpec(LinkSpec):
    pod_nodes: PosInt | None = Field(None, description="nodes per pod (non-blocking inside); absent: one pod")
    oversubscription: Annotated[float, Field(ge=1)] = Field(1.0, description="above the pod; 1 = non-blocking")


class DataCentersSpec(Strict):
    count: Annotated[int, Field(ge=2)] = Field(description="data centers; the nodes split evenly between them")
    bandwidth_gbs: Pos = Field(description="per direction, per device, across the interconnect, GB/s")
    latency_ms: NonNeg = Field(description="one way between two data centers, milliseconds")
    oversubscription: Annotated[float, Field(ge=1)] = Field(
        1.0, description="a data center's NIC bandwidth over its interconnect's; 1 = non-blocking")


class FwdBwd(Strict):
    fwd: Curve = Field(description="achieved fraction of mem_bw_gbs for the pooled lookup, by row width")
    bwd: Curve = Field(description="the same for backward + optimizer, by row width")


class WeightedCost(Strict):
    fwd: Pos = Field(description="a weighted forward's time over an unweighted one's (cubic calibrate)")
    bwd: Pos = Field(description="the same for backward + optimizer (FBGEMM's CPU one computes the weights' grad)")


def _needs_fp32(per: dict[str, Any], what: str) -> dict[str, Any]:
    if "fp32" not in per:
        raise ValueError(f"must map {what} (fp32 required)")
    return per


class DeviceSpec(Strict):
    type: Literal[DEVICE_TYPES]  # type: ignore[valid-type]
    memory_gb: Pos
    mem_bw_gbs: Pos
    dense_gflops: Annotated[dict[DensePrecision, Pos], AfterValidator(
        lambda d: _needs_fp32(d, f"dense precisions {list(DENSE_PRECISIONS)} to GFLOP/s"))]
    gemm_half_mflop: NonNeg
    embedding: Annotated[dict[Kernel, Annotated[dict[EmbPrecision, FwdBwd], AfterValidator(
        lambda d: _needs_fp32(d, f"emb precisions {list(EMB_PRECISIONS)} to {{fwd, bwd}}"))]], Field(min_length=1)]
    step_overhead_ms: NonNeg
    cores: PosInt | None = Field(None, description="cpu: the node's cores its ranks share (required on cpu)")
    thread_exp: dict[Literal[(*KERNELS, "dense")], NonNeg] = {}  # type: ignore[misc]
    process_mb: NonNeg = 0.0
    spawned_process_mb: NonNeg = 0.0
    elementwise_gbs: dict[DensePrecision, Curve] = {}
    shared_speed: dict[Literal["dense", "embedding"], Annotated[float, Field(gt=0, le=1)]] = {}
    replica_merge_gbs: dict[Literal["sparse", "dense"], Pos] = {}
    glue_ns_per_id: NonNeg = 0.0
    weighted_cost: dict[Kernel, WeightedCost] = Field(
        {}, description="per backend, a weighted table's lookup time over an unweighted one's; absent: 1")
    jitter: NonNeg = 0.0
    host_link_gbs: NonNeg = 0.0
    overlap_hidden: Annotated[float, Field(ge=-1, le=1)] = Field(
        0.0, description="of a collective beside compute, the share of the shorter hidden (1 = all, < 0: costs)")
    reads_own_ids: bool = Field(False, description="the framework reads each rank's shards' ids itself "
                                "(HugeCTR): no input all-to-all")

    @model_validator(mode="after")
    def _cpu_cores(self) -> DeviceSpec:
        if self.type == "cpu" and not self.cores:
            raise ValueError("cores is required for a cpu device (the node's cores its ranks share)")
        return self


FRAMEWORKS = ("harness", "torchrec")  # what can run a trial's step (`--backend real` / `--backend torchrec`)


class FrameworkSpec(Strict):
    """What a framework's step costs around the kernels and collectives, where it differs from the device's own
    figures (cubic's harness): the fixed cost of a step, the embedding collection's own work per looked-up id
    (input routing, output assembly, autograd), a step on several ranks beyond its collectives' bytes and
    latency (the framework's own calls around them) and per collection beyond the first, what a rank holds
    before any model state, whether it reads each rank's shards' ids itself."""

    step_overhead_ms: NonNeg | None = None
    glue_ns_per_id: NonNeg | None = None
    process_mb: NonNeg | None = None
    spawned_process_mb: NonNeg | None = None  # a rank spawned afresh (`config.ranks_spawned`); absent: process_mb
    reads_own_ids: bool | None = None
    dist_overhead_ms: NonNeg | None = None
    collection_ms: NonNeg | None = None
    dense_replica_merge: bool | None = None


class ClusterFile(Strict):
    """A cluster file (`clusters/*.yaml`): the hardware the simulator prices a configuration on."""

    name: Annotated[str, Field(min_length=1)]
    nodes: PosInt
    devices_per_node: PosInt
    device: DeviceSpec
    intra_node: IntraNodeSpec
    network: NetworkSpec
    host_memory_gb: Pos
    datacenters: DataCentersSpec | None = Field(None, description="a tier above the pods; absent: one")
    base: str | None = Field(None, description="a shipped preset this file states the differences "
                             "from, or `local`: this machine's calibration")
    fabric: str | None = Field(None, description="a shipped preset whose network and datacenters "
                               "(what joins the nodes) replace the base's")
    frameworks: dict[Literal[FRAMEWORKS[1:]], FrameworkSpec] = Field(  # type: ignore[valid-type]
        {}, description="per framework, the step's figures where they differ from the device's (the harness's)")
    price_per_gpu_hour: Pos | None = Field(
        None, description="what one device costs an hour, in the user's currency (a cost objective's input); "
        "presets carry none")
    about: str = ""
    source: dict[str, Any] = Field({}, description="what measured this file, when")

    @model_validator(mode="after")
    def _switches_hold_whole_nodes(self) -> ClusterFile:
        up = self.intra_node.uplink
        if up and (up.devices >= self.devices_per_node or self.devices_per_node % up.devices):
            raise ValueError(f"intra_node.uplink.devices={up.devices} must divide devices_per_node="
                             f"{self.devices_per_node} into two or more switches")
        return self

    @model_validator(mode="after")
    def _sockets_hold_whole_switches(self) -> ClusterFile:
        so, up, n = self.intra_node.sockets, self.intra_node.uplink, self.devices_per_node
        if so and (n % so.count or (up and (n // so.count) % up.devices)):
            raise ValueError(f"intra_node.sockets.count={so.count} must divide devices_per_node={n}"
                             + (f" into sockets of whole switches of {up.devices}" if up else ""))
        return self

    @model_validator(mode="after")
    def _datacenters_hold_whole_pods(self) -> ClusterFile:
        dc = self.datacenters
        if dc is None:
            return self
        if self.nodes % dc.count:
            raise ValueError(f"datacenters.count={dc.count} does not divide nodes={self.nodes} "
                             f"(each data center holds nodes / count)")
        per, pod = self.nodes // dc.count, self.network.pod_nodes
        if pod and per % pod:
            raise ValueError(f"network.pod_nodes={pod} does not divide the {per} nodes of a data center "
                             f"(a pod cannot straddle two)")
        return self


def cluster_from_dict(d: Any, where: str = "cluster",
                      figures: dict[str, str] | None = None) -> Cluster:
    """A checked mapping as a Cluster; `figures` says where each figure came from (`load_cluster`
    knows the files merged; without it, all came from `d` itself: measured if calibrate wrote it).
    """
    f: ClusterFile = validate(ClusterFile, d, where)  # type: ignore[assignment]
    if figures is None:
        figures = provenance.collapse(provenance.stated(d, Path(where), preset=False))
    dv = f.device
    device = Device(
        dv.type, dv.memory_gb, dv.mem_bw_gbs, dict(dv.dense_gflops), dv.gemm_half_mflop,
        {k: {p: KernelEff(dict(fb.fwd), dict(fb.bwd)) for p, fb in per.items()} for k, per in dv.embedding.items()},
        dict(dv.thread_exp), dv.step_overhead_ms, dv.cores or 0, process_mb=dv.process_mb,
        spawned_process_mb=dv.spawned_process_mb,
        elementwise_gbs={k: dict(v) for k, v in dv.elementwise_gbs.items()}, shared_speed=dict(dv.shared_speed),
        glue_ns_per_id=dv.glue_ns_per_id, weighted_cost={k: v.model_dump() for k, v in dv.weighted_cost.items()},
        host_link_gbs=dv.host_link_gbs, jitter=dv.jitter,
        replica_merge_gbs=dict(dv.replica_merge_gbs), overlap_hidden=dv.overlap_hidden,
        reads_own_ids=dv.reads_own_ids)
    net = f.network
    up, so = f.intra_node.uplink, f.intra_node.sockets
    intra = Link(f.intra_node.bandwidth_gbs, f.intra_node.latency_us,
                 in_network_reduction=f.intra_node.in_network_reduction,
                 uplink_devices=up.devices if up else 0, uplink_gbs=up.bandwidth_gbs if up else 0.0,
                 sockets=so.count if so else 0, socket_gbs=so.bandwidth_gbs if so else 0.0)
    dcs = f.datacenters
    return Cluster(f.name, f.nodes, f.devices_per_node, device, intra,
                   Link(net.bandwidth_gbs, net.latency_us, net.pod_nodes or 0, net.oversubscription,
                        net.in_network_reduction),
                   f.host_memory_gb, f.about, dict(f.source),
                   DataCenters(dcs.count, dcs.bandwidth_gbs, dcs.latency_ms * 1e3, dcs.oversubscription)
                   if dcs else None,
                   {k: v.model_dump(exclude_none=True) for k, v in f.frameworks.items()},
                   price_per_gpu_hour=f.price_per_gpu_hour, figures=figures)


def load_cluster(path: str | Path) -> Cluster:
    """A cluster file, or ConfigError (one line: the file, the key, what is allowed)."""
    raw, origins = _raw(Path(path), ())
    return cluster_from_dict(raw, str(path), provenance.collapse(origins))


def cluster_mapping(path: str | Path) -> Any:
    """A cluster file's mapping as the loader checks it: its `base` and `fabric` merged under it."""
    return _raw(Path(path), ())[0]


FABRIC = ("network", "datacenters")  # what joins the nodes: a `fabric:` preset's, not the base's


def _preset_names() -> list[str]:
    here = shipped_cluster("local.yaml").parent
    return sorted(p.stem for p in here.glob("*.yaml") if p.stem != "local")


def _named(path: Path, key: str, name: Any, seen: tuple[Path, ...]) -> Path:
    """The file `base:` or `fabric:` names (a shipped preset; `local` too for a base: this
    machine's calibration, `local_cluster_path`), or ConfigError naming the file, the key and what
    is allowed."""
    presets = _preset_names()
    allowed = ["local", *presets] if key == "base" else presets
    if not isinstance(name, str) or name not in allowed:
        raise ConfigError(f"{path}: {key}: {name!r}: choose one of {allowed}")
    target = local_cluster_path() if name == "local" else shipped_cluster(f"{name}.yaml")
    if name == "local" and not target.exists():
        raise ConfigError(f"{path}: base: 'local': this machine has no calibration ({target}); "
                          f"run `cubic calibrate`, or choose one of {presets}")
    if target.resolve() in seen:
        chain = " -> ".join(p.name for p in (*seen, target.resolve()))
        raise ConfigError(f"{path}: {key}: {name!r}: a cluster cannot build on itself ({chain})")
    return target


def _raw(path: Path, seen: tuple[Path, ...]) -> tuple[Any, dict[str, str]]:
    """A cluster file's mapping, with `base: PRESET|local` (what it differs from) merged under it
    and `fabric: PRESET`'s network and datacenters in place of the base's: the file's keys win,
    nested mappings merge key by key. A site built of a preset's nodes, or of this machine's, then
    states only what differs, and each hardware figure keeps one home (and one source comment).
    Also each figure group's origin (harness/sim/provenance.py). `name`, `about` and `source`
    describe one file and are never inherited: a file without a name is named after itself."""
    try:
        raw = yaml.safe_load(read_text(path, "cluster file"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML") from None
    if not isinstance(raw, dict):
        return raw, {}
    shipped = shipped_cluster("local.yaml").resolve().parent
    preset = path.resolve().parent == shipped and path.stem != "local"
    origins = provenance.stated(raw, path, preset)
    if "base" not in raw and "fabric" not in raw:
        return raw, origins
    seen = (*seen, path.resolve())
    base, fabric = raw.pop("base", None), raw.pop("fabric", None)
    under: dict[str, Any] = {}
    under_origins: dict[str, str] = {}
    if base is not None:
        got, under_origins = _whole(_named(path, "base", base, seen), seen)
        under = {k: v for k, v in got.items() if k not in provenance.NOT_FIGURES}
    if fabric is not None:
        fab, fab_origins = _whole(_named(path, "fabric", fabric, seen), seen)
        under = {**{k: v for k, v in under.items() if k not in FABRIC},
                 **{k: fab[k] for k in FABRIC if k in fab}}
        joins = {g: g.split(".", 1)[0] in FABRIC for g in (*under_origins, *fab_origins)}
        under_origins = {**{g: o for g, o in under_origins.items() if not joins[g]},
                         **{g: o for g, o in fab_origins.items() if joins[g]}}
    merged = _merge(under, raw)
    merged.setdefault("name", path.stem)
    return merged, {**under_origins, **origins}


def _whole(path: Path, seen: tuple[Path, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """A base or fabric file, checked whole on its own: a broken calibration is named as itself."""
    got, origins = _raw(path, seen)
    validate(ClusterFile, got, str(path))
    return got, origins


def _merge(under: Any, over: Any) -> Any:
    if isinstance(under, dict) and isinstance(over, dict):
        return {**under, **{k: _merge(under.get(k), v) for k, v in over.items()}}
    return over


def shipped_file(folder: str, package: str, name: str) -> Path:
    """`FOLDER/NAME` of the working directory, else the one cubic ships as package data (`package`), so the
    shipped spaces and clusters work from any directory, installed editable or not."""
    from importlib.resources import files

    here = Path(folder) / name
    shipped = Path(str(files(package) / name))
    return here if here.exists() or not shipped.exists() else shipped


def shipped_cluster(name: str) -> Path:
    return shipped_file("clusters", "cubic_clusters", name)


def resolve(name_or_path: str | Path) -> Cluster:
    """A cluster by file path or by a shipped preset's name (`local`, `h100-8`, ...); `local` is this
    machine's file, the one `local_cluster` reads."""
    return load_cluster(cluster_path(name_or_path))


def cluster_path(name_or_path: str | Path) -> Path:
    """The file `resolve` reads for a path or a preset's name; ConfigError for a name that is
    neither, naming the presets (a path that does not exist is left for the loader to name)."""
    p = Path(name_or_path)
    if not p.exists() and p.suffix == "" and "/" not in str(name_or_path):
        p = local_cluster_path() if name_or_path == "local" else shipped_cluster(f"{name_or_path}.yaml")
        if not p.exists():
            raise ConfigError(f"{name_or_path}: no such cluster file or preset; presets: "
                              f"{', '.join(['local', *_preset_names()])}")
    return p


def calibrated_cluster_path() -> Path:
    """Where `cubic calibrate` writes this machine by default: $XDG_CONFIG_HOME/cubic/local.yaml
    (~/.config/cubic/local.yaml), outside the checkout, so calibrating never overwrites a shipped file."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".config"  # XDG: relative is ignored
    return base / "cubic" / "local.yaml"


def local_cluster_path() -> Path:
    """The file `local_cluster` reads: CUBIC_LOCAL_CLUSTER, else this machine's calibration
    (`calibrated_cluster_path`), else the shipped clusters/local.yaml (which may not exist)."""
    env = os.environ.get("CUBIC_LOCAL_CLUSTER")
    if env and env != "none":
        return Path(env)
    mine = calibrated_cluster_path()
    return mine if mine.exists() else shipped_cluster("local.yaml")


@functools.cache
def local_cluster() -> Cluster | None:
    """This machine as `cubic calibrate` measured it: what real trials run on (read once per process:
    the planners ask for it per table). Looked up in order: CUBIC_LOCAL_CLUSTER=FILE (=none: none, for
    calibration itself), the calibration's default output (~/.config/cubic/local.yaml, honouring
    XDG_CONFIG_HOME), the shipped clusters/local.yaml. None when none of them exists."""
    if os.environ.get("CUBIC_LOCAL_CLUSTER") == "none":
        return None
    path = local_cluster_path()
    return load_cluster(path) if path.exists() else None
