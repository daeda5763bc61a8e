"""The confirm step: re-measure the baseline and walk down the ranking until `confirm_top_k`
configurations pass the quality gate; the fastest confirmed one wins.

Why re-measure: the first measurement was selected for being high (winner's curse), so only
re-measurements count, each with the space's own warm-up and measured steps. Why walk rather than
take the top k: the fastest configurations are often fast *because* they change numerics (bigger
batches, SGD, low precision), and a gate that rejected the whole top k used to leave the baseline as
the "winner" of a 40-trial tune.

The walk, one run at a time (trials side by side on one node share its memory bandwidth and would
skew the very numbers that pick the winner):
1. Candidates: every completed trial but the baseline, fastest first, less those a check while
   searching already rejected (`TrialRecord.feasible`).
2. Screen the next candidate while fewer than k passed or may still pass (layouts of one model
   count once: they pass or fail with it; a tune whose first five candidates were one stack's
   layouts judged only that stack, 8 quality runs to "not resolved"), fewer than
   SCREEN_FACTOR x k candidates needed runs of their own, and its search run, over the baseline's
   re-measured median, is above the pairs of the would-be winner (of those that passed, the fastest
   median; `Candidates.beyond_reach`): the ranking is by search run, a measurement picked for being
   high, so no later candidate can beat that one. A candidate screened while a verdict was out,
   not yet run, leaves the walk the same way once that verdict makes it unable to win
   (`leave_unreachable`). One that trains a model already rejected inherits the verdict.
3. Every re-measurement of a candidate runs right after one of the baseline, and its speed-up is the
   median of those pairs' ratios (`TrialRecord.confirm_speedup`). Why: this machine drifts by 1.5x
   over minutes, and a baseline re-measured three times back to back caught one fast spell that
   every candidate measured later was compared with; a tune then crowned the baseline. A candidate
   that changes numerics gets one re-measurement first, then, where quality runs are to judge it,
   its other `repeats - 1` (a pair costs a fifth of a quality run), one candidate at a time, the
   fastest by its pairs so far (`Candidates.next_judged`), and while they tell it measurably faster
   than the would-be winner up to `repeats` more before its quality runs (`Candidates.reps_of`: that
   lead alone sends it to up to 2 x `max_seeds` quality runs); one that passed gets its other
   re-measurements unless the best of its search run and its pairs so far is within the would-be
   winner's pairs (`Candidates.outpaced`: it is then not crowned). It cannot win, and fails without
   a (further) quality run, where the best of its pairs and its search run is at most 1, or where
   its pairs are not measurably faster than those of the would-be winner, a configuration that
   passed (`Candidates.cannot_win`, `told_faster`: Welch's interval on the logs at the gate's
   confidence).
   Otherwise its quality runs decide (`cubic.quality.rules.sequential`: the first `seeds`, then one
   more pair while the interval straddles the tolerance, up to `max_seeds` or until its chance to
   pass within them is spent), or without quality runs its NE over the baseline's samples. Quality
   runs go to one candidate at a time, the fastest first, and among those whose pass would spare
   it (`spares`: not measurably slower, within its reach) the likeliest pass per run: the runs its
   next seed costs over its chance to pass within the seed budget, from its own pairs or, before
   two, from what its changes cost alone in the screen, summed per seed (`Candidates.focus`,
   `turn`); an open candidate that may be as fast and comes first by that gets its pairs before.
   Why: a pass spares every slower candidate its quality runs, while judged in rank order the
   runs go first to a stack near the tolerance that may end "not resolved" beside one as fast
   that would pass sooner.
   A model whose quality already failed (its own runs, or a twin's it inherits) is not re-measured
   at all, and a layout of a model still being judged on a faster twin waits for that verdict (not
   for a twin re-measured slower than its own search run: `Candidates.may_outrun`); one whose
   first quality runs equal another's bit for bit trains the same model (`same_model`); a
   candidate that passes gets its other re-measurements, unless outpaced. The baseline runs alone
   only up to its own `repeats`, once no candidate wants a run.
4. Back off (once the walk has nothing left to run): where the fastest configuration was rejected
   for quality (failed, or not resolved within the seed budget) and is faster than everything that
   passed, judge its layout with fewer of its numerics changes, one new trial at a time, in the
   order and with the pruning and budget of `cubic.tune.backoff`, stopping at the first that passes.
   Why: the fastest configurations stack two or three changes that each pass alone (fp16 tables,
   bf16 dense, bf16 comm), and their sum sits at the tolerance, where no seed budget resolves it;
   the walk then found nothing else that passed and the tune crowned the baseline, though the same
   layout with one change fewer was 1.4x faster and within the tolerance. A back-off trial is a new
   trial (phase "backoff"), judged as any candidate; it is the confirm's cost, not the search
   budget's.
5. The verdict and its reason go to every screened record (`quality_ok`, `quality_reason`)."""


from __future__ import annotations

import math
import statistics
import time
from typing import Any

from optuna.trial import TrialState

from cubic.execution.runner import Pending
from cubic.quality.rules import NOT_RESOLVED, Verdict, covering, paired_mean
from cubic.quality.screen import Screened
from cubic.search.proxy import Proxy
from cubic.search.samplers import distributions
from cubic.space.numerics import covered_where
from cubic.study.record import BACKOFF, TrialRecord
from cubic.tune import backoff
from cubic.tune.backoff import CRASHED, FAILED, PASSED, SLOW, BackoffPlan, Variant
from cubic.tune.candidates import Candidates, Phase, median_finite
from cubic.tune.checks import QualityChecks, reused
from cubic.tune.context import Tuning
from cubic.tune.work import BackoffRun, GateRun, RemeasureRun

__all__ = ["SCREEN_FACTOR", "Candidates", "Confirm", "Phase", "median_finite"]

SCREEN_FACTOR = 3  # confirm screens at most this many x confirm_top_k configurations
SHOWN = 5  # back-off variants the log names (a source with 7 changes has 127)


class Confirm(Candidates):
    """One confirm: `run()` returns the screened records (baseline first), each with its verdict."""

    def __init__(self, ctx: Tuning, checks: QualityChecks) -> None:
        super().__init__(ctx, checks)
        # the back-off's variants (`cubic.tune.backoff`; None: not planned)
        self.plan: BackoffPlan | None = None
        self.judging: Variant | None = None  # the back-off variant being judged
        self.last_backoff: TrialRecord | None = None  # its trial (None: it did not complete)

    # ------------------------------------------------------------------ the walk
    def run(self) -> list[TrialRecord]:
        ctx, space, view, base = self.ctx, self.ctx.space, self.ctx.view, self.base
        known_bad = len(self.ranked) - len(self.cands) - (base is not None) - len(self.uncrowned)
        if self.uncrowned:
            view.note(f"confirm: {len(self.uncrowned)} fast configuration(s) not crowned: real quality "
                      "runs ruled out, or never judged, a numerics change they make")
        if known_bad:
            view.note(f"confirm: {known_bad} fast configuration(s) skipped: " + (
                "held-out quality checks while searching rejected the model they train"
                if self.qr else
                "their search trials' NE over the baseline's samples already fails the quality "
                "gate"))
        k = space.confirm_top_k
        max_screen = min(len(self.cands), SCREEN_FACTOR * k)  # candidates with runs of their own
        if not ctx.policy.judges_quality:
            view.note("confirm: simulated trials: no quality gate (a simulation predicts no model "
                      "quality; " + ("numerics are crowned only as real quality runs judged them)"
                                     if ctx.policy.carried is not None else
                                     "a real tune of the winner judges it)"))
        view.note(f"confirm: baseline + the fastest configurations until {k} pass the quality gate "
                  f"(at most {max_screen} screened), {self.reps} re-measurements each"
                  if max_screen else
                  "confirm: the baseline only (no other configuration completed), "
                  f"{self.reps} re-measurements")
        pending: list[Pending] = []
        order: list[TrialRecord] = []
        idle = False
        while True:
            ctx.check_lease()
            if idle and pending:  # one run at a time, and nothing new to decide on until it ends
                idle = not self.collect(pending, order, eta=False)
                continue
            if self.screen_next(k, max_screen):
                t = self.cands[self.walked]
                self.walked += 1
                self.screened.append(t)
                continue
            self.leave_unreachable()
            for t in self.screened:  # the same model was rejected: its verdict, without a run
                self.inherit_rejection(t)
                self.adopt_twin(t)
                self.tell_spared(t)
            order = ([base] if base else []) + self.screened
            nxt = self.next_remeasure()
            if nxt is not None and not pending:  # one at a time (see the module docstring)
                job, pair = nxt
                cfg = space.config(job.params)
                if base is not None and job is not base and space.differs_in_numerics(job.params):
                    cfg = covering(cfg, space.config(base.params))
                pending.append(ctx.runner.submit(cfg, tag=RemeasureRun(job, beside=pair)))
                self.inflight[job.number] = self.inflight.get(job.number, 0) + 1
                continue
            qjob = next(((t, sd) for t in order if (sd := self.quality_seed(t)) is not None), None)
            if qjob is not None and not pending:
                t, sd = qjob
                qr = self.qr
                p = ctx.runner.submit(ctx.space.quality_config(t.params, sd), tag=GateRun(t, sd))
                pending.append(p)
                view.note(f"quality run: #{t.number} seed {sd + 1} (at least {qr.seeds}, at most "
                          f"{qr.max_seeds}), {qr.samples:,} samples, held-out {qr.eval_samples:,}"
                          + reused(p))
                self.qinflight[t.number] = self.qinflight.get(t.number, 0) + 1
                continue
            if not pending:
                # (a verdict a twin inherited above may have left the walk short of k)
                if not self.screen_next(k, max_screen) and not self.backoff(pending):
                    break
                continue
            idle = not self.collect(pending, order)
        return self.judge_all()

    def screen_next(self, k: int, max_screen: int) -> bool:
        """Whether the walk screens its next candidate (step 2)."""
        phases = [self.phase(t) for t in self.screened]
        passed = sum(ph is Phase.PASSED for ph in phases)
        # the models still open: layouts of one model pass or fail together
        undecided = len({self.model_of(t) for t, ph in zip(self.screened, phases, strict=True)
                         if ph.open})
        own = sum(t.quality_runs_of is None for t in self.screened)  # cost runs of their own
        return (passed < k and passed + undecided < k and own < max_screen
                and self.walked < len(self.cands) and not self.reached_end())

    def reached_end(self) -> bool:
        """Whether the rest of the ranking cannot beat the would-be winner (`beyond_reach`), said
        once."""
        t = self.cands[self.walked]
        lead = self.beyond_reach(t)
        if lead is not None:
            self.ctx.view.note(
                f"confirm: #{t.number} and the {len(self.cands) - self.walked - 1} after it in the "
                f"ranking ran at most {t.value or 0.0:,.0f} qps in the search, within the pairs "
                f"re-measured for #{lead.number}, which passed: not screened")
            self.walked = len(self.cands)
        return lead is not None

    def leave_unreachable(self) -> None:
        """Take out of the walk each candidate screened but not yet run whose search run is within
        the would-be winner's reach (`beyond_reach`), as `reached_end` leaves the rest of the
        ranking. Why: while a model's verdict is out the walk screens its layouts (they add no
        open model), and once it passes, each slower layout's first pair only told that it cannot
        win: 14 pairs, a tenth of a `make tune`, after the winner passed. One holding quality runs
        of its own, or with a run in flight, stays: its twins read their verdict from it."""
        lead = self.would_win()
        if lead is None:
            return
        gone = [t for t in self.screened if t is not self.base and t is not lead
                and not self.runs(t) and not self.inflight.get(t.number)
                and t.number not in self.beside and not self.qinflight.get(t.number)
                and not (self.qdone(t) and t.quality_runs_of in (None, t.number))
                and self.beyond_reach(t) is not None]
        if not gone:
            return
        self.screened = [t for t in self.screened if t not in gone]
        names = ", ".join(f"#{t.number}" for t in gone)
        self.ctx.view.note(
            f"confirm: {names} ran at most {max(t.value or 0.0 for t in gone):,.0f} qps in the "
            f"search, within the pairs re-measured for #{lead.number}, which passed: not "
            "re-measured")

    def collect(self, pending: list[Pending], order: list[TrialRecord], eta: bool = True) -> bool:
        """Record the runs that finished (up to half a second's wait), then the ETA over `order` (where any did,
        or `eta`); whether any did. Until one does, the walk decides nothing new: a pass costs ~30 ms of a
        core the run measures on."""
        ctx, view, base = self.ctx, self.ctx.view, self.base
        done = ctx.runner.wait(pending, timeout=0.5)
        for p, res in done:
            pending.remove(p)
            ctx.check_lease(fresh=True)  # confirm writes go to cubic's table: Optuna checks nothing
            match p.tag:
                case GateRun(rec=t, seed=sd):
                    self.qinflight[t.number] -= 1
                    self.checks.record_run(t, res, sd)
                case RemeasureRun(rec=t, beside=c):
                    self.inflight[t.number] -= 1
                    self.record(t, res)
                    if c is not None:  # the baseline's half of c's pair
                        ok = res.status == "ok" and res.qps > 0
                        self.beside[c.number] = res.qps if ok else None
                    view.add(t, time.monotonic() - p.started, confirm=res)
                case BackoffRun(trial=trial):
                    rec = ctx.store.finish(trial, res)
                    view.add(rec, time.monotonic() - p.started)
                    self.last_backoff = rec if rec.state == TrialState.COMPLETE else None
                    if self.last_backoff is not None:
                        self.ran_backoff(rec)
        if done or eta:  # (a candidate's runs come in pairs)
            left = sum(max(0, self.reps - self.runs(t)) * (1 if t is base or base is None else 2)
                       for t in order if self.phase(t) is not Phase.FAILED)
            view.set_eta(left, 1.0)
        view.refresh()
        return bool(done)

    # ------------------------------------------------------------------ back off (step 4)
    def backoff(self, pending: list[Pending]) -> bool:
        """Add the next back-off variant to the walk (a new trial on `pending`, or one the search
        ran to `screened`); False when there is none: no back-off is wanted, one passed, or the
        plan is spent (`cubic.tune.backoff`)."""
        ctx, space = self.ctx, self.ctx.space
        if self.plan is None:
            self.plan = self.backoff_plan()
        if self.plan is None:
            return False
        if self.judging is not None:  # what the variant judged last found
            self.plan.record(self.judging, self.outcome(self.last_backoff))
            self.judging = None
        while (v := self.plan.next(self.best_passed())) is not None:
            cfg = space.config(v.params)
            number = ctx.store.completed_keys().get(cfg.key())
            if number is not None:  # the search already ran it: judge that trial
                t = next((o for o in [*self.ranked, *self.screened] if o.number == number), None)
                if t is None or t is self.base:  # the layout alone is the baseline's: no faster
                    self.plan.record(v, SLOW)
                elif any(o is t for o in self.screened):  # judged already
                    self.plan.record(v, self.outcome(t))
                elif not any(o is t for o in self.cands):  # rejected while searching
                    self.plan.record(v, FAILED)
                else:
                    self.screened.append(t)
                    self.judging, self.last_backoff = v, t
                    return True
                continue
            ctx.store.enqueue(v.params, {"phase": BACKOFF})
            trial = ctx.store.study.ask(distributions(space))
            attrs = {**trial.user_attrs, "searcher": "confirm", "config": cfg.to_dict()}
            p = ctx.launch(trial, cfg, attrs, BackoffRun(trial))
            if p is None:  # refused by the memory model
                self.plan.record(v, CRASHED)
                continue
            pending.append(p)
            self.judging, self.last_backoff = v, None
            return True
        return False

    def ran_backoff(self, rec: TrialRecord) -> None:
        """The back-off variant's trial completed: judge it, unless its run is no faster than the
        best that passed (`BackoffPlan.ran`), which no re-measurement or quality run can change."""
        assert self.plan is not None and self.judging is not None
        best = self.best_passed()
        if self.plan.ran(self.judging, rec.value or 0.0, best):
            self.screened.append(rec)
            return
        self.judging = None
        self.ctx.view.note(f"confirm: back off: #{rec.number} ({rec.value or 0.0:,.0f} qps) is no "
                           f"faster than the best that passed ({best:,.0f}): not judged")

    def outcome(self, t: TrialRecord | None) -> str:
        """What judging a back-off variant's trial found (None: it did not complete)."""
        if t is None:
            return CRASHED
        if self.phase(t) is Phase.PASSED:
            return PASSED
        return SLOW if self.cannot_win(t) is not None else FAILED

    def best_passed(self) -> float:
        """The fastest re-measured median among the configurations that passed (0 where none
        did)."""
        passed = [t for t in ([self.base] if self.base else []) + self.screened
                  if t.confirm_qps and self.phase(t) is Phase.PASSED and self.outpaced(t) is None]
        return max((statistics.median(t.confirm_qps) for t in passed), default=0.0)

    def backoff_plan(self) -> BackoffPlan | None:
        """The variants of `backoff_source`'s configuration to judge, fastest expected first
        (None: none)."""
        src = self.backoff_source()
        if src is None:
            return None
        space, store = self.ctx.space, self.ctx.store
        changed = [k for k in space.differs_in_numerics(src.params) if k in src.params]
        values = {t.number: t.value for t in self.ranked}
        keys = store.completed_keys()

        def measured(p: dict[str, Any]) -> float | None:
            number = keys.get(space.config(p).key())
            return values.get(number) if number is not None else None

        ok = [t for t in self.ranked if (t.value or 0.0) > 0]
        proxy = (Proxy(space).fit([space.tup(t.params) for t in ok], [t.value for t in ok])
                 if len(ok) >= 2 else None)

        def predict(ps: list[dict[str, Any]]) -> list[float]:
            """The proxy's speed of each variant relative to its own of the source, times the
            source's search run: on the measured variants' scale, and the proxy's level error
            cancels."""
            mu, _ = proxy.predict([space.tup(p) for p in [src.params, *ps]])
            return [(src.value or 0.0) * math.exp(float(m - mu[0])) for m in mu[1:]]

        out = frozenset(x.change for k in changed
                        if (x := self.screen_of(k, src.params[k])) is not None and x.ok is False)
        plan = backoff.plan(space, src.params, changed, measured,
                            predict if proxy is not None else None,
                            lambda k: self.change_cost(k, src.params[k]), ruled_out=out)
        if not plan.order:
            return None
        unresolved = (self.qr is not None
                      and self.checks.sequential(src, self.base)[0] == NOT_RESOLVED)
        why = ("was rejected while searching" if src.number not in {t.number for t in self.screened}
               else "is not resolved" if unresolved else "fails")
        ruled = ", ".join(f"{n}={v}" + (f", but {w}" if (w := covered_where((n, v))) else "")
                          for n, v in sorted(out, key=str))
        shown = "; ".join(
            f"{v.label()} ({v.speed:,.0f} qps {'measured' if v.measured else 'predicted'})"
            for v in plan.order[:SHOWN]) + (f"; {len(plan.order) - SHOWN} more"
                                             if len(plan.order) > SHOWN else "")
        self.ctx.view.note(
            f"confirm: back off: #{src.number} ({self.speed(src):,.0f} qps) is faster than all "
            f"that passed but its quality {why}; judging its layout with fewer of its numerics "
            f"changes ({', '.join(changed)}), the fastest expected first, at most {plan.budget} "
            f"with quality runs" + (f" (none keeps {ruled}: the screen ruled it out)"
                                    if out else "") + f": {shown}")
        return plan

    def backoff_source(self) -> TrialRecord | None:
        """The configuration to back off from: the fastest one rejected for its quality (a failed
        or unresolved gate, or a rejection while searching), not for a crash or its speed, where
        it is faster than every configuration that passed (None: there is none, or the policy
        judges no quality)."""
        if not self.ctx.policy.judges_quality:
            return None
        best = self.best_passed()
        screened, cands = {t.number for t in self.screened}, {t.number for t in self.cands}

        def rejected(t: TrialRecord) -> bool:
            if (t is self.base or t.confirm_failed
                    or not self.ctx.space.differs_in_numerics(t.params)):
                return False
            if t.number in screened:
                return self.phase(t) is Phase.FAILED and self.cannot_win(t) is None
            return t.number not in cands  # rejected while searching

        src = max((t for t in self.ranked if rejected(t)), key=self.speed, default=None)
        return src if src is not None and self.speed(src) > best else None

    def screen_of(self, knob: str, value: Any) -> Screened | None:
        """The screen's run of `knob = value` alone (None: it ran none)."""
        base = self.ctx.space.baseline_params()
        return next((x for x in self.checks.screen if x.params.get(knob) == value and all(
            x.params[k] == v for k, v in base.items() if k != knob)), None)

    def change_cost(self, knob: str, value: Any) -> float:
        """What the screen measured `knob = value` alone to cost in eval NE (inf: it failed, or
        no screen ran it)."""
        x = self.screen_of(knob, value)
        bne = self.base.quality_eval_ne if self.base is not None else []
        d = paired_mean(x.eval_ne, bne) if x is not None else None
        return float("inf") if x is None or x.ok is False or d is None else d

    def judge_all(self) -> list[TrialRecord]:
        """Each screened record's verdict and reason; a trial a check while searching rejected
        gets its reason."""
        targets = ([self.base] if self.base else []) + self.screened
        self.ctx.check_lease(fresh=True)
        for t in targets:
            ok, why = self.gate(t)
            verdict = t.quality_verdict or (Verdict.PASSED if ok else Verdict.FAILED)
            self.ctx.store.update(t, quality_ok=ok, quality_reason=why, quality_verdict=verdict)
        # rejected by a check while searching: the verdict's reason, for the report
        for t in self.ranked:
            if t.quality_heldout_ok is False and t.quality_reason is None:
                why = (f"quality screen: {', '.join(t.quality_screened_out)} alone fails held-out "
                       "quality" if t.quality_screened_out else
                       f"held-out check while searching: {self.checks.heldout(t, self.base)[1]}")
                self.ctx.store.update(t, quality_ok=False, quality_reason=why)
        return targets
