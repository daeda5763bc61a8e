"""A co-design study's answer: its Pareto front, the knee, a table and a plot of time to train
against cost.

The front is the finished trials no other beats on every objective (Optuna's `best_trials`); trials
with the same values show once, as the earliest, with how many are alike (a fabric on one node, or a
sharding knob naming what the planner chose anyway, changes nothing). The knee is the front's point
nearest the ideal one (each objective's best on the front) once every objective is scaled to [0, 1]
over the front: where giving up a little of one objective stops buying much of another.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import optuna
from rich.console import Console
from rich.table import Table

from cubic.space.codesign import OBJECTIVES


@dataclass(frozen=True)
class Point:
    """One front point: its trial, cluster, configuration and scores."""

    trial: int
    cluster: str
    config: str  # the knobs that differ from the baseline, and the per-table plan
    plan: str
    scores: dict[str, float]
    alike: int = 0  # other front trials with the same values (the earliest is shown)


@dataclass(frozen=True)
class Front:
    objectives: list[str]
    points: list[Point]  # ordered by the first objective
    knee: int | None  # index into points
    trials: int
    failed: int
    wall_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "knee_trial": self.points[self.knee].trial if self.knee is not None else None,
        }


def knee(points: list[Point], objectives: list[str]) -> int | None:
    """The index of the point nearest the ideal one, each objective scaled to [0, 1]."""
    if not points:
        return None
    norm = []
    for o in objectives:
        xs = [p.scores[o] for p in points]
        lo, hi = min(xs), max(xs)
        sign = 1 if OBJECTIVES[o][0] == "minimize" else -1
        norm.append(
            [
                0.0 if hi == lo else (x - lo) / (hi - lo) if sign > 0 else (hi - x) / (hi - lo)
                for x in xs
            ]
        )
    dist = [math.hypot(*(n[i] for n in norm)) for i in range(len(points))]
    return min(range(len(points)), key=dist.__getitem__)


def front(
    study: optuna.Study, objectives: list[str], describe: Any, wall_s: float | None = None
) -> Front:
    """The study's front; `describe(params)` is a configuration in a few words."""
    done = study.get_trials(deepcopy=False)
    by_values: dict[tuple[float, ...], Point] = {}
    for t in sorted(study.best_trials, key=lambda t: t.number):
        p = by_values.get(tuple(t.values))
        if p is not None:  # the same values: a knob that changed nothing here (one node: no fabric)
            by_values[tuple(t.values)] = replace(p, alike=p.alike + 1)
            continue
        by_values[tuple(t.values)] = Point(
            t.number,
            t.user_attrs.get("cluster", ""),
            describe(t.params),
            t.user_attrs.get("plan", ""),
            dict(t.user_attrs.get("scores") or {}),
        )
    pts = list(by_values.values())
    first = objectives[0]
    pts.sort(key=lambda p: p.scores[first] * (1 if OBJECTIVES[first][0] == "minimize" else -1))
    return Front(
        objectives,
        pts,
        knee(pts, objectives),
        len(done),
        sum(t.state == optuna.trial.TrialState.FAIL for t in done),
        wall_s,
    )


FMT = {
    "time_to_train": lambda x: f"{x * 60:,.1f} min",
    "cost": lambda x: f"{x:,.2f}",
    "qps": lambda x: f"{x / 1e6:,.2f} M/s",
    "memory_headroom": lambda x: f"{x:.0%}",
}


def print_front(console: Console, f: Front) -> None:
    t = Table(
        title=f"Pareto front: {len(f.points)} of {f.trials} trials ({f.failed} failed)",
        header_style="bold",
        box=None,
    )
    for col in ("#", "cluster", "configuration (per-table plan)", *f.objectives, "qps"):
        t.add_column(col)
    for i, p in enumerate(f.points):
        mark = " [bold green]knee[/]" if i == f.knee else ""
        t.add_row(
            f"{p.trial}{mark}" + (f" (+{p.alike} alike)" if p.alike else ""),
            p.cluster,
            f"{p.config} ({p.plan})",
            *(FMT[o](p.scores[o]) for o in f.objectives),
            FMT["qps"](p.scores.get("qps", 0.0)),
        )
    console.print(t)
    if f.knee is not None:
        k = f.points[f.knee]
        console.print(
            f"[bold]knee[/]: trial #{k.trial} on {k.cluster}: "
            + ", ".join(f"{o} {FMT[o](k.scores[o])}" for o in f.objectives)
        )
    if f.wall_s is not None:
        console.print(f"study wall time here: {f.wall_s:,.1f} s")


def plot_front(study: optuna.Study, f: Front, path: Path) -> Path | None:
    """Every finished trial on the first two objectives, by node type, the front drawn over them."""
    if len(f.objectives) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_o, y_o = f.objectives[:2]
    shown = {
        o: (60.0, "minutes") if o == "time_to_train" else (1.0, OBJECTIVES[o][1])
        for o in (x_o, y_o)
    }
    fig, ax = plt.subplots(figsize=(9, 6))
    by_node: dict[str, list[tuple[float, float]]] = {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        s = t.user_attrs.get("scores") or {}
        node = t.user_attrs.get("cluster", "?").split(" ")[0]
        by_node.setdefault(node, []).append((s[x_o] * shown[x_o][0], s[y_o] * shown[y_o][0]))
    for node, xy in sorted(by_node.items()):
        ax.scatter([a for a, _ in xy], [b for _, b in xy], s=12, alpha=0.35, label=node)

    def xy(p: Point) -> tuple[float, float]:
        return p.scores[x_o] * shown[x_o][0], p.scores[y_o] * shown[y_o][0]

    fx, fy = [xy(p)[0] for p in f.points], [xy(p)[1] for p in f.points]
    ax.plot(fx, fy, "k-o", ms=4, lw=1, label="front")
    for p in f.points:
        ax.annotate(
            p.cluster.replace(" ", "\n", 1),
            xy(p),
            fontsize=6,
            xytext=(3, 3),
            textcoords="offset points",
        )
    if f.knee is not None:
        k = f.points[f.knee]
        ax.scatter(*xy(k), marker="*", s=220, c="red", zorder=5, label="knee")
    ax.set_xlabel(f"{x_o} ({shown[x_o][1]})")
    ax.set_ylabel(f"{y_o} ({shown[y_o][1]})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("co-design: every priced configuration and cluster, and the front")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_front(f: Front, path: Path) -> Path:
    path.write_text(json.dumps(f.to_dict(), indent=1))
    return path
