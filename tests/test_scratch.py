"""The Ray workers' socket folder of a tune (cubic/execution/scratch.py): kept while its tuner lives, removed
when it ends, and, where its tuner was killed, by the next tune."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cubic.execution.scratch import Scratch, abandoned

KILLED = """
import os, signal
from cubic.execution.scratch import Scratch
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
