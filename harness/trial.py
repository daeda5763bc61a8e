"""run_trial: one configuration -> one TrialResult, in a fresh set of rank processes.

The parent owns the rendezvous (a TCPStore on an OS-chosen free port, so
concurrent trials never collide), starts `world_size` rank processes (forked
from a server that imported torch and the harness once: `rank_context`), and
watches them: a rank that raises reports its reason; a rank that dies, runs
out of memory or hangs past the timeout ends the trial with status
error / oom / timeout, and every process the trial started is killed. A rank
also exits by itself if its parent disappears, so a killed tuner leaves no
orphans. run_trial never raises for a failing trial.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import platform
import queue
import signal
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing import forkserver, util
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cubic_harness.config import (
    SCRATCH_ENV,
    TrialConfig,
    TrialResult,
    env_overrides,
    host_cores,
    oversubscribed,
)
from cubic_harness.errors import ConfigError, debugging
from cubic_harness.scratch import Scratch


def _is_oom(msg: str) -> bool:
    m = msg.lower()
    return "out of memory" in m or "memoryerror" in m or "exceeds mem_cap" in m or "cannot allocate" in m


def _watch_parent(ppid: int) -> None:
    """Exit once this process is orphaned: its parent (the trial's process, or the fork server, which exits
    with it) is gone and it was handed to another."""
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(17)


def adopt_trial_env(env: dict[str, str]) -> None:
    """A rank's first act: take the trial's environment (a forked rank starts with the fork server's) and exit
    with its parent."""
    os.environ.clear()
    os.environ.update(env)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()


def _rank_entry(cfg_dict: dict, rank: int, port: int, q, collect_tables: bool, env: dict[str, str]) -> None:
    """Process entry of one rank (module-level so a spawned or forked child can find it)."""
    adopt_trial_env(env)
    try:
        out = train_one_rank(TrialConfig.from_dict(cfg_dict), rank, "127.0.0.1", port, collect_tables)
        q.put((rank, "ok", "", out))
    except BaseException as e:  # report every failure as one line, then die
        q.put((rank, *rank_failure(rank, e), None))
        time.sleep(0.2)
        os._exit(1)


def train_one_rank(cfg: TrialConfig, rank: int, host: str, port: int, collect_tables: bool = False,
                   store: dist.TCPStore | None = None, device: torch.device | None = None) -> dict:
    """One rank's whole life: join the rendezvous at host:port (or use `store`, which rank 0 of a trial
    spanning nodes hosts itself), train, leave. The same on every launcher (spawned here, a Ray actor
    there: cubic/execution/multinode.py), so a trial computes the same wherever its ranks run."""
    torch.set_num_threads(cfg.threads_per_rank)
    own_gpu = device is not None  # a launcher that gave each rank its own GPU (Ray's num_gpus=1)
    device = device or _rank_device(cfg, rank)
    backend = "nccl" if device.type == "cuda" and (own_gpu or _nccl_ok(cfg)) else "gloo"
    if store is None:
        store = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=cfg.timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=cfg.world_size,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    from cubic_harness.planning import plan_for
    from cubic_harness.train import train_rank

    out = train_rank(cfg, plan_for(cfg), rank, device, collect_tables)
    dist.destroy_process_group()
    return out


def rank_failure(rank: int, e: BaseException) -> tuple[str, str]:
    """(status, one line) for an exception a rank died of."""
    msg = f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())}"[:400]
    if debugging():
        traceback.print_exc()
    return ("oom" if isinstance(e, MemoryError) or _is_oom(msg) else "error"), msg


def _rank_device(cfg: TrialConfig, rank: int) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    n = torch.cuda.device_count()
    return torch.device("cuda", rank % n)


def _nccl_ok(cfg: TrialConfig) -> bool:
    """NCCL refuses two ranks on one GPU: then we fall back to gloo (the parent warns)."""
    return torch.cuda.device_count() >= cfg.world_size


def check_config(cfg: TrialConfig) -> None:
    """Everything that makes a config bad input (raises ConfigError with one line)."""
    cfg.validate()
    from cubic_harness.workload import SIMULATED_ONLY

    if cfg.workload.name in SIMULATED_ONLY:
        raise ConfigError(f"workload {cfg.workload.name} is for the simulator (--backend sim --cluster ...): "
                          f"{sum(t.bytes_fp32 for t in cfg.workload.tables) / 2**30:.0f} GiB of tables; for a real "
                          "trial use mlperf-dcnv2-mini")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: no CUDA device is available here; use device=cpu")
    if cfg.kernel == "fbgemm":
        from cubic_kernels.fbgemm_backend import available

        try:
            present = available()
        except Exception as e:  # installed but broken: this trial fails with the reason, the tune goes on
            raise ConfigError(f"kernel=fbgemm: fbgemm_gpu is installed but fails to import: "
                              f"{type(e).__name__}: {e}") from None
        if not present:
            raise ConfigError("kernel=fbgemm needs fbgemm_gpu (pip extra 'cpu' or 'cuda'); or use kernel=torch")
    if cfg.uvm_cache_load_factor > 0 and cfg.kernel != "fbgemm":  # (the simulator prices any kernel's lookups)
        raise ConfigError(f"uvm_cache_load_factor={cfg.uvm_cache_load_factor}: the UVM cache is FBGEMM's "
                          f"(kernel=fbgemm); kernel={cfg.kernel} keeps its tables in device memory")
    if cfg.kernel == "triton" and cfg.device == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        raise ConfigError("kernel=triton needs device=cuda (or TRITON_INTERPRET=1 for tests)")
    from cubic_harness.planning import plan_for

    plan_for(cfg)


def env_info(cfg: TrialConfig) -> dict[str, Any]:
    try:
        import fbgemm_gpu

        fb = fbgemm_gpu.__version__
    except Exception:
        fb = None
    dev = torch.cuda.get_device_name(0) if cfg.device == "cuda" and torch.cuda.is_available() else platform.processor()
    return {"backend": "real", "torch": torch.__version__, "fbgemm": fb, "device": cfg.device,
            "device_name": dev or "cpu",
            "world_size": cfg.world_size, "hostname": platform.node(), "cpus": os.cpu_count(),
            "omp_wait_policy": rank_env(cfg).get("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "default")),
            # the ranks inherit this process's priority: at a raised niceness any other process on the machine
            # takes their CPU first, and a busy machine measured them 25x slower (why: cubic/execution/runner.py)
            "niceness": os.getpriority(os.PRIO_PROCESS, 0),
            "ids": cfg.workload.ids_record(),
            "env_overrides": env_overrides(),
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def rank_env(cfg: TrialConfig) -> dict[str, str]:
    """Environment overrides for the rank processes.

    When ranks x threads exceed this process's cores, each rank's OpenMP workers spin-wait
    (libgomp's default, milliseconds on this CPU) on cores another rank needs: 2 ranks x 2
    threads on 2 cores ran at 10.6k samples/s with fbgemm and 40k with OMP_WAIT_POLICY=PASSIVE
    (world 2 x 1 thread: 43k). So oversubscribed trials wait passively; a user's own setting wins."""
    if cfg.device == "cpu" and oversubscribed(cfg.world_size, cfg.threads_per_rank, host_cores()) and (
            "OMP_WAIT_POLICY" not in os.environ):
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {}


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """os.environ plus `extra` while spawning (spawned children copy the parent's environment)."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# What a rank imports before its first step: ~3 s of CPU each in a fresh interpreter (torch 1.2 s; DDP's and the
# optimizer's first call import dynamo, 1.5 s; the native kernels' numba 0.6 s), most of a small trial's time on
# 2 cores; forked from a server that imported them, a tiny 2-rank trial starts in 0.15 s instead of 2.5-3.
RANK_PRELOAD = ("cubic_harness.trial", "cubic_harness.train", "cubic_harness.planning", "torch._dynamo",
                "torch.distributed.fsdp", "cubic_kernels.native_backend")
# A TorchRec rank's: TorchRec and FBGEMM take ~5 s of CPU more to import (harness/torchrec_trial.py).
TORCHREC_PRELOAD = (*RANK_PRELOAD, "cubic_harness.torchrec_trial", "cubic_harness.torchrec_kernel",
                    "torchrec.distributed.model_parallel", "torchrec.distributed.train_pipeline",
                    "torchrec.distributed.planner", "torchrec.models.dlrm")
# Variables the preloaded libraries read when they load (libgomp, MKL, glibc's malloc, the dynamic linker, numba,
# torch, the collectives): a forked rank keeps its server's values of these; every other variable it reads from
# the trial's environment, which `_rank_entry` installs.
LOAD_TIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "MALLOC_", "LD_", "NUMBA_", "TORCH", "PYTORCH_",
                 "CUDA_", "NCCL_", "GLOO_")


# ... but not these, which a library writes into os.environ itself, after it loaded, with its own
# default: torch's inductor stores its cache folder (/tmp/torchinductor_USER) the first time anything
# asks for it, as TorchRec's planner does when `sharding: torchrec_planner` plans in this process. A
# spawned rank computes the same default, and it is read when compiling, not at load.
SELF_SET_ENV = frozenset({"TORCHINDUCTOR_CACHE_DIR"})


def _native_view(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_ENV) and k not in SELF_SET_ENV}


def trial_env(cfg: TrialConfig) -> dict[str, str]:
    """The environment a trial's ranks run with: this process's, and `rank_env`'s overrides."""
    return {**os.environ, **rank_env(cfg)}


# Fork servers a process keeps, one per framework and load-time environment: a tune on 2 cores runs
# the harness plain and oversubscribed (PASSIVE), and may plan or train with TorchRec. Each holds its
# framework's imports for the process's life (the harness's: 0.62 GB RSS, `ps` during a `make tune`),
# so a process that meets more environments spawns the rest.
MAX_SERVERS = 4
_ServerKey = tuple[tuple[str, ...], tuple[tuple[str, str], ...]]
_servers: dict[_ServerKey, Any] = {}
_start_lock = threading.Lock()
_spawn_only = threading.local()
_server: tuple[tuple[str, ...], dict[str, str]] | None = None  # (the fence's fallback: multiprocessing's own)

try:  # Fence: multiprocessing keeps one fork server per process (forkserver._forkserver); a second
    # one is its class, started here, and a rank asks it through the module's `connect_to_new_process`,
    # which `_ServerProcess.start` points at it. Missing in a later Python: one server, the rest spawn.
    from multiprocessing.context import ForkServerContext, ForkServerProcess
    from multiprocessing.forkserver import ForkServer

    _SERVERS_OK = callable(getattr(forkserver, "connect_to_new_process", None))
except ImportError:  # pragma: no cover - a Python without them
    ForkServerContext = ForkServerProcess = ForkServer = None  # type: ignore[assignment,misc]
    _SERVERS_OK = False


if _SERVERS_OK:
    class _ServerProcess(ForkServerProcess):  # type: ignore[misc,valid-type]
        """A rank forked by the server `_cubic_server` names (module level: the child unpickles it)."""

        _cubic_server: _ServerKey

        def start(self) -> None:
            server = _servers[self._cubic_server]
            with _start_lock:
                default = forkserver.connect_to_new_process
                forkserver.connect_to_new_process = server.connect_to_new_process
                try:
                    super().start()
                finally:
                    forkserver.connect_to_new_process = default

    class _ServerContext(ForkServerContext):  # type: ignore[misc,valid-type]
        """The forkserver start method, through one of this process's servers."""

        def __init__(self, key: _ServerKey) -> None:
            self.key = key

        def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (multiprocessing's name)
            p = _ServerProcess(*args, **kwargs)
            p._cubic_server = self.key
            return p


@functools.cache
def _own_scratch() -> Scratch:
    """A worker's folder where the runner's is on another node: one for the process's life."""
    return Scratch()


def _sockets_in_scratch() -> None:
    """Make this process's multiprocessing folder, where its fork servers' sockets go, under
    SCRATCH_ENV's folder before a server starts: multiprocessing removes its folder when the
    process exits normally, but a Ray worker ends without running exit handlers. Where the variable
    names no folder here (a worker on another node than the runner's), under a `Scratch` of this
    process's own, which the next tune's first worker on this node removes once this one is gone. A
    no-op where the variable is unset or the folder is already made."""
    folder = os.environ.get(SCRATCH_ENV, "")
    get_temp_dir = getattr(util, "get_temp_dir", None)  # Fence: undocumented; its folder is cached
    if not folder or get_temp_dir is None:
        return
    if not os.path.isdir(folder):
        folder = _own_scratch().path
    default, tempfile.tempdir = tempfile.tempdir, folder  # (the documented default for mkdtemp)
    try:
        get_temp_dir()
    finally:
        tempfile.tempdir = default


def _server_for(preload: tuple[str, ...], native: dict[str, str]) -> Any:
    """The context of the server that preloaded `preload` and holds `native` as its load-time
    environment, started now if this process has room for another (None: it has not)."""
    key = (preload, tuple(sorted(native.items())))
    with _start_lock:  # (trials in threads of one process: one server per key)
        if key not in _servers:
            mine = _native_view(dict(os.environ))
            if len(_servers) >= MAX_SERVERS or any(k not in native for k in mine):
                return None  # (a load-time variable this process has and the rank must not: spawned)
            _sockets_in_scratch()
            server = ForkServer()
            server.set_forkserver_preload(list(preload))
            # the server copies this environment, and its libraries read it; os.environ holds the
            # variables only while it starts, as `run_ranks` does while spawning
            with _environ({k: v for k, v in native.items() if mine.get(k) != v}):
                server.ensure_running()
            _servers[key] = server
    return _ServerContext(key)


@contextlib.contextmanager
def spawned_ranks() -> Iterator[None]:
    """Start this thread's ranks afresh, as where no server serves them (`cubic calibrate` measures
    such a rank's memory)."""
    _spawn_only.on = True
    try:
        yield
    finally:
        _spawn_only.on = False


def rank_context(env: dict[str, str], preload: tuple[str, ...] = RANK_PRELOAD) -> Any:
    """How to start a rank whose environment is `env` and whose framework imports `preload` (RANK_PRELOAD for
    the harness's, TORCHREC_PRELOAD for TorchRec's): forked from a fork server of this process, else spawned.

    1. A rank is forked from a server that imported exactly its framework's modules: a forked rank's
       peak RSS counts the server's pages (~170 MB less than a spawned one's for the harness), so every rank
       holds the figure the calibration measured for its framework (`process_mb`).
    2. ... and whose LOAD_TIME_ENV equals the rank's (libgomp's OMP_WAIT_POLICY for an oversubscribed trial:
       `rank_env`): those variables are read when the libraries load, so a forked rank could not take them.
    3. The first rank of a framework and environment starts its server (`MAX_SERVERS` at most), with this
       process's environment and those variables, so a 2-core tune's oversubscribed trials (about half of
       them) fork too: 0.7 s to the first step instead of 3.4 s spawned.
    Any other rank is spawned afresh (`spawned_ranks`); a result's `env.rank_start` says which ran."""
    native = _native_view(env)
    if getattr(_spawn_only, "on", False):
        return mp.get_context("spawn")
    if not _SERVERS_OK:  # the one server multiprocessing keeps, for the first environment asked
        global _server
        if _server is None:
            _sockets_in_scratch()
            mp.get_context("forkserver").set_forkserver_preload(list(preload))
            forkserver.ensure_running()
            _server = (preload, _native_view(dict(os.environ)))
        return mp.get_context("forkserver" if _server == (preload, native) else "spawn")
    return _server_for(preload, native) or mp.get_context("spawn")


def run_ranks(cfg: TrialConfig, collect_tables: bool = False) -> tuple[str, str, dict[int, dict]]:
    """Start the rank processes and wait: (status, one-line error, {rank: output})."""
    env = trial_env(cfg)
    ctx = rank_context(env)
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=cfg.timeout_s),
                          wait_for_workers=False)
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(cfg.to_dict(), r, store.port, q, collect_tables, env),
                         daemon=True) for r in range(cfg.world_size)]
    outs: dict[int, dict] = {}
    reported: dict[int, tuple[str, str]] = {}  # rank -> (status, message): failures in the ranks' own words
    status, error = "ok", ""
    deadline = time.monotonic() + cfg.timeout_s
    settle: float | None = None  # once a rank failed: until when to hear how the others ended
    try:
        with _environ(rank_env(cfg)):
            for p in procs:
                p.start()
        while len(outs) < cfg.world_size:
            if settle is None and (reported or any(p.exitcode not in (None, 0) for p in procs)):
                settle = time.monotonic() + SETTLE_S
            if settle is not None and (time.monotonic() > settle
                                       or all(p.exitcode is not None or r in outs for r, p in enumerate(procs))):
                break
            try:
                rank, st, msg, out = q.get(timeout=0.2)
            except queue.Empty:
                if settle is None and time.monotonic() > deadline:
                    status, error = "timeout", (f"trial exceeded timeout_s={cfg.timeout_s:g} ({len(outs)} of "
                                                f"{cfg.world_size} ranks finished)")
                    break
                continue
            if st == "ok":
                outs[rank] = out
            else:
                reported[rank] = (st, msg)
        if settle is not None:
            with contextlib.suppress(queue.Empty):  # reports of ranks that exited right after sending
                while True:
                    rank, st, msg, out = q.get(timeout=0.1)
                    if st != "ok":
                        reported[rank] = (st, msg)
            status, error = _root_cause(procs, reported, outs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:  # one that never started cannot be joined (and would hide why)
                p.join(timeout=5)
        q.close()
        del store
    return status, error, outs


SETTLE_S = 1.5  # after a rank fails, how long to hear the others: the first report is often a peer's

# What a rank says when another rank died under it: the symptom, never the cause.
_PEER_ERRORS = ("connection reset", "connection closed", "broken pipe", "connection refused", "read error",
                "write error", "socket", "timed out", "timeout")


def _root_cause(procs: list, reported: dict[int, tuple[str, str]], outs: dict[int, dict]) -> tuple[str, str]:
    """(status, one line) of a failed trial. A rank killed without a word (the OOM killer's SIGKILL, a
    segfault) comes first: its peers then fail with socket errors within milliseconds, and those
    often arrive first. Then a rank's own out-of-memory or exception, then the peers' symptoms."""
    silent = [(r, p.exitcode) for r, p in enumerate(procs)
              if p.exitcode not in (None, 0) and r not in reported and r not in outs]
    killed = [(r, code) for r, code in silent if code < 0]
    if killed:
        r, code = killed[0]
        why = f"killed by signal {-code}" + (" (likely the OOM killer)" if code == -signal.SIGKILL else "")
        return ("oom" if code == -signal.SIGKILL else "error"), f"rank {r} {why} without a report"
    if reported:
        return first_cause(reported)
    r, code = silent[0]
    return "error", f"rank {r} exited with code {code} without a report"


def first_cause(reported: dict[int, tuple[str, str]]) -> tuple[str, str]:
    """The report that names the cause among ranks' own failure reports: an out-of-memory first, then a
    rank's own exception before a peer's socket symptom, then the lowest rank."""
    def rank_of(kv: tuple[int, tuple[str, str]]) -> tuple[bool, bool, int]:
        (r, (st, msg)) = kv
        return st != "oom", any(e in msg.lower() for e in _PEER_ERRORS), r
    return min(reported.items(), key=rank_of)[1]


def run_trial(cfg: TrialConfig) -> TrialResult:
    """Run one configuration; never raises for a failing trial (status says what happened)."""
    env = env_info(cfg)
    try:
        check_config(cfg)
    except ConfigError as e:
        from cubic_harness.sharding.planner import PlanError

        return TrialResult.failed("oom" if isinstance(e, PlanError) and "mem_cap" in str(e) else "error", str(e),
                                  cfg, env=env)
    t0, started_at = time.perf_counter(), time.time()
    env.update(placement="local", nodes=1, rank_nodes=[platform.node()] * cfg.world_size,
               rank_start=rank_context(trial_env(cfg)).get_start_method())
    try:
        status, error, outs = run_ranks(cfg)
    except Exception as e:  # could not even start the processes
        return TrialResult.failed("error", f"{type(e).__name__}: {e}", cfg, env=env)
    env["wall_s"] = round(time.perf_counter() - t0, 2)
    if status == "ok":
        env["omp_wait_policy"] = outs[0]["omp_wait_policy"]
        env["startup_s"] = round(outs[0]["first_step_at"] - started_at, 2)
        env["rank_start_mb"] = round(outs[0]["start_mem_mb"], 1)
    if status != "ok":
        return TrialResult.failed(status, error, cfg, env=env)
    return summarize(cfg, outs[0], env)


def summarize(cfg: TrialConfig, r0: dict, env: dict) -> TrialResult:
    """Rank 0's measurements -> TrialResult (qps = median over windows; warm-up excluded)."""
    import json

    bad = next((i for i, x in enumerate(r0["losses"]) if not math.isfinite(x)), None)
    if bad is not None or not math.isfinite(r0["ne"]):
        where = f"at step {bad}" if bad is not None else "on another rank"
        return TrialResult.failed("error", f"diverged: the loss became non-finite {where} (NaN/inf); its "
                                  f"speed is not worth having", cfg, env=env)
    step_s = r0["step_s"]
    n = len(step_s)
    bounds = [round(i * n / cfg.windows) for i in range(cfg.windows + 1)]
    samples = cfg.global_batch
    window_qps = [samples * (hi - lo) / sum(step_s[lo:hi])
                  for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]
    med = statistics.median(window_qps)
    # one window has no spread to measure: NaN (stored as null), not a reassuring 0
    cv = statistics.pstdev(window_qps) / statistics.mean(window_qps) if len(window_qps) > 1 else math.nan
    ms = sorted(s * 1e3 for s in step_s)
    res = TrialResult(
        status="ok", qps=med, qps_cv=cv, step_ms_p50=statistics.median(ms),
        step_ms_p90=ms[min(n - 1, int(round(0.9 * (n - 1))))], peak_mem_mb=r0["peak_mem_mb"],
        loss_first=r0["losses"][0], loss_last=r0["losses"][-1], ne=r0["ne"], breakdown_ms=r0["breakdown_ms"],
        config=cfg.to_dict(), env=env, window_qps=window_qps, losses=r0["losses"],
        plan=json.loads(r0["plan_json"])["tables"],
    )
    for key in ("fp8_probe", "replica_sync"):
        if key in r0:
            res.extra[key] = r0[key]
    if cfg.comm_overlap != "none":  # beside `comm` (the exposed waits): what ran beside compute, per step
        res.extra["comm_hidden_ms"] = r0["comm_hidden_ms"]
    if r0.get("eval"):  # held-out quality (cfg.eval_samples): flat, so every view reads it as a column
        res.extra.update({f"eval_{k}": v for k, v in r0["eval"].items()})
    return res
