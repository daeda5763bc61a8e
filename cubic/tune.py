"""The `cubic tune` loop: propose -> run on Ray -> store, then confirm the top-k and pick the winner.

- Resume: the store is the truth. Trials left RUNNING by a dead tuner become FAIL(interrupted) and
  their configurations are enqueued again; the budget counts trials that ran (COMPLETE, or FAIL
  for a reason of their own), so a resumed tune finishes with exactly the budget, and a
  configuration already completed is never launched again (dedupe by `TrialConfig.key()`).
  "Dead" is checked, not assumed: a tuner holds the study's lease (`cubic.lease`) while it runs,
  and a second one on the same study refuses to start.
- Confirm: the top-k and the baseline are re-measured `repeats` times (the first measurement was
  selected for being high - winner's curse - so only re-measurements count), each with the space's
  own warm-up and measured steps. A configuration whose knobs change the numerics must keep its
  normalized entropy over the baseline's samples (`cubic.quality.matched_ne`, from its per-step
  losses; a smaller global batch runs longer to cover them, `cubic.quality.covering`) within the
  space's tolerance of the baseline's. The fastest confirmed one wins.
- Quality screen: with quality runs, each numerics change alone is judged before the search
  (`cubic.screen`); configurations with a change that fails are neither proposed nor confirmed.
- View: `cubic.view` (a rich live table on a terminal, one line per trial otherwise).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console

from cubic.lease import TunerLease, describe
from cubic.memory_check import refusal as memory_refusal
from cubic.quality import (
    EARLY_REJECT,
    MORE,
    NOT_RESOLVED,
    covering,
    judge,
    matched_ne,
    noise_floor,
    paired_mean,
    sequential,
    within,
)
from cubic.quality_store import QualityStore, ReusingRunner
from cubic.runner import Pending, RayRunner
from cubic.samplers import distributions, make_sampler
from cubic.screen import ATTR as SCREEN_ATTR
from cubic.screen import Screened, decide, failing_changes, single_changes
from cubic.screen import load as load_screen
from cubic.space import SearchSpace
from cubic.store import NOT_RUN, Store, safe_url
from cubic.view import TuneView, short_config
from cubic_harness.config import TrialConfig, TrialResult, json_safe
from cubic_harness.errors import ConfigError

if TYPE_CHECKING:  # the simulator's runner is imported only by a --backend sim tune
    from cubic.sim_runner import SimRunner

MAX_SKIPS = 20  # consecutive duplicate proposals before the search gives up
SCREEN_FACTOR = 3  # confirm screens at most this many x confirm_top_k configurations

class Tuner:
    """One `cubic tune`: `run()` searches until the budget is spent, confirms, returns the summary."""

    def __init__(self, space: SearchSpace, store: Store, runner: RayRunner | SimRunner, searcher: str = "cubic",
                 budget: int | None = None, seed: int = 0, console: Console | None = None,
                 live: bool | None = None, warm_start: list[tuple[dict, float | None, str]] | None = None,
                 quality_store: QualityStore | None = None) -> None:
        self.space, self.store, self.runner, self.searcher = space, store, runner, searcher
        if quality_store is not None and space.quality_runs is not None and not runner.simulated:
            self.runner = ReusingRunner(runner, quality_store)
        self.study: optuna.Study = store.study
        self.budget = budget or space.budget
        self.console = console or Console()
        self.view = TuneView(space, self.budget, self.console, live)
        history = []
        if searcher == "cubic":
            history = [(t.params, t.value if t.state == TrialState.COMPLETE else None)
                       for t in store.history() if set(t.params) == set(space.knobs)
                       and t.user_attrs.get("status") not in NOT_RUN]
        self.warm = [h for h in warm_start or [] if set(h[0]) == set(space.knobs)] if searcher == "cubic" else []
        history += self.warm
        self.sampler = make_sampler(searcher, space, seed=seed, budget=self.budget, history=history,
                                    simulated=runner.simulated)
        self.n_history = len(history) - len(self.warm)
        self.study.sampler = self.sampler
        self.dists = distributions(space)
        self.base_key = space.config(space.baseline_params()).key()
        # trials on the simulator (cubic/sim_runner.py): no quality to judge, nothing to re-measure
        self.simulated = runner.simulated
        self._base: FrozenTrial | None = None  # the completed baseline trial, once known
        self._judged: dict[tuple, FrozenTrial] = {}  # numerics key -> the trial a search-time check judged
        self._screen: list[Screened] = []  # the quality screen (cubic.screen): each numerics change alone

    # ------------------------------------------------------------------ entry
    def run(self) -> dict[str, Any]:
        """Hold the study's lease (`cubic.lease`: a second tuner on the same study refuses to
        start rather than fail this one's running trials) while searching and confirming."""
        self.lease = TunerLease(self.store.rdb, self.study._study_id,
                                f"study {self.study.study_name!r} in {safe_url(self.store.rdb.url)}").acquire(
                                    on_wait=self.console.print)
        try:
            return self._run()
        finally:
            self.lease.release()

    def _run(self) -> dict[str, Any]:
        self.store.record_space()
        interrupted = self.store.recover_interrupted()
        self._queue_baseline()
        self.view.seed(self.store.trials(TrialState.COMPLETE, TrialState.FAIL))
        if self.lease.took_over:
            self.view.note(f"took the study over from a tuner that is gone: {describe(self.lease.took_over)}")
        if interrupted:
            self.view.note(f"resumed: {len(interrupted)} interrupted trial(s) "
                           f"{[t.number for t in interrupted]} marked failed and re-queued")
        if isinstance(self.runner, ReusingRunner):
            qs = self.runner.store
            self.view.note(f"quality store: {qs.count()} finished quality runs kept in {safe_url(qs.url)}; a run "
                           "it holds is reused, not trained again")
        if self.n_history:
            self.view.note(f"warm start: {self.n_history} trials of earlier studies on this space")
        if self.warm:
            n_sim = sum(h[2] == "sim" for h in self.warm)
            self.view.note(f"warm start: {len(self.warm)} trials from --warm-start ({n_sim} simulated: the proxy "
                           "ranks them apart from measurements and learns where they are wrong)")
        with self.view:
            self._search()
            self.view.phase = "confirm"
            confirmed = self._confirm() if self.space.confirm_top_k > 0 else []
            self.lease.check(fresh=True)
        return self._summary(confirmed)

    def _queue_baseline(self) -> None:
        for t in self.store.trials(TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING, TrialState.RUNNING):
            if t.user_attrs.get("config_key") == self.base_key and t.user_attrs.get("status") not in NOT_RUN:
                return
        self.store.enqueue(self.space.baseline_params(), {"phase": "baseline"})

    # ------------------------------------------------------------------ search
    def _search(self) -> None:
        pending: list[Pending] = []
        stop, skips = False, 0
        self._judged = {self.space.numerics_key(t.params): t for t in self.store.trials(TrialState.COMPLETE)
                        if "quality_heldout_ok" in t.user_attrs and "quality_runs_of" not in t.user_attrs}
        if not self.simulated:  # a resumed tune keeps the runs its screen already paid for
            stored = {s.change: s for s in load_screen(self.study.user_attrs)}
            self._screen = [stored.get(s.change, s) for s in single_changes(self.space)]
        self._estimate_quality()
        while True:
            self.lease.check()
            used = self.store.budget_used()
            self.view.used = used
            room = used + sum(not (_is_check(p) or _is_screen(p)) for p in pending) < self.budget and not stop
            check = self._next_check(pending) if self._free(pending) else None
            if check is not None:
                pending.append(check)
                continue
            if room and self._free(pending):
                waiting = bool(self.store.trials(TrialState.WAITING))
                if not waiting and self.sampler.should_stop(self.study):
                    stop = True
                    self.view.note(f"{self.searcher}: nothing more worth trying; stopping at {used} trials")
                    continue
                with self._writing():
                    p = self._launch(self.study.ask(self.dists), pending)
                if p is None:
                    skips += 1
                    stop = skips > MAX_SKIPS or self.sampler.last_info.get("phase") == "exhausted"
                else:
                    pending.append(p)
                    skips = 0
                continue
            if not pending:
                return
            for p, res in self.runner.wait(pending, timeout=0.5):
                pending.remove(p)
                if _is_check(p):
                    self._checked(p.tag[1], res, p.tag[2])
                    continue
                if _is_screen(p):
                    self._screened(p.tag[1], res, p.tag[2])
                    continue
                with self._writing():
                    frozen = self.store.finish(p.tag, res)
                self._estimate_quality(frozen)
                self.view.add(frozen, time.monotonic() - p.started)
            self._eta(pending, self.budget - self.store.budget_used())

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """A write that fails because its trial is already finished means a new holder of the lease
        failed it as interrupted: say that (LeaseLost), not a traceback."""
        try:
            yield
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):  # ValueError: "Cannot tell a FAIL trial"
            self.lease.check(fresh=True)
            raise

    def _estimate_quality(self, finished: FrozenTrial | None = None) -> None:
        """Free quality estimates (`cubic.quality`) for finished numerics-changing trials, so the
        searcher learns which fast configurations the gate would reject (user attrs "ne_matched",
        and "quality_est_ok" where the trial's steps cover the baseline's samples).

        Called with no trial when the search starts (a resumed study may hold trials that wait for
        an estimate) and with each trial as it finishes: once the baseline is in, only that trial
        needs one; the baseline's own arrival estimates every trial that finished before it."""
        if self.simulated:  # simulated trials have no losses to estimate quality from
            return
        if finished is not None and self._base is not None:
            todo = [finished]
        else:
            done = self.store.trials(TrialState.COMPLETE)
            self._base = self._baseline_of(done)
            # the view shows the caller's object of the finished trial: update that one
            todo = [finished if finished is not None and t.number == finished.number else t for t in done]
        if self._base is None:
            return
        bres = self._base.user_attrs.get("result") or {}
        bcfg = self.space.config(self._base.params)
        tol = self.space.quality_tolerance
        for t in todo:
            ua = t.user_attrs
            if (t.state != TrialState.COMPLETE or ua.get("config_key") == self.base_key
                    or not self.space.differs_in_numerics(t.params)):
                continue
            if "ne_matched" in ua:  # estimated before: redo the verdict only if the tolerance changed
                ne = ua["ne_matched"]
                if ne is None or ua.get("quality_est_tol") == tol:
                    continue
            else:
                ne = matched_ne((ua.get("result") or {}).get("losses") or [], self.space.config(t.params),
                                bres.get("losses") or [], bcfg, bres.get("ne"))
            attrs: dict[str, Any] = {"ne_matched": ne}
            # Where quality runs judge, the estimate gives no verdict on another global batch: over the first
            # samples it fails a larger batch for having taken fewer steps on them (held-out quality at the
            # budget does not: 2x batches pass), and that veto kept a seed's search out of the fast region.
            # Such trials are judged by held-out checks while searching (`_next_check`).
            biased = self.space.quality_runs is not None and (
                self.space.config(t.params).global_batch != bcfg.global_batch)
            if ne is not None and not biased:
                attrs.update(quality_est_ok=within(ne, bres["ne"], tol), quality_est_tol=tol)
            judged = self._judged.get(self.space.numerics_key(t.params))
            if judged is not None and judged.number != t.number and "quality_heldout_ok" not in ua:
                attrs.update(self._verdict_attrs(judged))
            self.store.set_finished_attrs(t, attrs)
            self._screen_verdict(t, self._base)

    # ------------------------------------------------------------------ held-out checks while searching
    def _next_check(self, pending: list[Pending]) -> Pending | None:
        """A quality run the search pays for now, if any (one at a time): the baseline's seeds first (the
        pairs and the noise floor), then the quality screen's (`cubic.screen`: each numerics change alone,
        before the searcher proposes anything), then the incumbent's, the fastest trial faster than the baseline that
        held-out quality has not rejected, when it changes numerics no quality run has judged yet.

        Why while searching and not only at confirm: the searcher's feasibility model learns from the
        verdict (`quality_heldout_ok`, given to every trial that trains the same model), so one rejected
        4x-batch incumbent steers the search to the region that passes instead of filling the confirm
        with its variants; a passing verdict overrides the in-run estimate. After a rejection the next
        fastest is the incumbent: the search walks down its ranking as it goes. At most a quarter of the
        trial budget (at least `confirm_top_k + 1`) is checked this way (a rejection after its first seed
        costs one run); the confirm reuses every run."""
        qr = self.space.quality_runs
        if qr is None or self.simulated or any(_is_check(p) or _is_screen(p) for p in pending):
            return None
        done = self.store.trials(TrialState.COMPLETE)
        base = self._baseline_of(done)
        if base is None:
            return None
        bne = base.user_attrs.get("quality_eval_ne") or []
        if None in bne:
            return None
        if len(bne) < qr.seeds:
            return self._submit_check(base, len(bne), "the baseline (pairs and noise floor)")
        scr = next((x for x in self._screen if x.ok is None), None)
        if scr is not None:  # before the search proposes anything: each numerics change alone
            n = len(scr.eval_ne)
            p = self.runner.submit(self._quality_config(scr.params, n), tag=("screen", scr, n))
            self.view.note(f"quality screen: {scr.label} alone, seed {n + 1}/{qr.seeds}, {qr.samples:,} samples "
                           f"({sum(x.ok is not None for x in self._screen) + 1} of {len(self._screen)} changes)"
                           + _reused(p))
            return p
        top = max((t for t in done if t is not base and t.user_attrs.get("quality_heldout_ok") is not False
                   and (t.value or 0.0) > (base.value or 0.0)), key=lambda t: t.value or 0.0, default=None)
        if (top is None or "quality_heldout_ok" in top.user_attrs or not self.space.differs_in_numerics(top.params)
                or self.space.numerics_key(top.params) in self._judged):
            return None
        n = len(top.user_attrs.get("quality_eval_ne") or [])
        if n == 0 and len(self._judged) >= max(self.space.confirm_top_k + 1, self.budget // 4):
            return None
        return self._submit_check(top, n, "the incumbent")

    def _quality_config(self, params: dict[str, Any], seed: int) -> TrialConfig:
        """The quality run of params' model at `seed`: the config `SearchSpace.model_params` picks for that
        model, so every configuration that trains it shares the run (through the quality store)."""
        return self.space.quality_runs.config(self.space.config(self.space.model_params(params)), seed)

    def _submit_check(self, t: FrozenTrial, seed: int, what: str) -> Pending:
        qr = self.space.quality_runs
        p = self.runner.submit(self._quality_config(t.params, seed), tag=("check", t, seed))
        self.view.note(f"quality check while searching: #{t.number} ({what}) seed {seed + 1}/{qr.seeds}, "
                       f"{qr.samples:,} samples, held-out {qr.eval_samples:,}" + _reused(p))
        return p

    def _checked(self, t: FrozenTrial, res: TrialResult, seed: int) -> None:
        """Record a search-time quality run; once t's verdict is decided, give it to t and to every trial
        that trains the same model."""
        self._record_quality(t, res, seed)  # (updates t's attrs in place)
        if t.user_attrs.get("config_key") == self.base_key:
            return
        done = self.store.trials(TrialState.COMPLETE)
        ok, _ = self._heldout(t, self._baseline_of(done))
        if ok is None:
            return
        self.store.set_finished_attrs(t, {"quality_heldout_ok": ok})
        key = self.space.numerics_key(t.params)
        self._judged[key] = t
        same = [o for o in done if o.number != t.number and "quality_heldout_ok" not in o.user_attrs
                and o.user_attrs.get("config_key") != self.base_key and self.space.numerics_key(o.params) == key]
        for o in same:
            self.store.set_finished_attrs(o, self._verdict_attrs(t))
        self.view.note(f"quality check: #{t.number} {'passes' if ok else 'fails'} held-out quality"
                       + (f" (and {len(same)} trial(s) that train the same model)" if same else "")
                       + ("" if ok else ": the searcher now avoids it"))

    def _screened(self, scr: Screened, res: TrialResult, seed: int) -> None:
        """Record a screen run; once the change's verdict is decided, store it (the samplers read it from
        the study: `Observations.seen`) and, if it fails, give every trial that uses it the verdict."""
        ok = res.status == "ok" and res.extra.get("eval_ne") is not None
        scr.eval_ne.append(res.extra.get("eval_ne") if ok else None)
        scr.eval_auc.append(res.extra.get("eval_auc") if ok else None)
        if not ok:
            scr.reason = f"seed {seed}: {res.status}: {res.error}"[:300]
        done = self.store.trials(TrialState.COMPLETE)
        base = self._baseline_of(done)
        bne = (base.user_attrs.get("quality_eval_ne") or []) if base is not None else []
        verdict, why = decide(scr, bne, self.space.quality_runs)
        if verdict is not None:
            scr.ok, scr.reason = verdict, (why if ok else f"its quality run failed: {scr.reason}")
        self.study.set_user_attr(SCREEN_ATTR, json_safe([x.to_dict() for x in self._screen]))
        if verdict is None:
            return
        self.view.note(f"quality screen: {scr.label} alone {'passes' if verdict else 'fails'}: {scr.reason}"
                       + ("" if verdict else "; configurations with it are out of the search"))
        for t in done:
            self._screen_verdict(t, base)

    def _screen_verdict(self, t: FrozenTrial, base: FrozenTrial | None) -> None:
        """A finished trial that uses a change the screen failed fails held-out quality with it; one that
        trains what a screened change alone trains starts from that change's runs (same model, same seeds)."""
        ua = t.user_attrs
        if ua.get("config_key") == self.base_key or "quality_heldout_ok" in ua:
            return
        out = frozenset(x.change for x in self._screen if x.ok is False)
        bad = failing_changes(self.space, t.params, out)
        if bad:
            self.store.set_finished_attrs(t, {"quality_heldout_ok": False, "quality_screened_out": bad})
            return
        if ua.get("quality_eval_ne"):
            return
        key = self.space.numerics_key(t.params)
        same = next((x for x in self._screen if x.eval_ne and None not in x.eval_ne
                     and self.space.numerics_key(x.params) == key), None)
        if same is not None:
            self.store.set_finished_attrs(t, {"quality_eval_ne": list(same.eval_ne),
                                              "quality_eval_auc": list(same.eval_auc),
                                              "quality_screen_runs": same.label})
            ok, _ = self._heldout(t, base)
            if ok is not None:
                self.store.set_finished_attrs(t, {"quality_heldout_ok": ok})
                self._judged.setdefault(key, t)

    def _baseline_of(self, trials: list[FrozenTrial]) -> FrozenTrial | None:
        return next((t for t in trials if t.user_attrs.get("config_key") == self.base_key), None)

    def _heldout(self, t: FrozenTrial, base: FrozenTrial | None) -> tuple[bool | None, str]:
        """t's held-out verdict from its quality runs and the baseline's, with its reason (None while its
        seeds are still to run): a failed run fails, so does one far past the tolerance after its first
        seeds (`early_reject`), else the paired judgement over all seeds (`cubic.quality.judge`)."""
        qr = self.space.quality_runs
        ne = t.user_attrs.get("quality_eval_ne") or []
        bne = (base.user_attrs.get("quality_eval_ne") or []) if base is not None else []
        if None in ne:
            return False, f"quality run failed: {t.user_attrs.get('quality_failed')}"
        why = early_reject(t, qr, base)
        if why is not None:
            return False, why
        if len(ne) < qr.seeds or len(bne) < qr.seeds:
            return None, ""
        if None in bne:
            return False, f"the baseline's quality runs failed: {base.user_attrs.get('quality_failed')}"
        j = judge(ne[:qr.seeds], bne[:qr.seeds], qr.tolerance)
        return j["ok"], j["reason"]

    def _sequential(self, t: FrozenTrial, base: FrozenTrial | None) -> tuple[str, dict[str, Any] | None]:
        """t's confirm verdict from its quality runs so far (`cubic.quality.sequential`): a failed run of
        either side, or a candidate far past the tolerance after its first seeds (`early_reject`), fails."""
        qr = self.space.quality_runs
        ne = t.user_attrs.get("quality_eval_ne") or []
        bne = (base.user_attrs.get("quality_eval_ne") or []) if base is not None else []
        if None in ne or None in bne or early_reject(t, qr, base) is not None:
            return "failed", None
        return sequential(ne, bne, qr)

    @staticmethod
    def _verdict_attrs(judged: FrozenTrial) -> dict[str, Any]:
        """What a trial that trains the same model as `judged` inherits: its quality runs and verdict."""
        ua = judged.user_attrs
        return {k: ua[k] for k in ("quality_eval_ne", "quality_eval_auc", "quality_failed", "quality_heldout_ok")
                if k in ua} | {"quality_runs_of": judged.number}

    def _free(self, pending: list[Pending]) -> bool:
        """Room on the cluster for one more trial (asking starts Ray, so only ask with budget left)."""
        if self.space.max_concurrent and len(pending) >= self.space.max_concurrent:
            return False
        return self.runner.has_room(pending)

    def _launch(self, trial: optuna.Trial, pending: list[Pending]) -> Pending | None:
        # Enqueued trials (baseline, resumed) carry their attrs; the sampler's own proposals its last_info.
        enqueued = "fixed_params" in self.study._storage.get_trial_system_attrs(trial._trial_id)
        ua = trial.user_attrs if enqueued else self.sampler.last_info
        if ua.get("phase") == "exhausted":
            self.store.skip(trial, "the searcher had no untried configuration left")
            return None
        try:
            cfg = self.space.config(trial.params)
        except ConfigError as e:  # samplers only propose valid configs; never spend budget on this
            self.store.skip(trial, str(e))
            return None
        key = cfg.key()
        twin = self.store.completed_keys().get(key)
        if twin is None and any(p.cfg.key() == key for p in pending):
            twin = -1
        if twin is not None:
            self.store.skip(trial, f"same configuration as trial {twin}" if twin >= 0 else "already running")
            return None
        self.store.start(trial, {
            "searcher": self.searcher, "phase": ua.get("phase") or self.sampler.name,
            "predicted_qps": ua.get("predicted_qps"), "predicted_std": ua.get("predicted_std"),
            "config_key": key, "config": cfg.to_dict(),
        })
        refused = None if self.simulated else memory_refusal(cfg)
        if refused is not None:  # the model predicts it runs out of memory: recorded as such, never started
            why, pred = refused
            res = TrialResult.failed("oom", f"not launched: {why}", cfg, env={"backend": "real", "launched": False},
                                     extra={"predicted_mem_mb": round(pred.peak_mb, 1),
                                            "predicted_mem_per_position_mb": [round(m, 1) for m in pred.mem_mb],
                                            "mem_limit_mb": round(pred.limit_mb, 1)})
            with self._writing():
                self.view.add(self.store.finish(trial, res), None)
            self.view.note(f"trial {trial.number} not launched: {why}")
            return None
        return self.runner.submit(cfg, tag=trial)

    def _eta(self, pending: list[Pending], remaining: int) -> None:
        per = max(1.0, self.runner.cpus / max(1.0, min((p.cpus for p in pending), default=self.runner.cpus)))
        confirm_runs = (self.space.confirm_top_k + 1) * self.space.repeats if self.space.confirm_top_k else 0
        self.view.set_eta(max(0, remaining) + confirm_runs, per)
        self.view.refresh()

    # ------------------------------------------------------------------ confirm + quality gate
    def _confirm(self) -> list[FrozenTrial]:
        """Re-measure the baseline and walk down the ranking until `confirm_top_k` configurations
        pass the quality gate (or SCREEN_FACTOR x k that need quality runs of their own were screened;
        one that trains a model already rejected inherits that verdict without a run).

        A configuration that changes numerics is screened first: one run, its NE over the baseline's
        samples judged against the baseline's; only if it passes does it get its other `repeats - 1`.
        Runs go one at a time: trials side by side on one node share its memory bandwidth and
        would skew the very numbers that pick the winner. Why walk rather than take the top k: the
        fastest configurations are often fast *because* they change numerics (bigger batches, SGD,
        low precision), and a gate that rejected the whole top k used to leave the baseline as the
        "winner" of a 40-trial tune."""
        ranked = sorted(self.store.trials(TrialState.COMPLETE), key=lambda t: -(t.value or 0.0))
        base = self._baseline_of(ranked)
        qr = None if self.simulated else self.space.quality_runs
        # with quality runs the in-run estimate only guides the searcher: over the first samples after
        # warm-up it fails larger batches for training fewer steps on them, which held-out quality does not
        cands = [t for t in ranked if t is not base and (t.user_attrs.get("quality_heldout_ok") is not False if qr
                                                         else t.user_attrs.get("quality_est_ok") is not False)]
        known_bad = len(ranked) - len(cands) - (base is not None)
        if known_bad:
            self.view.note(f"confirm: {known_bad} fast configuration(s) skipped: " + (
                "held-out quality checks while searching rejected the model they train" if qr else
                "their search trials' NE over the baseline's samples already fails the quality gate"))
        k = self.space.confirm_top_k
        max_screen = min(len(cands), SCREEN_FACTOR * k)  # candidates with runs of their own
        reps = 1 if self.simulated else self.space.repeats  # a simulation gives the same answer again
        if self.simulated:
            self.view.note("confirm: simulated trials: no quality gate (a simulation predicts no model quality; "
                           "a real tune of the winner judges it)")
        self.view.note(f"confirm: baseline + the fastest configurations until {k} pass the quality gate "
                       f"(at most {max_screen} screened), {reps} re-measurements each" if max_screen else
                       f"confirm: the baseline only (no other configuration completed), {reps} re-measurements")
        screened: list[FrozenTrial] = []  # in rank order
        pending: list[Pending] = []
        inflight: dict[int, int] = {}  # trial number -> runs in flight
        qinflight: dict[int, int] = {}  # trial number -> quality runs in flight

        def runs(t: FrozenTrial) -> int:
            return len(t.user_attrs.get("confirm_qps") or []) + len(t.user_attrs.get("confirm_failed") or [])

        def qdone(t: FrozenTrial | None) -> int:
            return len(t.user_attrs.get("quality_eval_ne") or []) if t is not None else 0

        def verdict(t: FrozenTrial) -> bool | None:
            """None while undecided (no run back yet, or the baseline's NE not in yet)."""
            if t.user_attrs.get("confirm_failed"):
                return False
            if self.simulated or not self.space.differs_in_numerics(t.params):
                return True
            if qr is not None:  # quality runs decide, sequentially (`cubic.quality.sequential`)
                state, _ = self._sequential(t, base)
                if state == MORE or not t.user_attrs.get("confirm_qps"):  # seeds or its speed still to come
                    return None
                return state == "passed"
            if not t.user_attrs.get("confirm_ne") or base is None or not base.user_attrs.get("confirm_ne"):
                return None
            return self._quality(t, base)[0]

        def seeds_wanted(t: FrozenTrial) -> int:
            """How many quality seeds t's verdict needs by now: the first `seeds`, then one more pair at a
            time while its interval straddles the tolerance (`cubic.quality.sequential`); the baseline as
            many as the candidate that wants the most (the pairs)."""
            if t is base:
                return max([qr.seeds] + [seeds_wanted(c) for c in screened if c is not base])
            if (not t.user_attrs.get("confirm_qps") or verdict(t) is not None  # decided, or layout only
                    or self._sequential(t, base)[0] != MORE):
                return 0
            return min(qr.max_seeds, max(qr.seeds, min(qdone(t), qdone(base)) + 1))

        def quality_seed(t: FrozenTrial) -> int | None:
            """The seed of t's next quality run, if it needs one now: the baseline's first (the noise
            floor, and the pairs), then each numerics-changing candidate after its first speed run, its seed
            n once the baseline's seed n is in."""
            if qr is None:
                return None
            n = qdone(t) + qinflight.get(t.number, 0)
            if n >= seeds_wanted(t):
                return None
            if t is base:
                return n
            if qdone(base) <= n or None in (base.user_attrs.get("quality_eval_ne") or []):
                return None
            key = self.space.numerics_key(t.params)
            same = next((o for o in screened if o is not t and qinflight.get(o.number, 0) == 0 and qdone(o)
                         and self._sequential(o, base)[0] != MORE
                         and self.space.numerics_key(o.params) == key), None)
            if same is not None and n == 0:  # the same model on the same samples: its quality runs are t's
                self.store.set_finished_attrs(t, {k: same.user_attrs.get(k) for k in (
                    "quality_eval_ne", "quality_eval_auc", "quality_failed") if k in same.user_attrs}
                    | {"quality_runs_of": same.number})
                self.view.note(f"quality: #{t.number} trains what #{same.number} trains: its quality runs apply")
                return None
            return n

        def wants(t: FrozenTrial) -> bool:
            """One more run of t now? (Screening: only the first run until the verdict is in.)"""
            n = runs(t) + inflight.get(t.number, 0)
            if n >= reps:
                return False
            v = verdict(t)
            return v is True or (v is None and n == 0) or (t is base)

        while True:
            self.lease.check()
            passed = [t for t in screened if verdict(t) is True]
            undecided = [t for t in screened if verdict(t) is None]
            own = sum("quality_runs_of" not in t.user_attrs for t in screened)  # those that cost runs of their own
            if (len(passed) < k and len(passed) + len(undecided) < k and own < max_screen
                    and len(screened) < len(cands)):
                t = cands[len(screened)]
                rejected = next((o for o in screened if verdict(o) is False and "quality_runs_of" not in o.user_attrs
                                 and o.user_attrs.get("quality_eval_ne") and self.space.differs_in_numerics(t.params)
                                 and self.space.numerics_key(o.params) == self.space.numerics_key(t.params)), None)
                if rejected is not None:  # the same model was rejected: its verdict, without a run
                    self.store.set_finished_attrs(t, self._verdict_attrs(rejected))
                screened.append(t)
                continue
            order = ([base] if base else []) + screened
            job = next((t for t in order if wants(t)), None)
            if job is not None and not pending:  # one at a time (see the docstring)
                cfg = self.space.config(job.params)
                if base is not None and job is not base and self.space.differs_in_numerics(job.params):
                    cfg = covering(cfg, self.space.config(base.params))
                pending.append(self.runner.submit(cfg, tag=job))
                inflight[job.number] = inflight.get(job.number, 0) + 1
                continue
            qjob = next(((t, sd) for t in order if (sd := quality_seed(t)) is not None), None)
            if qjob is not None and not pending:
                t, sd = qjob
                pending.append(p := self.runner.submit(self._quality_config(t.params, sd), tag=(t, sd)))
                self.view.note(f"quality run: #{t.number} seed {sd + 1} (at least {qr.seeds}, at most "
                               f"{qr.max_seeds}), {qr.samples:,} samples, held-out {qr.eval_samples:,}" + _reused(p))
                qinflight[t.number] = qinflight.get(t.number, 0) + 1
                continue
            if not pending:
                break
            for p, res in self.runner.wait(pending, timeout=0.5):
                pending.remove(p)
                self.lease.check(fresh=True)  # confirm writes bypass Optuna's state check
                if isinstance(p.tag, tuple):
                    t, sd = p.tag
                    qinflight[t.number] -= 1
                    self._record_quality(t, res, sd)
                    continue
                inflight[p.tag.number] -= 1
                self._record_confirm(p.tag, res, base)
                self.view.add(p.tag, time.monotonic() - p.started, confirm=res)
            left = sum(max(0, reps - runs(t)) for t in order if verdict(t) is not False)
            self.view.set_eta(left, 1.0)
            self.view.refresh()
        targets = ([base] if base else []) + screened
        self.lease.check(fresh=True)
        for t in targets:
            ok_, why = self._quality(t, base)
            self.store.set_finished_attrs(t, {"quality_ok": ok_, "quality_reason": why, "quality_verdict": (
                t.user_attrs.get("quality_verdict") or ("passed" if ok_ else "failed"))})
        for t in ranked:  # rejected by a check while searching: the verdict's reason, for the report
            ua = t.user_attrs
            if ua.get("quality_heldout_ok") is False and "quality_reason" not in ua:
                why = (f"quality screen: {', '.join(ua['quality_screened_out'])} alone fails held-out quality"
                       if ua.get("quality_screened_out") else
                       f"held-out check while searching: {self._heldout(t, base)[1]}")
                self.store.set_finished_attrs(t, {"quality_ok": False, "quality_reason": why})
        return targets

    def _record_confirm(self, t: FrozenTrial, res: TrialResult, base: FrozenTrial | None) -> None:
        """Append a re-measurement's qps and NE (over the baseline's samples) to the trial's attrs."""
        ua = t.user_attrs
        if res.status == "ok" and res.qps > 0:
            ne: float | None = res.ne
            if base is not None and t.number != base.number and self.space.differs_in_numerics(t.params):
                bres = base.user_attrs.get("result") or {}
                ne = matched_ne(res.losses, self.space.config(t.params), bres.get("losses") or [],
                                self.space.config(base.params), bres.get("ne"))
            attrs = {"confirm_qps": list(ua.get("confirm_qps") or []) + [res.qps],
                     "confirm_ne": list(ua.get("confirm_ne") or []) + [ne]}
        else:
            attrs = {"confirm_failed": list(ua.get("confirm_failed") or []) + [f"{res.status}: {res.error}"]}
        self.store.set_finished_attrs(t, attrs)

    def _record_quality(self, t: FrozenTrial, res: TrialResult, seed: int) -> None:
        """Append one quality run's held-out eval NE and AUC (None for a failed run, with its reason)."""
        ua = t.user_attrs
        ok = res.status == "ok" and res.extra.get("eval_ne") is not None
        attrs = {"quality_eval_ne": list(ua.get("quality_eval_ne") or []) + [res.extra.get("eval_ne") if ok else None],
                 "quality_eval_auc": list(ua.get("quality_eval_auc") or []) + [res.extra.get("eval_auc") if ok
                                                                                else None]}
        if not ok:
            attrs["quality_failed"] = f"seed {seed}: {res.status}: {res.error}"[:300]
        self.store.set_finished_attrs(t, attrs)
        self.view.note(f"quality run: #{t.number} seed {seed + 1}: " + (
            f"eval NE {res.extra['eval_ne']:.5f}, AUC {res.extra['eval_auc']:.4f}" if ok else attrs["quality_failed"]))

    def _quality(self, t: FrozenTrial, base: FrozenTrial | None) -> tuple[bool, str]:
        why = early_reject(t, self.space.quality_runs, base)
        if why is not None:
            self.store.set_finished_attrs(t, {"quality_eval_diff": paired_diff(t, base)})
            return False, why
        ua = t.user_attrs
        if ua.get("confirm_failed"):
            return False, f"re-measurement failed: {ua['confirm_failed'][0]}"[:300]
        if not ua.get("confirm_qps"):
            return False, "not re-measured"
        qr = self.space.quality_runs
        if base is not None and t.number == base.number:
            if qr is not None and ua.get("quality_eval_ne"):
                ne = [x for x in ua["quality_eval_ne"] if x is not None]
                noise = noise_floor(ne)
                return True, (f"baseline (eval NE {statistics.mean(ne):.5f} over {len(ne)} seed(s)"
                              + (f", seed-to-seed sd {noise:.3%})" if noise is not None else ")") if ne else
                              "baseline (its quality runs failed: " + str(ua.get("quality_failed")) + ")")
            return True, "baseline"
        changed = self.space.differs_in_numerics(t.params)
        if changed and self.simulated:
            return True, (f"simulated: quality not judged (changes {', '.join(changed)}); a real tune's quality "
                          "gate judges it")
        if not changed:
            return True, "numerics unchanged (only layout/kernel/pipelining knobs differ): no quality run needed"
        if qr is not None:
            if ua.get("quality_failed"):
                return False, f"quality run failed: {ua['quality_failed']}"
            cand, bne = ua.get("quality_eval_ne") or [], (base.user_attrs.get("quality_eval_ne") or []) if base else []
            if None in bne:
                return False, f"the baseline's quality runs failed: {base.user_attrs.get('quality_failed')}"
            state, j = self._sequential(t, base)
            if state == MORE or j is None:
                return False, (f"changes {', '.join(changed)} but its quality runs are incomplete "
                               f"({len(cand)} seed(s), at least {qr.seeds}; baseline {len(bne)})")
            self.store.set_finished_attrs(t, {"quality_eval_diff": j["diff"], "quality_se": j["se"],
                                              "quality_noise": j["noise"], "quality_resolved": j["resolved"],
                                              "quality_ci": j["ci"], "quality_verdict": state})
            n = len(j["diffs"])
            head = {"passed": "passed", "failed": "failed",
                    NOT_RESOLVED: f"NOT RESOLVED after {n} paired seeds (the seed budget, quality.max_seeds): the "
                                  f"interval straddles the tolerance, so it is not crowned"}[state]
            return state == "passed", f"{head}: {j['reason']} (changes {', '.join(changed)})"
        ne_t = _median_finite(ua.get("confirm_ne"))
        ne_b = _median_finite(base.user_attrs.get("confirm_ne")) if base is not None else None
        if ne_t is None or ne_b is None or ne_b <= 0:
            return False, f"changes {changed} but NE is unavailable (trial {ne_t}, baseline {ne_b})"
        rel = (ne_t - ne_b) / ne_b
        tol = self.space.quality_tolerance
        ok = within(ne_t, ne_b, tol)
        return ok, (f"NE {ne_t:.4f} vs baseline {ne_b:.4f}: {rel:+.2%} {'<=' if ok else '>'} {tol:.2%} "
                    f"(changes {', '.join(changed)})")

    # ------------------------------------------------------------------ summary
    def _screen_summary(self) -> list[dict[str, Any]]:
        return [x.to_dict() | {"change": x.label, "verdict": x.verdict} for x in self._screen]

    def _summary(self, confirmed: list[FrozenTrial]) -> dict[str, Any]:
        trials = self.store.trials(TrialState.COMPLETE, TrialState.FAIL)
        ran = [t for t in trials if t.user_attrs.get("status") not in NOT_RUN]
        # (by its key: with quality runs its reason is "baseline (eval NE ...)", and matching the reason's text
        # left every such tune's winner without its speed-up)
        base = self._baseline_of(confirmed)
        base_q = _median_finite(base.user_attrs.get("confirm_qps") if base else None)
        if base_q is None and base is not None:
            base_q = base.value
        winner = None
        ok = [t for t in confirmed if t.user_attrs.get("quality_ok") and t.user_attrs.get("confirm_qps")]
        if ok:
            w = max(ok, key=lambda t: statistics.median(t.user_attrs["confirm_qps"]))
            cq = w.user_attrs["confirm_qps"]
            bq = base.user_attrs.get("confirm_qps") if base else None
            med = statistics.median(cq)
            winner = {
                "trial": w.number, "qps": med, "qps_spread": [min(cq), max(cq)],
                "baseline_qps": base_q, "speedup": med / base_q if base_q else None,
                "speedup_spread": [min(cq) / max(bq), max(cq) / min(bq)] if bq else None,
                "config": w.user_attrs.get("config"), "config_key": w.user_attrs.get("config_key"),
                "searcher": self.searcher, "quality_reason": w.user_attrs.get("quality_reason"),
                "confirm_qps": cq, "short_config": short_config(self.space, w.params),
            }
            qr = self.space.quality_runs
            if self.simulated:
                winner["backend"] = "sim"
                winner["cluster"] = self.runner.cluster.name  # type: ignore[union-attr]
            elif qr is not None:  # the evidence behind the quality verdict
                winner["quality"] = {**qr.to_dict(), **{k.removeprefix("quality_"): w.user_attrs.get(k) for k in (
                    "quality_eval_ne", "quality_eval_auc", "quality_eval_diff", "quality_se", "quality_noise",
                    "quality_resolved", "quality_ci", "quality_verdict")},
                    "baseline_eval_ne": base.user_attrs.get("quality_eval_ne") if base else None,
                    "screen": self._screen_summary()}
        self.store.set_winner(winner)  # None clears a winner an earlier confirm left behind
        done = [t for t in ran if t.state == TrialState.COMPLETE]
        top = max(done, key=lambda t: t.value or 0.0, default=None)
        if base_q is None:  # no confirm ran: the baseline's search measurement
            base_q = next((t.value for t in done if t.user_attrs.get("config_key") == self.base_key), None)
        best = None if top is None else {
            "trial": top.number, "qps": top.value, "short_config": short_config(self.space, top.params),
            "speedup": top.value / base_q if base_q else None}
        return {
            "study": self.study.study_name, "storage": safe_url(self.store.rdb.url), "best_measured": best,
            "run_dir": str(self.store.run_dir) if self.store.run_dir else None, "searcher": self.searcher,
            "budget": self.budget, "trials": len(ran),
            "ok": sum(t.state == TrialState.COMPLETE for t in ran),
            "failed": sum(t.state == TrialState.FAIL for t in ran),
            "proxy_tau": self.view.tau, "winner": winner,
            "screen": self._screen_summary(),
            "quality_runs": ({"ran": self.runner.ran, "reused": self.runner.reused}
                             if isinstance(self.runner, ReusingRunner) else None),
            "confirmed": [{"trial": t.number, "short_config": short_config(self.space, t.params),
                           "qps": t.value, "confirm_qps": t.user_attrs.get("confirm_qps"),
                           "quality_ok": t.user_attrs.get("quality_ok"),
                           "quality_verdict": t.user_attrs.get("quality_verdict"),
                           "quality_eval_diff": t.user_attrs.get("quality_eval_diff"),
                           "quality_ci": t.user_attrs.get("quality_ci"),
                           "quality_reason": t.user_attrs.get("quality_reason")} for t in confirmed],
        }


def _reused(p: Pending) -> str:
    return ": reused from the quality store, not trained again" if p.reused else ""


def _is_check(p: Pending) -> bool:
    """A search-time quality run (tag ("check", trial, seed)), not a search trial."""
    return isinstance(p.tag, tuple) and p.tag[0] == "check"


def _is_screen(p: Pending) -> bool:
    """A quality screen run (tag ("screen", Screened, seed)), not a search trial."""
    return isinstance(p.tag, tuple) and p.tag[0] == "screen"


def early_reject(t: FrozenTrial, qr: Any, base: FrozenTrial | None) -> str | None:
    """Why t fails the quality gate before all its seeds ran (None if it may still pass): its mean paired
    eval-NE difference so far is over EARLY_REJECT x the tolerance, far past what the paired noise on
    these workloads spans (hundredths of a percent), so its remaining quality runs would be wasted."""
    if qr is None or base is None or t is base:
        return None
    n = min(len(t.user_attrs.get("quality_eval_ne") or []), len(base.user_attrs.get("quality_eval_ne") or []))
    d = paired_diff(t, base)
    if n >= qr.seeds or d is None or d <= EARLY_REJECT * qr.tolerance:
        return None
    return (f"eval NE {d:+.3%} vs baseline after {n} of {qr.seeds} paired seed(s), over {EARLY_REJECT:g} x the "
            f"{qr.tolerance:.2%} tolerance: rejected without the remaining quality runs")


def paired_diff(t: FrozenTrial, base: FrozenTrial) -> float | None:
    """Mean relative eval-NE difference of t from the baseline over the seeds both have run (None if none)."""
    return paired_mean(t.user_attrs.get("quality_eval_ne") or [], base.user_attrs.get("quality_eval_ne") or [])


def _median_finite(xs: Any) -> float | None:
    vals = [float(x) for x in (xs or []) if x is not None and math.isfinite(float(x))]
    return statistics.median(vals) if vals else None
