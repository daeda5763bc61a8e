"""`cubic report` on a co-design run: the study's Pareto front (each point's trial, cluster,
configuration and per-table plan, and its scores), the knee, and the plot of time to train
against cost, in the terminal and in one self-contained HTML page.

The front is rebuilt from the study (`cubic.codesign.front.front`), not read from front.json: the
store is the one source of truth the rest of `cubic report` reads, and front.json is only as fresh
as the last `cubic codesign` that ran to its end (one interrupted, or a study shared through
`--storage`, moves on without it).
"""

from __future__ import annotations

import base64
import html
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from cubic.codesign.front import FMT, Front, front, plot_front
from cubic.results.report import CSS, LEFT
from cubic.space.codesign import OBJECTIVES
from cubic.study.store import safe_url, storage_url
from cubic_harness.errors import ConfigError, write_text

CLUSTER_PARAM = "cluster."  # the study's cluster knobs (cubic.codesign.clusters): not the space's


def is_codesign(study: optuna.Study) -> bool:
    """A `cubic codesign` study: named NAME@codesign, or multi-objective (a tune never is)."""
    return (
        study.study_name.endswith("@codesign")
        or "codesign" in study.user_attrs
        or len(study.directions) > 1
    )


def objectives(study: optuna.Study, where: str) -> list[str]:
    """The names of the study's values: stored by the study, else matched to each trial's scores
    (a study written before it stored them)."""
    named = (study.user_attrs.get("codesign") or {}).get("objectives")
    if named:
        return [str(o) for o in named]
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        s = t.user_attrs.get("scores") or {}
        names = [next((o for o in OBJECTIVES if s.get(o) == v), None) for v in t.values]
        if None not in names and len(set(names)) == len(names):
            return [str(o) for o in names]
    raise ConfigError(
        f"{where}: study {study.study_name!r} has several objectives but does not name them "
        "(not a `cubic codesign` study)"
    )


def describer(study: optuna.Study) -> Any:
    """`describe(params)` for `front`: the configuration as `cubic codesign` stored it for the
    trial, else (an older study) every knob of the space."""
    stored = {
        _key(t.params): str(t.user_attrs["config"])
        for t in study.get_trials(deepcopy=False)
        if "config" in t.user_attrs
    }

    def describe(params: dict[str, Any]) -> str:
        return stored.get(_key(params)) or " ".join(
            f"{k}={v}" for k, v in params.items() if not k.startswith(CLUSTER_PARAM)
        )

    return describe


def _key(params: dict[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


def load_front(study: optuna.Study, where: str) -> Front:
    """The study's front and knee; ConfigError (one line) when it has no priced trial."""
    trials = study.get_trials(deepcopy=False)
    name = study.study_name
    if not trials:
        raise ConfigError(f"{where}: study {name!r} has no trials yet; run `cubic codesign` first")
    if not any(t.state == TrialState.COMPLETE for t in trials):
        why = next((t.user_attrs.get("reason") for t in trials if t.user_attrs.get("reason")), "")
        why = f"; first failure: {' '.join(str(why).split())[:160]}" if why else ""
        raise ConfigError(
            f"{where}: study {name!r} has no completed trial "
            f"({len(trials)} trials, none priced{why})"
        )
    return front(study, objectives(study, where), describer(study))


def plot_uri(study: optuna.Study, f: Front) -> str | None:
    """`plot_front`'s figure as a data:image/png;base64 URI (None with fewer than 2 objectives)."""
    with tempfile.TemporaryDirectory() as d:
        png = plot_front(study, f, Path(d) / "front.png")
        if png is None:
            return None
        return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def _cells(row: list[tuple[str, bool]]) -> str:
    """<td>s of (text, numeric) pairs, escaped; text left-aligned."""
    return "".join(f"<td{'' if num else LEFT}>{html.escape(v)}</td>" for v, num in row)


def front_html(f: Front) -> str:
    """The front as an HTML table, the knee's row marked."""
    heads = ["trial", "cluster", "configuration", "per-table plan", *f.objectives]
    heads += [] if "qps" in f.objectives else ["qps"]
    rows = []
    for i, p in enumerate(f.points):
        label = f"{p.trial}" + (" knee" if i == f.knee else "")
        label += f" (+{p.alike} alike)" if p.alike else ""
        scores = [(FMT[o](p.scores[o]) if o in p.scores else "", True) for o in heads[4:]]
        text = [(label, False), (p.cluster, False), (p.config, False), (p.plan, False)]
        tds = _cells([*text, *scores])
        style = ' style="font-weight:bold;background:#eef7ee"' if i == f.knee else ""
        rows.append(f"<tr{style}>{tds}</tr>")
    head = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    return f'<div class="wide"><table><tr>{head}</tr>{"".join(rows)}</table></div>'


def failed_html(study: optuna.Study) -> str:
    """The trials told FAIL, each with its cluster and reason."""
    bad = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    if not bad:
        return '<p class="muted">none</p>'
    rows = []
    for t in bad:
        why = str(t.user_attrs.get("reason") or "")
        if "same_as" in t.user_attrs:
            why = f"as trial #{t.user_attrs['same_as']}: {why}"
        ua = t.user_attrs
        rows.append(
            "<tr>"
            + _cells([(str(t.number), True), (str(ua.get("cluster", "")), False),
                      (str(ua.get("config", "")), False), (why, False)])
            + "</tr>"
        )
    head = "".join(f"<th>{h}</th>" for h in ("trial", "cluster", "configuration", "reason"))
    return f'<div class="wide"><table><tr>{head}</tr>{"".join(rows)}</table></div>'


def render_html(study: optuna.Study, f: Front, where: str) -> str:
    """The co-design report page as one string: the front, the knee, the plot, the failed trials."""
    title = f"cubic co-design report: {study.study_name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="muted">store {html.escape(where)} &middot; {f.trials} trials '
        f"({f.failed} failed) &middot; objectives {html.escape(', '.join(f.objectives))} "
        f"&middot; generated {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}</p>",
    ]
    if f.knee is not None:
        k = f.points[f.knee]
        got = ", ".join(f"{o} {FMT[o](k.scores[o])}" for o in f.objectives)
        parts.append(
            f'<p class="win">Knee: trial #{k.trial} on <b>{html.escape(k.cluster)}</b>, '
            f"{html.escape(k.config)} ({html.escape(k.plan)}): {html.escape(got)}</p>"
        )
    parts += [
        f"<h2>Pareto front: {len(f.points)} of {f.trials} trials</h2>",
        front_html(f),
        '<p class="muted">the finished trials no other beats on every objective, one per set of '
        "values (+n alike: later trials with the same values); the knee is the point nearest the "
        "ideal one once each objective is scaled to [0, 1] over the front</p>",
    ]
    uri = plot_uri(study, f)
    if uri is not None:
        x_o, y_o = f.objectives[:2]
        name = f"{x_o} against {y_o}"
        parts += [
            f"<h2>{html.escape(name)}</h2>",
            f'<img alt="{html.escape(name)}" src="{uri}">',
            '<p class="muted">every priced configuration and cluster by GPU type, the front drawn '
            "over them, the knee starred</p>",
        ]
    parts += ["<h2>Trials that failed</h2>", failed_html(study), "</body></html>"]
    return "\n".join(parts)


def write_report(
    study: optuna.Study, run_dir_or_storage_url: str | Path, out: str | Path
) -> tuple[Path, Front]:
    """Rebuild the front, write the HTML, and return (path, front) for the terminal."""
    where = safe_url(storage_url(run_dir_or_storage_url))
    f = load_front(study, where)
    out = Path(out)
    write_text(out, render_html(study, f, where), "report")
    return out, f
