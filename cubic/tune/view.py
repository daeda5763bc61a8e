"""What a tune shows: the live table of finished trials (progress, best so far, the proxy's
Kendall tau, ETA; one line per trial when not on a terminal) and the final summary."""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

from optuna.trial import TrialState
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cubic.quality.rules import NOT_RESOLVED, Verdict
from cubic.search.proxy import kendall_tau
from cubic.space.search_space import SearchSpace
from cubic.study.record import TrialRecord
from cubic.tune.outcome import ConfirmedRow, Summary
from cubic_harness.config import TrialResult

SHORT = {"sharding": "", "sharding_group_size": "G", "sparse_sync": "sync", "emb_optimizer": "opt",
         "batch_size": "bs", "kernel": "k", "emb_precision": "emb", "dense_precision": "dense",
         "comm_precision": "comm", "allreduce_comm_precision": "ar", "pipeline_depth": "pipe",
         "threads_per_rank": "thr", "world_size": "W"}


def short_config(space: SearchSpace, params: dict[str, Any]) -> str:
    """The knobs that differ from the baseline, tersely ('baseline' if none)."""
    if set(params) != set(space.knobs):
        return "?"
    base = space.baseline_params()
    parts = []
    for k, v in space.canonical(params).items():
        if v != base.get(k):
            s = SHORT.get(k, k)
            parts.append(f"{s}={v}" if s else str(v))
    return " ".join(parts) or "baseline"


def fmt_s(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def quality_flag(t: TrialRecord) -> str:
    """The one quality signal a finished trial carries while searching (`TrialRecord.feasible`'s precedence),
    named for its source; empty where nothing rules it out."""
    if t.quality_heldout_ok is False:
        return "held-out eval NE fails the gate"
    if t.quality_heldout_ok is None and t.quality_est_ok is False:
        return "in-run NE estimate past the tolerance"
    return ""


class TuneView:
    """Finished trials + a header (progress, best so far, proxy Kendall tau, ETA)."""

    def __init__(self, space: SearchSpace, budget: int, console: Console, live: bool | None = None) -> None:
        self.space, self.budget, self.console = space, budget, console
        self.live_on = console.is_terminal if live is None else live
        self.rows: list[dict[str, Any]] = []
        self.durations: list[float] = []
        self.phase, self.status, self.used = "search", "", 0
        self.best: tuple[float, int] | None = None
        self.baseline_qps: float | None = None
        self.pred: list[tuple[float, float]] = []
        self.eta_s: float | None = None
        self._live: Live | None = None

    def __enter__(self) -> TuneView:
        if self.live_on:
            self._live = Live(self._render(), console=self.console, refresh_per_second=2)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc)
            self._live = None

    def seed(self, trials: list[TrialRecord]) -> None:
        """Trials of an earlier run of this study (resume): counted, not printed."""
        for t in trials:
            self._account(t, None)

    def add(self, t: TrialRecord, seconds: float | None, confirm: TrialResult | None = None) -> None:
        """A finished trial, or (confirm=result) one re-measurement of trial t."""
        ua = t.run
        if confirm is None:
            self._account(t, seconds)
            ok, status, error = t.state == TrialState.COMPLETE, ua.get("status", ""), ua.get("error") or ""
            qps, phase, pred = (t.value if ok else None), ua.get("phase", ""), ua.get("predicted_qps")
        else:
            self.durations.append(seconds or 0.0)
            ok, status, error = confirm.status == "ok", confirm.status, confirm.error
            qps, phase, pred = (confirm.qps if ok else None), "confirm", None
        row = {"n": t.number, "phase": phase, "cfg": short_config(self.space, t.params), "status": status,
               "qps": qps, "pred": pred, "best": self.best[0] if self.best else None, "error": error,
               "quality": quality_flag(t) if confirm is None else ""}
        self.rows.append(row)
        if not self.live_on:
            self.console.print(self._line(row), highlight=False, soft_wrap=True)
        self.refresh()

    def _account(self, t: TrialRecord, seconds: float | None) -> None:
        if seconds is not None:
            self.durations.append(seconds)
        if t.state != TrialState.COMPLETE or not t.value:
            return
        if t.run.get("phase") == "baseline" and self.baseline_qps is None:
            self.baseline_qps = t.value
        if self.best is None or t.value > self.best[0]:
            self.best = (t.value, t.number)
        if t.run.get("predicted_qps"):
            self.pred.append((t.run["predicted_qps"], t.value))

    def note(self, msg: str) -> None:
        self.status = msg
        if self.live_on:
            self.refresh()
        else:
            self.console.print(msg, highlight=False, soft_wrap=True)

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def set_eta(self, remaining_runs: int, parallel: float) -> None:
        if self.durations:
            recent = self.durations[-10:]
            self.eta_s = sum(recent) / len(recent) * remaining_runs / max(1.0, parallel)

    @property
    def tau(self) -> float | None:
        return kendall_tau([p for p, _ in self.pred], [q for _, q in self.pred])

    def header(self) -> str:
        best = "-"
        if self.best:
            sp = f", {self.best[0] / self.baseline_qps:.2f}x baseline" if self.baseline_qps else ""
            best = f"{self.best[0]:,.0f} qps (#{self.best[1]}{sp})"
        tau = f"{self.tau:+.2f}" if self.tau is not None else "-"
        return (f"{self.phase}: {self.used}/{self.budget} trials | best {best} | proxy tau {tau} "
                f"(n={len(self.pred)}) | ETA {fmt_s(self.eta_s)}")

    def _line(self, r: dict[str, Any]) -> str:
        qps = f"{r['qps']:,.0f} qps" if r["qps"] else r["status"].upper()
        pred = f" (pred {r['pred']:,.0f})" if r["pred"] else ""
        err = f" - {r['error'][:120]}" if r["status"] != "ok" and r["error"] else ""
        best = f"{r['best']:,.0f}" if r["best"] else "-"
        q = f"  ({r['quality']})" if r.get("quality") else ""
        return f"#{r['n']:<3} {r['phase']:<9} {r['cfg'][:56]:<56} {qps:>14}{pred}  best {best}{err}{q}"

    def _render(self) -> Group:
        t = Table(box=None, pad_edge=False, header_style="bold")
        for col, just in (("#", "right"), ("phase", "left"), ("config (vs baseline)", "left"),
                          ("qps", "right"), ("predicted", "right"), ("best", "right"), ("quality", "left")):
            t.add_column(col, justify=just)  # type: ignore[arg-type]
        for r in self.rows[-16:]:
            qps = Text(f"{r['qps']:,.0f}") if r["qps"] else Text(f"{r['status']} {r['error'][:40]}", style="red")
            t.add_row(str(r["n"]), r["phase"], r["cfg"][:64], qps, f"{r['pred']:,.0f}" if r["pred"] else "",
                      f"{r['best']:,.0f}" if r["best"] else "", Text(r.get("quality", ""), style="yellow"))
        return Group(Text(self.header(), style="bold"), t, Text(self.status, style="dim"))


# ====================================================================== loop


def _median(xs: list[float] | None) -> float:
    xs = [x for x in xs or [] if x is not None]
    return statistics.median(xs) if xs else 0.0


VERDICT_HEAD = {Verdict.PASSED: "ok", Verdict.FAILED: "REJECTED", NOT_RESOLVED: "NOT RESOLVED",
                Verdict.SLOWER: "not judged"}
EVAL_NE = re.compile(r"eval NE (?P<diff>[+-][\d.]+%) vs baseline (?:over|after) (?P<n>\d+)")
CELL_MAX = 72  # characters of a reason without numbers of its own; the report holds the rest


def quality_cell(c: ConfirmedRow) -> str:
    """A confirmed configuration's quality in one short line: the verdict, the paired held-out eval NE
    difference, its interval and seeds; a model judged once is shown once (`same_model_as`)."""
    verdict, d = c.quality_verdict, c.quality_eval_diff
    if c.same_model_as is not None:
        head = VERDICT_HEAD.get(verdict) or ("ok" if c.quality_ok else "REJECTED")
        return f"{head}: same model as #{c.same_model_as}"
    if d is not None and verdict in VERDICT_HEAD:
        ci, conf, n = c.quality_ci, c.quality_confidence, c.quality_seeds
        iv = (f", {conf:.0%} CI {ci[0]:+.2%}..{ci[1]:+.2%}" if ci and conf else
              f", CI {ci[0]:+.2%}..{ci[1]:+.2%}" if ci else "")
        seeds = f", {n} seeds" if n else ""
        return f"{VERDICT_HEAD[verdict]}: eval NE {d:+.3%}{iv}{seeds}"
    head = VERDICT_HEAD.get(verdict) or ("ok" if c.quality_ok else "REJECTED")
    reason = c.quality_reason or ""
    m = EVAL_NE.search(reason)
    if m:  # judged by held-out runs before the confirm (the screen, a check while searching, an early reject)
        where = (" (screen)" if reason.startswith("quality screen") else
                 " (real runs, carried)" if reason.startswith("simulated: ") else " (while searching)")
        return f"{head}: eval NE {m['diff']}, {m['n']} seed{'s' * (m['n'] != '1')}{where}"
    why = reason.split(" (changes ")[0].split("; ")[0].split(": it cannot win")[0]
    why = why.replace(" (only layout/kernel/pipelining knobs differ)", "")
    return f"{head}: {why[:CELL_MAX - 1] + '…' if len(why) > CELL_MAX else why}"


def remeasured_cell(qps: list[float]) -> str:
    """Each re-measurement, or past three (the baseline, beside every candidate) their median and range."""
    if len(qps) <= 3:
        return ", ".join(f"{q:,.0f}" for q in qps) or "-"
    return f"{statistics.median(qps):,.0f} (median of {len(qps)}, {min(qps):,.0f}-{max(qps):,.0f})"


def print_summary(console: Console, s: Summary) -> None:
    """The final word: winner, speed-up over the baseline with its spread, where the study lives."""
    console.print(f"[bold]cubic tune[/] {s.study}: {s.trials} trials ({s.ok} ok, "
                  f"{s.failed} failed) with searcher {s.searcher}"
                  + (f", proxy Kendall tau {s.proxy_tau:+.2f}" if s.proxy_tau is not None else "")
                  + (f"; {len(s.backoff)} of them the confirm's back-off (beyond the budget)"
                     if s.backoff else ""))
    if s.screen:
        title = ("quality screen: each numerics change alone (held-out eval NE vs the baseline)"
                 if s.carried_from is None else
                 f"quality verdicts carried from real runs ({s.carried_from}): each change alone")
        t = Table(title=title, box=None, header_style="bold")
        for col in ("change", "verdict"):
            t.add_column(col)
        for x in s.screen:
            # one line each (`screen.cell`); a summary stored before cells, and a carried verdict, in full
            t.add_row(x["change"], x.get("cell") or (x["verdict"] + (f": {x['reason']}" if x["reason"] else "")))
        console.print(t)
    if s.quality_runs:
        q = s.quality_runs
        console.print(f"quality runs: {q.ran} trained, {q.reused} reused from the quality store")
    if s.confirmed:
        print_confirmed(console, s.confirmed)
    w = s.winner
    # faster than the winner, not crowned: say so where the winner is read (the fastest; the others by count)
    left = sorted((c for c in s.confirmed if c.quality_verdict == NOT_RESOLVED and c.confirm_qps
                   and (not w or _median(c.confirm_qps) > (w.qps or 0.0))),
                  key=lambda c: -_median(c.confirm_qps))
    if left:
        c = left[0]
        more = (f" ({len(left) - 1} more faster than the winner are not resolved either)"
                if len(left) > 1 else "")
        console.print(f"[bold yellow]not resolved[/]: trial #{c.trial} ({c.short_config}) "
                      f"re-measured {_median(c.confirm_qps):,.0f} qps, but its quality verdict is "
                      "not resolved (more seeds: quality.max_seeds; a looser call: "
                      f"quality.confidence): not crowned{more}")
    # not judged, its median over the winner's though not measurably faster: say why it is not crowned
    for c in (c for c in s.confirmed if c.quality_verdict == Verdict.SLOWER and c.confirm_qps
              and w and _median(c.confirm_qps) > (w.qps or 0.0)):
        console.print(f"[bold yellow]not judged[/]: trial #{c.trial} ({c.short_config}) re-measured "
                      f"{_median(c.confirm_qps):,.0f} qps, not measurably faster than one that passed, so "
                      "its quality was not judged")
    if s.carried_from is not None and not s.screen:
        console.print(f"quality verdicts: none carried ({s.carried_from}): a numerics change is "
                      "never crowned")
    for c in s.not_crowned:
        sp = f" = {c.speedup:.2f}x the baseline" if c.speedup else ""
        console.print(f"[bold yellow]not crowned[/]: trial #{c.trial} ({c.short_config}) predicted "
                      f"{c.qps or 0:,.0f} qps{sp}: {c.reason}")
    if w:
        sp = ""
        if w.speedup:
            lo_hi = w.speedup_spread or [w.speedup, w.speedup]
            sp = f" = [bold green]{w.speedup:.2f}x[/] the baseline ({lo_hi[0]:.2f}-{lo_hi[1]:.2f}x)"
        console.print(f"[bold]winner[/]: trial #{w.trial} ({w.short_config}): {w.qps:,.0f} qps "
                      f"(re-measured {w.qps_spread[0]:,.0f}-{w.qps_spread[1]:,.0f}){sp}")
    elif s.confirmed:
        console.print("[bold]winner[/]: none confirmed (no configuration passed the "
                      "re-measurement and quality gate)")
    ref = s.torchrec_planner
    if ref and ref.speedup:
        how = ("re-measured beside the baseline" if ref.re_measured
               else "measured once, right after the baseline's search run")
        console.print(f"vs TorchRec's planner: {ref.speedup:.2f}x its plan of the baseline "
                      f"(trial #{ref.trial}, {ref.qps:,.0f} qps, {how})")
    if not w and s.best_measured:
        b = s.best_measured
        sp = f" = {b.speedup:.2f}x the baseline" if b.speedup else ""
        why = "" if s.confirmed else " (not confirmed: budget.confirm_top_k is 0)"
        console.print(f"best measured: trial #{b.trial} ({b.short_config}): {b.qps:,.0f} qps"
                      f"{sp}{why}")
    where = s.run_dir or s.storage
    console.print(f"study [bold]{s.study}[/] in {s.storage}"
                  + (f"; run dir {where}" if s.run_dir else ""))


def print_confirmed(console: Console, rows: list[ConfirmedRow]) -> None:
    """The confirmed configurations' table: speed, first and re-measured, and the quality cell."""
    t = Table(title="confirmed (re-measured) configurations", box=None, header_style="bold")
    for col in ("#", "config (vs baseline)", "first qps", "re-measured qps", "x baseline beside",
                "quality"):
        t.add_column(col)
    for c in rows:
        sp = c.confirm_speedup
        t.add_row(str(c.trial) + (" (back-off)" if c.backoff else ""), c.short_config,
                  f"{c.qps:,.0f}", remeasured_cell(c.confirm_qps or []),
                  f"{sp:.2f}x" if sp else "-", quality_cell(c))
    console.print(t)
    if any(c.quality_eval_diff is not None for c in rows):
        console.print("quality: held-out eval NE vs the baseline, paired by seed, with its "
                      "interval; every reason in full: cubic report RUN_DIR", style="dim")
