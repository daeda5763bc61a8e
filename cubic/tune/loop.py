"""The `cubic tune` loop: propose -> run -> store, then confirm the top-k and pick the winner.

The lifecycle of one tune, written once (each step's role in its own module):

1. Hold the study's lease (`cubic.study.lease`): a second tuner on the same study refuses to start rather than
   fail this one's running trials.
2. Resume: the store is the truth. Trials left RUNNING by a dead tuner become FAIL(interrupted) and their
   configurations are enqueued again; the baseline is enqueued unless it ran.
3. Search (`Tuner._search`), until the budget of trials that ran is spent or the searcher has nothing left:
   - ask the searcher (an Optuna sampler, `cubic.search.samplers`) for a configuration and launch it on the
     cluster unless it is a duplicate (`TrialConfig.key()`) or the memory model says it cannot fit;
   - between trials, the quality runs the search pays for (`cubic.tune.checks`): the baseline's seeds,
     the screen of each numerics change alone, held-out checks of the incumbent;
   - as each trial finishes, store it and estimate its quality from its own losses.
4. Confirm (`cubic.tune.confirm`): re-measure and gate the fastest until `confirm_top_k` pass.
5. Summarise (`cubic.tune.summary`): the winner, stored on the study, and what the tune found.

What a study's trials can tell (measured or simulated) is decided once, in `cubic.tune.policy`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import optuna
from optuna.trial import TrialState
from rich.console import Console

from cubic.execution.runner import Pending, Runner
from cubic.quality.carried import Carried, CarriedVerdicts
from cubic.quality.scaled import ScaledVerdicts
from cubic.quality.screen import ATTR as SCREEN_ATTR
from cubic.quality.store import QualityStore, ReusingRunner
from cubic.search.fidelity import Fidelity
from cubic.search.samplers import distributions, make_sampler
from cubic.space.search_space import SearchSpace
from cubic.study.lease import TunerLease, describe
from cubic.study.record import NOT_RUN, REFERENCE
from cubic.study.store import Store, safe_url
from cubic.tune.checks import QualityChecks
from cubic.tune.confirm import Confirm
from cubic.tune.context import Tuning
from cubic.tune.outcome import Summary
from cubic.tune.policy import Policy
from cubic.tune.summary import summary
from cubic.tune.view import TuneView
from cubic.tune.work import QUALITY_RUNS, CheckRun, ScreenRun, SearchRun
from cubic_harness.config import json_safe
from cubic_harness.errors import ConfigError


def carried_verdicts(space: SearchSpace, store: QualityStore | None,
                     judged_in: SearchSpace | None = None) -> Carried | None:
    """What a simulated study of `space` crowns by: the real quality runs in `store` of `judged_in`,
    a space of the same workload at another size (`cubic.quality.scaled`), where given; else of the
    space itself where it trains a model here (it has quality runs); a space only simulated has none
    to carry (None)."""
    where = safe_url(store.url) if store is not None else ""
    if judged_in is not None:
        return ScaledVerdicts(space, CarriedVerdicts(judged_in, store, where))
    if space.quality_runs is None:
        return None
    return CarriedVerdicts(space, store, where)


MAX_SKIPS = 20  # consecutive duplicate proposals before the search gives up


class Tuner:
    """One `cubic tune`: `run()` searches until the budget is spent, confirms, returns the summary."""

    def __init__(self, space: SearchSpace, store: Store, runner: Runner, searcher: str = "cubic",
                 budget: int | None = None, seed: int = 0, console: Console | None = None,
                 live: bool | None = None, warm_start: list[tuple[dict, float | None, Fidelity]] | None = None,
                 quality_store: QualityStore | None = None,
                 quality_from: SearchSpace | None = None) -> None:
        policy = (Policy.simulated(runner.cluster.name,  # type: ignore[attr-defined]
                                   carried_verdicts(space, quality_store, quality_from))
                  if runner.simulated else Policy.measured(space, runner.backend))
        if quality_store is not None and policy.quality_runs is not None:
            runner = ReusingRunner(runner, quality_store)
        self.searcher = searcher
        self.study: optuna.Study = store.study
        budget = budget or space.budget
        self.console = console or Console()
        self.ctx = Tuning(space, store, runner, TuneView(space, budget, self.console, live), policy,
                          base_key=space.config(space.baseline_params()).key(), budget=budget)
        self.checks = QualityChecks(self.ctx)
        self.space, self.store, self.runner, self.view, self.budget = space, store, runner, self.ctx.view, budget
        history = []
        if searcher == "cubic":
            history = [(t.params, t.value if t.state == TrialState.COMPLETE else None)
                       for t in store.history() if set(t.params) == set(space.knobs)
                       and t.user_attrs.get("status") not in NOT_RUN]
        self.warm = [h for h in warm_start or [] if set(h[0]) == set(space.knobs)] if searcher == "cubic" else []
        history += self.warm
        self.sampler = make_sampler(searcher, space, seed=seed, budget=budget, history=history,
                                    own=Fidelity.of(store.backend, store.figures))
        self.n_history = len(history) - len(self.warm)
        self.sampler.feasible = store.feasible
        self.study.sampler = self.sampler
        self.dists = distributions(space)

    # ------------------------------------------------------------------ 1. the lease
    def run(self) -> Summary:
        self.ctx.lease = self.lease = TunerLease(
            self.store.rdb, self.store.name, f"study {self.study.study_name!r} in {safe_url(self.store.rdb.url)}"
        ).acquire(on_wait=self.console.print)
        try:
            return self._run()
        finally:
            self.lease.release()

    # ------------------------------------------------------------------ 2. resume, then 3-5
    def _run(self) -> Summary:
        self.store.record_space()
        interrupted = self.store.recover_interrupted()
        self._queue_baseline()
        self.view.seed(self.store.records(TrialState.COMPLETE, TrialState.FAIL))
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
            n = Counter(h[2].backend for h in self.warm)
            self.view.note(f"warm start: {len(self.warm)} trials from --warm-start "
                           f"({', '.join(f'{k} {v}' for k, v in n.items())}): the proxy ranks each source "
                           "apart and learns where one's order is not another's")
        self._carry_verdicts()
        with self.view:
            self._search()
            self.view.phase = "confirm"
            confirmed = Confirm(self.ctx, self.checks).run() if self.space.confirm_top_k > 0 else []
            self.lease.check(fresh=True)
        return summary(self.ctx, self.checks, confirmed, self.searcher, self.view.tau)

    def _carry_verdicts(self) -> None:
        """A simulated study of a trainable space: the real quality runs' verdicts become its screen, so
        the searcher keeps to what it can crown (`cubic.quality.carried`)."""
        carried = self.ctx.policy.carried
        if carried is None:
            return
        verdicts = carried.changes()
        self.study.set_user_attr(SCREEN_ATTR, json_safe([v.to_screened().to_dict() for v in verdicts]))
        count = {ok: sum(v.ok is ok for v in verdicts) for ok in (True, False, None)}
        apart = sum(bool(v.not_carried) for v in verdicts)
        self.view.note(f"quality verdicts carried from real runs ({carried.source_note}): {count[True]} "
                       f"change(s) pass, {count[False]} ruled out, {count[None]} never judged"
                       + (f" ({apart} of them not carried here)" if apart else "")
                       + "; the search keeps to the changes that passed")

    def _queue_baseline(self) -> None:
        """The baseline first, then TorchRec's planner's plan of it where the space offers that (`reference`),
        each unless it ran or waits already."""
        held = {t.config_key for t in self.store.records(TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING,
                                                         TrialState.RUNNING) if t.status not in NOT_RUN}
        ref = self.space.reference_params()
        for params, phase in ((self.space.baseline_params(), "baseline"), (ref, REFERENCE)):
            if params is not None and self.space.config(params).key() not in held:
                self.store.enqueue(params, {"phase": phase})

    # ------------------------------------------------------------------ 3. search
    def _search(self) -> None:
        pending: list[Pending] = []
        stop, skips, idle = False, 0, False
        self.checks.start()
        while True:
            self.lease.check()
            if idle and pending:  # nothing finished since the last pass decided to wait: nothing to decide
                idle = not self._collect(pending, eta=False)
                continue
            used = self.store.budget_used()
            self.view.used = used
            room = used + sum(not isinstance(p.tag, QUALITY_RUNS) for p in pending) < self.budget and not stop
            check = self.checks.next_run(pending) if self._free(pending) else None
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
            idle = not self._collect(pending)

    def _collect(self, pending: list[Pending], eta: bool = True) -> bool:
        """Record the runs that finished within half a second, then the ETA (where any did, or `eta`);
        whether any did. Until one does, the loop decides nothing new: a pass reads the whole study
        (~17 ms, twice), and at two passes a second it took 3% of a core from the ranks being measured."""
        done = self.runner.wait(pending, timeout=0.5)
        for p, res in done:
            pending.remove(p)
            match p.tag:
                case CheckRun():
                    self.checks.checked(p.tag, res)
                case ScreenRun():
                    self.checks.screened(p.tag, res)
                case SearchRun(trial=trial):
                    with self._writing():
                        rec = self.store.finish(trial, res)
                    self.checks.estimate(rec)
                    self.view.add(rec, time.monotonic() - p.started)
        if done or eta:  # (the pass before counted the trials that ran: none has ended since, unless done)
            self._eta(pending, self.budget - (self.store.budget_used() if done else self.view.used))
        else:
            self.view.refresh()
        return bool(done)

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """A write that fails because its trial is already finished means a new holder of the lease
        failed it as interrupted: say that (LeaseLost), not a traceback."""
        try:
            yield
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError):  # ValueError: "Cannot tell a FAIL trial"
            self.lease.check(fresh=True)
            raise

    def _free(self, pending: list[Pending]) -> bool:
        """Room on the cluster for one more trial (asking starts Ray, so only ask with budget left)."""
        if self.space.max_concurrent and len(pending) >= self.space.max_concurrent:
            return False
        return self.runner.has_room(pending)

    def _launch(self, trial: optuna.Trial, pending: list[Pending]) -> Pending | None:
        """Start `trial` on the cluster, or finish it at once: skipped (a duplicate, nothing left to
        propose) or refused (predicted out of memory). Enqueued trials (the baseline, a resumed one) carry
        their attrs (`Store.enqueue` sets config_key); the sampler's own proposals its `last_info`."""
        ua = trial.user_attrs if "config_key" in trial.user_attrs else self.sampler.last_info
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
        attrs = {"searcher": self.searcher, "phase": ua.get("phase") or self.sampler.name,
                 "predicted_qps": ua.get("predicted_qps"), "predicted_std": ua.get("predicted_std"),
                 "config_key": key, "config": cfg.to_dict()}
        return self.ctx.launch(trial, cfg, attrs, SearchRun(trial))

    def _eta(self, pending: list[Pending], remaining: int) -> None:
        per = max(1.0, self.runner.cpus / max(1.0, min((p.cpus for p in pending), default=self.runner.cpus)))
        confirm_runs = (self.space.confirm_top_k + 1) * self.space.repeats if self.space.confirm_top_k else 0
        self.view.set_eta(max(0, remaining) + confirm_runs, per)
        self.view.refresh()
