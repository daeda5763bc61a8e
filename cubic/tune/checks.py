"""Quality while searching: free in-run estimates, the quality screen, and held-out checks of the incumbent.

Three sources of a quality verdict, cheapest first (which one counts: `TrialRecord.feasible`):
1. The in-run estimate (`estimate`): each finished numerics-changing trial's NE over the baseline's
   samples, from its own per-step losses (`cubic.quality.rules.matched_ne`); free.
2. The screen (`next_run`): each numerics change alone, judged by held-out quality runs against the
   baseline's (`cubic.quality.screen`); a change that fails is out of the search, and every trial that uses
   it fails with it. `upfront`: every change before the search proposes anything. `on_demand`: only the
   changes every incumbent carried through the last `SETTLE` trials (`settled_changes`); a change no fast
   configuration carries is never paid for, nor is one the next trials' leaders drop, and one that stays
   settled after a one-seed pass gets its second seed (`due_screen`). A check (3.) of the model a change
   trains alone continues that change's runs, and its verdict becomes the change's.
3. Held-out checks of the incumbent (`next_run` while searching): the fastest trial faster than the
   baseline that no held-out run has judged, when it changes numerics. Why while searching and not only at
   confirm: the searcher's feasibility model learns from the verdict, so one rejected 4x-batch incumbent
   steers the search to the region that passes instead of filling the confirm with its variants. After a
   rejection the next fastest is the incumbent: the search walks down its ranking as it goes. At most a
   quarter of the trial budget (at least `confirm_top_k + 1`) is checked this way; the confirm reuses
   every run.

A verdict goes to every trial that trains the same model (`SearchSpace.numerics_key`), with its runs.
"""

from __future__ import annotations

from typing import Any

from optuna.trial import TrialState

from cubic.execution.runner import Pending
from cubic.quality.rules import (
    EARLY_REJECT,
    Judgement,
    Verdict,
    judge,
    matched_ne,
    paired_mean,
    same_runs,
    sequential,
    within,
)
from cubic.quality.screen import ATTR as SCREEN_ATTR
from cubic.quality.screen import (
    Screened,
    decide,
    failing_changes,
    implied_out,
    nearer_first,
    single_changes,
)
from cubic.quality.screen import cell as screen_cell
from cubic.quality.screen import load as load_screen
from cubic.space.numerics import blocking, covered_where
from cubic.space.quality_runs import ON_DEMAND
from cubic.study.record import TrialRecord
from cubic.tune.context import Tuning
from cubic.tune.work import CheckRun, ScreenRun
from cubic_harness.config import TrialResult, json_safe

SETTLE = 2  # later trials an incumbent must outlast before on-demand held-out runs judge it (`settled`)


class QualityChecks:
    """The search's quality state: the baseline once known, the models held-out runs judged, the screen."""

    def __init__(self, ctx: Tuning) -> None:
        self.ctx = ctx
        self.base: TrialRecord | None = None  # the completed baseline trial, once known
        self.judged: dict[tuple, TrialRecord] = {}  # numerics key -> the trial a search-time check judged
        self.screen: list[Screened] = []  # each numerics change alone (`cubic.quality.screen`)
        # (the baseline's own, its NE, the baseline's) -> `sequential`'s verdict: the confirm asks it of
        # every candidate many times a pass (phase, focus, the spare rules); a judgement costs ~0.4 ms
        self._verdicts: dict[tuple[bool, tuple, tuple], tuple[Verdict, Judgement | None]] = {}

    def start(self) -> None:
        """Pick up what a resumed study already knows: its judged models and the runs its screen paid for."""
        space, store = self.ctx.space, self.ctx.store
        self.judged = {space.numerics_key(t.params): t for t in store.records(TrialState.COMPLETE)
                       if t.quality_heldout_ok is not None and t.quality_runs_of is None}
        if self.ctx.policy.quality_runs is not None:
            stored = {s.change: s for s in load_screen(store.study.user_attrs)}
            self.screen = [stored.get(s.change, s) for s in single_changes(space)]
        self.estimate()

    # ------------------------------------------------------------------ 1. the in-run estimate
    def estimate(self, finished: TrialRecord | None = None) -> None:
        """In-run quality estimates for finished numerics-changing trials ("ne_matched", and "quality_est_ok"
        where the trial's steps cover the baseline's samples).

        Called with no trial when the search starts (a resumed study may hold trials that wait for an
        estimate) and with each trial as it finishes: once the baseline is in, only that trial needs one;
        the baseline's own arrival estimates every trial that finished before it."""
        if not self.ctx.policy.estimates_quality:
            return
        space, store = self.ctx.space, self.ctx.store
        if finished is not None and self.base is not None:
            todo = [finished]
        else:
            done = store.records(TrialState.COMPLETE)
            self.base = self.ctx.baseline_of(done)
            todo = done
        if self.base is None:
            return
        bres = self.base.result
        bcfg = space.config(self.base.params)
        tol = space.quality_tolerance
        for t in todo:
            if (t.state != TrialState.COMPLETE or t.config_key == self.ctx.base_key
                    or not space.differs_in_numerics(t.params)):
                continue
            if t.quality_est_tol == tol:  # estimated with this tolerance before (a resume with another re-judges)
                continue
            ne = matched_ne(t.result.get("losses") or [], space.config(t.params),
                            bres.get("losses") or [], bcfg, bres.get("ne"))
            attrs: dict[str, Any] = {"ne_matched": ne, "quality_est_tol": tol}
            # Where quality runs judge, the estimate gives no verdict on another global batch: over the first
            # samples it fails a larger batch for having taken fewer steps on them (held-out quality at the
            # budget does not: 2x batches pass), and that veto kept a seed's search out of the fast region.
            # Such trials are judged by held-out checks while searching instead.
            biased = space.quality_runs is not None and space.config(t.params).global_batch != bcfg.global_batch
            if ne is not None and not biased:
                attrs.update(quality_est_ok=within(ne, bres["ne"], tol))
            judged = self.judged.get(space.numerics_key(t.params))
            if judged is not None and judged.number != t.number and t.quality_heldout_ok is None:
                attrs.update(judged.heldout())
            store.update(t, **attrs)
            self.screen_verdict(t, self.base)

    # ------------------------------------------------------------------ 2. and 3. held-out runs
    def next_run(self, pending: list[Pending]) -> Pending | None:
        """A quality run the search pays for now, if any (one at a time): the baseline's seeds first (the
        pairs and the noise floor), then the screen's, then the incumbent's."""
        qr = self.ctx.policy.quality_runs
        if qr is None or any(isinstance(p.tag, CheckRun | ScreenRun) for p in pending):
            return None
        space, view = self.ctx.space, self.ctx.view
        done = self.ctx.store.records(TrialState.COMPLETE)
        base = self.ctx.baseline_of(done)
        if base is None:
            return None
        bne = base.quality_eval_ne
        if None in bne:
            return None
        if len(bne) < qr.seeds:
            return self._submit_check(base, len(bne), "the baseline (pairs and noise floor)")
        lead = leaders(done, base)
        top = lead[-1] if lead else None
        on_demand = qr.screen == ON_DEMAND
        if on_demand and top is None:
            return None
        settled = settled_changes(space, lead) if on_demand else None
        scr = self.due_screen(settled)
        if scr is not None:  # each numerics change alone: before the search, or the incumbent's on demand
            n = len(scr.eval_ne)
            run = self.ctx.space.quality_config(scr.params, n)
            p = self.ctx.runner.submit(run, tag=ScreenRun(scr, n))
            why = (f"({sum(x.ok is not None for x in self.screen) + 1} of {len(self.screen)} changes)"
                   if not on_demand or top is None else f"(a change of the incumbent #{top.number})"
                   if scr.change in (settled or ()) else
                   f"(nearer the baseline than the incumbent #{top.number}'s, which it may rule out)")
            view.note(f"quality screen: {scr.label} alone, seed {n + 1}/{qr.seeds}, {qr.samples:,} samples "
                      + why + reused(p))
            return p
        if on_demand and not self.settled(top, done):
            return None  # no held-out run for an incumbent the next trials may still beat
        if (top is None or top.quality_heldout_ok is not None or not space.differs_in_numerics(top.params)
                or space.numerics_key(top.params) in self.judged):
            return None
        n = len(top.quality_eval_ne)
        if n == 0 and len(self.judged) >= max(space.confirm_top_k + 1, self.ctx.budget // 4):
            return None
        return self._submit_check(top, n, "the incumbent")

    def due_screen(self, settled: set[tuple[str, Any]] | None) -> Screened | None:
        """The screen's next change to run: the first undecided one, or with the screen on demand
        (`settled` given: `settled_changes`) the first change the leaders settled on that is undecided
        or passed on fewer than `seeds` (for now, `screen.decide`). Why the second seed: the search
        commits to a settled change, and one seed of a change near the tolerance says little of the
        next (seed-to-seed spread is of the tolerance's size); taken on one seed, it sends the
        confirm's quality runs to stacks built on it that may end "not resolved". A change further from
        the baseline than one not yet run, where its cost only grows that way, gives way to that one
        (`screen.nearer_first`): ruled out, it rules the other out with it (`screen.implied_out`)."""
        if settled is None:
            due = next((x for x in self.screen if x.ok is None), None)
        else:
            seeds = self.ctx.policy.quality_runs.seeds
            due = next((x for x in self.screen if x.change in settled
                        and (x.ok is None or x.ok and len(x.eval_ne) < seeds)), None)
        return None if due is None else nearer_first(due, self.screen, self.ctx.space)

    @staticmethod
    def settled(t: TrialRecord, done: list[TrialRecord]) -> bool:
        """t has stayed the fastest through `SETTLE` trials that finished after it (or it is the last
        word of a search that ran out of proposals: the confirm judges it then)."""
        return sum(o.number > t.number for o in done) >= SETTLE

    def _submit_check(self, t: TrialRecord, seed: int, what: str) -> Pending:
        qr = self.ctx.policy.quality_runs
        run = self.ctx.space.quality_config(t.params, seed)
        p = self.ctx.runner.submit(run, tag=CheckRun(t, seed))
        self.ctx.view.note(f"quality check while searching: #{t.number} ({what}) seed {seed + 1}/{qr.seeds}, "
                           f"{qr.samples:,} samples, held-out {qr.eval_samples:,}" + reused(p))
        return p

    def checked(self, work: CheckRun, res: TrialResult) -> None:
        """Record a search-time quality run; once its trial's verdict is decided, give it to the trial and to
        every trial that trains the same model."""
        t, space, store = work.rec, self.ctx.space, self.ctx.store
        self.record_run(t, res, work.seed)
        if t.config_key == self.ctx.base_key:
            return
        self.pool_with_screen(t)
        done = store.records(TrialState.COMPLETE)
        ok, _ = self.heldout(t, self.ctx.baseline_of(done))
        if ok is None:
            return
        store.update(t, quality_heldout_ok=ok)
        key = space.numerics_key(t.params)
        self.judged[key] = t
        same = [o for o in done if o.number != t.number and o.quality_heldout_ok is None
                and o.config_key != self.ctx.base_key and space.numerics_key(o.params) == key]
        for o in same:
            store.update(o, **t.heldout())
        self.ctx.view.note(f"quality check: #{t.number} {'passes' if ok else 'fails'} held-out quality"
                           + (f" (and {len(same)} trial(s) that train the same model)" if same else "")
                           + ("" if ok else ": the searcher now avoids it"))
        self.extend_screen(t, done)

    def pool_with_screen(self, t: TrialRecord) -> None:
        """Where t's own first runs equal a screened change's bit for bit (eval NE and AUC, at least
        `IDENTICAL_SEEDS` of them), t trains that change's model here, and takes its further runs
        seed by seed. Why: bf16 communication into bf16 dense math rounds nothing the dense math
        does not (`numerics.COVERS`), so the incumbent that carries both trains what the screen's
        bf16 dense alone trains, and its second check run repeated the screen's, to every digit."""
        ne, auc, n = t.quality_eval_ne, t.quality_eval_auc, len(t.quality_eval_ne)
        if t.quality_screen_runs:
            return
        key = self.ctx.space.numerics_key(t.params)
        same = next((x for x in self.screen if len(x.eval_ne) > n and None not in x.eval_ne
                     and same_runs(ne, auc, x.eval_ne, x.eval_auc)
                     and self.ctx.space.numerics_key(x.params) != key), None)
        if same is None:
            return
        self.ctx.store.update(t, quality_eval_ne=list(same.eval_ne),
                              quality_eval_auc=list(same.eval_auc), quality_screen_runs=same.label)
        self.ctx.view.note(f"quality: #{t.number}'s first {n} quality run(s) equal {same.label} alone's "
                           f"bit for bit: the same model here, so its other {len(same.eval_ne) - n} "
                           "apply")

    def extend_screen(self, t: TrialRecord, done: list[TrialRecord]) -> None:
        """A check of the model a screened change trains alone extends that change's runs (same model, same
        seeds): the screen passes a change after one seed where it looks clear, and the check's later seeds
        are the change's own. Where they fail it, the change is ruled out as the screen rules one out, so the
        search stops proposing it with other knobs; a check of that model alone would only avoid that one."""
        space = self.ctx.space
        key = space.numerics_key(t.params)
        scr = next((x for x in self.screen if space.numerics_key(x.params) == key), None)
        if scr is None or len(t.quality_eval_ne) <= len(scr.eval_ne):
            return
        was = scr.ok
        scr.eval_ne, scr.eval_auc = list(t.quality_eval_ne), list(t.quality_eval_auc)
        base = self.ctx.baseline_of(done)
        verdict, why = decide(scr, base.quality_eval_ne if base is not None else [],
                              self.ctx.policy.quality_runs)
        if verdict is not None:
            scr.ok, scr.reason = verdict, why
        self._store_screen(scr if verdict is not None and verdict != was else None, base, done,
                           f" (#{t.number}'s check of the same model)")

    def screened(self, work: ScreenRun, res: TrialResult) -> None:
        """Record a screen run; once the change's verdict is decided, store it (the samplers read it from
        the study: `Observations.seen`) and, if it fails, give every trial that uses it the verdict."""
        scr, seed = work.change, work.seed
        ok = res.status == "ok" and res.extra.get("eval_ne") is not None
        scr.eval_ne.append(res.extra.get("eval_ne") if ok else None)
        scr.eval_auc.append(res.extra.get("eval_auc") if ok else None)
        if not ok:
            scr.reason = f"seed {seed}: {res.status}: {res.error}"[:300]
        done = self.ctx.store.records(TrialState.COMPLETE)
        base = self.ctx.baseline_of(done)
        bne = base.quality_eval_ne if base is not None else []
        verdict, why = decide(scr, bne, self.ctx.policy.quality_runs)
        if verdict is not None:
            scr.ok, scr.reason = verdict, (why if ok else f"its quality run failed: {scr.reason}")
        self._store_screen(scr if verdict is not None else None, base, done)

    def _store_screen(self, decided: Screened | None, base: TrialRecord | None,
                      done: list[TrialRecord], how: str = "") -> None:
        """Store the screen (the samplers read it from the study); where a change was just decided, say so
        and give its verdict to every finished trial that uses it."""
        implied = implied_out(self.screen, self.ctx.space) if decided is not None and not decided.ok else []
        self.ctx.store.study.set_user_attr(SCREEN_ATTR, json_safe([x.to_dict() for x in self.screen]))
        if decided is None:
            return
        where = covered_where(decided.change)
        self.ctx.view.note(f"quality screen: {decided.label} alone {'passes' if decided.ok else 'fails'}"
                           f"{how}: {decided.reason}"
                           + ("" if decided.ok else "; configurations with it are out of the search"
                              + (f" but those {where} (their own quality runs judge them)" if where else "")))
        for x in implied:
            self.ctx.view.note(f"quality screen: {x.label} ruled out {x.reason}")
        for t in done:
            self.screen_verdict(t, base)

    def screen_verdict(self, t: TrialRecord, base: TrialRecord | None) -> None:
        """A finished trial that uses a change the screen failed fails held-out quality with it; one that
        trains what a screened change alone trains starts from that change's runs (same model, same seeds)."""
        space, store = self.ctx.space, self.ctx.store
        if t.config_key == self.ctx.base_key or t.quality_heldout_ok is not None:
            return
        out = frozenset(x.change for x in self.screen if x.ok is False)
        bad = failing_changes(space, t.params, out)
        if bad:
            store.update(t, quality_heldout_ok=False, quality_screened_out=bad)
            return
        if t.quality_eval_ne:
            return
        key = space.numerics_key(t.params)
        same = next((x for x in self.screen if x.eval_ne and None not in x.eval_ne
                     and space.numerics_key(x.params) == key), None)
        if same is not None:
            store.update(t, quality_eval_ne=list(same.eval_ne), quality_eval_auc=list(same.eval_auc),
                         quality_screen_runs=same.label)
            ok, _ = self.heldout(t, base)
            if ok is not None:
                store.update(t, quality_heldout_ok=ok)
                self.judged.setdefault(key, t)

    def record_run(self, t: TrialRecord, res: TrialResult, seed: int) -> None:
        """Append one quality run's held-out eval NE and AUC (None for a failed run, with its reason)."""
        ok = res.status == "ok" and res.extra.get("eval_ne") is not None
        attrs = {"quality_eval_ne": [*t.quality_eval_ne, res.extra.get("eval_ne") if ok else None],
                 "quality_eval_auc": [*t.quality_eval_auc, res.extra.get("eval_auc") if ok else None]}
        if not ok:
            attrs["quality_failed"] = f"seed {seed}: {res.status}: {res.error}"[:300]
        self.ctx.store.update(t, **attrs)
        self.ctx.view.note(f"quality run: #{t.number} seed {seed + 1}: " + (
            f"eval NE {res.extra['eval_ne']:.5f}, AUC {res.extra['eval_auc']:.4f}" if ok else attrs["quality_failed"]))

    # ------------------------------------------------------------------ verdicts from held-out runs
    def heldout(self, t: TrialRecord, base: TrialRecord | None) -> tuple[bool | None, str]:
        """t's held-out verdict from its quality runs and the baseline's, with its reason (None while its
        seeds are still to run): a failed run fails, so does one far past the tolerance after its first
        seeds (`early_reject`), else the paired judgement over all seeds (`cubic.quality.rules.judge`)."""
        qr = self.ctx.space.quality_runs
        ne = t.quality_eval_ne
        bne = base.quality_eval_ne if base is not None else []
        if None in ne:
            return False, f"quality run failed: {t.quality_failed}"
        why = early_reject(t, qr, base)
        if why is not None:
            return False, why
        if len(ne) < qr.seeds or len(bne) < qr.seeds:
            return None, ""
        if None in bne:
            return False, f"the baseline's quality runs failed: {base.quality_failed}"
        j = judge(ne[:qr.seeds], bne[:qr.seeds], qr.tolerance, qr.confidence)
        return j.ok, j.reason

    def sequential(self, t: TrialRecord,
                   base: TrialRecord | None) -> tuple[Verdict, Judgement | None]:
        """t's confirm verdict from its quality runs so far (`cubic.quality.rules.sequential`): a failed run of
        either side, or a candidate far past the tolerance after its first seeds (`early_reject`), fails."""
        qr = self.ctx.space.quality_runs
        ne = t.quality_eval_ne
        bne = base.quality_eval_ne if base is not None else []
        key = (t is base, tuple(ne), tuple(bne))
        if key not in self._verdicts:
            failed = None in ne or None in bne or early_reject(t, qr, base) is not None
            self._verdicts[key] = (Verdict.FAILED, None) if failed else sequential(ne, bne, qr)
        return self._verdicts[key]

    def screen_summary(self) -> list[dict[str, Any]]:
        """The summary's screen table: each change, its verdict and its one-line cell (`screen.cell`)."""
        base = self.ctx.baseline_of(self.ctx.store.records(TrialState.COMPLETE))
        bne = base.quality_eval_ne if base is not None else []
        qr = self.ctx.policy.quality_runs
        return [x.to_dict() | {"change": x.label, "verdict": x.verdict,
                               "cell": screen_cell(x, bne, qr) if qr is not None else x.verdict}
                for x in self.screen]


def leaders(done: list[TrialRecord], base: TrialRecord) -> list[TrialRecord | None]:
    """The incumbent after each finished trial, in trial order: the fastest trial so far faster than
    the baseline that no held-out run rejected (None while there is none)."""
    out: list[TrialRecord | None] = []
    best: TrialRecord | None = None
    for t in sorted(done, key=lambda r: r.number):
        if (t is not base and t.quality_heldout_ok is not False and (t.value or 0.0) > (base.value or 0.0)
                and (best is None or (t.value or 0.0) > (best.value or 0.0))):
            best = t
        out.append(best)
    return out


def settled_changes(space: Any, leaders: list[TrialRecord | None]) -> set[tuple[str, Any]]:
    """The numerics changes every incumbent carried through the last `SETTLE` trials: a change the search
    keeps winning with is settled even while each new trial with it beats the last. Why not wait for
    one incumbent to outlast two trials: a harmful change whose stacks keep improving (SGD tables,
    +3.5% eval NE alone) would lead every trial and never be screened while it does.

    Less a change each of them makes beside one that may cover it (bf16 communication beside bf16
    dense math, `numerics.COVERS`): ruled out alone, it would rule none of them out (`blocking`), so
    its run alone could not steer the search where it leads. Two `make tune`s spent two runs each to
    rule bf16 communication out alone while every incumbent carried it with bf16 dense math, and
    crowned that stack. It is settled once an incumbent carries it uncovered."""
    recent = leaders[-(SETTLE + 1):]
    if len(recent) <= SETTLE or any(t is None for t in recent):
        return set()
    made = [space.numerics_changes(t.params) for t in recent]
    return {c for c in frozenset.intersection(*made) if any(blocking(m, frozenset({c})) for m in made)}


def reused(p: Pending) -> str:
    return ": reused from the quality store, not trained again" if p.reused else ""


def early_reject(t: TrialRecord, qr: Any, base: TrialRecord | None) -> str | None:
    """Why t fails the quality gate before all its seeds ran (None if it may still pass): its mean paired
    eval-NE difference so far is over EARLY_REJECT x the tolerance, far past what the paired noise on
    these workloads spans (hundredths of a percent), so its remaining quality runs would be wasted."""
    if qr is None or base is None or t is base:
        return None
    n = min(len(t.quality_eval_ne), len(base.quality_eval_ne))
    d = paired_diff(t, base)
    if n >= qr.seeds or d is None or d <= EARLY_REJECT * qr.tolerance:
        return None
    return (f"eval NE {d:+.3%} vs baseline after {n} of {qr.seeds} paired seed(s), over {EARLY_REJECT:g} x the "
            f"{qr.tolerance:.2%} tolerance: rejected without the remaining quality runs")


def paired_diff(t: TrialRecord, base: TrialRecord) -> float | None:
    """Mean relative eval-NE difference of t from the baseline over the seeds both have run (None if none)."""
    return paired_mean(t.quality_eval_ne, base.quality_eval_ne)
