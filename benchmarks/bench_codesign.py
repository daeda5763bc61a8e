"""The co-design study (issue 61): MLPerf DLRM-DCNv2 to its quality target over A100, H100, H200,
B200 and GB200 NVL72 at 8-256 GPUs, InfiniBand with SHARP vs RoCE
(search_spaces/mlperf_codesign.yaml), and how well each searcher finds its front.

1. Every (cluster, configuration) of the space priced once: the true front of time to train and
   cost, and the wall time of pricing it all.
2. Each searcher (random, Optuna's NSGA-II, cubic's proxy) run `--seeds` times for `--trials`
   trials, side by side in one run, its front after a third, two thirds and all of them against
   the true front: the epsilon indicator (the factor by which the worst-matched true-front point
   is missed in time or cost; 1.0 is the true front) and the share of the true front found, median
   and range. The searchers read the prices of step 1 (the simulator is deterministic), so what
   differs is only what each chose to price.
3. The study as a user runs it: `cubic codesign --space search_spaces/mlperf_codesign.yaml --trials
   N` (the proxy), its front, knee and wall time, and the plot.

4. Where the space lists `sites`: what a second data center costs, per node type and size, the
   best time to train and its cost in one site and split between two, from step 1's prices.

Writes benchmarks/data/codesign.json and codesign_front.png (`--space S`: S's name in place of
`codesign`, e.g. codesign_sites.json for search_spaces/mlperf_codesign_sites.yaml, with step 4's plot,
codesign_sites_second_site.png).

    .venv/bin/python benchmarks/bench_codesign.py [--trials 120] [--seeds 3] [--space SPACE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import track  # noqa: E402
from rich.table import Table  # noqa: E402

from cubic.cli.codesign import study_front  # noqa: E402
from cubic.codesign.front import plot_front, print_front  # noqa: E402
from cubic.codesign.study import CodesignStudy, Priced  # noqa: E402
from cubic.space.search_space import load_space  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
SPACE = ROOT / "search_spaces" / "mlperf_codesign.yaml"
SEARCHERS = ("random", "nsga2", "proxy")


class Priced1(CodesignStudy):
    """A study that reads its prices from the exhaustive table (the same deterministic `price`)."""

    table: dict[tuple[str, str], Priced] = {}

    def price(self, params: dict[str, Any]) -> Priced:
        key = (self.choice(params).label, self.config(params).key())
        if key not in self.table:
            self.table[key] = super().price(params)
        return self.table[key]


def every_params(cd: CodesignStudy) -> list[dict[str, Any]]:
    names = list(cd.dists)
    combos = itertools.product(*(cd.dists[n].choices for n in names))  # type: ignore[attr-defined]
    return [dict(zip(names, c, strict=True)) for c in combos]


def epsilon(found: list[tuple[float, float]], true: list[tuple[float, float]]) -> float:
    """The multiplicative epsilon indicator: the least factor by which every true-front point is
    matched in both objectives by some found point (1.0: the true front found)."""
    return max(min(max(p[0] / q[0], p[1] / q[1]) for p in found) for q in true)


def recall(found: list[tuple[float, float]], true: list[tuple[float, float]]) -> float:
    """The share of the true front's points found exactly."""
    fs = set(found)
    return sum(q in fs for q in true) / len(true)


def front_points(scores: list[dict[str, float]]) -> list[tuple[float, float]]:
    """The distinct non-dominated (time to train, cost) pairs."""
    pts = {(s["time_to_train"], s["cost"]) for s in scores}
    return sorted(p for p in pts if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in pts))


def exhaustive(sp: Any) -> tuple[list[dict[str, float]], float, int, list[tuple[dict[str, Any], Priced]]]:
    """Every (cluster, configuration) priced once: the scores of those that ran, the wall seconds, how many
    were priced, and each parameter set with its outcome."""
    cd = Priced1(sp, optuna.storages.InMemoryStorage(), searcher="random")
    t0 = time.perf_counter()
    done: dict[tuple[str, str], Priced] = {}
    each = []
    for p in track(every_params(cd), description="pricing every cluster x configuration"):
        key = (cd.choice(p).label, cd.config(p).key())
        if key not in done:
            done[key] = cd.price(p)
        each.append((p, done[key]))
    wall = time.perf_counter() - t0
    ok = [v.scores for v in done.values() if v.status == "ok"]
    return ok, wall, len(done), each


def second_site(each: list[tuple[dict[str, Any], Priced]]) -> list[dict[str, Any]]:
    """Per node type and size (and fabric, NVLink domain): the fastest configuration's time to train and its
    cost in one site and in two, and why two did not run where it did not."""
    best: dict[tuple, dict[int, Priced]] = {}
    for p, pr in each:
        where = tuple((k, v) for k, v in sorted(p.items()) if k.startswith("cluster.") and k != "cluster.sites")
        got = best.setdefault(where, {}).get(p["cluster.sites"])
        if got is None or _faster(pr, got):
            best[where][p["cluster.sites"]] = pr
    rows = []
    for where, by in best.items():
        one, two = by.get(1), by.get(2)
        if one is None or two is None or one.status != "ok":
            continue
        row = {**dict(where), "one_site_h": one.scores["time_to_train"], "one_site_cost": one.scores["cost"]}
        if two.status == "ok":
            row.update(two_sites_h=two.scores["time_to_train"], two_sites_cost=two.scores["cost"],
                       slower=two.scores["time_to_train"] / one.scores["time_to_train"], plan_one=one.plan,
                       plan_two=two.plan)
        else:
            row["two_sites"] = two.reason
        rows.append(row)
    return rows


def plot_second_site(rows: list[dict[str, Any]], path: Path) -> None:
    """Time to train against GPUs, a line per node type, solid in one site and dashed split between two."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for k, node in enumerate(sorted({r["cluster.node"] for r in rows})):
        mine = sorted((r for r in rows if r["cluster.node"] == node), key=lambda r: r["cluster.gpus"])
        color = f"C{k}"
        ax.plot([r["cluster.gpus"] for r in mine], [r["one_site_h"] * 60 for r in mine], "o-", color=color,
                label=f"{node}, one site")
        two = [r for r in mine if "two_sites_h" in r]
        ax.plot([r["cluster.gpus"] for r in two], [r["two_sites_h"] * 60 for r in two], "s--", color=color,
                label=f"{node}, two sites")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("time to train (minutes), fastest configuration")
    ax.set_title("what a second data center costs: time to train in one site and split between two")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _faster(a: Priced, b: Priced) -> bool:
    """`a` ran and trains sooner than `b` (or `b` did not run)."""
    if a.status != "ok":
        return False
    return b.status != "ok" or a.scores["time_to_train"] < b.scores["time_to_train"]


def print_second_site(con: Console, rows: list[dict[str, Any]]) -> None:
    t = Table(title="what a second data center costs: the fastest configuration in one site and split between "
              "two (time to train, cost at the space's prices)", header_style="bold")
    for c in ("node", "GPUs", "one site", "two sites", "x slower", "cost, one / two"):
        t.add_column(c)
    for r in sorted(rows, key=lambda r: (r["cluster.node"], r["cluster.gpus"])):
        if "two_sites" in r:
            t.add_row(r["cluster.node"], str(r["cluster.gpus"]), f"{r['one_site_h'] * 60:.1f} min",
                      r["two_sites"], "-", f"{r['one_site_cost']:.2f} / -")
            continue
        t.add_row(r["cluster.node"], str(r["cluster.gpus"]), f"{r['one_site_h'] * 60:.1f} min",
                  f"{r['two_sites_h'] * 60:.1f} min", f"{r['slower']:.2f}x",
                  f"{r['one_site_cost']:.2f} / {r['two_sites_cost']:.2f}")
    con.print(t)


def run_searcher(
    sp: Any, searcher: str, seed: int, trials: int
) -> tuple[list[tuple[int, dict[str, float]]], float]:
    """(trial number, scores) of each trial that ran, and the wall seconds the study took."""
    cd = Priced1(
        sp,
        optuna.storages.InMemoryStorage(),
        seed=seed,
        searcher=searcher,
        console=Console(quiet=True),
    )
    wall = cd.run(trials)
    ok = [
        (t.number, t.user_attrs["scores"])
        for t in cd.study.get_trials(deepcopy=False)
        if t.state == optuna.trial.TrialState.COMPLETE
    ]
    return ok, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=120)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--space", type=Path, default=SPACE)
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    con = Console(width=150)
    sp = load_space(args.space)
    stem = "codesign" + args.space.stem.removeprefix("mlperf_codesign")  # codesign, codesign_sites
    all_ok, wall_all, n_all, each = exhaustive(sp)
    true_front = front_points(all_ok)
    con.print(
        f"every cluster x configuration: {n_all} priced ({len(all_ok)} ran) in {wall_all:.0f} s; "
        f"true front {len(true_front)} points"
    )
    rows: dict[str, Any] = {}
    looks = sorted({args.trials // 3, 2 * args.trials // 3, args.trials})
    for s in SEARCHERS:
        runs = [run_searcher(sp, s, seed, args.trials) for seed in range(args.seeds)]
        rows[s] = {"proposal_wall_s": [w for _, w in runs]}
        for n in looks:
            fronts = [front_points([sc for i, sc in ok if i < n]) for ok, _ in runs]
            rows[s][n] = {
                "epsilon": [epsilon(f, true_front) for f in fronts],
                "recall": [recall(f, true_front) for f in fronts],
            }
    t = Table(
        title=f"the front each searcher found, against the true front ({len(true_front)} points), "
        f"{args.seeds} seeds: epsilon (x by which the worst-matched true point is missed) median "
        "(range); share of the true front found",
        header_style="bold",
    )
    t.add_column("searcher")
    for n in looks:
        t.add_column(f"{n} trials: epsilon")
        t.add_column("found")
    t.add_column("wall s (median)")
    for s, r in rows.items():
        cells = []
        for n in looks:
            e, rc = r[n]["epsilon"], r[n]["recall"]
            cells += [
                f"{statistics.median(e):.3f} ({min(e):.3f}-{max(e):.3f})",
                f"{statistics.median(rc):.0%}",
            ]
        t.add_row(s, *cells, f"{statistics.median(r['proposal_wall_s']):.1f}")
    con.print(t)
    # the study as a user runs it, with its own pricing: wall time, front, knee, plot
    run_dir = Path("/tmp/bench_codesign_study")
    if run_dir.exists():
        for p in run_dir.iterdir():
            p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{run_dir / 'study.db'}")
    cd = CodesignStudy(sp, storage, seed=0, searcher="proxy", console=con)
    wall = cd.run(args.trials)
    f = study_front(cd, wall)
    print_front(con, f)
    plot_front(cd.study, f, DATA / f"{stem}_front.png")
    sites = second_site(each) if sp.codesign.sites != [1] else []
    if sites:
        print_second_site(con, sites)
        plot_second_site(sites, DATA / f"{stem}_second_site.png")
    out = {
        "command": "benchmarks/bench_codesign.py " + " ".join(sys.argv[1:]),
        "space": str(args.space.name),
        "exhaustive": {
            "priced": n_all,
            "ran": len(all_ok),
            "wall_s": wall_all,
            "front": true_front,
        },
        "searchers": rows,
        "trials": args.trials,
        "study": f.to_dict(),
        **({"second_site": sites} if sites else {}),
    }
    (DATA / f"{stem}.json").write_text(json.dumps(out, indent=1))
    con.print(f"wrote {DATA / f'{stem}.json'}, {DATA / f'{stem}_front.png'}")


if __name__ == "__main__":
    main()
