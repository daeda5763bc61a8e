"""The confirm step: re-measure the baseline and walk down the ranking until `confirm_top_k` configurations
pass the quality gate; the fastest confirmed one wins.

Why re-measure: the first measurement was selected for being high (winner's curse), so only
re-measurements count, each with the space's own warm-up and measured steps. Why walk rather than take
the top k: the fastest configurations are often fast *because* they change numerics (bigger batches, SGD,
low precision), and a gate that rejected the whole top k used to leave the baseline as the "winner" of a
40-trial tune.

The walk, one run at a time (trials side by side on one node share its memory bandwidth and would skew
the very numbers that pick the winner):
1. Candidates: every completed trial but the baseline, fastest first, less those a check while searching
   already rejected (`TrialRecord.feasible`).
2. Screen the next candidate while fewer than k passed or may still pass, and fewer than SCREEN_FACTOR x k
   candidates needed runs of their own. One that trains a model already rejected inherits the verdict.
3. Every re-measurement of a candidate runs right after one of the baseline, and its speed-up is the median
   of those pairs' ratios (`TrialRecord.confirm_speedup`). Why: this machine drifts by 1.5x over minutes,
   and a baseline re-measured three times back to back caught one fast spell that every candidate measured
   later was compared with; a tune then crowned the baseline. A candidate that changes numerics gets one
   re-measurement first. If neither that pair nor its search run (over the baseline's re-measured median)
   beat the baseline, it cannot win: it fails without a quality run. Otherwise its quality runs decide
   (`cubic.quality.rules.sequential`: the first `seeds`, then one more pair while the interval straddles
   the tolerance, up to `max_seeds` or until its chance to pass within them is spent), or without quality
   runs its NE over the baseline's samples. A model whose quality already failed (its own runs, or a twin's
   it inherits) is not re-measured at all, and a layout of a model still being judged on a faster twin waits
   for that verdict; one whose first quality runs equal a decided candidate's bit for bit takes that one's
   runs (`same_model`); only a candidate that passes gets its other `repeats - 1` re-measurements. The
   baseline runs alone only up to its own `repeats`, once no candidate wants a run.
4. Back off (once the walk has nothing left to run): where the fastest configuration was rejected for
   quality (failed, or not resolved within the seed budget) and is faster than everything that passed, judge
   its layout with fewer of its numerics changes, one new trial at a time, in the order and with the pruning
   and budget of `cubic.tune.backoff`, stopping at the first that passes. Why: the fastest configurations
   stack two or three changes that each pass alone (fp16 tables, bf16 dense, bf16 comm), and their sum sits
   at the tolerance, where no seed budget resolves it; the walk then found nothing else that passed and the
   tune crowned the baseline, though the same layout with one change fewer was 1.4x faster and within the
   tolerance. A back-off trial is a new trial (phase "backoff"), judged as any candidate; it is the
   confirm's cost, not the search budget's.
5. The verdict and its reason go to every screened record (`quality_ok`, `quality_reason`).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from optuna.trial import TrialState

from cubic.execution.runner import Pending
from cubic.quality.rules import (
    FUTILE,
    MORE,
    NOT_RESOLVED,
    Verdict,
    covering,
    matched_ne,
    noise_floor,
    paired_mean,
    within,
)
from cubic.search.proxy import Proxy
from cubic.search.samplers import distributions
from cubic.study.record import BACKOFF, TrialRecord
from cubic.tune import backoff
from cubic.tune.backoff import CRASHED, FAILED, PASSED, SLOW, BackoffPlan, Variant
from cubic.tune.checks import QualityChecks, early_reject, paired_diff, reused
from cubic.tune.context import Tuning
from cubic.tune.work import BackoffRun, GateRun, RemeasureRun
from cubic_harness.config import TrialResult

SCREEN_FACTOR = 3  # confirm screens at most this many x confirm_top_k configurations
IDENTICAL_SEEDS = 2  # quality runs equal bit for bit, seed by seed, before a model is taken for another's


class Confirm:
    """One confirm: `run()` returns the screened records (baseline first), each with its verdict."""

    def __init__(self, ctx: Tuning, checks: QualityChecks) -> None:
        self.ctx, self.checks = ctx, checks
        self.qr = ctx.policy.quality_runs
        self.reps = ctx.policy.repeats
        self.ranked = sorted(ctx.store.records(TrialState.COMPLETE), key=lambda t: -(t.value or 0.0))
        self.base = ctx.baseline_of(self.ranked)
        # with quality runs the in-run estimate only guides the searcher: over the first samples after
        # warm-up it fails larger batches for training fewer steps on them, which held-out quality does not
        self.cands = [t for t in self.ranked if t is not self.base and (
            t.quality_heldout_ok is not False if self.qr else t.quality_est_ok is not False)]
        self.screened: list[TrialRecord] = []  # in rank order, then the back-off trials
        self.walked = 0  # candidates the walk took from `cands`
        self.plan: BackoffPlan | None = None  # the back-off's variants (`cubic.tune.backoff`; None: not planned)
        self.judging: Variant | None = None  # the back-off variant being judged
        self.last_backoff: TrialRecord | None = None  # its trial (None: it did not complete)
        self.inflight: dict[int, int] = {}  # trial number -> re-measurements in flight
        self.beside: dict[int, float | None] = {}  # trial number -> the baseline's qps just run before its next
        self.qinflight: dict[int, int] = {}  # trial number -> quality runs in flight

    # ------------------------------------------------------------------ state of one candidate
    def runs(self, t: TrialRecord) -> int:
        return len(t.confirm_qps) + len(t.confirm_failed)

    def qdone(self, t: TrialRecord | None) -> int:
        return len(t.quality_eval_ne) if t is not None else 0

    def verdict(self, t: TrialRecord) -> bool | None:
        """None while undecided (no run back yet, or the baseline's NE not in yet)."""
        if t.confirm_failed:
            return False
        if not self.ctx.policy.judges_quality or not self.ctx.space.differs_in_numerics(t.params):
            return True
        if self.qr is not None and not t.quality_eval_ne and self.cannot_win(t) is not None:
            return False
        if self.qr is not None:  # quality runs decide, sequentially (`cubic.quality.rules.sequential`)
            state, _ = self.checks.sequential(t, self.base)
            if state == MORE:
                return None
            if state != Verdict.PASSED:  # rejected for its model: its speed no longer matters
                return False
            return True if t.confirm_qps else None
        if not t.confirm_ne or self.base is None or not self.base.confirm_ne:
            return None
        return self.gate(t)[0]

    def cannot_win(self, t: TrialRecord) -> float | None:
        """t's best speed-up where that is at most 1: neither a re-measurement over the baseline's run beside
        it nor its search run over the baseline's re-measured median beat the baseline, so it cannot be the
        winner and no quality run is spent on it (None: it may still win, or nothing to compare yet)."""
        if self.base is None or t is self.base or not t.confirm_qps or not self.base.confirm_qps:
            return None
        bmed = statistics.median(self.base.confirm_qps)
        ratio = max([*(t.paired_ratios or [q / bmed for q in t.confirm_qps]), (t.value or 0.0) / bmed])
        return ratio if ratio <= 1.0 else None

    def seeds_wanted(self, t: TrialRecord) -> int:
        """How many quality seeds t's verdict needs by now: the first `seeds`, then one more pair at a time
        while its interval straddles the tolerance; the baseline as many as the candidate that wants the
        most (the pairs)."""
        if t is self.base:
            return max([self.qr.seeds] + [self.seeds_wanted(c) for c in self.screened if c is not self.base])
        if (not t.confirm_qps or self.verdict(t) is not None  # decided, or layout only
                or self.checks.sequential(t, self.base)[0] != MORE):
            return 0
        return min(self.qr.max_seeds, max(self.qr.seeds, min(self.qdone(t), self.qdone(self.base)) + 1))

    def quality_seed(self, t: TrialRecord) -> int | None:
        """The seed of t's next quality run, if it needs one now: the baseline's first (the noise floor, and
        the pairs), then each numerics-changing candidate after its first speed run, its seed n once the
        baseline's seed n is in."""
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
            self.ctx.view.note(f"quality: #{t.number}{how}, so #{owner.number}'s quality runs apply")
            return None
        return n

    def settled(self, o: TrialRecord) -> bool:
        """o's quality runs so far decide its model: some are in, none in flight, and the verdict wants no more."""
        return bool(self.qdone(o)) and not self.qinflight.get(o.number) and \
            self.checks.sequential(o, self.base)[0] != MORE

    def same_model(self, t: TrialRecord, n: int) -> tuple[TrialRecord, str] | None:
        """A settled candidate whose quality runs are t's, and how that is known (None: none):
        1. the same numerics key (the same model on the same samples), t's own n runs so far its first ones;
        2. another key, and t's own first n >= IDENTICAL_SEEDS runs equal to its first n bit for bit (eval NE and
           AUC), with more of them. A knob that rounds nothing the model does not round anyway (bf16
           communication of embeddings that bf16 dense math reads) is inert for it, which no rule over knobs
           can know for every model, and the runs show. Two equal seeds, not one: each seed draws other data
           and another teacher."""
        if self.qinflight.get(t.number):
            return None
        space = self.ctx.space
        key = space.numerics_key(t.params)
        twin = next((o for o in self.screened if o is not t and self.settled(o)
                     and space.numerics_key(o.params) == key), None)
        if twin is not None and t.quality_eval_ne == twin.quality_eval_ne[:n]:
            return twin, f" trains what #{twin.number} trains"
        if n < IDENTICAL_SEEDS or t.quality_runs_of is not None or None in t.quality_eval_ne + t.quality_eval_auc:
            return None
        alike = next((o for o in self.screened if o is not t and o is not self.base and self.qdone(o) > n
                      and self.settled(o) and o.quality_eval_ne[:n] == t.quality_eval_ne
                      and o.quality_eval_auc[:n] == t.quality_eval_auc), None)
        if alike is None:
            return None
        knobs = dict.fromkeys(space.differs_in_numerics(t.params) + space.differs_in_numerics(alike.params))
        inert = ", ".join(f"{k} {t.params.get(k)} vs {alike.params.get(k)}" for k in knobs
                          if t.params.get(k) != alike.params.get(k))
        return alike, (f"'s first {n} quality runs equal #{alike.number}'s bit for bit: the same model here "
                       f"({inert}: no change to what it trains)")

    def wants(self, t: TrialRecord) -> bool:
        """One more re-measurement of t now? (Screening: only the first until the verdict is in.)"""
        n = self.runs(t) + self.inflight.get(t.number, 0)
        if n >= self.reps:
            return False
        v = self.verdict(t)
        return v is True or (v is None and n == 0 and self.twin_judged(t) is None) or (t is self.base)

    def twin_judged(self, t: TrialRecord) -> TrialRecord | None:
        """A candidate screened before t that trains the same model and is still being judged (None: none).
        t's first re-measurement waits for that verdict: a rejection reaches t without a run of its own
        (`inherit_rejection`), a pass with its quality runs (`quality_seed`). Why: the walk screens a model's
        layouts together, and a pair of runs spent on one before its twin's verdict is wasted where that
        verdict rejects the model (about five pairs a `make tune`)."""
        if self.qr is None or t not in self.screened or not self.ctx.space.differs_in_numerics(t.params):
            return None
        key = self.ctx.space.numerics_key(t.params)
        earlier = self.screened[:self.screened.index(t)]
        return next((o for o in earlier if self.ctx.space.numerics_key(o.params) == key
                     and self.verdict(o) is None), None)

    def inherit_rejection(self, t: TrialRecord) -> None:
        """Give t, not yet run, the verdict of a screened twin whose quality runs (its own, or a search-time
        check's it holds) rejected the model; t's own runs so far are the same model's, so the twin's include
        them. A twin that failed for another reason (a crashed re-measurement, too slow to win) passes none."""
        space = self.ctx.space
        if (self.runs(t) or self.inflight.get(t.number) or self.qinflight.get(t.number)
                or not space.differs_in_numerics(t.params) or self.verdict(t) is False):
            return
        key = space.numerics_key(t.params)
        rejected = next((o for o in self.screened if o is not t and len(o.quality_eval_ne) >= max(1, self.qdone(t))
                         and not self.qinflight.get(o.number) and space.numerics_key(o.params) == key
                         and self.checks.sequential(o, self.base)[0] not in (MORE, Verdict.PASSED)), None)
        if rejected is not None:
            self.ctx.store.update(t, **rejected.heldout())
            self.ctx.view.note(f"quality: #{t.number} trains what #{rejected.number} trains: rejected with it, "
                               "not re-measured")

    def next_remeasure(self) -> tuple[TrialRecord, TrialRecord | None] | None:
        """The next re-measurement, as (whose, the candidate it pairs with): a candidate's own run right after
        the baseline's beside it (step 3), the pair's other half first; the baseline alone only for its own
        `repeats`, once no candidate wants a run (None: nothing to re-measure now)."""
        t = (next((c for c in self.screened if c.number in self.beside), None)
             or next((c for c in self.screened if self.wants(c)), None))
        if t is not None:
            return (t, None) if self.base is None or t.number in self.beside else (self.base, t)
        return (self.base, None) if self.base is not None and self.wants(self.base) else None

    # ------------------------------------------------------------------ the walk
    def run(self) -> list[TrialRecord]:
        ctx, space, view, base = self.ctx, self.ctx.space, self.ctx.view, self.base
        known_bad = len(self.ranked) - len(self.cands) - (base is not None)
        if known_bad:
            view.note(f"confirm: {known_bad} fast configuration(s) skipped: " + (
                "held-out quality checks while searching rejected the model they train" if self.qr else
                "their search trials' NE over the baseline's samples already fails the quality gate"))
        k = space.confirm_top_k
        max_screen = min(len(self.cands), SCREEN_FACTOR * k)  # candidates with runs of their own
        if not ctx.policy.judges_quality:
            view.note("confirm: simulated trials: no quality gate (a simulation predicts no model quality; "
                      "a real tune of the winner judges it)")
        view.note(f"confirm: baseline + the fastest configurations until {k} pass the quality gate "
                  f"(at most {max_screen} screened), {self.reps} re-measurements each" if max_screen else
                  f"confirm: the baseline only (no other configuration completed), {self.reps} re-measurements")
        pending: list[Pending] = []
        while True:
            ctx.check_lease()
            passed = [t for t in self.screened if self.verdict(t) is True]
            undecided = [t for t in self.screened if self.verdict(t) is None]
            own = sum(t.quality_runs_of is None for t in self.screened)  # those that cost runs of their own
            if (len(passed) < k and len(passed) + len(undecided) < k and own < max_screen
                    and self.walked < len(self.cands)):
                t = self.cands[self.walked]
                self.walked += 1
                self.screened.append(t)
                continue
            for t in self.screened:  # the same model was rejected: its verdict, without a run
                self.inherit_rejection(t)
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
                pending.append(p := ctx.runner.submit(self.checks.quality_config(t.params, sd), tag=GateRun(t, sd)))
                view.note(f"quality run: #{t.number} seed {sd + 1} (at least {qr.seeds}, at most "
                          f"{qr.max_seeds}), {qr.samples:,} samples, held-out {qr.eval_samples:,}" + reused(p))
                self.qinflight[t.number] = self.qinflight.get(t.number, 0) + 1
                continue
            if not pending:
                if not self.backoff(pending):
                    break
                continue
            for p, res in ctx.runner.wait(pending, timeout=0.5):
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
                            self.beside[c.number] = res.qps if res.status == "ok" and res.qps > 0 else None
                        view.add(t, time.monotonic() - p.started, confirm=res)
                    case BackoffRun(trial=trial):
                        rec = ctx.store.finish(trial, res)
                        view.add(rec, time.monotonic() - p.started)
                        self.last_backoff = rec if rec.state == TrialState.COMPLETE else None
                        if self.last_backoff is not None:
                            self.screened.append(rec)
            left = sum(max(0, self.reps - self.runs(t)) * (1 if t is base or base is None else 2)
                       for t in order if self.verdict(t) is not False)  # (a candidate's runs come in pairs)
            view.set_eta(left, 1.0)
            view.refresh()
        return self.judge_all()

    # ------------------------------------------------------------------ back off (step 4)
    def backoff(self, pending: list[Pending]) -> bool:
        """Add the next back-off variant to the walk (a new trial on `pending`, or one the search ran to
        `screened`); False when there is none: no back-off is wanted, one passed, or the plan is spent
        (`cubic.tune.backoff`)."""
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
                if t is None or t is self.base:  # the layout alone is the baseline's own: no faster than it
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
            p = ctx.launch(trial, cfg, {**trial.user_attrs, "searcher": "confirm", "config": cfg.to_dict()},
                           BackoffRun(trial))
            if p is None:  # refused by the memory model
                self.plan.record(v, CRASHED)
                continue
            pending.append(p)
            self.judging, self.last_backoff = v, None
            return True
        return False

    def outcome(self, t: TrialRecord | None) -> str:
        """What judging a back-off variant's trial found (None: it did not complete)."""
        if t is None:
            return CRASHED
        if self.verdict(t) is True:
            return PASSED
        return SLOW if self.cannot_win(t) is not None else FAILED

    def best_passed(self) -> float:
        """The fastest re-measured median among the configurations that passed (0 where none did)."""
        passed = [t for t in ([self.base] if self.base else []) + self.screened
                  if t.confirm_qps and self.verdict(t) is True]
        return max((statistics.median(t.confirm_qps) for t in passed), default=0.0)

    def backoff_plan(self) -> BackoffPlan | None:
        """The variants of `backoff_source`'s configuration to judge, fastest expected first (None: none)."""
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
        proxy = Proxy(space).fit([space.tup(t.params) for t in ok], [t.value for t in ok]) if len(ok) >= 2 else None

        def predict(ps: list[dict[str, Any]]) -> list[float]:
            """The proxy's speed of each variant relative to its own of the source, times the source's search
            run: on the measured variants' scale, and the proxy's level error cancels."""
            mu, _ = proxy.predict([space.tup(p) for p in [src.params, *ps]])
            return [(src.value or 0.0) * math.exp(float(m - mu[0])) for m in mu[1:]]

        plan = backoff.plan(space, src.params, changed, measured, predict if proxy is not None else None,
                            lambda k: self.change_cost(k, src.params[k]))
        if not plan.order:
            return None
        why = ("was rejected while searching" if src.number not in {t.number for t in self.screened} else
               "is not resolved" if self.qr is not None and self.checks.sequential(src, self.base)[0] ==
               NOT_RESOLVED else "fails")
        shown = "; ".join(f"{v.label()} ({v.speed:,.0f} qps {'measured' if v.measured else 'predicted'})"
                          for v in plan.order)
        self.ctx.view.note(
            f"confirm: back off: #{src.number} ({self.speed(src):,.0f} qps) is faster than all that passed but its "
            f"quality {why}; judging its layout with fewer of its numerics changes ({', '.join(changed)}), the "
            f"fastest expected first, at most {plan.budget} with quality runs: {shown}")
        return plan

    def backoff_source(self) -> TrialRecord | None:
        """The configuration to back off from: the fastest one rejected for its quality (a failed or unresolved
        gate, or a rejection while searching), not for a crash or its speed, where it is faster than every
        configuration that passed (None: there is none, or the policy judges no quality)."""
        if not self.ctx.policy.judges_quality:
            return None
        best = self.best_passed()
        screened, cands = {t.number for t in self.screened}, {t.number for t in self.cands}

        def rejected(t: TrialRecord) -> bool:
            if t is self.base or t.confirm_failed or not self.ctx.space.differs_in_numerics(t.params):
                return False
            if t.number in screened:
                return self.verdict(t) is False and self.cannot_win(t) is None
            return t.number not in cands  # rejected while searching

        src = max((t for t in self.ranked if rejected(t)), key=self.speed, default=None)
        return src if src is not None and self.speed(src) > best else None

    def change_cost(self, knob: str, value: Any) -> float:
        """What the screen measured `knob = value` alone to cost in eval NE (inf: it failed, or no screen ran it)."""
        base = self.ctx.space.baseline_params()
        bne = self.base.quality_eval_ne if self.base is not None else []
        for x in self.checks.screen:
            if x.params.get(knob) == value and all(x.params[k] == v for k, v in base.items() if k != knob):
                d = paired_mean(x.eval_ne, bne)
                return float("inf") if x.ok is False or d is None else d
        return float("inf")

    @staticmethod
    def speed(t: TrialRecord) -> float:
        """Its re-measured median, or its search run where it was not re-measured."""
        return statistics.median(t.confirm_qps) if t.confirm_qps else (t.value or 0.0)

    def judge_all(self) -> list[TrialRecord]:
        """Each screened record's verdict and reason; a trial a check while searching rejected gets its reason."""
        targets = ([self.base] if self.base else []) + self.screened
        self.ctx.check_lease(fresh=True)
        for t in targets:
            ok, why = self.gate(t)
            self.ctx.store.update(t, quality_ok=ok, quality_reason=why,
                                  quality_verdict=t.quality_verdict or (Verdict.PASSED if ok else Verdict.FAILED))
        for t in self.ranked:  # rejected by a check while searching: the verdict's reason, for the report
            if t.quality_heldout_ok is False and t.quality_reason is None:
                why = (f"quality screen: {', '.join(t.quality_screened_out)} alone fails held-out quality"
                       if t.quality_screened_out else
                       f"held-out check while searching: {self.checks.heldout(t, self.base)[1]}")
                self.ctx.store.update(t, quality_ok=False, quality_reason=why)
        return targets

    def record(self, t: TrialRecord, res: TrialResult) -> None:
        """Append a re-measurement's qps, the baseline's beside it, and its NE (over the baseline's samples) to
        t's record."""
        space, base = self.ctx.space, self.base
        beside = self.beside.pop(t.number, None)
        if res.status == "ok" and res.qps > 0:
            ne: float | None = res.ne
            if base is not None and t.number != base.number and space.differs_in_numerics(t.params):
                bres = base.result
                ne = matched_ne(res.losses, space.config(t.params), bres.get("losses") or [],
                                space.config(base.params), bres.get("ne"))
            paired = {} if base is None or t is base else {"confirm_base_qps": [*t.confirm_base_qps, beside]}
            self.ctx.store.update(t, confirm_qps=[*t.confirm_qps, res.qps], confirm_ne=[*t.confirm_ne, ne], **paired)
        else:
            self.ctx.store.update(t, confirm_failed=[*t.confirm_failed, f"{res.status}: {res.error}"])

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
        if not t.confirm_qps and not (changed and qr is not None and self.verdict(t) is False):
            return False, "not re-measured"  # (a model rejected for its quality needs no speed)
        if base is not None and t.number == base.number:
            if qr is not None and t.quality_eval_ne:
                ne = [x for x in t.quality_eval_ne if x is not None]
                noise = noise_floor(ne)
                return True, (f"baseline (eval NE {statistics.mean(ne):.5f} over {len(ne)} seed(s)"
                              + (f", seed-to-seed sd {noise:.3%})" if noise is not None else ")") if ne else
                              "baseline (its quality runs failed: " + str(t.quality_failed) + ")")
            return True, "baseline"
        if changed and qr is not None and not t.quality_eval_ne and (ratio := self.cannot_win(t)) is not None:
            return False, (f"at most {ratio:.2f}x the baseline (search, and re-measured beside it): it cannot win, "
                           f"so no quality run was spent on it (changes {', '.join(changed)})")
        if changed and not self.ctx.policy.judges_quality:
            return True, (f"simulated: quality not judged (changes {', '.join(changed)}); a real tune's quality "
                          "gate judges it")
        if not changed:
            return True, "numerics unchanged (only layout/kernel/pipelining knobs differ): no quality run needed"
        if qr is not None:
            if t.quality_failed:
                return False, f"quality run failed: {t.quality_failed}"
            cand, bne = t.quality_eval_ne, base.quality_eval_ne if base else []
            if None in bne:
                return False, f"the baseline's quality runs failed: {base.quality_failed}"
            state, j = self.checks.sequential(t, base)
            if state == MORE or j is None:
                return False, (f"changes {', '.join(changed)} but its quality runs are incomplete "
                               f"({len(cand)} seed(s), at least {qr.seeds}; baseline {len(bne)})")
            store.update(t, quality_eval_diff=j["diff"], quality_se=j["se"], quality_noise=j["noise"],
                         quality_resolved=j["resolved"], quality_ci=j["ci"], quality_verdict=state)
            n = len(j["diffs"])
            if state != NOT_RESOLVED:
                head = state
            else:
                budget = ("the seed budget, quality.max_seeds" if n >= qr.max_seeds else
                          f"its chance to pass within quality.max_seeds={qr.max_seeds} is {j['pass_chance']:.0%}, "
                          f"under {FUTILE:.0%}")
                head = (f"NOT RESOLVED after {n} paired seeds ({budget}): the interval straddles the tolerance, "
                        "so it is not crowned")
            return state == Verdict.PASSED, f"{head}: {j['reason']} (changes {', '.join(changed)})"
        ne_t = median_finite(t.confirm_ne)
        ne_b = median_finite(base.confirm_ne) if base is not None else None
        if ne_t is None or ne_b is None or ne_b <= 0:
            return False, f"changes {changed} but NE is unavailable (trial {ne_t}, baseline {ne_b})"
        rel = (ne_t - ne_b) / ne_b
        tol = space.quality_tolerance
        ok = within(ne_t, ne_b, tol)
        return ok, (f"NE {ne_t:.4f} vs baseline {ne_b:.4f}: {rel:+.2%} {'<=' if ok else '>'} {tol:.2%} "
                    f"(changes {', '.join(changed)})")


def median_finite(xs: Any) -> float | None:
    vals = [float(x) for x in (xs or []) if x is not None and math.isfinite(float(x))]
    return statistics.median(vals) if vals else None
