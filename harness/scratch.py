"""The folder a tune's Ray workers keep their fork servers' sockets in (`SCRATCH_ENV`).

multiprocessing removes the folder of a process's fork server sockets when the process exits
normally; a Ray worker ends without running exit handlers, so the Ray runner gives its workers one
folder per tune and removes it when the tune ends. A tuner that is killed (SIGKILL, the OOM killer)
cannot: the next tune on the machine removes its folder, which it knows was abandoned because nobody
holds the folder's lock. A worker on another node, where the runner's folder is not, makes a folder
of its own the same way (`cubic_harness.trial`): it holds the lock for its life, and the next tune's
first worker on that node removes the folder. A lock dies with the process that held it, whatever
killed it, and it is seen across PID namespaces that share the temp folder, where a process id would
not be. The lock file appears already locked (locked under another name, then renamed), so a sweep
never takes a folder that is being made.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import IO

PREFIX = "cubic-ray-"
LOCK = ".lock"


class Scratch:
    """One tune's folder, locked while this process lives; removed by `remove`, or when the object
    goes or the process exits, whichever comes first."""

    def __init__(self) -> None:
        for folder in abandoned():
            shutil.rmtree(folder, ignore_errors=True)
        self.path = tempfile.mkdtemp(prefix=PREFIX)
        locking = os.path.join(self.path, ".locking")
        lock = open(locking, "w")  # noqa: SIM115 - held until `remove`
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(locking, os.path.join(self.path, LOCK))
        self._remove = weakref.finalize(self, _remove, self.path, lock)

    def remove(self) -> None:
        self._remove()


def _remove(path: str, lock: IO[str]) -> None:
    lock.close()
    shutil.rmtree(path, ignore_errors=True)


def abandoned() -> list[Path]:
    """This user's tune folders in the temp folder whose lock nobody holds: their tuner died."""
    out = []
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            with open(folder / LOCK) as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a live tuner, another user's, or not a tune's folder
            continue
        out.append(folder)
    return out
