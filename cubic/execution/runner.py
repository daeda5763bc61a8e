"""Runs trials as Ray tasks: locally (a Ray of its own on this machine) or on a cluster (`--address`).

Each trial is one task. What it asks Ray for depends on the space's `budget.isolation`:
- "node" (default): a CPU trial asks for a whole node's CPUs (the largest node's), so no other trial
  runs beside it: trials side by side share memory bandwidth and caches and would time each other,
  and a proxy fitted on such timings learns the neighbours. A cuda trial asks for one GPU per rank and
  those GPUs' share of the node's CPUs (2 of 8 GPUs -> a quarter of the CPUs).
- "cores": the CPUs its ranks use (world_size x threads_per_rank): more trials at once, noisier.
Either way CPUs are capped at the largest node's (a 4-rank trial still runs on a 2-core machine), and
a cuda trial gets one GPU per rank (capped likewise: several ranks then share a GPU), so that Ray pins
it to its own GPUs (CUDA_VISIBLE_DEVICES) and never runs two trials at once on one GPU.
The task calls `cubic_harness.trial.run_trial` in a Ray worker, which starts the rank processes. On a
cluster of several nodes, a trial with world_size > ranks_per_node spans world_size / ranks_per_node
nodes instead: its task only coordinates, and a placement group holds one Ray actor per rank
(cubic/execution/multinode.py). Whatever
happens to the task - a crash of the worker, an exception, a hang past the trial's own timeout
(counted from when the task started, not from when it was queued) - comes back as a TrialResult with
a failed status and a one-line reason; the tuner never dies of a trial.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from cubic_harness.config import SCRATCH_ENV, TrialConfig, TrialResult, env_overrides
from cubic_harness.errors import ConfigError
from cubic_harness.scratch import Scratch

OBJECT_STORE_MB = 200  # results are a few KB; without a cap Ray reserves 30% of RAM
HARD_TIMEOUT_SLACK_S = 60.0  # run_trial enforces timeout_s itself; this only catches a stuck worker
STARTED = "started"  # the task's first item: it left Ray's queue and runs (the hard timeout counts from here)
# Ray starts its workers at niceness 15, so that they yield the CPU to Ray's own processes; a trial's ranks
# inherit it and then yield to every other process on the machine too. Beside two busy processes on 2 cores a
# trial of the tiny space took 100 s to start and ran at 500 samples/s instead of 6 s and 6,200 at niceness 0
# (run directly: 5 s, 7,700): measured throughput became a measure of the neighbours. Trials and rank actors
# therefore run at the driver's niceness (0), which Ray reads from this variable when it starts a worker;
# `TrialResult.env["niceness"]` records what each trial ran at.
WORKER_NICENESS = {"RAY_worker_niceness": "0"}


def worker_env(scratch: str = "") -> dict[str, Any]:
    """The runtime_env of a trial's Ray workers: the driver's niceness, and each of
    `MEASUREMENT_ENV` the driver has set, which a worker on another node (or a Ray started before
    it was set) would not inherit; with `scratch`, the folder for the workers' fork servers'
    sockets (`SCRATCH_ENV`)."""
    folder = {SCRATCH_ENV: scratch} if scratch else {}
    return {"env_vars": {**WORKER_NICENESS, **env_overrides(), **folder}}


def _run(cfg_dict: dict[str, Any], span: dict[str, Any] | None = None, backend: str = "real",
         cwd: str | None = None) -> Iterator[Any]:
    """The Ray task body (module level, so workers import it by name): a streaming generator that
    yields STARTED, then the result dict. The marker is how the tuner tells a trial waiting for
    resources (a cluster shared with other jobs) from one that hangs. With `span`, the trial's ranks
    run on several nodes (cubic/execution/multinode.py) and this task only coordinates them. `backend`
    says what trains: cubic's harness ("real") or TorchRec ("torchrec", harness/torchrec_trial.py, which
    imports the workload's MODULE:FACTORY from the driver's folder `cwd`, as `cubic workload from-torchrec`
    did)."""
    yield STARTED
    cfg = TrialConfig.from_dict(cfg_dict)
    if backend == "torchrec":
        from cubic_harness.torchrec_trial import run_torchrec

        yield run_torchrec(cfg, cwd).to_dict()
        return
    if span is not None:
        from cubic.execution.multinode import run_on_nodes

        yield run_on_nodes(cfg, span.get("node_cpus")).to_dict()
        return
    from cubic_harness.trial import run_trial

    yield run_trial(cfg).to_dict()


@dataclass
class Pending:
    cfg: TrialConfig
    ref: Any  # the task's ObjectRefGenerator
    cpus: float
    gpus: float = 0.0
    tag: Any = None  # the caller's handle (trial, confirm slot)
    started: float = field(default_factory=time.monotonic)  # submitted
    running: float | None = None  # the STARTED marker arrived
    spans: bool = False  # its ranks span nodes: it may first wait for its placement (cubic/execution/multinode.py)
    reused: bool = False  # answered from the quality store, not run (cubic/quality/store.py; ref is None)


def _check_reachable(address: str) -> None:
    """Fail fast on an address nobody listens at (ray.init would retry for a long time)."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--address {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=3.0):
            pass
    except OSError as e:
        raise ConfigError(f"--address {address}: Ray cluster unreachable ({e.strerror or e})") from None


class Runner(Protocol):
    """What the tuner asks of a runner, whichever runs the trials (`RayRunner`, the simulator's `SimRunner`,
    the quality store's `ReusingRunner` around either): `submit` a config, `wait` for finished ones; the rest
    does not care which ran."""

    simulated: bool  # results are the simulator's predictions (`cubic.tune.policy`)
    backend: str  # what trains a trial: "real" (cubic's harness), "torchrec", or "sim"

    @property
    def cpus(self) -> float:  # the cluster's CPUs (the ETA's parallelism)
        ...

    def has_room(self, pending: list[Pending]) -> bool:  # capacity for one more trial beside `pending`
        ...

    def submit(self, cfg: TrialConfig, tag: Any = None) -> Pending:  # start it; `tag` comes back with it
        ...

    def wait(self, pending: list[Pending], timeout: float = 1.0) -> list[tuple[Pending, TrialResult]]:
        """Those of `pending` that finished within `timeout` seconds, each with its result."""
        ...


class RayRunner:
    """Submit TrialConfigs, wait for any to finish. Ray starts on first use (a finished study that is
    run again never starts it); `check()` validates the address up front, `stop()` shuts down the Ray it
    started (from a cluster given by `--address` it only disconnects; the cluster keeps running)."""

    simulated = False  # cubic/execution/sim_runner.py's SimRunner says True

    def __init__(self, address: str | None = None, isolation: str = "node", backend: str = "real") -> None:
        self.address = address
        self.isolation = isolation  # "node" | "cores", see the module docstring
        self.backend = backend  # what a trial trains in: "real" (cubic's harness) or "torchrec"
        self._cpus = self._gpus = self._node_cpus = self._node_gpus = 0.0
        self._nodes = 0
        self._remote: Any = None
        self._owns = False
        self._scratch: Scratch | None = None  # the workers' sockets' folder while its Ray runs

    def check(self) -> RayRunner:
        if self.address:
            _check_reachable(self.address)
        return self

    def _started(self) -> RayRunner:
        return self.start() if self._remote is None else self

    @property
    def cpus(self) -> float:
        """CPUs of the Ray cluster (starts Ray)."""
        return self._started()._cpus

    @property
    def gpus(self) -> float:
        """GPUs of the Ray cluster (starts Ray)."""
        return self._started()._gpus

    def start(self) -> RayRunner:
        import ray

        self.check()
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR",
                                  "configure_logging": True}
        if not self.address:
            kwargs.update(num_cpus=os.cpu_count() or 1, object_store_memory=OBJECT_STORE_MB * 2**20)
        try:
            if not ray.is_initialized():
                # without --address, a Ray of its own ("local"): a bare ray.init() would join whatever cluster
                # `ray start` last ran on this machine (/tmp/ray/ray_current_cluster) or RAY_ADDRESS names, and
                # then refuse the CPU count it was given
                ray.init(address=self.address or "local", **kwargs)
                self._owns = True
                # this job's workers end with it, so the folder can go when `stop` ends the job
                self._scratch = Scratch()
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
            where = self.address or "local"
            hint = ""
            if self.address and os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
                # Ray 2.60 turns token auth on for `ray start` where ~/.ray/auth_token exists (any local
                # ray.init writes it), but a driver given an address sends the token only when told to
                hint = ("; if the cluster uses token authentication (`ray start` turns it on where "
                        "~/.ray/auth_token exists), set RAY_AUTH_MODE=token")
            raise ConfigError(f"--address {where}: cannot start/connect to Ray: "
                              f"{' '.join(str(e).split())[:200]}{hint}") from None
        res = ray.cluster_resources()
        self._cpus, self._gpus = float(res.get("CPU", 1.0)), float(res.get("GPU", 0.0))
        # one trial is one task on one node: cap what it asks for at the largest node, not the cluster
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")] or [res]
        self._node_cpus = max(float(n.get("CPU", 0.0)) for n in nodes) or 1.0
        self._nodes = len(nodes)
        self._node_gpus = max(float(n.get("GPU", 0.0)) for n in nodes)
        self._remote = ray.remote(max_retries=0)(_run)
        return self

    def stop(self) -> None:
        if self._remote is None:
            return
        import ray

        if self._owns and ray.is_initialized():
            ray.shutdown()
        self._owns = False
        if self._scratch is not None:
            self._scratch.remove()
            self._scratch = None

    def _worker_env(self) -> dict[str, Any]:
        return worker_env(self._scratch.path if self._scratch is not None else "")

    def cpus_for(self, cfg: TrialConfig) -> float:
        node = self._started()._node_cpus
        own = min(cfg.world_size * cfg.threads_per_rank, node)
        if self.isolation == "cores":
            return float(own)
        if cfg.device == "cuda" and self._node_gpus:
            return float(max(own, node * self.gpus_for(cfg) / self._node_gpus))
        return float(node)

    def gpus_for(self, cfg: TrialConfig) -> float:
        """One GPU per rank, at most the largest node's; none on a cluster without GPUs (the trial then
        fails at once with the harness's own "no CUDA device" error instead of waiting forever)."""
        return float(min(cfg.world_size, self._started()._node_gpus)) if cfg.device == "cuda" else 0.0

    def has_room(self, pending: list[Pending]) -> bool:
        """Whether one more trial fits beside `pending` (CPUs, and GPUs once trials hold some). Starts
        Ray: a Ray that cannot start must fail the tune before a trial is created in the store."""
        if not pending:
            return self.cpus > 0
        return (sum(p.cpus for p in pending) < self.cpus
                and (not any(p.gpus for p in pending) or sum(p.gpus for p in pending) < self.gpus))

    def spans(self, cfg: TrialConfig) -> bool:
        """Whether `cfg`'s ranks go to world_size / ranks_per_node nodes (cubic/execution/multinode.py). On a one-node
        cluster a trial keeps today's fast path: its ranks_per_node topology is then the harness's own
        (groups of ranks on the one machine), and env.placement says "local". A TorchRec trial's ranks run on
        its task's node."""
        return self.backend == "real" and self._started()._nodes > 1 and cfg.world_size > cfg.ranks_per_node

    def submit(self, cfg: TrialConfig, tag: Any = None) -> Pending:
        if self.spans(cfg):  # starts Ray if needed
            from cubic.execution.multinode import bundles_for

            node_cpus = self._node_cpus if self.isolation == "node" and cfg.device == "cpu" else None
            bundles = bundles_for(cfg, node_cpus)
            # the coordinating task holds nothing: the ranks' placement group holds the resources
            ref = self._remote.options(num_cpus=0, num_gpus=0,
                                       runtime_env=self._worker_env()).remote(
                cfg.to_dict(), {"node_cpus": node_cpus})
            return Pending(cfg, ref, sum(b["CPU"] for b in bundles), sum(b.get("GPU", 0.0) for b in bundles), tag,
                           spans=True)
        cpus, gpus = self.cpus_for(cfg), self.gpus_for(cfg)
        extra = () if self.backend == "real" else (None, self.backend, os.getcwd())  # TorchRec: the driver's folder
        task = self._remote.options(num_cpus=cpus, num_gpus=gpus,
                                    runtime_env=self._worker_env())
        ref = task.remote(cfg.to_dict(), *extra)
        return Pending(cfg, ref, cpus, gpus, tag)

    def wait(self, pending: list[Pending], timeout: float = 1.0) -> list[tuple[Pending, TrialResult]]:
        """The pending trials that finished (or were given up on) within `timeout` seconds. A trial
        still queued for resources is never given up on; a running one after its own timeout_s
        plus slack (run_trial enforces timeout_s itself: this catches a stuck worker)."""
        import ray

        if not pending:
            return []
        ready, _ = ray.wait([p.ref for p in pending], num_returns=len(pending), timeout=timeout)
        ready_set = set(ready)
        done = []
        for p in pending:
            if p.ref in ready_set:
                res = self._next(p)
                if res is None and p.running is not None:  # STARTED; is the result already in too?
                    if ray.wait([p.ref], timeout=0)[0]:
                        res = self._next(p)
                if res is not None:
                    done.append((p, res))
                    continue
            limit = p.cfg.timeout_s + HARD_TIMEOUT_SLACK_S
            if p.spans:
                from cubic.execution.multinode import PLACEMENT_WAIT_S

                limit += PLACEMENT_WAIT_S
            if p.running is not None and time.monotonic() - p.running > limit:
                ray.cancel(p.ref, force=True)
                done.append((p, TrialResult.failed(
                    "timeout", f"no result {limit:g}s after the trial started; the Ray task was cancelled", p.cfg)))
        return done

    def _next(self, p: Pending) -> TrialResult | None:
        """Consume the task's next item: None for STARTED (recorded), else its result."""
        try:
            ref = next(p.ref)
        except StopIteration:
            return TrialResult.failed("error", "the Ray task ended without a result", p.cfg)
        res = self._result(ref, p.cfg)
        if res is None:
            p.running = time.monotonic()
        return res

    def _result(self, ref: Any, cfg: TrialConfig) -> TrialResult | None:
        """The item behind `ref`: None for STARTED, else a TrialResult (a failed one for whatever
        happened to the task)."""
        import ray
        from ray import exceptions as rex

        try:
            value = ray.get(ref)
            return None if value == STARTED else TrialResult.from_dict(value)
        except rex.RayTaskError as e:  # run_trial raised (ConfigError or a bug): the config failed
            cause = e.cause if getattr(e, "cause", None) is not None else e
            return TrialResult.failed("error", f"{type(cause).__name__}: {cause}", cfg)
        except (rex.WorkerCrashedError, rex.NodeDiedError, rex.LocalRayletDiedError) as e:
            return TrialResult.failed("error", f"Ray worker died: {type(e).__name__}: {e}", cfg)
        except rex.OutOfMemoryError as e:
            return TrialResult.failed("oom", f"Ray killed the trial for memory: {e}", cfg)
        except rex.TaskCancelledError:
            return TrialResult.failed("timeout", "the Ray task was cancelled", cfg)
        except rex.RayError as e:
            return TrialResult.failed("error", f"{type(e).__name__}: {e}", cfg)
