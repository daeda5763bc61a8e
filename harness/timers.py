"""Per-phase wall-clock accumulators for the time breakdown (emb_fwd, emb_bwd, comm, dense, optim)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager


class Timers:
    """Accumulates seconds per phase while `enabled` (the measured steps only)."""

    def __init__(self) -> None:
        self.enabled = False
        self.sync = None  # e.g. torch.cuda.synchronize on GPU, so phases are not attributed late
        self.totals: dict[str, float] = defaultdict(float)

    def add(self, phase: str, seconds: float) -> None:
        # Work on the pipelined input-distribution thread overlaps the step: only the
        # main thread's time (including its wait for that work) is the step's breakdown.
        if self.enabled and threading.current_thread() is threading.main_thread():
            self.totals[phase] += seconds

    @contextmanager
    def phase(self, name: str):
        if self.sync:
            self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            self.add(name, time.perf_counter() - t0)

    def reset(self) -> None:
        self.totals.clear()


TIMERS = Timers()  # one per rank process
