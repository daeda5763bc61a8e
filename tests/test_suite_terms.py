"""The suite's own terms: what it reads of the developer's machine, and what CI states itself."""

from __future__ import annotations

import os
from pathlib import Path

from cubic_harness.sim.cluster import calibrated_cluster_path

ROOT = Path(__file__).resolve().parent.parent


def test_the_suite_never_reads_the_developers_calibration():
    """A `cubic calibrate` in ~/.config would change what every planner test prices."""
    home = Path("~/.config").expanduser().resolve()
    pinned = Path(os.environ["XDG_CONFIG_HOME"]).resolve()
    assert pinned != home
    assert calibrated_cluster_path().resolve().is_relative_to(pinned)


def test_ci_states_ci_true_itself():
    """`require()` turns a missing optional package into a failure only under CI=true: .ci/run sets it."""
    lines = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    assert "export CI=true" in lines
    assert lines.index("export CI=true") < lines.index("make test")
