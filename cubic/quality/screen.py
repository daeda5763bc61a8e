"""The quality screen: each numerics change of a space judged alone by held-out quality, before the search, or
on demand when a settled incumbent carries it (`QualityRuns.screen`; `cubic.tune.checks` runs it).

Why: a tune's fastest configurations are often fast *because* they change numerics (a 4x batch, SGD
tables, low precision), and held-out quality runs judged them one model at a time. Three tunes of the
default space spent 15-22 quality runs rejecting new combinations of the same two or three harmful
changes, because the searcher learns per configuration and kept proposing the next one; one of them
ended with the baseline as its winner. Judging each change alone costs one run per change (a second
only where the first is ambiguous); configurations that contain a change that fails are then out of
the search (`cubic.search.samplers.base.Observations.seen`) and out of the confirm, so the whole trial budget
goes to the region that can win.

The assumption, stated: a change that costs eval NE alone is not repaired by another knob of the same
space. It does not hold for a batch change in a space that lists learning rates as knobs, so global
batch changes are not screened there. A change another may cover (`cubic.space.numerics.COVERS`:
bf16 communication beside bf16 dense math) is not repaired there but may cost nothing beyond it, so
a configuration that makes both stays in the search, judged by its own quality runs. A combination
of changes that pass is still judged by its own quality runs (the search-time checks and the
confirm, `cubic.tune`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cubic.quality.rules import EARLY_REJECT, Judgement, judge, paired_mean
from cubic.space.numerics import COVERS, MONOTONE, Change, blocking, further_out
from cubic.space.quality_runs import OFF, QualityRuns
from cubic.space.search_space import SearchSpace

ATTR = "quality_screen"  # the study's user attr: a list of Screened.to_dict()
LR_KNOBS = ("emb_lr", "dense_lr")
VERDICTS = {True: "passes", False: "ruled out", None: "undecided"}
NOT_RUN = "not run"  # an on-demand screen's change no settled incumbent carried


@dataclass
class Screened:
    """One numerics change alone (the baseline with one knob changed) and its quality runs so far."""

    name: str  # what trains differently (SearchSpace.numerics_changes): emb_optimizer, global_batch, replicas
    value: Any
    params: dict[str, Any]  # the baseline's params with this change
    eval_ne: list[float | None]
    eval_auc: list[float | None]
    ok: bool | None = None  # None: undecided
    reason: str = ""

    @property
    def change(self) -> tuple[str, Any]:
        return (self.name, self.value)

    @property
    def verdict(self) -> str:
        """passes | ruled out | undecided, or "not run" where an on-demand screen never needed it."""
        return VERDICTS[self.ok] if self.ok is not None or self.eval_ne else NOT_RUN

    @property
    def label(self) -> str:
        return f"{self.name}={self.value}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "params": self.params, "eval_ne": self.eval_ne,
                "eval_auc": self.eval_auc, "ok": self.ok, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Screened:
        return cls(d["name"], d["value"], dict(d["params"]), list(d["eval_ne"]), list(d["eval_auc"]),
                   d.get("ok"), d.get("reason", ""))


def single_changes(space: SearchSpace) -> list[Screened]:
    """Every numerics change a knob of the space makes alone on the baseline
    (`one_knob_changes`); none where the space has no quality runs or turns the screen off."""
    qr = space.quality_runs
    if qr is None or qr.screen == OFF:
        return []
    return one_knob_changes(space)


def one_knob_changes(space: SearchSpace) -> list[Screened]:
    """Every numerics change a knob of the space makes alone on the baseline (one per change: the
    sharding types that are not column-wise are one change), in knob order, whether or not the space
    trains quality runs itself (a simulated space judged by another's: `cubic.quality.scaled`)."""
    lr_knobs = set(LR_KNOBS) & set(space.knobs)
    base = space.baseline_params()
    out: dict[tuple[str, Any], Screened] = {}
    for k, kn in space.knobs.items():
        for v in kn.choices:
            p = {**base, k: v}
            if space.tup(p) == space.tup(base) or not space.valid(p):
                continue
            changes = space.numerics_changes(p)
            if len(changes) != 1:  # layout only, or a knob that only means something with another one
                continue
            (name, value), = changes
            if name == "global_batch" and lr_knobs:  # its verdict depends on the learning-rate knobs
                continue
            out.setdefault((name, value), Screened(name, value, space.params_of(space.tup(p)), [], []))
    return list(out.values())


def monotone(space: SearchSpace) -> bool:
    """Whether the screen may rule a change out by another on the same side of the baseline
    (`numerics.MONOTONE`): only where every configuration trains at the baseline's learning rates."""
    return space.lr_scaling == "none" and not set(LR_KNOBS) & set(space.knobs)


def nearer_first(s: Screened, screen: list[Screened], space: SearchSpace) -> Screened:
    """The change to screen in place of `s`: the nearest to the baseline, not yet run, of those `s` lies
    further out than (`numerics.further_out`), else `s`. Why: ruled out, it rules `s` out with it
    (`implied_out`), and the search, kept from `s`, would next carry it; passed, `s` still gets its run."""
    if not monotone(space):
        return s
    nearer = [x for x in screen if x.ok is None and not x.eval_ne
              and further_out(s.change, x.change, space.baseline)]
    return max(nearer, key=lambda x: abs(x.value - s.value), default=s)


def implied_out(screen: list[Screened], space: SearchSpace) -> list[Screened]:
    """Rule out, without runs of their own, the changes not yet run that lie further out than one the
    screen ruled out (`numerics.MONOTONE`); return them. A change with runs keeps their verdict."""
    if not monotone(space):
        return []
    out = [x for x in screen if x.ok is False and x.eval_ne]
    found = []
    for x in screen:
        by = next((o for o in out if further_out(x.change, o.change, space.baseline)), None)
        if x.ok is None and not x.eval_ne and by is not None:
            x.ok, x.reason = False, f"as {by.label} is, without a run of its own ({MONOTONE[x.name].why})"
            found.append(x)
    return found


def stacked_diffs(made: frozenset[Change], screen: list[Screened],
                  base_ne: Sequence[float | None]) -> list[float] | None:
    """Per seed, the sum of the relative eval-NE differences the screen measured for each change in
    `made` alone: what a configuration making them all would cost, were the costs to add. A change
    another in `made` may cover (`numerics.COVERS`) adds nothing. None where a change has no runs
    paired on two seeds or a run failed. Only an expectation, to order work by (which candidate's
    quality runs come first: `cubic.tune.candidates.Candidates.turn`), never a verdict: a stack is
    judged by its own runs."""
    own = [c for c in made if not COVERS.get(c, frozenset()) & made]
    runs = {x.change: x.eval_ne for x in screen}
    if not own or any(c not in runs for c in own):
        return None
    n = min(len(base_ne), *(len(runs[c]) for c in own))
    cols = [base_ne[:n], *(runs[c][:n] for c in own)]
    if n < 2 or any(v is None or not math.isfinite(v) for col in cols for v in col):
        return None
    return [sum((runs[c][i] - base_ne[i]) / base_ne[i] for c in own)  # type: ignore[operator]
            for i in range(n)]


@dataclass(frozen=True)
class Decision:
    """A change's verdict from its runs so far (`decision`), with the figures it rests on: `diff`, the
    paired eval NE difference over `seeds` seeds (None: a run failed, or none ran); `judgement`, the
    gate's paired judgement where all `qr.seeds` ran (None: one seed decided, or none yet)."""

    ok: bool | None
    reason: str
    diff: float | None = None
    seeds: int = 0
    judgement: Judgement | None = None


def decision(s: Screened, base_ne: list[float | None], qr: QualityRuns) -> Decision:
    """A change's verdict from its quality runs paired by seed with the baseline's (ok None: run the next
    seed). One seed decides where it is clear: within the tolerance the change passes for now (every
    configuration that uses it is still judged by its own runs; on demand, a change the search settles
    on gets its other seeds: `QualityChecks.due_screen`), far past it (EARLY_REJECT x) it fails; in
    between, all seeds and the paired judgement of the gate (`cubic.quality.rules.judge`)."""
    ran = min(len(s.eval_ne), len(base_ne))
    n = min(ran, qr.seeds)  # the gate judges the first `qr.seeds`; a failure in any run counts
    if n == 0:
        return Decision(None, "")
    if None in s.eval_ne[:ran]:
        return Decision(False, "its quality run failed", seeds=n)
    d = paired_mean(s.eval_ne[:n], base_ne[:n])
    if d is None or paired_mean(s.eval_ne, base_ne) is None:  # a baseline run failed: the gate says so
        return Decision(None, "", seeds=n)
    if n < qr.seeds:
        if d <= qr.tolerance:
            return Decision(True, f"eval NE {d:+.3%} vs baseline after {n} seed(s), within {qr.tolerance:.2%}",
                            d, n)
        if d > EARLY_REJECT * qr.tolerance:
            return Decision(False, (f"eval NE {d:+.3%} vs baseline after {n} seed(s), over {EARLY_REJECT:g} x "
                                    f"the {qr.tolerance:.2%} tolerance"), d, n)
        return Decision(None, "", d, n)
    j = judge(s.eval_ne[:n], base_ne[:n], qr.tolerance, qr.confidence)  # type: ignore[arg-type]
    return Decision(j.ok, j.reason, j.diff, n, j)


def decide(s: Screened, base_ne: list[float | None], qr: QualityRuns) -> tuple[bool | None, str]:
    """`decision`'s verdict and reason, as the screen stores them."""
    r = decision(s, base_ne, qr)
    return r.ok, r.reason


def cell(s: Screened, base_ne: list[float | None], qr: QualityRuns) -> str:
    """The summary's one line for a change: its verdict, then the paired eval NE difference over the runs
    that decided it (`decision`), with the interval where the gate judged and the seeds; a change ruled out
    by another, or whose run failed, says so. The full reason is the report's (`Screened.reason`)."""
    if s.verdict == NOT_RUN:
        return NOT_RUN
    head = s.verdict
    r = decision(s, base_ne, qr)
    if r.seeds == 0:  # ruled out with another (`implied_out`): the reason names it, then why
        return f"{head}: {s.reason.split(' (')[0]}" if s.reason else head
    if r.diff is None:
        return f"{head}: a quality run failed"
    seeds = f"{r.seeds} seed{'s' * (r.seeds != 1)}"
    if r.judgement is None:  # one seed decided, before the paired judgement
        far = f", over {EARLY_REJECT:g}x the tolerance" if r.diff > EARLY_REJECT * qr.tolerance else ""
        return f"{head}: eval NE {r.diff:+.3%}, {seeds}{far}"
    j = r.judgement
    ci = f", {j.confidence:.0%} CI {j.ci[0]:+.2%}..{j.ci[1]:+.2%}" if j.ci else ""
    return f"{head}: eval NE {r.diff:+.3%}{ci}, {seeds}"


def load(attrs: dict[str, Any]) -> list[Screened]:
    """The screen stored in a study's user attrs (empty if none ran)."""
    return [Screened.from_dict(d) for d in attrs.get(ATTR) or []]


def ruled_out(attrs: dict[str, Any]) -> frozenset[tuple[str, Any]]:
    """The changes the stored screen failed."""
    return frozenset(s.change for s in load(attrs) if s.ok is False)


def failing_changes(space: SearchSpace, params: dict[str, Any], out: frozenset[tuple[str, Any]]) -> list[str]:
    """The changes of params that the screen ruled out, as labels ("emb_optimizer=sgd")."""
    if not out:
        return []
    return sorted(f"{n}={v}" for n, v in blocking(space.numerics_changes(params), out))


def excluded_tuples(space: SearchSpace, out: frozenset[tuple[str, Any]]) -> frozenset[tuple]:
    """Every enumerable configuration of the space that contains a ruled-out change (cached per space
    and verdicts: samplers ask on every proposal); empty for spaces too large to enumerate."""
    if not out or space.all_tuples is None:
        return frozenset()
    if out not in space._excluded:
        space._excluded[out] = frozenset(t for t in space.all_tuples
                                         if blocking(space.numerics_changes(space.params_of(t)), out))
    return space._excluded[out]
