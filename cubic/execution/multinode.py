"""One trial whose ranks span Ray nodes: placed by a Ray placement group, run by one Ray actor per rank.

Why a placement group with one bundle per *node* (STRICT_SPREAD) rather than one bundle per rank: the
harness's topology (`ranks_per_node`: table-row-wise hosts, 2D group placement, intra- vs cross-node
all-to-alls) must be the real one, so exactly `ranks_per_node` ranks share each node. Bundles per rank
under PACK may fill one node with more ranks than that, under SPREAD may scatter a node's ranks; a bundle
per node holding that node's ranks' CPUs (or all of the node's under `isolation: node`) and GPUs, spread
strictly over distinct nodes, is the placement the config describes. Ray Train's TorchTrainer was the
alternative: it owns a worker group with the same placement group underneath, but it runs a training
loop of its own (checkpoints, reports, its own process-group setup and restarts), while a trial is the
harness's rank entry (`cubic_harness.trial.train_one_rank`), run unchanged as on one node; so cubic drives the
placement group and actors itself, the way Ray Train's worker group does.

Rank 0's actor hosts the rendezvous (a TCPStore on its node's IP and an OS-chosen port: no fixed ports);
the others join it. This runs inside the trial's Ray task (`cubic.execution.runner._run`), which waits on every
rank: a rank that raises reports its reason; an actor that dies (its node removed, its process killed)
ends the trial at once as failed, naming the rank and its node; a placement the cluster can never give
fails before anything starts; every actor is killed and the placement group removed on every path.
"""

from __future__ import annotations

import contextlib
import os
import platform
import select
import time
from typing import Any

from cubic.execution.runner import worker_env
from cubic_harness.config import TrialConfig, TrialResult

PLACEMENT_WAIT_S = 60.0  # a feasible placement the cluster is busy with: how long to queue for it
SETTLE_S = 1.5  # after a rank failed, how long to hear the others (the first report is often a peer's)
REAP_S = 30.0  # after ray.kill: how long to wait for the rank processes to be gone before giving up on them


class RankActor:
    """One rank of a trial in its own Ray worker process (wrapped by ray.remote in `run_on_nodes`)."""

    def __init__(self) -> None:
        self.store: Any = None

    def where(self) -> dict[str, str]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "host": platform.node(),
                "pid": str(os.getpid())}

    def host_rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: open the trial's TCPStore on this node (any interface, a free port)."""
        import datetime

        import ray
        import torch.distributed as dist

        self.store = dist.TCPStore("0.0.0.0", 0, None, True, datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        return ray.util.get_node_ip_address(), int(self.store.port)

    def train(self, cfg_dict: dict, rank: int, host: str, port: int) -> tuple[str, str, dict | None]:
        """(status, one line, output): as a spawned rank reports it on one node."""
        from cubic_harness.trial import rank_failure, train_one_rank

        cfg = TrialConfig.from_dict(cfg_dict)
        try:
            device = None
            if cfg.device == "cuda":  # Ray gave this actor one GPU (CUDA_VISIBLE_DEVICES): it is cuda:0 here
                import torch

                device = torch.device("cuda", 0)
            return "ok", "", train_one_rank(cfg, rank, host, port, store=self.store if rank == 0 else None,
                                            device=device)
        except BaseException as e:
            return (*rank_failure(rank, e), None)


def bundles_for(cfg: TrialConfig, node_cpus: float | None) -> list[dict[str, float]]:
    """One bundle per node: its ranks' CPUs (or the whole node's, `node_cpus`, for isolation) and GPUs."""
    rpn = cfg.ranks_per_node
    nodes = -(-cfg.world_size // rpn)
    b: dict[str, float] = {"CPU": float(node_cpus or rpn * cfg.threads_per_rank)}
    if cfg.device == "cuda":
        b["GPU"] = float(rpn)
    return [dict(b) for _ in range(nodes)]


def infeasible(bundles: list[dict[str, float]]) -> str | None:
    """Why the live cluster can never hold these bundles on distinct nodes (None if it can)."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fit = [n for n in nodes if all(n.get(k, 0.0) >= v for k, v in bundles[0].items())]
    if len(fit) >= len(bundles):
        return None
    need = ", ".join(f"{v:g} {k}" for k, v in bundles[0].items())
    return (f"placement infeasible: {len(bundles)} nodes with {need} each are needed (ranks_per_node ranks per "
            f"node), the cluster has {len(fit)} such of {len(nodes)} alive")


def run_on_nodes(cfg: TrialConfig, node_cpus: float | None = None) -> TrialResult:
    """Run `cfg` with `ranks_per_node` ranks on each of world_size / ranks_per_node Ray nodes."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cubic_harness.errors import ConfigError
    from cubic_harness.trial import check_config, env_info, rank_env, summarize

    env = env_info(cfg)
    env["placement"] = "nodes"
    try:
        check_config(cfg)
    except ConfigError as e:
        return TrialResult.failed("error", str(e), cfg, env=env)
    bundles = bundles_for(cfg, node_cpus)
    why = infeasible(bundles)
    if why:
        return TrialResult.failed("error", why, cfg, env=env)
    t0, started_at = time.perf_counter(), time.time()
    pg = placement_group(bundles, strategy="STRICT_SPREAD")
    actors: list[Any] = []
    where: list[dict] = []
    try:
        if not ray.wait([pg.ready()], timeout=PLACEMENT_WAIT_S)[0]:
            return TrialResult.failed("timeout", f"placement of {len(bundles)} node bundles not granted within "
                                      f"{PLACEMENT_WAIT_S:g} s (the cluster is busy)", cfg, env=env)
        remote = ray.remote(RankActor)
        per_rank = {"num_cpus": float(cfg.threads_per_rank) if node_cpus is None else
                    node_cpus / cfg.ranks_per_node, "num_gpus": 1.0 if cfg.device == "cuda" else 0.0}
        for r in range(cfg.world_size):  # CUBIC_TRIAL_RANK lets a person (and a test) find a rank's process
            actors.append(remote.options(
                max_restarts=0, runtime_env={"env_vars": {**worker_env()["env_vars"], **rank_env(cfg),
                                                         "CUBIC_TRIAL_RANK": f"{cfg.seed}:{r}"}},
                **per_rank, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=r // cfg.ranks_per_node)).remote())
        deadline = time.monotonic() + cfg.timeout_s
        where_refs = [a.where.remote() for a in actors]
        ready, _ = ray.wait(where_refs, num_returns=len(where_refs), timeout=max(0.0, deadline - time.monotonic()))
        if len(ready) < len(where_refs):
            return TrialResult.failed("timeout", f"{len(where_refs) - len(ready)} rank actors did not start within "
                                      f"{cfg.timeout_s:g} s", cfg, env=env)
        where.extend(ray.get(where_refs))
        env.update(nodes=len({w["node_id"] for w in where}), rank_nodes=[w["ip"] for w in where],
                   rank_node_ids=[w["node_id"] for w in where])
        host, port = ray.get(actors[0].host_rendezvous.remote(cfg.timeout_s))
        refs = {a.train.remote(cfg.to_dict(), r, host, port): r for r, a in enumerate(actors)}
        status, error, outs = _wait_ranks(refs, where, deadline)
        env["wall_s"] = round(time.perf_counter() - t0, 2)
        if status != "ok":
            return TrialResult.failed(status, error, cfg, env=env)
        env["startup_s"] = round(outs[0]["first_step_at"] - started_at, 2)
        return summarize(cfg, outs[0], env)
    finally:
        _reap(actors, where)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)


def _reap(actors: list[Any], where: list[dict]) -> None:
    """Kill every rank actor and return only once they are gone, so a trial's result means its ranks no longer
    hold CPUs, memory or sockets (the next trial's placement and timing rely on it). `ray.kill` is asynchronous:
    (1) kill all; (2) a call on a killed actor fails with RayActorError once Ray has marked it dead, which is the
    cluster-wide event to wait on; (3) on this host, also wait for the processes themselves to exit (Ray marks
    an actor dead when its worker disconnects, a moment before the process ends)."""
    import ray

    for a in actors:
        with contextlib.suppress(Exception):
            ray.kill(a, no_restart=True)
    probes = []
    for a in actors:
        with contextlib.suppress(Exception):
            probes.append(a.where.remote())
    if probes:
        with contextlib.suppress(Exception):
            ray.wait(probes, num_returns=len(probes), timeout=REAP_S)
    here = platform.node()
    _wait_exit([int(w["pid"]) for w in where if w.get("host") == here], REAP_S)


def _wait_exit(pids: list[int], timeout: float) -> None:
    """Block until each process has exited (a pidfd turns readable when it does; Linux 5.3+), or `timeout`."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # already gone (or no pidfd here: nothing to wait on)
            continue
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
        finally:
            os.close(fd)


def _wait_ranks(refs: dict[Any, int], where: list[dict], deadline: float) -> tuple[str, str, dict[int, dict]]:
    """Wait for every rank: (status, one line, {rank: output}). A dead actor is the root cause before any
    peer's report (its peers then fail on broken sockets); a rank's own exception before its peers'."""
    import ray
    from ray import exceptions as rex

    outs: dict[int, dict] = {}
    reported: dict[int, tuple[str, str]] = {}
    lost: dict[int, str] = {}
    left = list(refs)
    settle: float | None = None
    while left:
        now = time.monotonic()
        if settle is None and now > deadline:
            return "timeout", f"trial exceeded timeout_s ({len(outs)} of {len(refs)} ranks finished)", outs
        if settle is not None and now > settle:
            break
        ready, left = ray.wait(left, num_returns=1, timeout=0.5)
        for ref in ready:
            r = refs[ref]
            try:
                st, msg, out = ray.get(ref)
            except rex.RayActorError as e:  # the actor's process or its whole node is gone
                lost[r] = _lost_reason(r, where[r], e)
                settle = settle or time.monotonic() + SETTLE_S
                continue
            if st == "ok":
                outs[r] = out
            else:
                reported[r] = (st, msg)
                settle = settle or time.monotonic() + SETTLE_S
    if lost:
        return "error", lost[min(lost)], outs
    if reported:
        from cubic_harness.trial import first_cause

        return (*first_cause(reported), outs)
    return "ok", "", outs


def _lost_reason(rank: int, w: dict, e: Exception) -> str:
    import ray

    node_alive = any(n["NodeID"] == w["node_id"] and n.get("Alive") for n in ray.nodes())
    what = "its process died" if node_alive else "its node died"
    return (f"rank {rank} lost on node {w['ip']} (id {w['node_id'][:12]}): {what} "
            f"({type(e).__name__}: {' '.join(str(e).split())[:160]})")
