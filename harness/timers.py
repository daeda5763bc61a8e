"""Per-phase accumulators for the time breakdown (`PHASES`: a real trial's and the simulator's alike).

On CPU a phase is host wall-clock time. On CUDA it is the time between two CUDA events recorded on
the stream around the phase, read once per step after the step's own device sync (`flush`): a
device sync per phase would serialise the overlap (DDP's all-reduce, the pipelined input all-to-all)
that the measured step is meant to have, and host clocks around asynchronous kernels measure launches.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Threads whose names start with this run overlapped with the step (the input pipeline).
BACKGROUND = "cubic-bg"
#: The phases of a step, measured (`TrialResult.breakdown_ms`) and predicted (`harness/sim/perf.py`) alike:
#: `comm` is the step's collectives (input and pooled all-to-alls, DDP's all-reduce, a 2D grad_allreduce's
#: replica gather), `sync` the 2D weight_avg merge of the replicas (every k steps, its mean per step).
PHASES = ("emb_fwd", "emb_bwd", "comm", "sync", "dense", "optim")


class Timers:
    """Accumulates seconds per phase while `enabled` (the measured steps only)."""

    def __init__(self) -> None:
        self.enabled = False
        self.cuda = False  # time phases with CUDA events (then call flush() after each step's sync)
        self.totals: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, Any, Any]] = []

    def _counts(self) -> bool:
        # Work on the pipelined input-distribution thread overlaps the step, so it is left out (the
        # main thread's wait for it is counted). Every other thread is on the step's critical path:
        # on CUDA autograd runs the backward, and so the embedding update, on its own device thread.
        return self.enabled and not threading.current_thread().name.startswith(BACKGROUND)

    def add(self, phase: str, seconds: float) -> None:
        if self._counts():
            self.totals[phase] += seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda and self._counts():
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if not self.cuda:
                self.add(name, time.perf_counter() - t0)

    def flush(self) -> None:
        """Fold the CUDA events of the step in; call after the step's device sync (they are done)."""
        for name, start, end in self._events:
            self.totals[name] += start.elapsed_time(end) / 1e3
        self._events.clear()

    def reset(self) -> None:
        self.totals.clear()
        self._events.clear()


TIMERS = Timers()  # one per rank process
