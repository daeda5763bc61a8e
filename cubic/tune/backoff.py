"""The confirm's back-off plan (`cubic.tune.confirm`, step 4): which variant of a rejected configuration to
judge next.

A variant keeps the source's layout and a subset of its numerics changes; the others go back to the
baseline's values. With n changes there are 2^n - 1 variants below the source.
1. Order: fastest first. A variant the search ran is ordered by its search run; any other by the proxy's
   prediction (`cubic.search.proxy.Proxy`, fitted on the study's measured trials). Ties go to the variant
   that keeps more changes, then to the one whose dropped changes the screen measured costliest.
   Why not by the screen's cost: the screen judges each change alone over a seed or two, and stacked
   changes do not add up (bf16 dense and bf16 comm round the same activations). Dropping the change the
   screen found costliest can drop the one that carries the speed (dense bf16, 1.67x on the default space),
   while dropping fp16 tables instead keeps 1.46x and passes. Which variant passes is known only by judging
   it; what to judge first is the one that would win if it passed. The proxy's speed is taken relative to
   its own of the source, times the source's search run, so predicted and measured variants share a scale.
2. Prune by what was judged, on two monotone assumptions: a change only adds error, and it only adds speed.
   - A variant that keeps every change of one that failed (or was not resolved) would fail too.
   - A variant that keeps only changes of one measured no faster than the baseline cannot win.
   - A variant whose search run is no faster than the best that passed cannot win either; nor one
     that keeps a change whose own back-off trial ran no faster (it then costs no quality run).
3. Stop at the first variant that passes: every later one is expected slower.
4. Budget: at most n variants need quality runs, as many as a chain dropping one change at a time. The
   layout without any change needs only re-measurements, so it stays as the last resort beyond that budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cubic.quality.rules import Verdict
from cubic.space.numerics import blocking
from cubic.space.search_space import SearchSpace

PASSED, FAILED = Verdict.PASSED, Verdict.FAILED  # what judging a variant found: its quality verdict,
SLOW, CRASHED = "slow", "crashed"  # or that it was no faster, or did not run


@dataclass(frozen=True)
class Variant:
    """The source's layout keeping the numerics changes in `kept`."""

    kept: frozenset[str]
    params: dict[str, Any] = field(hash=False, compare=False)
    speed: float = 0.0  # its search run's qps where the search ran it, else the proxy's prediction (0: none)
    measured: bool = False  # `speed` is a measurement

    def label(self) -> str:
        return "keep " + ("+".join(sorted(self.kept)) if self.kept else "none (the layout alone)")


@dataclass
class BackoffPlan:
    """The variants in the order to judge them (`order`), what judging each found, and the budget."""

    order: list[Variant]
    budget: int  # variants that need quality runs (those that keep a change)
    outcomes: dict[frozenset[str], str] = field(default_factory=dict)
    spent: int = 0

    def next(self, best_passed: float) -> Variant | None:
        """The next variant to judge, or None: one passed, or the rest is pruned or over the budget.
        best_passed: the fastest re-measured median among the configurations that passed."""
        if PASSED in self.outcomes.values():
            return None
        for v in self.order:
            if v.kept in self.outcomes or (v.kept and self.spent >= self.budget):
                continue
            if v.measured and v.speed <= best_passed:
                continue
            if any(o == FAILED and k <= v.kept for k, o in self.outcomes.items()):
                continue
            if any(o == SLOW and v.kept <= k for k, o in self.outcomes.items()):
                continue
            self.spent += bool(v.kept)
            return v
        return None

    def record(self, v: Variant, outcome: str) -> None:
        self.outcomes[v.kept] = outcome

    def ran(self, v: Variant, qps: float, best_passed: float) -> bool:
        """v's own trial ran at `qps`: whether it is still worth judging. A variant that keeps a
        change and ran no faster than the best that passed cannot win (2.), so it is slow and costs
        no quality run; its subsets are pruned as slower still. The layout alone costs no quality
        run: its paired re-measurements judge it."""
        if v.kept and qps <= best_passed:
            self.record(v, SLOW)
            return False
        return True


def plan(space: SearchSpace, src: dict[str, Any], changed: Sequence[str],
         measured: Callable[[dict[str, Any]], float | None],
         predict: Callable[[list[dict[str, Any]]], list[float]] | None,
         cost: Callable[[str], float],
         ruled_out: frozenset[tuple[str, Any]] = frozenset()) -> BackoffPlan:
    """The back-off plan for source params `src` whose numerics changes (knobs) are `changed`.
    measured: a variant's search-run qps, None where the search did not run it; predict: the proxy's qps
    for variants (None: no proxy); cost: what the screen measured a knob's change alone to cost in eval NE;
    ruled_out: the changes (aspect, value) the screen ruled out alone; no variant keeps one where
    it is ruled out (2.: it failed alone; `numerics.blocking`). Why: such a variant fails as surely,
    and judging it costs its pairs and a quality run."""
    base = space.baseline_params()
    found: dict[tuple, tuple[frozenset[str], dict[str, Any]]] = {}
    for r in range(len(changed) - 1, -1, -1):  # most changes kept first: the tie-break's order
        for kept in itertools.combinations(changed, r):
            p = space.canonical({**src, **{k: base[k] for k in changed if k not in kept}})
            if space.valid(p) and not blocking(space.numerics_changes(p), ruled_out):
                found.setdefault(space.tup(p), (frozenset(kept), p))
    cands = list(found.values())
    speeds = [measured(p) for _, p in cands]
    guess = [i for i, s in enumerate(speeds) if s is None]
    if guess and predict is not None:
        for i, s in zip(guess, predict([cands[i][1] for i in guess]), strict=True):
            speeds[i] = s
    variants = [Variant(k, p, s or 0.0, i not in guess)
                for i, ((k, p), s) in enumerate(zip(cands, speeds, strict=True))]

    def dropped_cost(v: Variant) -> float:
        return sum(cost(k) for k in changed if k not in v.kept)

    order = sorted(variants, key=lambda v: (-v.speed, -len(v.kept), -dropped_cost(v)))
    return BackoffPlan(order, budget=len({k for v in variants for k in v.kept}))
