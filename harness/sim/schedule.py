"""One step as a critical path over a rank's streams: compute and its collectives'.

The performance model (`perf.py`) prices each piece of a step; this module says how they add up. A step is
a list of ops, each on one stream with the ops it waits for. The step's length is when the last op ends.

1. Each stream runs its ops one at a time, in the order listed: that order is the program's (a CUDA stream
   and the CPU's one autograd thread keep issue order). Compute is one stream; each process group's
   collectives are another (NCCL runs each communicator on its own stream), so DDP's all-reduce over the
   world and the group's all-to-all can run at once.
2. An op starts when its stream is free and every op in `after` has ended. A collective the code waits for
   (a blocking all-to-all) is one that the next compute op names in `after`. A collective the code only
   launches (`comm_overlap`'s pooled all-to-all, DDP's bucketed all-reduce) is one nothing waits for until
   its result is needed.
3. Collectives running at once share the rank's links: k of them each go at 1/k of their own speed, so
   their bytes take as long as in turn. While compute runs beside them, compute and the collectives each go
   at 1 / (2 - h) of their speed, where h is the device's `overlap_hidden` that `cubic calibrate` measures
   (a collective beside a busy compute). Why this rate: a collective of a ms beside compute of b >= a ms
   then takes b + (1 - h) a. At h = 1 the shorter is hidden. At h = 0 they take a + b, as if in turn (on
   CPU they share the cores and the memory bandwidth). At h < 0 together they cost more than in turn.
4. What each collective costs the step (`exposed`): its share of the time the compute waits, of the
   compute's lost speed while they run together, and of the time after the compute has ended. So the step
   is exactly the compute's own work plus every collective's exposed time; `hidden` is the rest of each
   collective's time.

A step has about a dozen ops and the loop goes event to event: a 1,000-configuration tune prices its steps
in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

COMPUTE = "compute"
EPS = 1e-12


@dataclass(frozen=True)
class Op:
    name: str
    ms: float  # its time with the rank to itself
    stream: str = COMPUTE  # compute, or the process group whose collective it is
    after: tuple[str, ...] = ()  # ops that must end before it starts


@dataclass(frozen=True)
class Timeline:
    step_ms: float
    exposed_ms: dict[str, float]  # per collective: what it adds to the step (step 4)
    hidden_ms: dict[str, float]  # per collective: its time that the step does not see
    end_ms: dict[str, float]  # when each op ends


def critical_path(ops: Sequence[Op], hidden_share: float) -> Timeline:
    """Run `ops` on their streams (the module docstring's steps 1-4)."""
    beside = 1.0 / (2.0 - hidden_share)
    names = {o.name for o in ops}
    for o in ops:
        if missing := [a for a in o.after if a not in names]:
            raise ValueError(f"op {o.name} waits for {missing}, which no op is")
    streams = list(dict.fromkeys([COMPUTE, *(o.stream for o in ops)]))
    queue = {s: [o for o in ops if o.stream == s] for s in streams}
    head = dict.fromkeys(streams, 0)
    running: dict[str, Op] = {}
    left: dict[str, float] = {}
    end: dict[str, float] = {}
    exposed = {o.name: 0.0 for o in ops if o.stream != COMPUTE}
    t = 0.0
    while True:
        started = True
        while started:  # step 2: start whatever is ready (an op of no time ends at once and may free others)
            started = False
            for s in streams:
                while s not in running and head[s] < len(queue[s]):
                    o = queue[s][head[s]]
                    if not all(a in end for a in o.after):
                        break
                    head[s], started = head[s] + 1, True
                    if o.ms <= EPS:
                        end[o.name] = t
                    else:
                        running[s], left[s] = o, o.ms
        if not running:
            if stuck := [queue[s][head[s]].name for s in streams if head[s] < len(queue[s])]:
                raise ValueError(f"ops {stuck} wait for each other (one waits for an op listed after it on its stream)")
            break
        comms = [s for s in running if s != COMPUTE]
        computing = COMPUTE in running
        k = len(comms)
        c_rate = beside if (computing and k) else 1.0  # step 3
        rate = {s: (c_rate / k if s != COMPUTE else c_rate) for s in running}
        dt = min(left[s] / rate[s] for s in running)
        for s in comms:  # step 4: the compute waits, or runs slower, while they run
            exposed[running[s].name] += ((1.0 - c_rate) if computing else 1.0) * dt / k
        t += dt
        for s in list(running):
            left[s] -= rate[s] * dt
            if left[s] <= EPS * max(1.0, running[s].ms):
                end[running.pop(s).name] = t
    hidden = {o.name: o.ms - exposed[o.name] for o in ops if o.stream != COMPUTE}
    return Timeline(t, exposed, hidden, end)
