"""`cubic tune --address`: trials run on an existing Ray cluster, which the tuner neither starts nor stops.

The cluster is a real head node (`ray start --head --block`) in its own session, temp dir and free ports
(Ray's fixed default 52365 for the agent collides with any other Ray on the machine; the client
server, 10001, needs `ray[client]`, which cubic does not install, and so does not start), so the test owns
exactly its processes: it is stopped through its own `ray start` process, never with `ray stop` (which
kills every Ray process on the machine, other tests' included).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from cubic.results.analysis import load_study

ROOT = Path(__file__).resolve().parents[1]
MARKER = "CUBIC_TEST_RAY_CLUSTER"  # in the environment of every process of the test cluster (inherited)


def _free_ports(n: int) -> list[int]:
    """n distinct ports nobody listens at now, on any interface (all bound at once so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _wait(cond: Callable[[], bool], timeout: float) -> bool:
    """Poll `cond` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@dataclass
class Cluster:
    proc: subprocess.Popen
    port: int
    temp_dir: Path
    client_env: dict[str, str]  # what a driver of this cluster needs (its auth token), without MARKER

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def logs(self) -> Path:
        return self.temp_dir / "session_latest" / "logs"

    def output(self) -> str:
        log = self.temp_dir / "head.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else ""

    def processes(self) -> list[psutil.Process]:
        """The head and its descendants, plus anything else started from it that outlived its parent
        (Ray workers have their own process groups; trial ranks are the workers' children)."""
        procs: dict[int, psutil.Process] = {}
        try:
            head = psutil.Process(self.proc.pid)
            procs = {p.pid: p for p in [head, *head.children(recursive=True)]}
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter():
            try:
                if p.pid not in procs and p.environ().get(MARKER) == str(self.temp_dir):
                    procs[p.pid] = p
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        return list(procs.values())

    def daemons(self) -> list[psutil.Process]:
        """The cluster's GCS server and raylet."""
        procs = []
        for p in self.processes():
            try:
                if p.name() in ("gcs_server", "raylet"):
                    procs.append(p)
            except psutil.Error:
                continue
        return procs


@pytest.fixture
def ray_cluster() -> Iterator[Cluster]:
    """A 2-CPU head node on free ports. Auth is explicit (a fresh token for the head and its clients), so
    the test does not depend on ~/.ray/auth_token: `ray start` turns token auth on when that file exists,
    a driver with an explicit address does not. The temp dir is short: Ray's Unix sockets live in it."""
    gcs, agent = _free_ports(2)
    temp_dir = Path(tempfile.mkdtemp(prefix="cubic-t-ray-", dir="/tmp" if os.path.isdir("/tmp") else None))
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    client_env = {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                  "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(gcs),
           "--num-cpus", "2", "--include-dashboard=false", "--object-store-memory", str(100 * 2**20),
           "--temp-dir", str(temp_dir), "--dashboard-agent-listen-port", str(agent), "--disable-usage-stats"]
    with open(temp_dir / "head.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=temp_dir, env={**client_env, MARKER: str(temp_dir)}, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    cluster = Cluster(proc, gcs, temp_dir, client_env)
    try:
        up = _wait(lambda: proc.poll() is not None or _accepts(gcs), 60)
        assert up and proc.poll() is None, f"the Ray head is not up (exit {proc.returncode}):\n{cluster.output()}"
        assert _wait(lambda: len(cluster.daemons()) == 2, 60), f"no GCS + raylet:\n{cluster.output()}"
        yield cluster
    finally:
        _stop(cluster)


def _stop(cluster: Cluster) -> None:
    """SIGTERM to `ray start` alone: it drains the node through the GCS and stops its processes (~4 s).
    (A SIGTERM to the whole group stops the GCS first, and the drain then waits 30 s for it.) Whatever
    is left after 30 s - a stuck shutdown, a worker in its own process group - is SIGKILLed; then none
    of the cluster's processes may remain."""
    procs = cluster.processes()
    if cluster.proc.poll() is None:
        cluster.proc.terminate()
        try:
            cluster.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    left = [p for p in procs + cluster.processes() if p.is_running()]
    try:
        os.killpg(cluster.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    cluster.proc.wait(10)
    _, alive = psutil.wait_procs(left, timeout=10)
    alive += [p for p in cluster.processes() if p not in alive]
    alive = [p for p in alive if _running(p)]  # a killed orphan stays a zombie where pid 1 does not reap
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
    assert not alive, f"Ray processes survived the cluster's teardown: {alive}"


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run_tasks(logs: Path) -> int:
    """`_run` executions in the cluster's worker logs: a worker writes ':task_name:NAME' to its stdout
    file as each task starts (the marker Ray's log monitor attributes output by)."""
    return sum(f.read_text(errors="replace").splitlines().count(":task_name:_run") for f in logs.glob("worker-*.out"))


def test_tune_runs_trials_on_an_existing_cluster_and_leaves_it_running(ray_cluster: Cluster, tmp_path: Path) -> None:
    """Proof that the trials ran on this cluster and not on a private local Ray, from the cluster's own
    session directory (Ray files each process's logs under the session of the cluster it is attached to):
    it holds a driver log named after the tuner's pid, and worker logs showing each trial's `_run` task.
    (The state API, `ray list tasks`, needs the dashboard this small cluster runs without; `ray.timeline`
    is fed by task events flushed asynchronously and lost the last task's in trials.) Afterwards the
    cluster must still run with the same GCS and raylet: the tuner only disconnects from a cluster it
    did not start."""
    run = tmp_path / "run"
    daemons = ray_cluster.daemons()
    cmd = [sys.executable, "-m", "cubic", "tune", "--space", "search_spaces/tiny.yaml", "--run-dir", str(run),
           "--trials", "3", "--no-live", "--address", ray_cluster.address]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ray_cluster.client_env, "CI": "true"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the tuner and whatever it started
        out, err = proc.communicate()
    assert proc.returncode == 0, f"{out}\n{err}\nRay head output:\n{ray_cluster.output()}"

    df = load_study(run)
    assert len(df) == 3, df[["number", "state", "status", "reason"]]
    assert (df["state"] == "COMPLETE").all() and (df["status"] == "ok").all() and (df["qps"] > 0).all(), df
    assert df["ok"].all()

    logs = ray_cluster.logs
    assert list(logs.glob(f"python-core-driver-*_{proc.pid}.log")), \
        f"no driver log of the tuner (pid {proc.pid}) in {logs}: {sorted(p.name for p in logs.iterdir())}"
    assert _wait(lambda: _run_tasks(logs) >= 3, 15), f"the cluster's workers ran {_run_tasks(logs)} `_run` tasks"

    assert ray_cluster.proc.poll() is None, ray_cluster.output()
    assert _accepts(ray_cluster.port)
    assert all(p.is_running() for p in daemons), daemons

    # Without --address the tuner starts a Ray of its own, whatever this machine runs: a bare ray.init() joined
    # the cluster RAY_ADDRESS named (or `ray start` last ran) and failed there on the CPU count it was given
    ran_before = _run_tasks(logs)
    own = subprocess.run([sys.executable, "-m", "cubic", "tune", "--space", "search_spaces/tiny.yaml", "--run-dir",
                          str(tmp_path / "own"), "--trials", "1", "--no-live"], cwd=ROOT, capture_output=True,
                         text=True, timeout=540, env={**ray_cluster.client_env, "CI": "true",
                                                      "RAY_ADDRESS": ray_cluster.address})
    assert own.returncode == 0, own.stdout[-2000:] + own.stderr[-2000:]
    assert load_study(tmp_path / "own")["ok"].all()
    assert _run_tasks(logs) == ran_before and ray_cluster.proc.poll() is None  # none of its trials ran here
