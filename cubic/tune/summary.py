"""What a tune found (`cubic.tune.outcome.Summary`, what `cubic tune` prints): the winner with
the evidence behind its speed and its quality, the best measured trial, the screen and the
confirm's verdicts.

The winner's speed-up is the median ratio of its re-measurements to the baseline's run beside each
(`TrialRecord.confirm_speedup`), never the search's first measurement: that one was selected for being high."""

from __future__ import annotations

import statistics
from dataclasses import replace

from optuna.trial import TrialState

from cubic.quality.rules import Verdict
from cubic.quality.store import ReusingRunner
from cubic.study.record import BACKOFF, NOT_RUN, REFERENCE, TrialRecord
from cubic.study.store import safe_url
from cubic.study.winner import PlannerRef, Winner
from cubic.tune.candidates import median_finite
from cubic.tune.checks import QualityChecks
from cubic.tune.context import Tuning
from cubic.tune.outcome import BestMeasured, ConfirmedRow, NotCrowned, QualityRunCount, Summary
from cubic.tune.view import short_config


def winner(ctx: Tuning, checks: QualityChecks, confirmed: list[TrialRecord], searcher: str,
           base_q: float | None) -> Winner | None:
    """The fastest confirmed configuration that passed the gate (None: none did); `base_q`: `baseline_qps`."""
    space = ctx.space
    # (by its key: with quality runs its reason is "baseline (eval NE ...)", and matching the reason's text
    # left every such tune's winner without its speed-up)
    base = ctx.baseline_of(confirmed)
    ok = [t for t in confirmed if t.quality_ok and t.confirm_qps]
    if not ok:
        return None
    # crowned over all its re-measurements: one that passed and was spared the rest as unable to
    # win (`Candidates.outpaced`) holds fewer, and its best pair is no verdict on its speed
    ok = [t for t in ok if len(t.confirm_qps) >= ctx.policy.repeats] or ok
    w = max(ok, key=lambda t: t.confirm_speedup(base_q) or 0.0)
    cq, pairs = w.confirm_qps, w.paired_ratios
    bq = base.confirm_qps if base else None
    med = statistics.median(cq)
    spread = ([min(pairs), max(pairs)] if pairs else [min(cq) / max(bq), max(cq) / min(bq)] if bq
              else None)
    qr = ctx.policy.quality_runs
    quality = None if qr is None else {  # the evidence behind the quality verdict
        **qr.to_dict(), **{k.removeprefix("quality_"): getattr(w, k) for k in (
            "quality_eval_ne", "quality_eval_auc", "quality_eval_diff", "quality_se", "quality_noise",
            "quality_resolved", "quality_ci", "quality_verdict")},
        "baseline_eval_ne": base.quality_eval_ne if base else None,
        "screen": checks.screen_summary()}
    return Winner(trial=w.number, qps=med, qps_spread=[min(cq), max(cq)], baseline_qps=base_q,
                  speedup=w.confirm_speedup(base_q), speedup_spread=spread,
                  confirm_base_qps=w.confirm_base_qps, config=w.run.get("config"),
                  config_key=w.config_key, searcher=searcher, quality_reason=w.quality_reason,
                  confirm_qps=cq, short_config=short_config(space, w.params),
                  provenance=dict(ctx.policy.provenance), quality=quality)


def reference(ctx: Tuning, win: Winner | None, best: BestMeasured | None) -> PlannerRef | None:
    """TorchRec's planner's plan of the baseline (the `reference` trial, where the space offers it): its qps
    (the confirm's median where it re-measured it, else its one search measurement) and what the winner (else
    the best measured trial) and the baseline give over it.

    The winner's speed-up over it goes through the baseline, each ratio measured side by side: the winner's
    paired re-measurements, and the reference's pairs where the confirm re-measured it, else its search run
    over the baseline's (the reference runs right after the baseline). Dividing the winner's re-measured qps
    by a reference measured once, minutes earlier, read a seed's 1.15x winner as 0.92x TorchRec's plan: the
    machine had slowed 15% in between (the baseline's 22,485 qps in the search, 19,101 in the confirm)."""
    done = ctx.store.records(TrialState.COMPLETE)
    ref = next((t for t in done if t.run.get("phase") == REFERENCE and t.value), None)
    if ref is None:
        return None
    q = median_finite(ref.confirm_qps) or ref.value
    base = ctx.baseline_of(done)
    over_base = ref.confirm_speedup(None) if ref.paired_ratios else (
        ref.value / base.value if base is not None and base.value else None)
    if win is not None and win.speedup and over_base:
        speedup: float | None = win.speedup / over_base
    else:
        speedup = best.qps / q if best is not None and best.qps else None
    return PlannerRef(trial=ref.number, qps=q, re_measured=bool(median_finite(ref.confirm_qps)),
                      speedup=speedup, baseline_speedup=1.0 / over_base if over_base else None)


def baseline_qps(ctx: Tuning, confirmed: list[TrialRecord]) -> float | None:
    """The baseline's re-measured median; its search measurement where the confirm did not re-measure it."""
    base = ctx.baseline_of(confirmed)
    q = median_finite(base.confirm_qps if base else None)
    if q is None and base is not None:
        q = base.value
    if q is None:  # no confirm ran
        done = ctx.store.records(TrialState.COMPLETE)
        q = next((t.value for t in done if t.config_key == ctx.base_key and t.status not in NOT_RUN), None)
    return q


def summary(ctx: Tuning, checks: QualityChecks, confirmed: list[TrialRecord], searcher: str,
            proxy_tau: float | None) -> Summary:
    """The tune's outcome; stores the winner on the study (None clears one an earlier confirm left)."""
    space, store = ctx.space, ctx.store
    base_q = baseline_qps(ctx, confirmed)
    win = winner(ctx, checks, confirmed, searcher, base_q)
    ran = [t for t in store.records(TrialState.COMPLETE, TrialState.FAIL) if t.ran]
    done = [t for t in ran if t.state == TrialState.COMPLETE]
    top = max(done, key=lambda t: t.value or 0.0, default=None)
    best = None if top is None else BestMeasured(
        trial=top.number, qps=top.value, short_config=short_config(space, top.params),
        speedup=top.value / base_q if base_q else None)
    ref = reference(ctx, win, best)
    if win and ref:  # stored with the winner: the report and the export show it beside the baseline's
        win = replace(win, vs_torchrec_planner=ref)
    store.set_winner(win)
    runner = ctx.runner
    carried = ctx.policy.carried
    return Summary(
        study=store.name, storage=safe_url(store.rdb.url), best_measured=best,
        run_dir=str(store.run_dir) if store.run_dir else None, searcher=searcher,
        budget=ctx.budget, trials=len(ran),
        ok=len(done), failed=sum(t.state == TrialState.FAIL for t in ran),
        proxy_tau=proxy_tau, winner=win, torchrec_planner=ref,
        screen=([c.to_row() for c in carried.changes()] if carried is not None
                else checks.screen_summary()),
        quality_runs=(QualityRunCount(runner.ran, runner.reused)
                      if isinstance(runner, ReusingRunner) else None),
        backoff=[t.number for t in ran if t.run.get("phase") == BACKOFF],
        confirmed=confirmed_rows(ctx, confirmed, base_q),
        carried_from=carried.source_note if carried is not None else None,
        not_crowned=not_crowned(ctx, win, base_q),
    )


SHOWN_NOT_CROWNED = 3


def not_crowned(ctx: Tuning, win: Winner | None, base_q: float | None) -> list[NotCrowned]:
    """A simulated study's fastest configurations, faster than its winner, that the real quality runs
    did not let it crown (the first SHOWN_NOT_CROWNED, fastest first)."""
    carried = ctx.policy.carried
    if carried is None:
        return []
    out = []
    for t in sorted(ctx.store.records(TrialState.COMPLETE), key=lambda t: -(t.value or 0.0)):
        if len(out) == SHOWN_NOT_CROWNED or (win is not None and (t.value or 0.0) <= (win.qps or 0.0)):
            break
        c = carried.crown(t.params)
        if not c.ok:
            out.append(NotCrowned(t.number, short_config(ctx.space, t.params), t.value,
                                  t.value / base_q if t.value and base_q else None, c.reason))
    return out


def confirmed_rows(ctx: Tuning, confirmed: list[TrialRecord],
                   base_q: float | None) -> list[ConfirmedRow]:
    """One row per confirmed configuration. `same_model_as`: the earlier row whose configuration trains the
    same model and was judged by the same quality runs (equal bit for bit: one `numerics_key`, or two the
    confirm pooled), so the summary shows that verdict once."""
    space, qr = ctx.space, ctx.policy.quality_runs
    first_of: dict[tuple, int] = {}
    rows = []
    for t in confirmed:
        # (a candidate spared as slower was judged by its own speed, not by its model's runs)
        judged = t.quality_verdict != Verdict.SLOWER and (
            t.quality_eval_diff is not None or "eval NE" in (t.quality_reason or ""))
        # its model: the quality runs that judged it (two keys whose runs equal bit for bit were pooled
        # as one, `Candidates.same_model`), else its numerics
        model = tuple(t.quality_eval_ne) if t.quality_eval_ne else space.numerics_key(t.params)
        key = ((model, t.quality_verdict, t.quality_eval_diff, t.quality_reason
                if t.quality_eval_diff is None else None) if judged else None)
        rows.append(ConfirmedRow(
            trial=t.number, short_config=short_config(space, t.params),
            backoff=t.run.get("phase") == BACKOFF,
            qps=t.value, confirm_qps=t.confirm_qps, confirm_speedup=t.confirm_speedup(base_q),
            quality_ok=t.quality_ok, quality_verdict=t.quality_verdict,
            quality_eval_diff=t.quality_eval_diff, quality_ci=t.quality_ci,
            quality_seeds=sum(x is not None for x in t.quality_eval_ne) or None,
            quality_confidence=qr.confidence if qr is not None else None,
            quality_reason=t.quality_reason,
            same_model_as=first_of.get(key) if key is not None else None))
        if key is not None:
            first_of.setdefault(key, t.number)
    return rows
