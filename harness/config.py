"""TrialConfig and TrialResult: the contract between the harness and the tuner.

Every co-design knob lives in `TrialConfig` (flat, so a knob's path is
YAML key -> TrialConfig field -> harness function -> TrialResult.config).
`TrialResult` is the one JSON object a trial returns (docs/architecture.md "Result schema").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cubic_harness.errors import ConfigError
from cubic_harness.workload import Workload


def host_cores() -> int:
    """The cores this process may run on (its affinity, which a container or `taskset` narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def oversubscribed(ranks: int, threads: int, cores: int) -> bool:
    """More threads than cores among a host's ranks. Their OpenMP workers must then wait passively
    (`trial.rank_env`), a setting libgomp reads when it loads, so such a rank forks from a server started
    with it (`trial.rank_context`)."""
    return ranks * threads > cores


def ranks_spawned(cfg: TrialConfig, framework: str) -> bool:
    """Whether a trial's ranks start afresh instead of forking from a fork server (`trial.rank_context`):
    TorchRec's 2D on CPU, whose ranks run with PYTHONOPTIMIZE=1 (harness/torchrec_trial.py), which a
    forked interpreter cannot take. A spawned rank holds more (a cluster's `spawned_process_mb`)."""
    return framework == "torchrec" and cfg.device != "cuda" and cfg.group_size < cfg.world_size


def load_time_env(name: str) -> str:
    """A variable as this process's libraries read it when they loaded: the environment its image was
    started with (/proc/self/environ; a forked rank's is its fork server's), not os.environ, which a rank
    replaces with its trial's after the fork. "default" where unset."""
    try:
        with open("/proc/self/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                k, _, v = item.partition(b"=")
                if k.decode(errors="replace") == name:
                    return v.decode(errors="replace")
        return "default"
    except OSError:  # not Linux: what the process holds now
        return os.environ.get(name, "default")


def json_safe(x: Any) -> Any:
    """Strict-JSON copy: NaN/inf -> None, recursively (JSON has no NaN; SQL JSON columns, pandas and
    strict parsers all read null)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


# Allowed values of every categorical knob: the single source for validation,
# the CLI's error messages and the search-space loader.
CHOICES: dict[str, tuple[Any, ...]] = {
    "kernel": ("fbgemm", "torch", "native", "triton"),
    "emb_precision": ("fp32", "fp16", "bf16"),
    "dense_precision": ("fp32", "bf16", "fp8_auto", "fp8_all"),
    "comm_precision": ("fp32", "bf16", "fp16"),
    "allreduce_comm_precision": ("fp32", "bf16", "fp16"),
    "sharding": (
        "table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel",
        "size_greedy", "lookup_greedy", "size_lookup_greedy", "auto", "plan", "torchrec_planner", "file",
    ),
    "sparse_sync": ("grad_allreduce", "weight_avg"),
    "group_placement": ("intra_node", "cross_node"),
    "emb_optimizer": ("rowwise_adagrad", "momentum_scaled_rowwise_adagrad", "sgd"),
    "pipeline_depth": (0, 1, 2),
    "comm_overlap": ("none", "forward", "forward_backward"),
    "device": ("cpu", "cuda"),
}


@dataclass(frozen=True)
class Precision:
    """One precision a knob can name (tables, dense, the wire): what every module needs to know of it."""

    name: str
    bytes: int  # per element, in memory or on the wire: the planner's memory and the performance model's bytes
    torch: str | None  # its torch dtype's attribute name (kernels' `DTYPES`, checked against this by a test)
    torchrec: str | None  # its member name in TorchRec's `DataType` and `CommType` (None: TorchRec has none)


#: The precisions, once: each module derives its own view (bytes, torch dtypes, TorchRec's names) from here.
PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", 4, "float32", "FP32"),
    Precision("fp16", 2, "float16", "FP16"),
    Precision("bf16", 2, "bfloat16", "BF16"),
    Precision("fp8_auto", 2, None, None),  # dense only: fp8 in the Linears the probe approves (harness/fp8.py)
    Precision("fp8_all", 1, None, None),  # dense only: every Linear in fp8
)}
DTYPE_BYTES = {n: p.bytes for n, p in PRECISIONS.items()}
TORCHREC_TYPES = {n: p.torchrec for n, p in PRECISIONS.items() if p.torchrec}  # DataType / CommType names
SHARDING_TYPES = CHOICES["sharding"][:5]
PLANNERS = CHOICES["sharding"][5:]


@dataclass
class TrialConfig:
    """One configuration to run: the workload plus every knob's value."""

    workload: Workload = field(default_factory=Workload.small)
    # --- parallelism / sharding
    world_size: int = 2
    sharding: str = "table_wise"
    sharding_group_size: int = 0  # 0 = world_size (plain model parallelism); G < world = 2D
    sparse_sync: str = "grad_allreduce"
    sparse_sync_interval: int = 1  # weight_avg: replicas merge every k steps (and after the last step)
    group_placement: str = "intra_node"  # 2D: a sharding group's ranks side by side (inside a node) or strided
    ranks_per_node: int = 2  # topology for table_row_wise (row-wise inside a node)
    column_shard_dim: int = 0  # column-wise shard width; 0 = widest multiple of 4 dividing dim, <= dim / group
    # sharding: file: the plan in this JSON file, exactly (harness/sharding/plan_file.py: a team's production plan)
    plan_file: str = ""
    # --- batch / precision / kernels
    batch_size: int = 1024  # per rank
    kernel: str = "native"  # CPU default: our numba TBE (= FBGEMM's math, >= its speed); fbgemm, torch, triton
    emb_precision: str = "fp32"
    dense_precision: str = "fp32"
    comm_precision: str = "fp32"
    # the dense gradients' all-reduce: a DDP comm hook (TorchRec: DefaultDataParallelWrapper's
    # allreduce_comm_precision); left out of to_dict at fp32, so every config stored before it keeps its key
    allreduce_comm_precision: str = "fp32"
    # FBGEMM's UVM cache (TorchRec: compute kernel fused_uvm_caching, CacheParams.load_factor): 0 keeps the
    # tables in device memory; x in (0, 1] keeps them in host memory, read through a device-side cache of x of
    # each table's rows. Trades device memory for host-link traffic on the misses: the profiled ids decide
    # the hit rate (harness/sim/perf.py hit_rate)
    uvm_cache_load_factor: float = 0.0
    emb_optimizer: str = "rowwise_adagrad"
    emb_lr: float = 0.01
    dense_lr: float = 0.01
    pipeline_depth: int = 0
    # the pooled all-to-all beside the bottom MLP: forward, and the gradients' beside its backward and DDP's
    # all-reduce (harness/sharding/comm.py InFlight); the same numbers as none, in another order
    comm_overlap: str = "none"
    # --- execution
    device: str = "cpu"
    threads_per_rank: int = 1
    seed: int = 0
    warmup_steps: int = 5
    measure_steps: int = 30
    windows: int = 3  # measured steps are split into this many windows -> median, cv
    timeout_s: float = 300.0
    mem_cap_mb: float = 0.0  # per-rank cap; 0 = none. Plans/trials over it are status=oom.
    eval_samples: int = 0  # held-out samples evaluated after training (eval NE and AUC); 0 = none

    # ------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Ranks of one model-parallel group (2D sparse parallelism when < world)."""
        return self.sharding_group_size or self.world_size

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks (`batch_size` is per rank)."""
        return self.batch_size * self.world_size

    @property
    def replicas(self) -> int:
        return self.world_size // self.group_size

    def validate(self, where: str = "config", workload: bool = True) -> TrialConfig:
        """Raise ConfigError (one line: where, key, allowed) on any impossible value. `workload=False`: the
        workload is known valid (a search space checks it once, then thousands of knob combinations)."""
        for key, allowed in CHOICES.items():
            val = getattr(self, key)
            if val not in allowed:
                raise ConfigError(f"{where}: {key}={val!r} is not allowed; choose one of {list(allowed)}")
        for key in ("world_size", "batch_size", "threads_per_rank", "measure_steps", "windows", "sparse_sync_interval"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"{where}: {key}={getattr(self, key)!r} must be >= 1")
        for key in ("warmup_steps", "seed", "column_shard_dim", "mem_cap_mb", "eval_samples"):
            if not math.isfinite(getattr(self, key)) or getattr(self, key) < 0:
                raise ConfigError(f"{where}: {key}={getattr(self, key)!r} must be >= 0")
        for key in ("emb_lr", "dense_lr", "timeout_s"):
            if not math.isfinite(getattr(self, key)) or getattr(self, key) <= 0:
                raise ConfigError(f"{where}: {key}={getattr(self, key)!r} must be a finite number > 0")
        if self.measure_steps < self.windows:
            raise ConfigError(f"{where}: measure_steps={self.measure_steps} must be >= windows={self.windows}")
        g = self.sharding_group_size
        if g < 0 or (g and self.world_size % g):
            raise ConfigError(
                f"{where}: sharding_group_size={g} must divide world_size={self.world_size} "
                f"(allowed: {[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]})"
            )
        if self.ranks_per_node < 1 or (self.sharding == "table_row_wise"
                                       and self.group_size % min(self.ranks_per_node, self.group_size)):
            raise ConfigError(
                f"{where}: ranks_per_node={self.ranks_per_node} must divide the sharding group "
                f"size {self.group_size} for table_row_wise (allowed: "
                f"{[d for d in range(1, self.group_size + 1) if self.group_size % d == 0]})"
            )
        if self.sharding == "table_row_wise" and self.group_placement == "cross_node" and self.replicas > 1:
            raise ConfigError(f"{where}: table_row_wise splits rows inside a node, which needs a sharding group's "
                              "ranks side by side: use group_placement=intra_node")
        if self.kernel == "native" and self.device == "cuda":
            raise ConfigError(f"{where}: kernel=native is a CPU kernel; with device=cuda choose torch or triton")
        for t in self.workload.constrained():  # the plan's constraints, against this group
            bad = [k for k in t.sharding_types if k not in SHARDING_TYPES]
            if bad:
                raise ConfigError(f"{where}: table {t.name} sharding_types: {bad[0]!r} is no sharding kind; "
                                  f"choose from {list(SHARDING_TYPES)}")
            if any(r >= self.group_size for r in t.ranks):
                raise ConfigError(f"{where}: table {t.name} ranks={t.ranks}: a sharding group of "
                                  f"{self.group_size} has positions 0..{self.group_size - 1}")
        if self.sharding == "file" and not self.plan_file:  # plan_file alone is inert: another sharding plans
            raise ConfigError(f"{where}: sharding=file runs the plan in plan_file: set plan_file=PATH")
        if self.sharding == "file" and workload:
            from cubic_harness.sharding.plan_file import load_plan

            load_plan(self)  # a table left out, a rank the group lacks, a table not covered: one line, now
        if self.sharding == "column_wise":
            seen: set[int] = set()
            for t in self.workload.tables:  # the first table of each width (788 tables have a few)
                if t.dim not in seen:
                    seen.add(t.dim)
                    self.column_width(t.dim, t.name, where)
        lf = self.uvm_cache_load_factor
        if not math.isfinite(lf) or not 0 <= lf <= 1:
            raise ConfigError(f"{where}: uvm_cache_load_factor={lf!r} must be in [0, 1] (0: tables in device memory)")
        if lf > 0 and self.device != "cuda":
            raise ConfigError(f"{where}: uvm_cache_load_factor={lf} needs device=cuda (a UVM cache keeps the tables "
                              "in host memory behind device memory); use uvm_cache_load_factor=0")
        if lf > 0 and self.replicas > 1 and self.sparse_sync == "weight_avg":
            raise ConfigError(f"{where}: uvm_cache_load_factor={lf} with 2D weight_avg: the replica merge writes "
                              "rows behind the cache, which cubic does not flush; use uvm_cache_load_factor=0")
        if self.kernel == "fbgemm" and self.emb_precision == "bf16":
            raise ConfigError(f"{where}: emb_precision=bf16 is not supported by kernel=fbgemm on CPU; "
                              "choose fp32 or fp16")
        if workload:
            self.workload.validate(where)
        return self

    def column_width(self, dim: int, table: str = "", where: str = "config") -> int:
        """Column-wise shard width of a `dim`-wide table: `column_shard_dim`, or the widest multiple of 4
        that divides dim and is at most dim / group size (dim 64 on 3 ranks: 16, not 21 or 20).
        ConfigError unless FBGEMM-legal: a multiple of 4 dividing dim."""
        w = self.column_shard_dim or next((w for w in range(max(4, dim // self.group_size) // 4 * 4, 3, -4)
                                           if dim % w == 0), 4)
        if w % 4 or dim % w or dim % 4:
            raise ConfigError(f"{where}: column_wise: table {table} dim {dim} cannot be split into FBGEMM-legal "
                              f"shards of width {w} (column_shard_dim must be 0 or a multiple of 4 dividing the dim)")
        return w

    # ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        # field by field: dataclasses.asdict deep-copied the workload (788 profiled tables) only to replace it
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["workload"] = self.workload.to_dict()
        for k, v in KEYLESS_DEFAULTS.items():
            if d[k] == v:
                d.pop(k)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config") -> TrialConfig:
        d = dict(d)
        for k, v in RETIRED.items():
            if k in d and d.pop(k) != v:
                raise ConfigError(f"{where}: {k!r} is no longer a TrialConfig key (only {k}: {v} loads); "
                                  f"{_RETIRED_WHY[k]}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {sorted(known)}")
        wl = d.pop("workload", None)
        cfg = cls(**{k: _coerce(k, v, where) for k, v in d.items()})
        if wl is not None:
            cfg.workload = wl if isinstance(wl, Workload) else Workload.from_dict(wl, where=f"{where}: workload")
        return cfg

    def replace(self, where: str = "config", **knobs: Any) -> TrialConfig:
        """A copy with knobs set (values coerced from strings, as `--set` gives them; errors name `where`)."""
        d = self.to_dict()
        d.update(knobs)
        return TrialConfig.from_dict(d, where)

    def key(self) -> str:
        """Canonical JSON of the whole config: equal configs have equal keys. Retired fields are in it at
        the one value stored trials had, so a stored trial's key is unchanged and a resumed study neither
        loses nor re-runs it. A plan file is keyed by its content as well as its path: an edited file is
        another configuration, not a duplicate of the trial that ran the old plan."""
        d = {**RETIRED, **self.to_dict()}
        if self.plan_file:
            d["plan_file"] = [self.plan_file, file_digest(self.plan_file)]
        return json.dumps(d, sort_keys=True)


def inert_knobs(cfg: TrialConfig) -> frozenset[str]:
    """The knobs whose value changes neither what trains nor how it runs for `cfg`: every value of
    each trains the same model at the same speed, so a search space counts them as one configuration
    and a backend need not run (or refuse) their value. Each is inert where what it sets is absent:

    - `sparse_sync` and `group_placement` with one replica (`sharding_group_size` 0 or the world):
      no replicas to keep in sync, and one sharding group of every rank, side by side or strided;
    - `sparse_sync_interval` without a weight_avg merge (one replica, or `grad_allreduce`, which
      applies one exact update every step): it only spaces the merges.

    `emb_optimizer` is never inert (SGD and row-wise AdaGrad train differently everywhere); only its
    `momentum_scaled_rowwise_adagrad` value trains as `rowwise_adagrad` without a weight_avg merge,
    its scaling being the merge's rule (harness/sharding/replica_sync.py)."""
    if cfg.replicas == 1:
        return frozenset({"sparse_sync", "group_placement", "sparse_sync_interval"})
    if cfg.sparse_sync != "weight_avg":
        return frozenset({"sparse_sync_interval"})
    return frozenset()


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes ("missing" where it cannot be read: loading it says why, in one line)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "missing"


#: Knobs added after studies were stored: at these values they stay out of `to_dict` (and `key()`), so a
#: stored trial's config key is unchanged and a resumed study neither loses nor re-runs it.
KEYLESS_DEFAULTS = {"allreduce_comm_precision": "fp32", "comm_overlap": "none", "uvm_cache_load_factor": 0.0,
                    "plan_file": ""}
#: Fields removed from TrialConfig, each at the value every stored production trial had: `key()` keeps them (the
#: keys of stored trials stay as they were), `from_dict` drops them (stored configs, exports and old YAML load).
RETIRED = {"inject_fault": "none"}
_RETIRED_WHY = {"inject_fault": "fault injection is a test hook: CUBIC_INJECT_FAULT (cubic_harness.faults)"}
_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(TrialConfig)}


def _coerce(key: str, val: Any, where: str) -> Any:
    """Turn `--set` strings / YAML scalars into the field's type, with a one-line error."""
    typ = _FIELD_TYPES.get(key)
    if key == "workload":
        return val
    try:
        if typ in ("int", "float") and isinstance(val, bool):  # YAML's true is not the number 1
            raise ValueError
        if typ == "int":
            if isinstance(val, float) and not val.is_integer():
                raise ValueError
            return int(val)
        if typ == "float":
            return float(val)
        if typ == "str":
            return str(val)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: {key}={val!r} is not a valid {typ}") from None
    return val


#: Environment variables that change a measurement without being a TrialConfig field: a benchmark's forced
#: transport or thread pool (to compare against the default), fp8's op path, the cluster file the planners
#: price with. Each set one is recorded in `TrialResult.env["env_overrides"]` (real and simulated trials
#: alike), so no number hides it.
MEASUREMENT_ENV = ("CUBIC_REPLICA_SYNC", "CUBIC_NATIVE_THREADS", "CUBIC_FP8_QUANT", "CUBIC_LOCAL_CLUSTER",
                   "CUBIC_INJECT_FAULT")


# A folder, made and removed by whoever starts the trials' workers (the Ray runner, per tune),
# where a worker's fork servers put their sockets (harness/trial.py `_sockets_in_scratch`).
SCRATCH_ENV = "CUBIC_SCRATCH"


def env_overrides() -> dict[str, str]:
    return {k: os.environ[k] for k in MEASUREMENT_ENV if k in os.environ}


@dataclass
class TrialResult:
    """What one trial returns (docs/architecture.md "Result schema"); serialises to one JSON object."""

    status: str = "ok"  # ok | oom | error | timeout
    error: str = ""
    qps: float = 0.0
    qps_cv: float = 0.0
    step_ms_p50: float = 0.0
    step_ms_p90: float = 0.0
    peak_mem_mb: float = 0.0
    loss_first: float = float("nan")
    loss_last: float = float("nan")
    ne: float = float("nan")
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    window_qps: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    plan: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_dict(self) -> dict[str, Any]:
        """The strict-JSON copy (NaN -> None) a store keeps: json_safe copies every container itself, so no deep
        copy comes first (a simulated 16,384-GPU trial's plan is thousands of shards)."""
        return json_safe({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def to_json(self) -> str:
        """Strict JSON (NaN -> null): `jq` and other strict parsers read it."""
        return json.dumps(self.to_json_dict(), allow_nan=False, default=float)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialResult:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def failed(cls, status: str, error: str, config: TrialConfig | None = None, **kw: Any) -> TrialResult:
        one_line = " ".join(str(error).split())[:500]
        return cls(status=status, error=one_line, config=config.to_dict() if config else {}, **kw)
