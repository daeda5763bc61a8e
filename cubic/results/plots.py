"""The figures of a study, one function each, shared by the notebook and `cubic report`.

Every function takes the frame of `cubic.load_study` and returns a matplotlib Figure built with the
object API (no pyplot): no global figure registry to leak in a long report run, no GUI backend needed,
and the notebook shows the same object the HTML report embeds.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from cubic.results import analysis

PHASE_COLORS = {"baseline": "tab:red", "warmup": "tab:gray", "proxy": "tab:blue", "confirm": "tab:green"}
BD_COLORS = {"emb_fwd": "tab:blue", "emb_bwd": "tab:cyan", "comm": "tab:orange", "sync": "tab:red",
             "dense": "tab:green", "optim": "tab:purple"}


def _empty(fig: Figure, ax, text: str) -> Figure:
    """A figure that says why it is empty instead of raising: tiny studies are normal."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])
    return fig


def _phase_color(phase: str) -> str:
    return PHASE_COLORS.get(str(phase), "tab:olive")


def best_so_far(df: pd.DataFrame) -> Figure:
    """Every trial's qps by trial number, the running best and the baseline: how fast the search won."""
    fig = Figure(figsize=(7.5, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Best throughput so far")
    if df.empty:
        return _empty(fig, ax, "no trials")
    bsf = analysis.best_so_far(df)
    ok = bsf[bsf["qps"].notna()]
    for phase, g in ok.groupby("phase", sort=False):
        ax.scatter(g["number"], g["qps"], s=28, color=_phase_color(phase), label=f"{phase or 'trial'}",
                   zorder=3)
    bad = bsf[bsf["qps"].isna()]
    if len(bad):
        y0 = float(ok["qps"].min()) if len(ok) else 0.0
        ax.scatter(bad["number"], [y0] * len(bad), marker="x", color="black", label="failed", zorder=3)
    if len(ok):
        ax.step(bsf["number"], bsf["best_qps"], where="post", color="tab:blue", lw=2, label="best so far")
    base = df.attrs.get("baseline_qps")
    if base:
        what = "baseline re-measured" if df.attrs.get("baseline_remeasured") else "baseline"
        ax.axhline(base, color="tab:red", ls="--", lw=1.2, label=f"{what} {base:,.0f}")
    ax.set_xlabel("trial")
    ax.set_ylabel("samples / s")
    ax.grid(alpha=0.3)
    fig.legend(fontsize=8, loc="outside right upper")
    return fig


def qps_by_knob(df: pd.DataFrame, knobs: list[str] | None = None) -> Figure:
    """Throughput per value of each varying knob (box + jittered points): which settings are fast."""
    knobs = analysis.varying_knobs(df) if knobs is None else knobs
    ok = analysis.usable(df)
    if not knobs or ok.empty:
        fig = Figure(figsize=(7.5, 3), layout="constrained")
        return _empty(fig, fig.add_subplot(), "no knob varied over the successful trials")
    cols = min(3, len(knobs))
    rows = math.ceil(len(knobs) / cols)
    fig = Figure(figsize=(4 * cols, 3.2 * rows), layout="constrained")
    fig.suptitle("Throughput by knob")
    rng = np.random.default_rng(0)
    base = df.attrs.get("baseline_qps")
    for i, k in enumerate(knobs):
        ax = fig.add_subplot(rows, cols, i + 1)
        vals = ok[k]
        num = pd.to_numeric(vals, errors="coerce")
        if num.notna().all() and num.nunique() > 6:  # continuous: a scatter says more than boxes
            ax.scatter(num, ok["qps"], s=18, alpha=0.8)
        else:
            levels = sorted(vals.astype(str).unique(), key=lambda v: (_sort_key(v), v))
            data = [ok.loc[vals.astype(str) == lv, "qps"].to_numpy() for lv in levels]
            ax.boxplot(data, positions=range(len(levels)), widths=0.5, showfliers=False)
            for j, d in enumerate(data):
                jitter = rng.uniform(-0.12, 0.12, len(d))
                ax.scatter(j + jitter, d, s=16, alpha=0.8, color="tab:blue", zorder=3)
            ax.set_xticks(range(len(levels)), levels, rotation=30 if len(levels) > 3 else 0, fontsize=8)
        if base:
            ax.axhline(base, color="tab:red", ls="--", lw=1)
        ax.set_title(k, fontsize=10)
        ax.grid(alpha=0.3)
        if i % cols == 0:
            ax.set_ylabel("samples / s")
    return fig


def _sort_key(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        return math.inf


def breakdown(df: pd.DataFrame, k: int = 5) -> Figure:
    """Step-time breakdown (embedding fwd/bwd, comm, dense, optimizer) of the top configs and the baseline:
    where the winner saves its time."""
    fig = Figure(figsize=(7.5, 0.6 * (k + 1) + 1.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Step time breakdown (ms per step)")
    ok = analysis.usable(df)
    order = list(analysis.top_k(df, k)["number"])  # as the report's top table: re-measured ones first
    top = ok.set_index("number", drop=False).loc[order]
    base = analysis.baseline_rows(df)
    base = base[base["ok"]].head(1)
    rows = pd.concat([top, base[~base["number"].isin(top["number"])]])
    bd_cols = [c for c in rows.columns if c.startswith("bd_") and rows[c].notna().any()]
    if rows.empty or not bd_cols:
        return _empty(fig, ax, "no time breakdown recorded")
    rows = rows.iloc[::-1]  # fastest on top
    labels = [f"#{int(r.number)} {r.phase}".strip()
              + (f"  x{r.speedup:.2f}" if r.speedup == r.speedup else "")
              for r in rows.itertuples()]
    left = np.zeros(len(rows))
    for c in bd_cols:
        w = rows[c].fillna(0.0).to_numpy(dtype=float)
        ax.barh(labels, w, left=left, color=BD_COLORS.get(c[3:]), label=c[3:])
        left += w
    if "step_ms_p50" in rows:
        ax.scatter(rows["step_ms_p50"], labels, marker="|", s=200, color="black", label="step p50", zorder=3)
    ax.set_xlabel("ms")
    fig.legend(fontsize=8, ncols=6, loc="outside lower center")
    ax.grid(axis="x", alpha=0.3)
    return fig


def prediction_vs_measurement(df: pd.DataFrame) -> Figure:
    """The proxy's prediction at proposal time against the measured qps: is the proxy worth trusting?"""
    fig = Figure(figsize=(5.5, 5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Proxy prediction vs measurement")
    ok = analysis.usable(df)
    pts = ok[ok["predicted_qps"].notna()]
    if pts.empty:
        return _empty(fig, ax, "no proxy predictions yet\n(the proxy predicts after the warm-up)")
    err = pts["predicted_std"].where(pts["predicted_std"].notna(), 0.0)
    for phase, g in pts.groupby("phase", sort=False):
        ax.errorbar(g["predicted_qps"], g["qps"], xerr=err.loc[g.index], fmt="o", ms=5, capsize=2,
                    color=_phase_color(phase), label=str(phase or "trial"))
    lo = float(min(pts["predicted_qps"].min(), pts["qps"].min())) * 0.9
    hi = float(max(pts["predicted_qps"].max(), pts["qps"].max())) * 1.1
    ax.plot([lo, hi], [lo, hi], color="0.5", ls=":", lw=1, label="y = x")
    if len(pts) >= 3:
        rho = pts["predicted_qps"].rank().corr(pts["qps"].rank())
        ax.text(0.03, 0.95, f"Spearman rank corr = {rho:.2f} (n={len(pts)})", transform=ax.transAxes,
                va="top", fontsize=9)
    ax.set_xlabel("predicted samples / s")
    ax.set_ylabel("measured samples / s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def importance(df: pd.DataFrame) -> Figure:
    """Which knobs matter: the share of log-throughput variance each explains."""
    imp = analysis.knob_importance(df)
    fig = Figure(figsize=(6, 0.4 * max(len(imp), 1) + 1.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Knob importance (share of log-qps variance)")
    if imp.empty or imp.sum() == 0:
        return _empty(fig, ax, "too few successful trials to rank knobs")
    imp = imp.iloc[::-1]
    ax.barh(imp.index, imp.to_numpy(), color="tab:blue")
    ax.set_xlim(0, 1)
    ax.set_xlabel("importance")
    ax.grid(axis="x", alpha=0.3)
    return fig


# name -> figure function: the report and the notebook show exactly these, in this order
def speed_vs_quality(df: pd.DataFrame) -> Figure:
    """Confirmed configurations' re-measured speed-up against their held-out eval NE difference from the
    baseline (quality runs), with the gate's tolerance and each point's paired standard error: the
    speed/quality trade-off and its Pareto front (faster and no worse). Spaces without quality runs:
    the in-run NE over the baseline's samples instead."""
    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Speed vs quality of the confirmed configurations")
    conf = df[df["confirm_speedup"].notna()] if "confirm_speedup" in df else df.iloc[:0]
    if conf.empty:
        return _empty(fig, ax, "no confirmed configurations")
    held_out = conf["quality_eval_diff"].notna().any() if "quality_eval_diff" in conf else False
    base = conf[conf["quality_reason"].astype(str).str.startswith("baseline")]
    bne = float(base["confirm_ne_median"].iloc[0]) if len(base) else math.nan
    pts = []
    for _, r in conf.iterrows():
        is_base = str(r["quality_reason"]).startswith("baseline")
        if held_out:
            x = 0.0 if is_base or not r["quality_eval_ne"] else r["quality_eval_diff"]
            err = 0.0 if is_base else r["quality_se"]
        else:
            x = (r["confirm_ne_median"] - bne) / bne if bne else math.nan
            err = math.nan
        if isinstance(x, float) and math.isnan(x):
            x = 0.0  # same numerics as the baseline (no quality run needed)
        y = r["confirm_speedup"]
        pts.append((100 * x, y))
        color = "tab:red" if is_base else ("tab:green" if r["quality_ok"] else "tab:gray")
        ax.errorbar(100 * x, y, xerr=None if not err or math.isnan(err) else 100 * err, fmt="o", color=color,
                    ms=6, capsize=3, zorder=3)
        ax.annotate(f"#{int(r['number'])}", (100 * x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    front = sorted(pts, key=lambda p: (p[0], -p[1]))  # lower NE first; at equal NE the fastest
    best, line = -math.inf, []
    for x, y in front:
        if y > best:
            best = y
            line.append((x, y))
    ax.step([p[0] for p in line], [p[1] for p in line], where="post", color="tab:blue", lw=1, alpha=0.6,
            label="Pareto front")
    tol = df.attrs.get("space", {}).get("quality") or {}
    tol = tol.get("tolerance") if held_out else df.attrs.get("space", {}).get("constraints", {}).get(
        "quality_tolerance")
    if tol:
        ax.axvline(100 * tol, color="tab:red", ls="--", lw=1, label=f"tolerance {tol:.2%}")
    ax.set_xlabel(("held-out eval NE" if held_out else "NE over the baseline's samples")
                  + " vs baseline (%, lower is better)")
    ax.set_ylabel("speed-up (re-measured)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


WHY_PHASES = {"lookups": "tab:blue", "all_to_all": "tab:orange", "all_reduce": "tab:red", "dp_sync": "tab:pink",
              "replica_sync": "tab:brown", "dense": "tab:green", "other": "0.7"}


def plan_why(why: dict) -> Figure:
    """The baseline's and the winner's modelled step by phase (left) and each rank's lookups, its critical
    rank marked (right): where the winner's plan saves its time (`cubic.results.plan_why`)."""
    views = why["views"]
    fig = Figure(figsize=(10, 3.2), layout="constrained")
    left_ax, right_ax = fig.subplots(1, 2, width_ratios=[1, 1.4])
    left_ax.set_title(f"Modelled step by phase (ms, {why['cluster']})")
    names = [v["name"] for v in views][::-1]
    acc = np.zeros(len(views))
    for ph, color in WHY_PHASES.items():
        w = np.array([v["phases_ms"].get(ph, 0.0) for v in views][::-1])
        if w.any():
            left_ax.barh(names, w, left=acc, color=color, label=ph)
            acc += w
    left_ax.legend(fontsize=7, loc="lower right")
    left_ax.grid(axis="x", alpha=0.3)
    right_ax.set_title("Lookups per rank (ms, forward + backward); * critical")
    n = max(len(v["lookups_ms"]) for v in views)
    width = 0.8 / len(views)
    for i, v in enumerate(views):
        x = np.arange(len(v["lookups_ms"])) + (i - (len(views) - 1) / 2) * width
        bars = right_ax.bar(x, v["lookups_ms"], width=width, label=v["name"],
                            color=("tab:gray", "tab:green")[i % 2]) if n <= 64 else None
        if bars is None:  # many ranks: a line per plan
            right_ax.plot(np.arange(len(v["lookups_ms"])), v["lookups_ms"], label=v["name"])
        c = v["critical"]
        right_ax.annotate("*", (x[c] if n <= 64 else c, v["lookups_ms"][c]), ha="center", va="bottom", fontsize=14)
    right_ax.set_xlabel("rank (group position)")
    right_ax.legend(fontsize=7)
    right_ax.grid(axis="y", alpha=0.3)
    return fig


FIGURES = {
    "Best so far": best_so_far,
    "Throughput by knob": qps_by_knob,
    "Time breakdown of the top configurations": breakdown,
    "Proxy prediction vs measurement": prediction_vs_measurement,
    "Knob importance": importance,
    "Speed vs quality": speed_vs_quality,
}
