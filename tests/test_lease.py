"""One tuner per study (`cubic.study.lease`): a second tuner refuses instead of failing the first's trials."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from cubic.study import lease as lease_mod
from cubic.study import tables
from cubic.study.lease import LeaseLost, TunerLease, holder
from cubic.study.store import open_storage
from cubic_harness.errors import ConfigError
from tests.test_tune import FAST, ROOT, cubic_tune, load, space_file

TABLE = tables.LEASES


def _store(tmp_path: Path) -> tuple[optuna.storages.RDBStorage, str]:
    rdb = open_storage(f"sqlite:///{tmp_path / 'study.db'}")
    optuna.create_study(study_name="s", storage=rdb, load_if_exists=True)
    return rdb, "s"


def _put(rdb: optuna.storages.RDBStorage, study: str, row: dict) -> None:
    """Another tuner's lease row, as it writes it (JSON text in cubic's lease table)."""
    tables.ensure(rdb.engine)
    with rdb.engine.begin() as conn:
        conn.execute(TABLE.delete().where(TABLE.c.study == study))
        conn.execute(TABLE.insert().values(study=study, schema=tables.SCHEMA, value_json=json.dumps(row)))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_second_lease_on_a_live_study_is_refused_until_the_first_is_released(tmp_path: Path) -> None:
    rdb, sid = _store(tmp_path)
    a = TunerLease(rdb, sid, "study 's'").acquire()
    try:
        # the heartbeat's age is whatever a busy machine makes it: the message names it, any number of seconds
        with pytest.raises(ConfigError, match=r"study 's' is being tuned by pid \d+ on .*heartbeat \d+s ago"):
            TunerLease(rdb, sid, "study 's'").acquire()
    finally:
        a.release()
    b = TunerLease(rdb, sid, "study 's'").acquire()
    assert b.took_over is None  # a released lease is simply free
    b.release()
    assert holder(rdb, sid) is None


@pytest.mark.parametrize("case", ["dead pid, this host", "silent, other host", "silent, this host"])
def test_a_dead_holders_lease_is_taken_over(tmp_path: Path, case: str, monkeypatch) -> None:
    monkeypatch.setattr(lease_mod, "HEARTBEAT_S", 0.05)  # the watch of a holder on another node
    rdb, sid = _store(tmp_path)
    now = time.time()
    here = {"host": socket.gethostname(), "node": lease_mod.node_id()}
    old = now - lease_mod.GRACE_S - 1
    holder = {"dead pid, this host": {**here, "pid": _dead_pid(), "heartbeat": now},
              "silent, other host": {"host": "elsewhere", "node": "x", "pid": 1, "heartbeat": old},
              "silent, this host": {**here, "pid": 1, "heartbeat": old}}[case]  # pid 1 lives, but is silent
    _put(rdb, sid, {**holder, "owner": "x", "started": now - 100})
    got = TunerLease(rdb, sid, "study 's'").acquire()
    assert got.took_over is not None and got.took_over["owner"] == "x"
    got.release()


@pytest.mark.parametrize("host", ["elsewhere", socket.gethostname()])
def test_a_live_holder_on_another_node_is_respected(tmp_path: Path, host: str) -> None:
    """Another machine, or a container with host networking (same hostname, other pid namespace):
    its pid means nothing here, so only a silent heartbeat makes it dead."""
    rdb, sid = _store(tmp_path)
    _put(rdb, sid, {"owner": "x", "host": host, "node": "other-boot:1", "pid": _dead_pid(), "started": time.time(),
                    "heartbeat": time.time()})
    with pytest.raises(ConfigError, match=f"being tuned by pid \\d+ on {host}"):
        TunerLease(rdb, sid, "study 's'").acquire()


def test_a_live_holder_whose_clock_runs_behind_is_not_taken_for_dead(tmp_path: Path, monkeypatch) -> None:
    """Its heartbeats carry times 60 s old by our clock, but they keep coming: watched, not taken. Its beat
    during the watch is written as the watch begins (`on_wait`), so no thread has to beat the clock to it."""
    monkeypatch.setattr(lease_mod, "HEARTBEAT_S", 0.05)
    rdb, sid = _store(tmp_path)
    beats = iter(range(1_000))

    def beat() -> None:
        _put(rdb, sid, {"owner": "x", "host": "elsewhere", "node": "other-boot:1", "pid": 1, "started": 0,
                        "heartbeat": time.time() - 60, "beat": next(beats)})

    heard: list[str] = []

    def watched(message: str) -> None:
        heard.append(message)
        beat()

    beat()
    with pytest.raises(ConfigError, match="being tuned by pid 1 on elsewhere"):
        TunerLease(rdb, sid, "study 's'").acquire(on_wait=watched)
    assert heard and "looks gone; making sure" in heard[0]


def test_a_holder_whose_lease_was_taken_stops_at_its_next_check(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(lease_mod, "HEARTBEAT_S", 0.05)
    rdb, sid = _store(tmp_path)
    a = TunerLease(rdb, sid, "study 's'").acquire()
    a.check()  # still ours: no error, and the heartbeat moves
    first = holder(rdb, sid)["heartbeat"]
    deadline = time.monotonic() + 60  # a bound, not a window: the beat comes when the thread gets a core
    while holder(rdb, sid)["heartbeat"] <= first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holder(rdb, sid)["heartbeat"] > first
    # a second tuner takes it over (as it would after this one was silent for GRACE_S)
    _put(rdb, sid, {"owner": "y", "host": "elsewhere", "pid": 7, "started": time.time(), "heartbeat": time.time()})
    a._thread.join(timeout=60)  # the heartbeat thread notices on its own and stops beating over the new row
    assert not a._thread.is_alive()
    with pytest.raises(LeaseLost, match="taken over by pid 7 on elsewhere"):
        a.check()
    assert holder(rdb, sid)["owner"] == "y"
    a.release()  # releasing a lost lease leaves the new holder's row alone
    assert holder(rdb, sid)["owner"] == "y"


def _race(url: str, sid: str, go, q: mp.Queue, done) -> None:
    rdb = open_storage(url)
    rdb.engine.connect().close()  # connected before the start: the race is on the lease, not the import
    go.wait(120)  # every racer starts together, however long each took to get here
    try:
        TunerLease(rdb, sid, "s").acquire()  # never released: the winner holds it until every racer has tried
        q.put("won")
    except ConfigError as e:
        q.put(f"refused: {e}")
    done.wait(120)  # alive (its lease live) until the test has every answer, however late a racer started


def test_tuners_starting_at_the_same_moment_get_exactly_one_lease(tmp_path: Path) -> None:
    rdb, sid = _store(tmp_path)
    url = str(rdb.url)
    ctx = mp.get_context("spawn")
    for _ in range(1):  # once each: the race on the UPDATE of a dead holder's row, then on the first INSERT
        _put(rdb, sid, {"owner": "gone", "host": socket.gethostname(), "node": lease_mod.node_id(), "pid": _dead_pid(),
                        "started": 0, "heartbeat": time.time()})  # a dead holder: takeover by UPDATE
        for first_insert in (False, True):
            if first_insert:  # no row at all: the race is on the INSERT
                with rdb.engine.begin() as conn:
                    conn.execute(TABLE.delete().where(TABLE.c.study == sid))
            q: mp.Queue = ctx.Queue()
            done = ctx.Event()
            go = ctx.Barrier(3)
            procs = [ctx.Process(target=_race, args=(url, sid, go, q, done)) for _ in range(3)]
            for p in procs:
                p.start()
            out = [q.get(timeout=60) for _ in procs]
            done.set()
            for p in procs:
                p.join(timeout=30)
            assert out.count("won") == 1, out
            assert all(o == "won" or "being tuned" in o or "same moment" in o for o in out), out


def _stopped(pid: int) -> list[psutil.Process]:
    """The processes under `pid` that stopped themselves (the fault hook's `stop`)."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [k for k in kids if _status(k) == psutil.STATUS_STOPPED]


def _status(p: psutil.Process) -> str:
    try:
        return p.status()
    except psutil.NoSuchProcess:
        return ""


def test_a_second_tune_on_a_running_study_exits_2_and_the_first_finishes_intact(tmp_path: Path) -> None:
    """Before the lease, the second tuner marked the first's running trials interrupted and re-ran
    them, and the first crashed with a traceback when it stored their results. The first tuner is held
    mid-tune by an event, not a window: its pipelined trials' rank stops itself (the fault hook, grid order
    reaches them third) and runs on when this test continues it, after the second tuner has been refused."""
    space = space_file(tmp_path, FAST.replace("confirm_top_k: 1", "confirm_top_k: 0"))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "cubic", "tune", "--no-live", "--space", str(space), "--run-dir", str(run),
           "--searcher", "grid"]
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115 - closed below (a file: a pipe nobody reads can fill)
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "CUBIC_INJECT_FAULT": "pipeline_depth=1:stop"})

    def output() -> str:
        return (tmp_path / "first.log").read_text()[-2000:]

    try:
        deadline = time.monotonic() + 150  # a bound on a bug, not a window: the stop is what the loop waits for
        while not _stopped(first.pid):
            assert first.poll() is None, output()
            assert time.monotonic() < deadline, "the first tuner never reached its stopping trial"
            time.sleep(0.2)
        second = cubic_tune("--space", str(space), "--run-dir", str(run), "--searcher", "grid")
        assert second.returncode == 2, second.stdout + second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and f"is being tuned by pid {first.pid} on " in lines[0], second.stderr
        while first.poll() is None:  # let every stopped trial run on, until the first tuner ends
            for p in _stopped(first.pid):
                p.send_signal(signal.SIGCONT)
            time.sleep(0.2)
    finally:
        log.close()
        if first.poll() is None:
            first.kill()
    out = output()
    assert first.returncode == 0, out[-2000:]
    trials = load(run, "fast").get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5, [(t.number, t.user_attrs.get("status"))
                                                                    for t in trials]
    assert holder(open_storage(f"sqlite:///{run / 'study.db'}"), "fast") is None  # released at the end
