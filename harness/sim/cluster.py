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
- `network`: each device's own NIC (an all-to-all cannot aggregate NICs), bandwidth and latency;
  optionally `pod_nodes` (nodes per pod, non-blocking inside) and `oversubscription` (above the pod);
- `host_memory_gb` per node.

Every key is checked at load, with one line naming the file, the key and what is allowed (exit 2 at
the CLI), as search spaces are. `cubic calibrate` writes these files from measurements; hand-written
presets say where their numbers come from in comments.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cubic_harness.errors import ConfigError, read_text

KERNELS = ("fbgemm", "torch", "native", "triton")
EMB_PRECISIONS = ("fp32", "fp16", "bf16")
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
    elementwise_gbs: dict[str, dict[int, float]] = field(default_factory=dict)  # dense work beyond GEMMs:
    #   activation bytes per second, per dense precision, by batch size (interpolated in log batch)
    shared_speed: dict[str, float] = field(default_factory=dict)  # CPU: speed a rank keeps (dense, embedding)
    #   when every core of its node runs a rank (shared caches and memory bandwidth)
    glue_ns_per_id: float = 0.0  # the embedding collection's own work (id routing, assembly) per local id
    host_link_gbs: float = 0.0  # GPU: device <-> host memory (PCIe) per device; 0 = tables must fit the device
    jitter: float = 0.0  # the wait at a collective per ms of compute before it (ranks drift apart)
    replica_merge_gbs: dict[str, float] = field(default_factory=dict)  # 2D weight_avg merge, beyond its wire:
    #   GB/s of the replicas' payload (rows x (width + state)), per transport (sparse, dense)

    def kernel(self, backend: str, precision: str) -> KernelEff | None:
        per = self.embedding.get(backend) or {}
        return per.get(precision) or (per.get("fp32") if precision != "fp32" else None)


@dataclass(frozen=True)
class Link:
    bandwidth_gbs: float  # per direction, per device
    latency_us: float  # per collective call between two ranks
    pod_nodes: int = 0  # network only: nodes per pod (a non-blocking fabric inside); 0 = one pod
    oversubscription: float = 1.0  # network only: traffic that leaves a pod shares links this much


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

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def pod_of(self, rank: int) -> int:
        return self.node_of(rank) // self.network.pod_nodes if self.network.pod_nodes else 0

    def rank_memory_mb(self, ranks_on_node: int) -> float:
        """What one rank may hold: its device's memory (GPU), or its share of the node's host memory."""
        if self.device.type == "gpu":
            return self.device.memory_gb * 1024
        return self.host_memory_gb * 1024 / max(1, ranks_on_node)


# ---------------------------------------------------------------------- loading
class _Check:
    """One-line errors naming the file and the key."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key}: {msg}")

    def section(self, d: Any, key: str, keys: set[str], optional: set[str] = frozenset()) -> dict:
        if not isinstance(d, dict):
            raise self.fail(key or "(top level)", f"must be a mapping with keys {sorted(keys)}")
        missing = sorted(keys - set(d))
        if missing:
            raise self.fail(f"{key + '.' if key else ''}{missing[0]}", f"missing; required keys: {sorted(keys)}")
        unknown = sorted(set(d) - keys - optional, key=str)  # YAML keys may be numbers too
        if unknown:
            raise self.fail(f"{key + '.' if key else ''}{unknown[0]}",
                            f"unknown key; allowed: {sorted(keys | optional)}")
        return d

    def num(self, d: dict, key: str, path: str, positive: bool = True, integer: bool = False) -> float:
        v = d[key]
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if integer:
            ok = ok and float(v).is_integer()
        if not ok:
            raise self.fail(path, f"{v!r} is not {'an integer' if integer else 'a number'}")
        if positive and v <= 0:
            raise self.fail(path, f"{v!r} must be > 0")
        if not positive and v < 0:
            raise self.fail(path, f"{v!r} must be >= 0")
        return int(v) if integer else float(v)

    def choice(self, v: Any, path: str, allowed: tuple) -> Any:
        if v not in allowed:
            raise self.fail(path, f"{v!r} is not allowed; choose one of {list(allowed)}")
        return v


def _link(c: _Check, d: Any, key: str) -> Link:
    pods = {"pod_nodes", "oversubscription"} if key == "network" else set()
    d = c.section(d, key, {"bandwidth_gbs", "latency_us"}, pods)
    over = c.num(d, "oversubscription", f"{key}.oversubscription") if "oversubscription" in d else 1.0
    if over < 1:
        raise c.fail(f"{key}.oversubscription", f"{over!r} must be >= 1 (1 = non-blocking)")
    return Link(c.num(d, "bandwidth_gbs", f"{key}.bandwidth_gbs"), c.num(d, "latency_us", f"{key}.latency_us", False),
                int(c.num(d, "pod_nodes", f"{key}.pod_nodes", integer=True)) if "pod_nodes" in d else 0, over)


def _eff_curve(c: _Check, d: Any, path: str) -> dict[int, float]:
    if not isinstance(d, dict) or not d:
        raise c.fail(path, "must map sizes (row widths or batch sizes, positive ints) to numbers")
    out = {}
    for k in d:
        if not (isinstance(k, int) and not isinstance(k, bool) and k > 0):
            raise c.fail(f"{path}.{k}", "size must be a positive integer")
        out[k] = c.num(d, k, f"{path}.{k}")
    return out


def _float_map(c: _Check, d: Any, path: str, keys: tuple[str, ...]) -> dict[str, float]:
    if not isinstance(d, dict):
        raise c.fail(path, f"must map {list(keys)} to numbers")
    for k in d:
        c.choice(k, f"{path}.{k}", keys)
    return {k: c.num(d, k, f"{path}.{k}") for k in d}


def _device(c: _Check, d: Any) -> Device:
    d = c.section(d, "device", {"type", "memory_gb", "mem_bw_gbs", "dense_gflops", "gemm_half_mflop", "embedding",
                                "step_overhead_ms"},
                  {"cores", "thread_exp", "process_mb", "elementwise_gbs", "shared_speed", "replica_merge_gbs",
                   "glue_ns_per_id", "jitter", "host_link_gbs"})
    typ = c.choice(d["type"], "device.type", DEVICE_TYPES)
    dense = d["dense_gflops"]
    if not isinstance(dense, dict) or "fp32" not in dense:
        raise c.fail("device.dense_gflops", f"must map dense precisions {list(DENSE_PRECISIONS)} to GFLOP/s "
                     "(fp32 required)")
    for k in dense:
        c.choice(k, f"device.dense_gflops.{k}", DENSE_PRECISIONS)
    emb = d["embedding"]
    if not isinstance(emb, dict) or not emb:
        raise c.fail("device.embedding", f"must map kernel backends {list(KERNELS)} to per-precision efficiencies")
    embedding: dict[str, dict[str, KernelEff]] = {}
    for kname, per in emb.items():
        c.choice(kname, f"device.embedding.{kname}", KERNELS)
        if not isinstance(per, dict) or "fp32" not in per:
            raise c.fail(f"device.embedding.{kname}", f"must map emb precisions {list(EMB_PRECISIONS)} to "
                         "{fwd, bwd} (fp32 required)")
        embedding[kname] = {}
        for prec, fb in per.items():
            p = f"device.embedding.{kname}.{c.choice(prec, f'device.embedding.{kname}.{prec}', EMB_PRECISIONS)}"
            fb = c.section(fb, p, {"fwd", "bwd"})
            embedding[kname][prec] = KernelEff(_eff_curve(c, fb["fwd"], f"{p}.fwd"),
                                               _eff_curve(c, fb["bwd"], f"{p}.bwd"))
    texp = d.get("thread_exp", {}) or {}
    if not isinstance(texp, dict):
        raise c.fail("device.thread_exp", "must map kernel backends to exponents")
    for k in texp:
        c.choice(k, f"device.thread_exp.{k}", (*KERNELS, "dense"))
        c.num(texp, k, f"device.thread_exp.{k}", positive=False)
    ew_raw = d.get("elementwise_gbs", {})
    if not isinstance(ew_raw, dict):
        raise c.fail("device.elementwise_gbs", f"must map {list(DENSE_PRECISIONS)} to {{batch size: GB/s}}")
    ew = {c.choice(k, f"device.elementwise_gbs.{k}", DENSE_PRECISIONS): _eff_curve(c, v, f"device.elementwise_gbs.{k}")
          for k, v in ew_raw.items()}
    shared = _float_map(c, d.get("shared_speed", {}), "device.shared_speed", ("dense", "embedding"))
    merge = _float_map(c, d.get("replica_merge_gbs", {}), "device.replica_merge_gbs", ("sparse", "dense"))
    if any(v > 1 for v in shared.values()):
        raise c.fail("device.shared_speed", "fractions of a rank's solo speed must be <= 1")
    cores = int(c.num(d, "cores", "device.cores", integer=True)) if "cores" in d else 0
    if typ == "cpu" and not cores:
        raise c.fail("device.cores", "required for a cpu device (the node's cores its ranks share)")
    def opt(key: str) -> float:
        return c.num(d, key, f"device.{key}", positive=False) if key in d else 0.0

    return Device(typ, c.num(d, "memory_gb", "device.memory_gb"), c.num(d, "mem_bw_gbs", "device.mem_bw_gbs"),
                  {k: c.num(dense, k, f"device.dense_gflops.{k}") for k in dense},
                  c.num(d, "gemm_half_mflop", "device.gemm_half_mflop", positive=False), embedding,
                  {k: float(v) for k, v in texp.items()}, c.num(d, "step_overhead_ms", "device.step_overhead_ms",
                                                                 positive=False), cores,
                  process_mb=opt("process_mb"), elementwise_gbs=ew, shared_speed=shared,
                  glue_ns_per_id=opt("glue_ns_per_id"), host_link_gbs=opt("host_link_gbs"), jitter=opt("jitter"),
                  replica_merge_gbs=merge)


TOP_KEYS = {"name", "nodes", "devices_per_node", "device", "intra_node", "network", "host_memory_gb"}


def cluster_from_dict(d: Any, where: str = "cluster") -> Cluster:
    c = _Check(where)
    d = c.section(d, "", TOP_KEYS, {"about", "source"})
    if not isinstance(d["name"], str) or not d["name"]:
        raise c.fail("name", "must be a non-empty string")
    src = d.get("source") or {}
    if not isinstance(src, dict):
        raise c.fail("source", "must be a mapping (what measured this file, when)")
    return Cluster(d["name"], int(c.num(d, "nodes", "nodes", integer=True)),
                   int(c.num(d, "devices_per_node", "devices_per_node", integer=True)), _device(c, d["device"]),
                   _link(c, d["intra_node"], "intra_node"), _link(c, d["network"], "network"),
                   c.num(d, "host_memory_gb", "host_memory_gb"), str(d.get("about", "")), src)


def load_cluster(path: str | Path) -> Cluster:
    """A cluster file, or ConfigError (one line: the file, the key, what is allowed)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(read_text(path, "cluster file"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML") from None
    return cluster_from_dict(raw, str(path))


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
    p = Path(name_or_path)
    if not p.exists() and p.suffix == "" and "/" not in str(name_or_path):
        p = local_cluster_path() if name_or_path == "local" else shipped_cluster(f"{name_or_path}.yaml")
    return load_cluster(p)


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
