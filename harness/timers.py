"""Per-phase wall-clock accumulators for the time breakdown (emb_fwd, emb_bwd, comm, dense, optim)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager

#: Threads whose names start with this run overlapped with the step (the input pipeline).
BACKGROUND = "cubic-bg"


class Timers:
    """Accumulates seconds per phase while `enabled` (the measured steps only)."""

    def __init__(self) -> None:
        self.enabled = False
        self.sync = None  # e.g. torch.cuda.synchronize on GPU, so phases are not attributed late
        self.totals: dict[str, float] = defaultdict(float)

    def add(self, phase: str, seconds: float) -> None:
        # Work on the pipelined input-distribution thread overlaps the step, so it is left out (the
        # main thread's wait for it is counted). Every other thread is on the step's critical path:
        # on CUDA autograd runs the backward, and so the embedding update, on its own device thread.
        if self.enabled and not threading.current_thread().name.startswith(BACKGROUND):
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
