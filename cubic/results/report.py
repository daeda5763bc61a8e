"""`cubic report`: a terminal summary and one self-contained HTML page with the notebook's plots.

The HTML embeds every figure as a base64 PNG data URI and links nothing outside itself, so it can be
mailed, attached to a ticket or opened offline and still show everything.
"""

from __future__ import annotations

import base64
import html
import io
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from cubic.quality.screen import NOT_RUN
from cubic.results import analysis, plots
from cubic.results.plan_why import CHANGED_SHOWN, plan_why
from cubic.study.winner import Winner
from cubic_harness.errors import write_text

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;
color:#222;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em} h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0} th,td{border:1px solid #ddd;padding:3px 8px;
text-align:right} th{background:#f4f4f4} td.l,th.l{text-align:left}
.kv td{text-align:left} .muted{color:#777} img{max-width:100%;height:auto;display:block;margin:.5em 0}
.wide{overflow-x:auto;max-width:100%}
.win{font-size:1.1em;background:#eef7ee;border:1px solid #cde3cd;padding:.6em 1em;border-radius:4px}
"""


def figure_data_uri(fig: Any, dpi: int = 96) -> str:
    """A Figure as a data:image/png;base64 URI: the report carries its pictures inside."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    if v is None or v is pd.NA:
        return ""
    return str(v)


def _table(df: pd.DataFrame) -> str:
    """A small HTML table (escaped) without pandas' styling machinery."""
    if df.empty:
        return '<p class="muted">none</p>'
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    rows = []
    for r in df.itertuples(index=False):
        cells = []
        for v in r:
            cls = "" if isinstance(v, int | float) and not isinstance(v, bool) else ' class="l"'
            cells.append(f"<td{cls}>{html.escape(_fmt(v))}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _top_html(df: pd.DataFrame, k: int) -> str:
    s = analysis.summary(df)
    heads, nums, rows = top_cells(df, k, list(HEADS))
    if not rows:
        return '<p class="muted">none</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    body = []
    for number, cells in rows:
        tds = "".join(f"<td{'' if n else LEFT}>{html.escape(c)}</td>"
                      for c, n in zip(cells, nums, strict=True))
        style = ' style="font-weight:bold;background:#eef7ee"' if number == s["winner_trial"] else ""
        body.append(f"<tr{style}>{tds}</tr>")
    return (f'<div class="wide"><table><tr>{head}</tr>{"".join(body)}</table></div>'
            f'<p class="muted">{html.escape(SPEEDUP_NOTE)}</p>')


def _speedup_text(s: dict[str, Any]) -> str:
    if s["winner_trial"] is None:
        return "no successful trial yet"
    sp = s["speedup"]
    base = s["winner_baseline_qps"]
    sp_txt = f"<b>{sp:.2f}x</b> the baseline ({base:,.0f} samples/s)" if sp and sp == sp and base else \
        "baseline not measured"
    conf = "confirmed" if s["confirmed"] else "best measured, not yet confirmed"
    ref = s.get("vs_torchrec_planner") or {}
    ref_txt = (f"; <b>{ref['speedup']:.2f}x</b> TorchRec's planner's plan of the baseline (trial #{ref['trial']}, "
               f"{ref['qps']:,.0f} samples/s)" if ref.get("speedup") else "")
    return f"Winner: trial #{s['winner_trial']} ({conf}) at {s['winner_qps']:,.0f} samples/s = {sp_txt}{ref_txt}"


def render_html(df: pd.DataFrame, k: int = 5) -> str:
    """The whole report page as one string."""
    s = analysis.summary(df)
    title = f"cubic report: {s['study']}"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="muted">store {html.escape(analysis.safe_url(str(s["storage"])))} &middot; {s["trials"]} trials '
        f'({s["ok"]} ok, {s["failed"]} without a measurement'
        + (f', and {s["not_run"]} proposals not run' if s["not_run"] else "") + ") &middot; generated "
        f'{datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}</p>',
        f'<p class="win">{_speedup_text(s)}</p>',
        f"<h2>Top {k} configurations</h2>", _top_html(df, k),
    ]
    for name, fn in plots.FIGURES.items():
        fig = fn(df)
        parts += [f"<h2>{html.escape(name)}</h2>",
                  f'<img alt="{html.escape(name)}" src="{figure_data_uri(fig)}">']
    win = Winner.from_dict(df.attrs["winner"]) if df.attrs.get("winner") else None
    if win:
        cfg = {key: v for key, v in (win.config or {}).items() if key != "workload"}
        kv = "".join(f"<tr><td>{html.escape(key)}</td><td>{html.escape(_fmt(v))}</td></tr>"
                     for key, v in cfg.items())
        parts += ["<h2>Winning configuration</h2>", f'<table class="kv">{kv}</table>',
                  '<p class="muted">export it with '
                  '<code>cubic export RUN_DIR --format yaml|json|torchrec</code></p>']
    parts += _plan_why_html(df)
    ver = analysis.verdict_table(df)
    if len(ver):
        parts += ["<h2>Quality verdicts of the confirmed configurations</h2>",
                  '<p class="muted">held-out eval NE paired by seed with the baseline, seeds added one at a time '
                  "until the interval clears the tolerance; &ldquo;not resolved&rdquo; is never crowned</p>",
                  _table(ver)]
    scr = analysis.screen_table(df)
    if len(scr):
        parts += ["<h2>Quality screen: each numerics change alone</h2>",
                  '<p class="muted">held-out eval NE after the quality budget, paired by seed with the baseline; '
                  "configurations with a change ruled out were not searched</p>", _table(scr)]
    parts += ["<h2>Trials without a measurement</h2>", _table(analysis.failed(df)), "</body></html>"]
    return "\n".join(parts)


def _plan_why_html(df: pd.DataFrame) -> list[str]:
    """The winner's plan against the baseline's, modelled: the figure, the critical ranks, the changed tables."""
    why = plan_why(df)
    if why is None:
        return []
    base, win = why["views"]
    head = (f"modelled on {why['cluster']}: the baseline {base['step_ms']:.2f} ms a step, critical rank "
            f"{base['critical']} ({base['imbalance']:.2f}x the mean rank's lookups); the winner "
            f"{win['step_ms']:.2f} ms, critical rank {win['critical']} ({win['imbalance']:.2f}x)")
    changed = why["changed"]
    rows = "".join(f"<tr><td>{html.escape(c['table'])}</td><td>{html.escape(c['baseline'])}</td>"
                   f"<td>{html.escape(c['winner'])}</td></tr>" for c in changed[:CHANGED_SHOWN])
    more = (f'<p class="muted">... and {len(changed) - CHANGED_SHOWN} more (cubic export RUN_DIR --format json '
            "lists every one)</p>" if len(changed) > CHANGED_SHOWN else "")
    table = (f"<table><tr><th>table</th><th>baseline</th><th>winner</th></tr>{rows}</table>{more}" if changed
             else '<p class="muted">the winner lays every table out as the baseline does</p>')
    return ["<h2>Why the winner's plan wins</h2>", f'<p class="muted">{html.escape(head)}</p>',
            f'<img alt="why the plan wins" src="{figure_data_uri(plots.plan_why(why))}">',
            f"<h3>{len(changed)} of {why['tables']} tables laid out differently</h3>", table]


def top_table(df: pd.DataFrame, k: int = 5) -> pd.DataFrame:
    """top_k with the baseline appended when it is not already among them, for the speed-up's reference."""
    top = analysis.top_k(df, k)
    base = analysis.baseline_rows(df)
    base = base[base["ok"]]
    if len(base) and not base["number"].isin(top["number"]).any():
        top = pd.concat([top, base[[c for c in top.columns if c in base]].head(1)], ignore_index=True)
    return top


LEFT = ' class="l"'
HEADS = {"number": "trial", "phase": "phase", "qps": "search qps", "confirm_qps_median": "re-measured",
         "speedup": "speed-up", "qps_cv": "cv", "peak_mem_mb": "mem MB", "quality_verdict": "held-out verdict",
         "quality_eval_diff": "held-out NE diff", "ne": "in-run NE (est.)"}
SPEEDUP_NOTE = ("speed-up: where the confirm re-measured a configuration, the median ratio of its re-measurements "
                "to the baseline's run right before each; else the search measurement over the baseline's; the "
                "banner, plots, export and notebook use the same figure. Configurations the confirm "
                "re-measured rank above those measured once (\"re-measured\" empty). Held-out verdict and NE "
                "diff: the confirm's quality runs, paired by seed with the baseline; in a study without them, "
                "in-run NE: an estimate over the trial's own first samples.")


def _cell(col: str, v: Any) -> str:
    if isinstance(v, float) and v == v and col in ("speedup", "confirm_speedup"):
        return f"{v:.2f}x"
    if isinstance(v, float) and v == v and col in ("qps_cv", "quality_eval_diff"):
        return f"{100 * v:.1f}%" if col == "qps_cv" else f"{v:+.3%}"
    if isinstance(v, float) and v == v and col == "ne":
        return f"{v:.4f}"
    return _fmt(v)


def top_cells(df: pd.DataFrame, k: int, cols: list[str]) -> tuple[list[str], list[bool], list[tuple]]:
    """Headers, numeric flags and formatted rows (trial number, cells) of the top table: one formatting for
    the terminal and the HTML."""
    top = top_table(df, k)
    cols = [c for c in cols if c in top] + [c for c in analysis.varying_knobs(df) if c in top]
    rows = [(int(number), [_cell(c, v) for c, v in zip(cols, vals, strict=True)])
            for number, vals in zip(top["number"], top[cols].itertuples(index=False), strict=True)]
    nums = [pd.api.types.is_numeric_dtype(top[c]) for c in cols]
    return [HEADS.get(c, c) for c in cols], nums, rows


def rich_table(df: pd.DataFrame, k: int = 5) -> Any:
    """The terminal view of the top configurations with their speed-up over the baseline (compact: the
    throughput, its noise and the knobs that differ; the HTML has the rest)."""
    from rich.table import Table

    s = analysis.summary(df)
    cols = ["number", "phase", "qps", "confirm_qps_median", "speedup", "qps_cv", "quality_verdict", "peak_mem_mb"]
    heads, nums, rows = top_cells(df, k, cols)
    t = Table(title=f"{s['study']}: top {min(k, s['ok'])} of {s['trials']} trials ({s['failed']} failed)")
    for i, h in enumerate(heads):  # values never fold (a narrow terminal folds the headers instead)
        t.add_column(h, justify="right" if nums[i] else "left", overflow="fold",
                     min_width=max((len(cells[i]) for _, cells in rows), default=1))
    for number, cells in rows:
        t.add_row(*cells, style="bold green" if number == s["winner_trial"] else None)
    return t


def write_report(run_dir_or_storage_url: str | Path, out: str | Path, study: str | None = None,
                 k: int = 5) -> tuple[Path, pd.DataFrame]:
    """Load the study, write the HTML, and return (path, frame) for the terminal summary."""
    df = analysis.load_study(run_dir_or_storage_url, study)
    analysis.require_completed(df, str(run_dir_or_storage_url))
    out = Path(out)
    write_text(out, render_html(df, k), "report")
    return out, df


def screen_line(df: pd.DataFrame) -> str | None:
    """The quality screen in one line for the terminal (None if none ran)."""
    scr = analysis.screen_table(df)
    if not len(scr):
        return None
    def part(v: str) -> str:
        rows = scr[scr["verdict"] == v]
        return ", ".join(f"{r.change} ({r.eval_ne_diff:+.2%})" for r in rows.itertuples()) or "none"
    unrun = (scr["verdict"] == NOT_RUN).sum()
    return (f"quality screen (each change alone, eval NE vs baseline): passes {part('passes')}; "
            f"ruled out {part('ruled out')}" + (f"; {unrun} not run (no settled incumbent carried them)"
                                                 if unrun else ""))


def summary_line(df: pd.DataFrame) -> str:
    """One plain line for the terminal under the table."""
    s = analysis.summary(df)
    if s["winner_trial"] is None:
        return f"no successful trial among {s['trials']}"
    sp = s["speedup"]
    sp_txt = f"{sp:.2f}x over the baseline" if sp and sp == sp else "baseline not measured"
    line = f"winner: trial #{s['winner_trial']} at {s['winner_qps']:,.0f} samples/s, {sp_txt}"
    ref = s.get("vs_torchrec_planner") or {}
    if ref.get("speedup"):
        line += f", {ref['speedup']:.2f}x TorchRec's planner's plan of it (trial #{ref['trial']})"
    if "env_backend" in df and (df["env_backend"] == "sim").any():  # say so: a prediction, not a measurement
        clusters = sorted({str(c) for c in df.get("env_cluster", pd.Series(dtype=str)).dropna()})
        frameworks = sorted({str(f) for f in df.get("env_framework", pd.Series(dtype=str)).dropna()} - {"harness"})
        line += (f" (simulated on {', '.join(clusters) or 'a cluster file'}"
                 + (f", {', '.join(frameworks)}'s step" if frameworks else "") + ": predicted, not measured)")
    elif "env_backend" in df and (df["env_backend"] == "torchrec").any():
        line += " (trained in TorchRec)"
    return line
