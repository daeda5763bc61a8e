"""Fault injection, a test hook: a rank that crashes, hangs, runs out of memory, is killed, or stops until a test
continues it (SIGSTOP, then the test's SIGCONT: a trial held running for exactly as long as the test needs),
chosen by the environment and never by a `TrialConfig`, so no production configuration carries a test knob.

`CUBIC_INJECT_FAULT` holds comma-separated rules, each `FAULT` (every trial) or `FIELD=VALUE:FAULT` (trials
whose config has that value, compared as text: `batch_size=48:oom`); the first rule that matches wins. The
faulting rank is rank 1 (rank 0 when alone), after its first warm-up step, so a trial has started for real.
The variable is one of `MEASUREMENT_ENV`: every result records that it was set, and the Ray runner hands it
to its workers on every node (`cubic/execution/runner.py`), so a tune's trials fault wherever they run.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import torch

from cubic_harness.config import TrialConfig
from cubic_harness.errors import ConfigError

ENV = "CUBIC_INJECT_FAULT"
FAULTS = ("crash", "hang", "oom", "kill", "stop")


def fault_for(cfg: TrialConfig) -> str | None:
    """The fault `CUBIC_INJECT_FAULT` gives this configuration (None: none)."""
    for rule in filter(None, (r.strip() for r in os.environ.get(ENV, "").split(","))):
        cond, _, fault = rule.rpartition(":")
        if fault not in FAULTS:
            raise ConfigError(f"{ENV}: {rule!r}: the fault must be one of {', '.join(FAULTS)}")
        if not cond:
            return fault
        field, eq, value = cond.partition("=")
        if not eq or not hasattr(cfg, field):
            raise ConfigError(f"{ENV}: {rule!r}: a condition is FIELD=VALUE with FIELD a TrialConfig field")
        if str(getattr(cfg, field)) == value:
            return fault
    return None


def maybe_fault(cfg: TrialConfig, rank: int, step: int, rss_mb: Callable[[], float]) -> None:
    """Fault here if this is the rank and step the rules pick; `rss_mb` reads the rank's memory (for oom)."""
    if rank != min(1, cfg.world_size - 1) or step != 1 or (fault := fault_for(cfg)) is None:
        return
    if fault == "crash":
        raise RuntimeError(f"injected crash ({ENV})")
    if fault == "kill":  # as the OOM killer does: no report, no cleanup
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang":
        time.sleep(1e6)
    if fault == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault == "oom":
        hog = []
        cap = cfg.mem_cap_mb or 1024
        while rss_mb() <= cap:
            hog.append(torch.ones(64 * 2**20 // 4))
        raise MemoryError(f"rank {rank} peak RSS {rss_mb():.0f} MB exceeds mem_cap_mb={cap:.0f}")
