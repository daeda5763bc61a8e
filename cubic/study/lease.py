"""One tuner per study: a lease that a second `cubic tune` on the same store must respect.

Why: a tuner that starts treats every RUNNING trial as left behind by a dead tuner (it marks it
FAIL(interrupted) and queues its configuration again). Were another tuner still alive on that study
(a second terminal on the same run directory, a second host on the same PostgreSQL study), the live
one would lose the results of its running trials and crash on its next write. So the tuner holds a
lease while it runs, and a second one refuses to start (one line, exit 2) until the first stops.

The lease is one row of cubic's own table `cubic_leases` (`cubic.study.tables`; one row per study, by its
name), taken and renewed by compare-and-set in SQL, so it is atomic on SQLite and PostgreSQL alike:
- taking a free lease is an INSERT (the table's primary key, the study, lets only one of two racing
  tuners in); taking over a dead holder's lease and every heartbeat are an UPDATE ... WHERE value
  is what this process last read or wrote (0 rows changed = someone else holds it now);
- the holder renews it every `HEARTBEAT_S` seconds from a daemon thread;
- a holder is dead when its process is gone (same machine and pid namespace, `node_id`: checked at
  once, so resuming right after `kill -9` needs no wait) or its heartbeat is older than `GRACE_S`
  (any host; one on another host is then watched for two heartbeats before it is taken over, so
  clocks that disagree cannot kill a live tuner);
- ownership is the row's `owner` uuid, not its exact text (a heartbeat whose commit reached the
  store but whose reply did not is still this tuner's);
- a tuner whose lease was taken (it was suspended or cut off from the store for `GRACE_S`) learns
  it at its next check and stops without writing more: its running trials are the new holder's.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy
from optuna.storages import RDBStorage

from cubic.study import tables
from cubic_harness.errors import ConfigError

HEARTBEAT_S = 5.0
GRACE_S = 30.0


class LeaseLost(ConfigError):
    """Another tuner took this study over; this one must stop writing."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def describe(holder: dict[str, Any]) -> str:
    age = time.time() - float(holder.get("heartbeat", 0))
    started = time.strftime("%H:%M:%S", time.localtime(float(holder.get("started", 0))))
    return f"pid {holder.get('pid')} on {holder.get('host')} (started {started}, heartbeat {age:.0f}s ago)"


def node_id() -> str:
    """Where a pid means the same process: this boot of this kernel and this pid namespace. (The
    hostname is not enough: containers with host networking share it, but not their pids.)"""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux: the hostname is the best there is
        return socket.gethostname()


def holder_alive(holder: dict[str, Any]) -> bool:
    """Whether the tuner that wrote `holder` may still be running."""
    if time.time() - float(holder.get("heartbeat", 0)) > GRACE_S:
        return False
    if holder.get("node") == node_id():
        return _pid_alive(int(holder.get("pid", -1)))
    return True


def _holder(value: str | None) -> dict[str, Any]:
    """The lease row's holder ({} for no row or an unreadable one)."""
    try:
        h = json.loads(value) if value else {}
    except ValueError:
        return {}
    return h if isinstance(h, dict) else {}


class TunerLease:
    """`acquire()` or ConfigError; `check()` in the tuner's loop; `release()` when it stops."""

    def __init__(self, rdb: RDBStorage, study: str, label: str) -> None:
        """`study`: the study's name (unique in its store)."""
        self.engine = rdb.engine
        self.study, self.label = study, label
        self.table = tables.LEASES
        tables.ensure(self.engine)
        self.me = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "node": node_id(), "pid": os.getpid(),
                   "started": time.time(), "heartbeat": time.time()}
        self._renewed = time.monotonic()  # the last heartbeat that reached the store
        self._value: str | None = None  # the row's value as this process last wrote it
        self._lost: dict[str, Any] | None = None  # who took the lease, once it is gone
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: dict[str, Any] | None = None  # the dead holder this tuner replaced, if any

    # ------------------------------------------------------------------ SQL
    def _where(self) -> Any:
        t = self.table
        return t.c.study == self.study

    def _read(self) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(sqlalchemy.select(self.table.c.value_json).where(self._where())).scalar_one_or_none()

    def _cas(self, old: str | None, new: str) -> bool:
        """Set the row to `new` iff it still holds `old` (None: iff there is no row)."""
        try:
            with self.engine.begin() as conn:
                if old is None:
                    conn.execute(self.table.insert().values(study=self.study, schema=tables.SCHEMA, value_json=new))
                    return True
                res = conn.execute(self.table.update().where(self._where() & (self.table.c.value_json == old))
                                   .values(value_json=new))
                return res.rowcount == 1
        except sqlalchemy.exc.IntegrityError:  # another tuner inserted first
            return False
        except sqlalchemy.exc.OperationalError:  # e.g. SQLite "database is locked": not set; callers retry
            return False

    def _stamp(self) -> str:
        self.me["heartbeat"] = time.time()
        return json.dumps(self.me, sort_keys=True)

    # ------------------------------------------------------------------ protocol
    def acquire(self, on_wait: Callable[[str], None] | None = None) -> TunerLease:
        """Take the lease, or ConfigError naming the live holder. A holder on another node that the
        clock calls silent is watched for two heartbeats before it is taken over, so a live tuner
        whose clock runs behind ours is never taken for dead (`on_wait` hears why we wait)."""
        for _ in range(5):
            old = self._read()
            holder = _holder(old) or None
            if holder is not None and not holder_alive(holder) and holder.get("node") != node_id():
                if on_wait is not None:
                    on_wait(f"{self.label}: its last tuner, {describe(holder)}, looks gone; making sure "
                            f"for {2 * HEARTBEAT_S:.0f}s")
                time.sleep(2 * HEARTBEAT_S)
                if self._read() != old:  # it beat meanwhile: alive, whatever the clocks say
                    holder["heartbeat"] = time.time()
            if holder is not None and holder_alive(holder):
                raise ConfigError(f"{self.label} is being tuned by {describe(holder)}: wait for it to finish, "
                                  f"or stop it and run this again to resume (a holder silent for {GRACE_S:.0f}s "
                                  "is taken over)")
            new = self._stamp()
            if self._cas(old, new):
                self._value, self.took_over, self._renewed = new, holder, time.monotonic()
                self._thread = threading.Thread(target=self._beat, name="cubic-lease", daemon=True)
                self._thread.start()
                return self
        raise ConfigError(f"{self.label}: another tuner is starting on it at the same moment; run again")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                new = self._stamp()
                if not self._cas(self._value, new):
                    new = self._read()
                    if not self._still_mine(new):
                        return
                    # else: our own write, whose commit only looked failed
                self._value, self._renewed = new, time.monotonic()
            except Exception:  # store briefly unreachable or locked: try again at the next beat
                continue

    def _still_mine(self, value: str | None) -> bool:
        """Whether the row `value` read is this tuner's (its owner id, not its exact text: see the
        module docstring); if not, remember who holds it now."""
        holder = _holder(value)
        if holder.get("owner") == self.me["owner"]:
            return True
        self._lost = holder or {"pid": "?", "host": "?"}
        return False

    def check(self, fresh: bool = False) -> None:
        """Raise LeaseLost once another tuner holds this study (this one must not write again).
        `fresh` reads the row now instead of trusting the heartbeat thread; so does any check once
        that thread has not renewed the lease for GRACE_S / 2 (this process was suspended, the store
        unreachable, or the thread died), since another tuner may take it over at GRACE_S."""
        stale = time.monotonic() - self._renewed > GRACE_S / 2
        if (fresh or stale) and self._lost is None:
            self._still_mine(self._read())
        if self._lost is not None:
            raise LeaseLost(f"{self.label}: taken over by {describe(self._lost)} after this tuner was silent "
                            f"for over {GRACE_S:.0f}s; stopping here (the new holder re-runs its running trials)")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_S + 5)
        if self._value is not None:
            try:
                cur = self._read()
                if _holder(cur).get("owner") == self.me["owner"]:  # never delete a new holder's row
                    with self.engine.begin() as conn:
                        conn.execute(self.table.delete().where(self._where() & (self.table.c.value_json == cur)))
            except sqlalchemy.exc.SQLAlchemyError:
                pass  # the store is gone: the lease expires on its own
            self._value = None


def holder(rdb: RDBStorage, study: str) -> dict[str, Any] | None:
    """Who holds `study`'s lease now (None: no tuner runs on it)."""
    if not tables.exists(rdb.engine, tables.LEASES):
        return None
    t = tables.LEASES
    with rdb.engine.connect() as conn:
        value = conn.execute(sqlalchemy.select(t.c.value_json).where(t.c.study == study)).scalar_one_or_none()
    return _holder(value) or None
