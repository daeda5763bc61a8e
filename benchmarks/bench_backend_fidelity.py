"""Do cubic's harness and TorchRec rank configurations alike? The same configurations, workload and ids in both
backends, alternating, on this machine.

N configurations drawn from a `target: torchrec` space (default: search_spaces/dlrm_cpu_torchrec.yaml, whose knob
values TorchRec runs as the harness measures them: FBGEMM's kernel on both sides, so what differs is the
framework around it) each run `--repeats` times in cubic's harness (`run_trial`) and in TorchRec
(`run_torchrec`), one after the other so drift hits both alike. It reports each configuration's median samples/s
in both, the Kendall tau of the two rankings, the median harness/TorchRec ratio, and where they disagree, why:
the ratio by knob value (a knob whose values change the ratio is priced differently by the two frameworks) and
the most discordant pairs. Writes benchmarks/data/backend_fidelity.json and .png.

`--predict CLUSTER` then prices the stored configurations with the simulator, each framework's step by its own
profile (the cluster's device figures for the harness, its `frameworks.torchrec` from `cubic calibrate
--framework torchrec` for TorchRec; neither was fitted on these configurations), and adds each profile's Kendall
tau and median |error| against its framework's measurements.

    python benchmarks/bench_backend_fidelity.py [--n 20] [--repeats 1] [--space FILE]
    python benchmarks/bench_backend_fidelity.py --predict ~/.config/cubic/local.yaml
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "data" / "backend_fidelity"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--space", type=Path, default=ROOT / "search_spaces" / "dlrm_cpu_torchrec.yaml")
    ap.add_argument("--predict", type=Path, help="a cluster file with a torchrec profile: price the stored rows")
    args = ap.parse_args()
    if args.predict:
        predict(args.predict)
        return
    from scipy.stats import kendalltau

    from cubic.space.search_space import load_space
    from cubic_harness.torchrec_trial import run_torchrec
    from cubic_harness.trial import run_trial

    con = Console()
    sp = load_space(args.space)
    rng = np.random.default_rng(args.seed)
    tups = [sp.tup(sp.baseline_params())]
    while len(tups) < args.n:
        t = sp.random_tuple(rng, exclude=set(tups))
        if t is None:
            break
        tups.append(t)
    params = [sp.params_of(t) for t in tups]
    rows = []
    t0 = time.time()
    with Progress(console=con) as prog:
        task = prog.add_task("harness, then TorchRec", total=len(params) * args.repeats)
        for p in params:
            cfg = sp.config(p)
            h, r, errs = [], [], []
            for _ in range(args.repeats):
                for run, out in ((run_trial, h), (run_torchrec, r)):
                    res = run(cfg)
                    (out.append(res.qps) if res.status == "ok" else errs.append(f"{run.__name__}: {res.error}"))
                prog.advance(task)
            rows.append({"params": p, "harness": statistics.median(h) if h else None,
                         "torchrec": statistics.median(r) if r else None, "errors": errs})
    ok = [x for x in rows if x["harness"] and x["torchrec"]]
    hq, tq = [x["harness"] for x in ok], [x["torchrec"] for x in ok]
    tau = float(kendalltau(hq, tq).statistic) if len(ok) >= 3 else float("nan")
    ratios = [a / b for a, b in zip(hq, tq, strict=True)]
    # where they disagree: the ratio by knob value, and the pairs the two order oppositely by the widest margin
    by_knob = {}
    for k in sp.knobs:
        vals = {}
        for x, q in zip(ok, ratios, strict=True):
            vals.setdefault(str(x["params"].get(k)), []).append(q)
        if len(vals) > 1:
            by_knob[k] = {v: {"median_ratio": statistics.median(qs), "n": len(qs)} for v, qs in sorted(vals.items())}
    discordant = []
    for i, j in itertools.combinations(range(len(ok)), 2):
        a, b = np.log(hq[i] / hq[j]), np.log(tq[i] / tq[j])
        if a * b < 0:
            diff = {k: (ok[i]["params"].get(k), ok[j]["params"].get(k)) for k in sp.knobs
                    if ok[i]["params"].get(k) != ok[j]["params"].get(k)}
            discordant.append({"pair": [i, j], "harness_ratio": float(np.exp(a)), "torchrec_ratio": float(np.exp(b)),
                               "margin": float(min(abs(a), abs(b))), "differ_in": diff})
    discordant.sort(key=lambda d: -d["margin"])
    out = {"space": str(args.space.relative_to(ROOT)), "n": len(rows), "ran_in_both": len(ok),
           "repeats": args.repeats, "kendall_tau": tau, "median_ratio_harness_over_torchrec": statistics.median(ratios),
           "ratio_range": [min(ratios), max(ratios)], "ratio_by_knob": by_knob, "discordant_pairs": discordant[:8],
           "rows": rows, "wall_s": round(time.time() - t0, 1)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(out, indent=1))
    t = Table(title=f"harness vs TorchRec, {len(ok)} configurations: Kendall tau {tau:.2f}, median ratio "
                    f"{out['median_ratio_harness_over_torchrec']:.2f}")
    for c in ("#", "knobs", "harness", "TorchRec", "ratio"):
        t.add_column(c)
    for i, x in enumerate(rows):
        knobs = ", ".join(f"{k}={v}" for k, v in x["params"].items())
        t.add_row(str(i), knobs, f"{x['harness']:,.0f}" if x["harness"] else "-",
                  f"{x['torchrec']:,.0f}" if x["torchrec"] else "; ".join(x["errors"])[:60],
                  f"{x['harness'] / x['torchrec']:.2f}" if x["harness"] and x["torchrec"] else "-")
    con.print(t)
    for k, vals in by_knob.items():
        con.print(f"{k}: " + ", ".join(f"{v} {d['median_ratio']:.2f} (n={d['n']})" for v, d in vals.items()))
    _plot(ok, tau)


def predict(cluster_file: Path) -> None:
    """Each stored configuration priced per framework; tau and median |error| per profile, beside the stored
    measurements (the json gains `predicted`)."""
    from scipy.stats import kendalltau

    from cubic.space.search_space import load_space
    from cubic_harness.sim.backend import simulate
    from cubic_harness.sim.cluster import load_cluster

    out = json.loads(OUT.with_suffix(".json").read_text())
    sp = load_space(ROOT / out["space"])
    base = load_cluster(cluster_file)
    profiles = {"harness": base, "torchrec": base.for_framework("torchrec")}
    rows = [r for r in out["rows"] if r["harness"] and r["torchrec"]]
    summary = {}
    for fw, c in profiles.items():
        pred = [simulate(sp.config(r["params"]), c).qps for r in rows]
        meas = [r[fw] for r in rows]
        for r, q in zip(rows, pred, strict=True):
            r.setdefault("predicted", {})[fw] = q
        errs = [abs(p / m - 1) for p, m in zip(pred, meas, strict=True)]
        summary[fw] = {"kendall_tau": float(kendalltau(pred, meas).statistic),
                       "median_abs_error": statistics.median(errs), "worst_abs_error": max(errs),
                       "profile": {k: getattr(c.device, k) for k in ("step_overhead_ms", "glue_ns_per_id")}}
    # the other way round: TorchRec's measurements priced with the harness's profile (what a framework-blind
    # simulator would say)
    blind = [r["predicted"]["harness"] for r in rows]
    summary["torchrec_priced_as_harness"] = {
        "kendall_tau": float(kendalltau(blind, [r["torchrec"] for r in rows]).statistic),
        "median_abs_error": statistics.median(abs(p / r["torchrec"] - 1) for p, r in zip(blind, rows, strict=True))}
    out["predicted"] = {"cluster": str(cluster_file), **summary}
    _plot(rows, out["kendall_tau"])
    OUT.with_suffix(".json").write_text(json.dumps(out, indent=1))
    con = Console()
    t = Table(title=f"the simulator against each framework's measurements ({len(rows)} configurations, none "
                    "fitted on)")
    for col in ("framework", "profile", "Kendall tau", "median |error|", "worst"):
        t.add_column(col)
    for fw in ("harness", "torchrec"):
        d = summary[fw]
        t.add_row(fw, f"{d['profile']['step_overhead_ms']:.2f} ms + {d['profile']['glue_ns_per_id']:.0f} ns/id",
                  f"{d['kendall_tau']:.2f}", f"{d['median_abs_error']:.1%}", f"{d['worst_abs_error']:.1%}")
    b = summary["torchrec_priced_as_harness"]
    t.add_row("torchrec, priced as the harness", "-", f"{b['kendall_tau']:.2f}", f"{b['median_abs_error']:.1%}", "")
    con.print(t)


def _plot(rows: list[dict], tau: float) -> None:
    """TorchRec's samples/s against the harness's, one point per configuration, 2D apart from one group."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(5.5, 4.5))
    ax = fig.add_subplot()
    for two_d, label, color in ((False, "one model-parallel group", "tab:blue"), (True, "2D (DMPCollection)",
                                                                                  "tab:orange")):
        pts = [(r["harness"], r["torchrec"]) for r in rows if (r["params"].get("sharding_group_size", 0) not in
                                                               (0, r["params"].get("world_size", 2))) == two_d]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=18, color=color, label=label)
    qs = [q for r in rows for q in (r["harness"], r["torchrec"])]
    lo, hi = min(qs) * 0.9, max(qs) * 1.1
    ax.plot([lo, hi], [lo, hi], lw=0.8, color="grey")
    ax.set(xscale="log", yscale="log", xlabel="cubic harness samples/s", ylabel="TorchRec samples/s",
           title=f"the same configurations in both (Kendall tau {tau:.2f})")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
