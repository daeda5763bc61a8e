"""The confirm's candidates: what each screened configuration has run and still wants, its phase
(`Phase`, named in one place: `Candidates.phase`), and the gate that turns its runs into a
verdict with its reason. The walk that runs them, one at a time, and the back-off are
`cubic.tune.confirm`'s."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from optuna.trial import TrialState

from cubic.quality.rules import (
    FUTILE,
    MORE,
    NOT_RESOLVED,
    Verdict,
    matched_ne,
    noise_floor,
    pass_chance,
    same_runs,
    within,
)
from cubic.quality.screen import stacked_diffs
from cubic.space.quality_runs import QualityRuns
from cubic.study.record import TrialRecord
from cubic.tune.checks import QualityChecks, early_reject, paired_diff
from cubic.tune.context import Tuning
from cubic_harness.config import TrialResult


class Phase(StrEnum):
    """Where a screened candidate stands (`Candidates.phase`). Why named: what the walk runs next
    for a candidate, and whether it counts as passed or still open, hangs on it."""

    # not run; a twin that trains the same model is still being judged: its verdict comes first
    WAITING = "waiting"
    # undecided, not re-measured: its first run decides whether quality runs are due
    MEASURING = "measuring"
    # re-measured; what decides (its quality runs, or the baseline's NE) is not all in
    JUDGING = "judging"
    # passed the gate, or needs none: its other re-measurements are due
    PASSED = "passed"
    # rejected (its quality, a crashed re-measurement, or too slow to win): nothing more is due
    FAILED = "failed"

    @property
    def open(self) -> bool:
        """Not decided yet: it may still pass."""
        return self not in (Phase.PASSED, Phase.FAILED)


@dataclass(frozen=True)
class Outrun:
    """Why a candidate cannot win (`Candidates.cannot_win`): the baseline's 1.0, or the would-be
    winner, a configuration that passed, is at least as fast by what was measured."""

    speedup: float  # its final speed-up, or (`final` False) the best it was measured at
    final: bool
    lead: TrialRecord | None  # the configuration that passed (None: the baseline)
    low: float  # the range of paired speed-ups re-measured for `lead` (1.0: the baseline)
    top: float

    def reason(self, seeds: int, passed: bool = False) -> str:
        """Why, in a line; `passed`: t passed, and is spared its other re-measurements."""
        spent = ("no further quality run was spent on it (its runs so far: the report)" if seeds
                 else "no quality run was spent on it")
        if passed and self.lead is not None:
            return (f"passed, at most {self.speedup:.2f}x (its search run and pairs so far), within "
                    f"#{self.lead.number}'s {self.low:.2f}-{self.top:.2f}x: it cannot win, so it is "
                    "not re-measured further")
        if self.lead is None:
            return (f"at most {self.speedup:.2f}x the baseline (search, and re-measured beside it): "
                    f"it cannot win, so {spent}")
        n, rng = self.lead.number, f"{self.low:.2f}-{self.top:.2f}x"
        if not self.final:
            return (f"at most {self.speedup:.2f}x (its search run and first pair), within #{n}'s "
                    f"{rng} (it passed): it cannot win, so {spent}")
        return (f"{self.speedup:.2f}x re-measured, not measurably faster than #{n}'s {rng} (it "
                f"passed): it cannot win, so {spent}")


class Candidates:
    """The confirm's state: the ranked trials, the baseline, the candidates screened so far and
    the runs in flight; one candidate's phase, what it wants next and its gate."""

    def __init__(self, ctx: Tuning, checks: QualityChecks) -> None:
        self.ctx, self.checks = ctx, checks
        self.qr = ctx.policy.quality_runs
        self.reps = ctx.policy.repeats
        self.ranked = sorted(ctx.store.records(TrialState.COMPLETE),
                             key=lambda t: -(t.value or 0.0))
        self.base = ctx.baseline_of(self.ranked)
        # with quality runs the in-run estimate only guides the searcher: over the first samples
        # after warm-up it fails larger batches for training fewer steps on them, which held-out
        # quality does not
        self.cands = [t for t in self.ranked if t is not self.base and (
            t.quality_heldout_ok is not False if self.qr else t.quality_est_ok is not False)]
        carried = ctx.policy.carried
        # a simulated study crowns only what real quality runs judged (`cubic.quality.carried`)
        self.uncrowned = ([] if carried is None else
                          [(t, c.reason) for t in self.cands if not (c := carried.crown(t.params)).ok])
        if self.uncrowned:
            out = {t.number for t, _ in self.uncrowned}
            self.cands = [t for t in self.cands if t.number not in out]
        self.screened: list[TrialRecord] = []  # in rank order, then the back-off trials
        self.walked = 0  # candidates the walk took from `cands`
        self.inflight: dict[int, int] = {}  # trial number -> re-measurements in flight
        # trial number -> the baseline's qps just run before its next
        self.beside: dict[int, float | None] = {}
        self.qinflight: dict[int, int] = {}  # trial number -> quality runs in flight
        # spared for one that passed, and said so (`tell_spared`): why, kept, since the baseline's median
        # drifts with the machine and would turn a search run's bound over and back
        self.spared: dict[int, Outrun] = {}
        # a numerics key -> the key whose quality runs its own equal bit for bit (`same_model` case 2)
        self.alike: dict[tuple, tuple] = {}

    # ------------------------------------------------------------------ state of one candidate
    def key(self, t: TrialRecord) -> tuple:
        """t's model: its numerics key, or the key its quality runs were found to equal bit for bit."""
        k = self.ctx.space.numerics_key(t.params)
        while k in self.alike:
            k = self.alike[k]
        return k

    def runs(self, t: TrialRecord) -> int:
        return len(t.confirm_qps) + len(t.confirm_failed)

    def qdone(self, t: TrialRecord | None) -> int:
        return len(t.quality_eval_ne) if t is not None else 0

    def verdict(self, t: TrialRecord) -> bool | None:
        """Whether t passed (None while undecided: no run back yet, or the baseline's NE not in
        yet); the walk reads it as `phase`."""
        if t.confirm_failed:
            return False
        if not self.ctx.policy.judges_quality or not self.ctx.space.differs_in_numerics(t.params):
            return True
        if self.qr is not None:  # quality runs decide, sequentially (`rules.sequential`)
            state, _ = self.checks.sequential(t, self.base)
            if state == MORE:  # still open, unless it can no longer win
                return False if self.cannot_win(t) is not None else None
            if state != Verdict.PASSED:  # rejected for its model: its speed no longer matters
                return False
            return True if t.confirm_qps else None
        if not t.confirm_ne or self.base is None or not self.base.confirm_ne:
            return None
        return self.gate(t)[0]

    def phase(self, t: TrialRecord) -> Phase:
        """t's phase, from its verdict (`verdict`), its re-measurements and its twins'."""
        v = self.verdict(t)
        if v is not None:
            return Phase.PASSED if v else Phase.FAILED
        if t.confirm_qps:
            return Phase.JUDGING
        return Phase.WAITING if self.twin_judged(t) is not None else Phase.MEASURING

    def cannot_win(self, t: TrialRecord) -> Outrun | None:
        """What t cannot beat, so that no (further) quality run is spent on it (None: it may still
        win, or nothing to compare yet). The baseline: neither a re-measurement over the
        baseline's run beside it nor its search run over the baseline's re-measured median beat
        it. The would-be winner (of those that passed, the fastest median): t's re-measurements,
        once all in, are not measurably faster than its (`told_faster`); before that, the best of
        them and of t's search run is within its range. Judging t's quality could then change the
        winner's name, not a speed the measurements can tell apart."""
        if self.base is None or t is self.base or not t.confirm_qps or not self.base.confirm_qps:
            return None
        if (said := self.spared.get(t.number)) is not None:
            return said
        mine = self.ratios(t)
        best = self.best_so_far(t)
        if best <= 1.0:
            return Outrun(best, False, None, 1.0, 1.0)
        if not self.final(t):
            return self.within_reach(t)
        lead = self.would_win()
        if lead is None or lead is t:
            return None
        theirs = self.ratios(lead)
        spared = spares(theirs, mine, (self.qr or QualityRuns).confidence)
        return Outrun(statistics.median(mine), True, lead, min(theirs), max(theirs)) if spared else None

    def outpaced(self, t: TrialRecord) -> Outrun | None:
        """Why t, which passed, cannot beat the would-be winner (None: it may): `within_reach`
        before its pairs are all in. Its further re-measurements could change the winner's name,
        not a speed they can tell apart, so it gets none and is not crowned: the other layouts of a
        model that passed are re-measured only where they may be faster."""
        if (self.base is None or t is self.base or not self.base.confirm_qps or self.final(t)
                or self.phase(t) is not Phase.PASSED):
            return None
        return self.spared.get(t.number) or self.within_reach(t)

    def best_so_far(self, t: TrialRecord) -> float:
        """The best of t's pairs so far and its search run over the baseline's re-measured median
        (the baseline re-measured): the most its speed-up can turn out to be."""
        assert self.base is not None and self.base.confirm_qps
        return max([*self.ratios(t), (t.value or 0.0) / statistics.median(self.base.confirm_qps)])

    def within_reach(self, t: TrialRecord) -> Outrun | None:
        """The would-be winner, where `best_so_far(t)` is within its `reach` (None: it is not, or
        there is none): the spare rule before t's pairs are all in."""
        lead = self.would_win()
        if lead is None or lead is t:
            return None
        best, theirs = self.best_so_far(t), self.ratios(lead)
        return Outrun(best, False, lead, min(theirs), max(theirs)) if best <= reach(theirs) else None

    def would_win(self) -> TrialRecord | None:
        """Of the candidates that passed with their speed-ups final, the fastest median: the winner
        if nothing faster passes (None: none)."""
        leads = [o for o in self.screened if o.confirm_qps and self.passed_final(o)]
        return max(leads, key=lambda o: statistics.median(self.ratios(o)), default=None)

    def beyond_reach(self, t: TrialRecord) -> TrialRecord | None:
        """The would-be winner where t, not screened yet, cannot beat it: t's search run over the
        baseline's re-measured median is within its range of pairs (None: t may). Every later
        candidate of the ranking (by search run) cannot either, so the walk ends there."""
        lead = self.would_win()
        if lead is None or self.base is None or not self.base.confirm_qps:
            return None
        bmed = statistics.median(self.base.confirm_qps)
        return lead if (t.value or 0.0) / bmed <= reach(self.ratios(lead)) else None

    def final(self, t: TrialRecord) -> bool:
        """All of t's re-measurements are in (`reps_of`): its speed-up will not change."""
        return self.runs(t) >= self.reps_of(t) and not self.inflight.get(t.number)

    def reps_of(self, t: TrialRecord) -> int:
        """The re-measurements t's speed-up rests on: `repeats`, and up to twice that for an open
        candidate whose pairs so far tell it faster than the would-be winner (`told_faster`), as
        long as they do. Why: that lead is all that sends it to its quality runs (up to
        `max_seeds` of its own and the baseline's, each ~10x a pair), so it is confirmed first on
        more of the cheap runs: among many layouts of a stack, one is just measurably faster on
        three pairs by chance (a baseline run in a slow spell is enough), and quality runs spent
        on a stack at the tolerance may end "not resolved"."""
        if (self.qr is None or self.base is None or t is self.base or self.runs(t) < self.reps
                or t.confirm_failed or not self.ctx.space.differs_in_numerics(t.params)
                or self.checks.sequential(t, self.base)[0] != MORE):
            return self.reps
        lead = self.would_win()
        if lead is None or lead is t:
            return self.reps
        faster = told_faster(self.ratios(t), self.ratios(lead), self.qr.confidence)
        return CONFIRM_LEAD * self.reps if faster else self.reps

    def passed_final(self, o: TrialRecord) -> bool:
        """o passed the gate and its speed-up is final: what a candidate must beat. (Read from its
        runs, not `phase`, which asks `cannot_win`.)"""
        if o is self.base or o.confirm_failed:
            return False
        if self.ctx.space.differs_in_numerics(o.params) and (
                self.qr is None or self.checks.sequential(o, self.base)[0] != Verdict.PASSED):
            return False
        return self.final(o)  # (after the verdict: an open one's `reps_of` asks `would_win`)

    def focus(self) -> TrialRecord | None:
        """The open candidate whose quality runs come next (None: none is ready, or a candidate's
        pairs come first: `turns`). One at a time, the fastest by its final speed-up first,
        since a slower one that passed would not spare it, while its pass spares every slower one
        (`cannot_win`). Of those whose pass would spare the fastest (`spares`), the likeliest
        pass per run first (`turn`), which may spare the others. Why not every one the fastest is not
        measurably faster than: a slower one cheaper to start may pass and still leave the fastest
        to be judged, so its runs decide nothing."""
        pick, _ = self.turns()
        return pick

    def turns(self) -> tuple[TrialRecord | None, TrialRecord | None]:
        """(`focus`, the candidate whose pairs come first; None where there is none). Pairs come
        first for a candidate whose lead over the would-be winner is being confirmed (`reps_of`),
        then for one that may take the focus: its pairs not all in, the best of them and its search
        run at least the slowest pair of the fastest ready one, and its turn before the focus's."""
        if self.qr is None or self.base is None:
            return None, None
        judging = [t for t in self.screened if t is not self.base and t.confirm_qps
                   and self.phase(t) is Phase.JUDGING]
        # a lead over the would-be winner is confirmed on more pairs before any quality run
        leads = [t for t in judging if self.reps <= self.runs(t) and not self.final(t)]
        if leads:
            return None, max(leads, key=lambda t: statistics.median(self.ratios(t)))
        ready = [t for t in judging if self.final(t)]
        if not ready:
            return None, None
        speed = {t.number: self.ratios(t) for t in ready}
        top = max(speed.values(), key=statistics.median)
        tied = [t for t in ready if spares(speed[t.number], top, self.qr.confidence)]
        pick = min(tied, key=lambda t: (*self.turn(t), -statistics.median(speed[t.number])))
        its_turn = self.turn(pick)  # (a pass chance each: once, not once per candidate)
        contenders = [t for t in judging if not self.final(t) and self.turn(t) < its_turn
                      and self.best_so_far(t) >= min(top)]
        if contenders:
            return None, max(contenders, key=lambda t: statistics.median(self.ratios(t)))
        return pick, None

    def turn(self, t: TrialRecord) -> tuple[float, int]:
        """What orders candidates as fast as each other for quality runs, the likeliest pass per run
        first: the runs t's next seed takes (its own, and the baseline's where that seed is not in)
        over its chance to pass within the seed budget (`rules.pass_chance`), then those runs.
        The chance rests on t's own pairs; before two, on what its changes cost alone in the
        screen, summed per seed (`screen.stacked_diffs`); without either, 0.5. Why: a stack whose
        interval straddles the tolerance may take every seed of the budget to end "not resolved",
        while one as fast and clearly within it passes in a few runs and spares the other. A stack
        of two changes that each cost about +0.06% alone sits near a 0.10% tolerance: taken first
        for its cheaper first seed, it spends three runs to end "not resolved" beside one as fast
        that then passes."""
        assert self.qr is not None and self.base is not None
        cost = 1 + (self.qdone(self.base) <= self.qdone(t))
        _, j = self.checks.sequential(t, self.base)
        diffs = j.diffs if j is not None and len(j.diffs) >= 2 else stacked_diffs(
            self.ctx.space.numerics_changes(t.params), self.checks.screen,
            self.base.quality_eval_ne)
        chance = 0.5
        if diffs is not None:
            diffs = diffs[:self.qr.max_seeds - 1]  # (a chance over the seeds still to come)
            chance = pass_chance(diffs, self.qr.tolerance, self.qr.confidence, self.qr.max_seeds)
        return cost / max(chance, MIN_CHANCE), cost

    def ratios(self, t: TrialRecord) -> list[float]:
        """t's re-measured speed-ups: paired, else over the baseline's re-measured median, else
        (the baseline not re-measured) its re-measured qps."""
        if t.paired_ratios:
            return t.paired_ratios
        if self.base is not None and self.base.confirm_qps:
            bmed = statistics.median(self.base.confirm_qps)
            return [q / bmed for q in t.confirm_qps]
        return list(t.confirm_qps)

    def seeds_wanted(self, t: TrialRecord) -> int:
        """How many quality seeds t's verdict needs by now: the first `seeds`, then one more pair
        at a time while its interval straddles the tolerance, for one candidate at a time
        (`focus`); the baseline its first `seeds`, and as many as that one wants (the pairs)."""
        if t is self.base:
            return max([self.qr.seeds, *(self.seeds_wanted(f) for f in [self.focus()] if f)])
        if self.phase(t) is not Phase.JUDGING or t is not self.focus():  # (one at a time)
            return 0
        pairs = min(self.qdone(t), self.qdone(self.base))
        return min(self.qr.max_seeds, max(self.qr.seeds, pairs + 1))

    def quality_seed(self, t: TrialRecord) -> int | None:
        """The seed of t's next quality run, if it needs one now: the baseline's first (the noise
        floor, and the pairs), then each numerics-changing candidate after its first speed run,
        its seed n once the baseline's seed n is in."""
        if self.qr is None:
            return None
        n = self.qdone(t) + self.qinflight.get(t.number, 0)
        if n >= self.seeds_wanted(t):
            return None
        if t is self.base:
            return n
        if self.qdone(self.base) <= n or None in self.base.quality_eval_ne:
            return None
        if (found := self.same_model(t, n)) is not None:
            owner, how = found
            self.ctx.store.update(t, **owner.heldout(verdict=False))
            self.ctx.view.note(
                f"quality: #{t.number}{how}, so #{owner.number}'s quality runs apply")
            return None
        return n

    def settled(self, o: TrialRecord) -> bool:
        """o's quality runs so far decide its model: some are in, none in flight, and the verdict
        wants no more."""
        return bool(self.qdone(o)) and not self.qinflight.get(o.number) and \
            self.checks.sequential(o, self.base)[0] != MORE

    def same_model(self, t: TrialRecord, n: int) -> tuple[TrialRecord, str] | None:
        """A candidate whose quality runs are t's, and how that is known (None: none):
        1. the same model (`key`) on the same samples, t's own n runs so far its first ones, settled,
           or holding more of them (here also one that cannot win: it holds its model's runs);
        2. another key, and t's own first n >= IDENTICAL_SEEDS runs equal to its first n bit for
           bit (eval NE and AUC): from then on one model (`alike`), its runs pooled seed by seed,
           settled or not. A knob that rounds nothing the model does not round anyway (bf16
           communication of embeddings that bf16 dense math reads) is inert for it, which no rule
           over knobs can know for every model (`numerics.COVERS` names where it may), and the runs
           show (after `IDENTICAL_SEEDS` runs)."""
        if self.qinflight.get(t.number):
            return None
        key = self.key(t)
        twin = next((o for o in self.screened if o is not t and self.key(o) == key
                     and (self.settled(o) or self.qdone(o) > n and not self.qinflight.get(o.number))),
                    None)
        if twin is not None and t.quality_eval_ne == twin.quality_eval_ne[:n]:
            return twin, f" trains what #{twin.number} trains"
        if n != len(t.quality_eval_ne) or t.quality_runs_of is not None:
            return None
        alike = next((o for o in self.screened if o is not t and o is not self.base
                      and self.key(o) != key and self.qdone(o) >= n
                      and not self.qinflight.get(o.number)
                      and same_runs(t.quality_eval_ne, t.quality_eval_auc, o.quality_eval_ne,
                                    o.quality_eval_auc)), None)
        if alike is None:
            return None
        self.alike[key] = self.key(alike)
        space = self.ctx.space
        knobs = dict.fromkeys(space.differs_in_numerics(t.params)
                              + space.differs_in_numerics(alike.params))
        inert = ", ".join(f"{k} {t.params.get(k)} vs {alike.params.get(k)}" for k in knobs
                          if t.params.get(k) != alike.params.get(k))
        return alike, (f"'s first {n} quality runs equal #{alike.number}'s bit for bit: the same "
                       f"model here ({inert}: no change to what it trains)")

    def wants(self, t: TrialRecord) -> bool:
        """One more re-measurement of t now? A candidate being screened gets its first, and all of
        them once quality runs are to judge it; one that passed gets the rest."""
        n = self.runs(t) + self.inflight.get(t.number, 0)
        if n >= self.reps_of(t):
            return False
        phase = self.phase(t)
        if phase is Phase.PASSED and self.outpaced(t) is not None:
            return False
        # all before its quality runs, one candidate at a time (`next_judged`): a pair costs a fifth of
        # a quality run, and with its speed final `focus` weighs it and `cannot_win` spares by it
        return (phase is Phase.PASSED or (phase is Phase.MEASURING and n == 0) or t is self.base
                or (phase is Phase.JUDGING and self.qr is not None and self.next_judged() is t))

    def next_judged(self) -> TrialRecord | None:
        """The open candidate whose other re-measurements are due, before its quality runs: one that
        may take the focus (`turns`), else, once none is ready for quality runs (`focus`), the
        fastest by its pairs so far; None: none. Why one at a time: a pass spares every slower
        candidate on its first pair (`cannot_win`), so re-measuring every open candidate in full
        first spends most runs on candidates a pass would have spared."""
        if self.qr is None:
            return None
        pick, first = self.turns()
        if first is not None or pick is not None:
            return first
        judged = [t for t in self.screened if t is not self.base and not self.final(t)
                  and self.phase(t) is Phase.JUDGING]
        return max(judged, key=lambda t: statistics.median(self.ratios(t)), default=None)

    def model_of(self, t: TrialRecord) -> tuple:
        """What t's quality verdict is a verdict of: its model (numerics key) where it changes
        numerics, else itself (a layout passes on its own)."""
        return (("model", self.key(t)) if self.ctx.space.differs_in_numerics(t.params)
                else ("layout", t.number))

    def twin_judged(self, t: TrialRecord) -> TrialRecord | None:
        """A candidate screened before t that trains the same model and is still being judged
        (None: none). t's first re-measurement waits for that verdict: a rejection reaches t
        without a run of its own (`inherit_rejection`), a pass with its quality runs
        (`quality_seed`). Why: the walk screens a model's layouts together, and a pair of runs
        spent on one before its twin's verdict is wasted where that verdict rejects the model
        (about five pairs a `make tune`). A twin re-measured slower than t may be does not hold
        it (`may_outrun`)."""
        if (self.qr is None or t not in self.screened
                or not self.ctx.space.differs_in_numerics(t.params)):
            return None
        key = self.key(t)
        earlier = self.screened[:self.screened.index(t)]
        return next((o for o in earlier if self.key(o) == key
                     and self.verdict(o) is None and not self.may_outrun(t, o)), None)

    def may_outrun(self, t: TrialRecord, o: TrialRecord) -> bool:
        """Whether t, not re-measured, may be faster than its twin o, whose re-measurements are
        all in: t's search run over the baseline's re-measured median is above o's median
        speed-up. A model's quality runs go to it by its fastest layout (`focus`), so t's one
        pair comes before the verdict. Why: the model's fastest layout is the one its verdict
        matters for; held behind a slower twin, t stays unmeasured while the quality runs go to
        slower stacks, and the confirm may crown one of those over it."""
        if (self.base is None or not self.base.confirm_qps or not o.confirm_qps
                or not self.final(o)):
            return False
        bound = (t.value or 0.0) / statistics.median(self.base.confirm_qps)
        return bound > statistics.median(self.ratios(o))

    def inherit_rejection(self, t: TrialRecord) -> None:
        """Give t, not yet run, the verdict of a screened twin whose quality runs (its own, or a
        search-time check's it holds) rejected the model; t's own runs so far are the same
        model's, so the twin's include them. A twin that failed for another reason (a crashed
        re-measurement, too slow to win) passes none."""
        space = self.ctx.space
        if (self.runs(t) or self.inflight.get(t.number) or self.qinflight.get(t.number)
                or not space.differs_in_numerics(t.params) or self.phase(t) is Phase.FAILED):
            return
        key = self.key(t)
        rejected = next((o for o in self.screened if o is not t
                         and len(o.quality_eval_ne) >= max(1, self.qdone(t))
                         and not self.qinflight.get(o.number)
                         and self.key(o) == key
                         and self.checks.sequential(o, self.base)[0] not in (MORE, Verdict.PASSED)),
                        None)
        if rejected is not None:
            self.ctx.store.update(t, **rejected.heldout())
            self.ctx.view.note(f"quality: #{t.number} trains what #{rejected.number} trains: "
                               "rejected with it, not re-measured")

    def adopt_twin(self, t: TrialRecord) -> None:
        """Give t the runs of a screened twin that trains the same model and holds more of them,
        settled (passed, or not) or spared: its model's verdict before its own speed is weighed.
        Why here and not only when t asks for a seed: quality runs go to one candidate at a time,
        and a layout of a model that passed was spared as "not judged" while waiting its turn."""
        if (self.qr is None or self.qinflight.get(t.number)
                or not self.ctx.space.differs_in_numerics(t.params)):
            return
        found = self.same_model(t, self.qdone(t))
        if found is not None and self.qdone(found[0]) > self.qdone(t):
            owner, how = found
            self.ctx.store.update(t, **owner.heldout(verdict=False))
            self.ctx.view.note(f"quality: #{t.number}{how}, so #{owner.number}'s quality runs apply")

    def tell_spared(self, t: TrialRecord) -> None:
        """Say once that t is spared by one that passed: still being judged, its quality runs;
        passed, its other re-measurements."""
        if t.number in self.spared:
            return
        out = self.outpaced(t)
        if out is not None:
            self.spared[t.number] = out
            self.ctx.view.note(f"confirm: #{t.number} {out.reason(self.qdone(t), passed=True)}")
            return
        if (self.qr is None or not self.ctx.space.differs_in_numerics(t.params)
                or self.checks.sequential(t, self.base)[0] != MORE):
            return
        out = self.cannot_win(t)
        if out is not None and out.lead is not None:
            self.spared[t.number] = out
            self.ctx.view.note(f"confirm: #{t.number} {out.reason(self.qdone(t))}")

    def next_remeasure(self) -> tuple[TrialRecord, TrialRecord | None] | None:
        """The next re-measurement, as (whose, the candidate it pairs with): a candidate's own
        run right after the baseline's beside it (step 3), the pair's other half first; the
        baseline alone only for its own `repeats`, once no candidate wants a run (None: nothing
        to re-measure now)."""
        t = (next((c for c in self.screened if c.number in self.beside), None)
             or next((c for c in self.screened if self.wants(c)), None))
        if t is not None:
            return (t, None) if self.base is None or t.number in self.beside else (self.base, t)
        return (self.base, None) if self.base is not None and self.wants(self.base) else None

    @staticmethod
    def speed(t: TrialRecord) -> float:
        """Its re-measured median, or its search run where it was not re-measured."""
        return statistics.median(t.confirm_qps) if t.confirm_qps else (t.value or 0.0)


    def record(self, t: TrialRecord, res: TrialResult) -> None:
        """Append a re-measurement's qps, the baseline's beside it, and its NE (over the
        baseline's samples) to t's record."""
        space, base = self.ctx.space, self.base
        beside = self.beside.pop(t.number, None)
        if res.status == "ok" and res.qps > 0:
            ne: float | None = res.ne
            if base is not None and t.number != base.number and space.differs_in_numerics(t.params):
                bres = base.result
                ne = matched_ne(res.losses, space.config(t.params), bres.get("losses") or [],
                                space.config(base.params), bres.get("ne"))
            paired = ({} if base is None or t is base
                      else {"confirm_base_qps": [*t.confirm_base_qps, beside]})
            self.ctx.store.update(t, confirm_qps=[*t.confirm_qps, res.qps],
                                  confirm_ne=[*t.confirm_ne, ne], **paired)
        else:
            failed = f"{res.status}: {res.error}"
            self.ctx.store.update(t, confirm_failed=[*t.confirm_failed, failed])

    # ------------------------------------------------------------------ the gate
    def gate(self, t: TrialRecord) -> tuple[bool, str]:
        """t's verdict and its reason, from what its re-measurements and quality runs say."""
        base, space, store = self.base, self.ctx.space, self.ctx.store
        why = early_reject(t, space.quality_runs, base)
        if why is not None:
            store.update(t, quality_eval_diff=paired_diff(t, base))
            return False, why
        if t.confirm_failed:
            return False, f"re-measurement failed: {t.confirm_failed[0]}"[:300]
        qr = space.quality_runs
        changed = space.differs_in_numerics(t.params)
        if not t.confirm_qps and not (changed and qr is not None and self.phase(t) is Phase.FAILED):
            return False, "not re-measured"  # (a model rejected for its quality needs no speed)
        if base is not None and t.number == base.number:
            if qr is not None and t.quality_eval_ne:
                ne = [x for x in t.quality_eval_ne if x is not None]
                noise = noise_floor(ne)
                sd = f", seed-to-seed sd {noise:.3%})" if noise is not None else ")"
                return True, (f"baseline (eval NE {statistics.mean(ne):.5f} over {len(ne)} seed(s)"
                              + sd if ne else
                              "baseline (its quality runs failed: " + str(t.quality_failed) + ")")
            return True, "baseline"
        if (changed and qr is not None and self.checks.sequential(t, base)[0] == MORE
                and (out := self.cannot_win(t)) is not None):
            store.update(t, quality_verdict=Verdict.SLOWER)
            return False, f"{out.reason(self.qdone(t))} (changes {', '.join(changed)})"
        if changed and not self.ctx.policy.judges_quality:
            carried = self.ctx.policy.carried
            if carried is not None:
                return True, f"simulated: {carried.crown(t.params).reason}"
            return True, (f"simulated: quality not judged (changes {', '.join(changed)}); a real "
                          "tune's quality gate judges it")
        if not changed:
            return True, ("numerics unchanged (only layout/kernel/pipelining knobs differ): "
                          "no quality run needed")
        if qr is not None:
            return self.gate_quality_runs(t, changed)
        ne_t = median_finite(t.confirm_ne)
        ne_b = median_finite(base.confirm_ne) if base is not None else None
        if ne_t is None or ne_b is None or ne_b <= 0:
            return False, f"changes {changed} but NE is unavailable (trial {ne_t}, baseline {ne_b})"
        rel = (ne_t - ne_b) / ne_b
        tol = space.quality_tolerance
        ok = within(ne_t, ne_b, tol)
        return ok, (f"NE {ne_t:.4f} vs baseline {ne_b:.4f}: {rel:+.2%} {'<=' if ok else '>'} "
                    f"{tol:.2%} (changes {', '.join(changed)})")

    def gate_quality_runs(self, t: TrialRecord, changed: list[str]) -> tuple[bool, str]:
        """The gate's verdict on t, a numerics change, from its quality runs (`rules.sequential`);
        stores the judgement's numbers on its record."""
        base, store, qr = self.base, self.ctx.store, self.ctx.space.quality_runs
        if t.quality_failed:
            return False, f"quality run failed: {t.quality_failed}"
        cand, bne = t.quality_eval_ne, base.quality_eval_ne if base else []
        if None in bne:
            return False, f"the baseline's quality runs failed: {base.quality_failed}"
        state, j = self.checks.sequential(t, base)
        if state == MORE or j is None:
            return False, (f"changes {', '.join(changed)} but its quality runs are incomplete "
                           f"({len(cand)} seed(s), at least {qr.seeds}; baseline {len(bne)})")
        store.update(t, quality_eval_diff=j.diff, quality_se=j.se, quality_noise=j.noise,
                     quality_resolved=j.resolved, quality_ci=j.ci, quality_verdict=state)
        n = len(j.diffs)
        if state != NOT_RESOLVED:
            head = state
        else:
            budget = ("the seed budget, quality.max_seeds" if n >= qr.max_seeds else
                      f"its chance to pass within quality.max_seeds={qr.max_seeds} is "
                      f"{j.pass_chance:.0%}, under {FUTILE:.0%}")
            head = (f"NOT RESOLVED after {n} paired seeds ({budget}): the interval straddles "
                    "the tolerance, so it is not crowned")
        return state == Verdict.PASSED, f"{head}: {j.reason} (changes {', '.join(changed)})"


def median_finite(xs: Any) -> float | None:
    vals = [float(x) for x in (xs or []) if x is not None and math.isfinite(float(x))]
    return statistics.median(vals) if vals else None


# How many times `repeats` an open candidate's pairs may grow to while they tell it faster than the
# would-be winner (`Candidates.reps_of`)
CONFIRM_LEAD = 2

# The least chance to pass a candidate's turn divides its runs by (`Candidates.turn`): a stack
# whose screened changes sum far past the tolerance still orders by its runs among such stacks
MIN_CHANCE = 1e-3

# How far above the would-be winner's median speed-up the spare rule may still say "cannot win": a
# candidate beyond it is judged however noisy the pairs. Why: one baseline run caught in a slow spell
# (17.8k samples/s among 26-30k) gave a passed 2D layout the pairs 1.46-2.56x (median 1.64x); every
# stack at 2.4-2.5x was then within its range and not measurably faster, and a `make tune` crowned
# 1.64x. The stacks the rule is for differ by a few percent (2.42x beside a pass at 2.31x).
REACH = 1.10


def reach(theirs: list[float]) -> float:
    """The highest speed-up the would-be winner's pairs `theirs` outrun: their range, and at most
    REACH x their median."""
    return min(max(theirs), REACH * statistics.median(theirs))


def spares(theirs: list[float], mine: list[float], confidence: float) -> bool:
    """Whether a pass of the candidate re-measured at speed-ups `theirs` leaves one at `mine` unable
    to win (`Candidates.cannot_win`): `mine` not measurably faster (`told_faster`), and their median
    within `reach` of `theirs`."""
    return not told_faster(mine, theirs, confidence) and statistics.median(mine) <= reach(theirs)


def told_faster(mine: list[float], theirs: list[float], confidence: float) -> bool:
    """Whether speed-ups `mine` are measurably above `theirs`: the `confidence` interval (the
    quality gate's) of the difference of their mean logs, Welch's, lies above 0; with a single
    measurement on either side, its median above all of theirs. Why logs: speed-ups are ratios,
    and a pair's noise is a share of its speed."""
    a, b = [math.log(x) for x in mine], [math.log(x) for x in theirs]
    if len(a) < 2 or len(b) < 2:
        return statistics.median(mine) > max(theirs)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    d = statistics.mean(a) - statistics.mean(b)
    if va + vb == 0:
        return d > 0
    from scipy.stats import t as student_t  # (as in `cubic.quality.rules`: slow to import)

    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return d - float(student_t.ppf(0.5 + confidence / 2, df)) * math.sqrt(va + vb) > 0
