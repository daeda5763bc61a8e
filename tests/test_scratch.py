"""The Ray workers' socket folder of a tune (harness/scratch.py): kept while its tuner lives,
removed when it ends, and, where its tuner was killed, by the next tune."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cubic_harness.scratch import Scratch, abandoned

KILLED = """
import os, signal
from cubic_harness.scratch import Scratch
s = Scratch()
print(s.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_tuners_folder_goes_with_the_next_tune_and_a_live_ones_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = Scratch()
    p = subprocess.run([sys.executable, "-c", KILLED], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    dead = Path(p.stdout.strip())
    assert p.returncode == -9 and dead.parent == tmp_path and dead.is_dir(), p.stderr
    assert abandoned() == [dead]  # the live tuner's lock is held: never taken for abandoned
    nxt = Scratch()
    assert not dead.exists() and Path(live.path).is_dir() and Path(nxt.path).is_dir()
    live.remove()
    assert not Path(live.path).exists() and Path(nxt.path).is_dir()


WORKER_ELSEWHERE = """
import os, signal
from multiprocessing import util
from cubic_harness import trial
trial._sockets_in_scratch()  # as before a fork server starts
print(util.get_temp_dir(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a Ray worker ends without exit handlers
"""


def test_a_worker_on_a_node_without_the_runners_folder_leaves_nothing_past_the_next_tune(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's folder is on its own node; a worker on another one puts its sockets' folder in
    a locked folder of its own, which the next tune's first worker there takes once it is gone."""
    from cubic_harness.config import SCRATCH_ENV

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    elsewhere = str(tmp_path / "on-the-runners-node")
    env = {**os.environ, "TMPDIR": str(tmp_path), SCRATCH_ENV: elsewhere}
    p = subprocess.run([sys.executable, "-c", WORKER_ELSEWHERE], capture_output=True, text=True,
                       timeout=120, env=env)
    sockets = Path(p.stdout.strip())
    assert p.returncode == -9 and sockets.is_dir(), p.stderr
    own = sockets.parent
    assert own.parent == tmp_path and own.name.startswith("cubic-ray-")
    assert not list(tmp_path.glob("pymp-*"))  # multiprocessing's own folder would be left for good
    assert abandoned() == [own]
    nxt = Scratch()
    assert not own.exists() and sorted(tmp_path.iterdir()) == [Path(nxt.path)]
    nxt.remove()
