"""Does a plan transfer? (issue 61 item 5): configurations ranked at one size, re-priced at other
sizes and GPU types by the simulator.

A user who tunes on what they have (one 8-GPU H100 node) and deploys on what they will run (256
GPUs, another GPU) wants to know whether the order of the configurations holds there, and what the
small size's winner costs at the large size. Here:

1. A fixed seeded random sample (`--pool`, seed `--seed`) of the knobs of
   search_spaces/dlrm_cluster.yaml (sharding incl. the per-table `plan`, 2D group size, sparse sync
   and placement, batch per GPU, table / dense / wire / all-reduce precisions, pipelining) plus
   `comm_overlap` and `kernel`, on MLPerf DLRM-DCNv2 and, as a second workload, Meta's
   `dlrm-datasets-2022` (788 tables). The group sizes are the space's values below the largest size
   (0, 8, ..., 128); a group size at or above a world size clamps to 0 there (one group of all).
2. Every configuration is priced at every target: 8 ... 256 GPUs on each of the A100, H100, H200,
   B200 presets and GB200 NVL72, each built as `base: PRESET` plus
   `nodes: ceil(GPUS / devices_per_node)` (read from the preset at run time; GB200's node is its
   72-GPU NVLink domain, so 128 and 256 GPUs use 2 and 4 racks partly). The batch per GPU is kept
   (weak scaling), as a copied config keeps it.
3. Source = 8 H100 (and 64 H100): the source's distinct configurations that run, in order of
   samples/s, are what a tune there would rank; its top K are copied as they are (their group size
   as clamped at the source) to each target. Per target: Spearman's rank correlation of the K's
   samples/s at the target with theirs at the source (a configuration that does not run at the
   target ranks last), the loss = the best samples/s at the target (of the sample there and of every
   source's copied top K) over the source winner's there ("x slower"), whether the winner runs there
   at all, and the loss after re-ranking the K at the target.

Throughput only: the simulator does not judge quality, so a knob that changes the numerics (fp16
tables, weight_avg with k > 1, the global batch) is priced like any other. Writes
benchmarks/data/transfer.json (every number, every configuration's knobs, the command, the wall
time) and transfer.png.

    .venv/bin/python benchmarks/bench_transfer.py [--pool 300] [--pool-2022 60] [--top-k 20]
                                                  [--seed 0] [--replot]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import (  # noqa: E402
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from cubic.space.knobs import Knob  # noqa: E402
from cubic.space.search_space import SearchSpace, load_space  # noqa: E402
from cubic_harness.errors import ConfigError  # noqa: E402
from cubic_harness.sim.backend import simulate  # noqa: E402
from cubic_harness.sim.cluster import (  # noqa: E402
    Cluster,
    cluster_from_dict,
    cluster_mapping,
    shipped_cluster,
)
from cubic_harness.workload import Workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
SPACE = ROOT / "search_spaces" / "dlrm_cluster.yaml"
PRESETS = {
    "A100": "a100-80-8",
    "H100": "h100-8",
    "H200": "h200-8",
    "B200": "b200-8",
    "GB200": "gb200-nvl72",
}
SIZES = (8, 16, 32, 64, 128, 256)
SOURCES = (("H100", 8), ("H100", 64))
EXTRA_KNOBS = {
    "comm_overlap": ("none", "forward", "forward_backward"),
    "kernel": ("triton", "torch"),
}

Target = tuple[str, int]  # (GPU type, GPUs)


def cluster_at(gpu: str, gpus: int) -> Cluster:
    """The preset as `base: PRESET` plus `nodes`: whole nodes (NVLink domains) holding `gpus`, read
    now, so an edited preset is priced as it stands."""
    preset = PRESETS[gpu]
    d = cluster_mapping(shipped_cluster(f"{preset}.yaml"))
    d["nodes"] = math.ceil(gpus / d["devices_per_node"])
    return cluster_from_dict(d, f"{preset} x {d['nodes']} nodes")


def ranks_per_node(gpus: int, c: Cluster) -> int:
    """Ranks a node block holds for table_row_wise: the whole job if one node holds it, else the
    largest block aligned with the nodes (GB200 at 128 GPUs: 72 does not divide 128, so 8)."""
    return gpus if gpus <= c.devices_per_node else math.gcd(gpus, c.devices_per_node)


def base_space(workload: Workload) -> SearchSpace:
    """The shipped 4,096-GPU space's knobs on `workload`, group sizes cut to the sizes studied, plus
    the overlap and the GPU kernel a user also sets."""
    sp = load_space(SPACE, check_choices=False)
    knobs = dict(sp.knobs)
    g = knobs["sharding_group_size"]
    knobs["sharding_group_size"] = dataclasses.replace(
        g, choices=tuple(v for v in g.choices if v < max(SIZES))
    )
    for k, choices in EXTRA_KNOBS.items():
        knobs[k] = Knob(
            k,
            choices,
            getattr(sp.baseline, k) if getattr(sp.baseline, k) in choices else choices[0],
        )
    base = dataclasses.replace(
        sp.baseline,
        workload=workload,
        comm_overlap=knobs["comm_overlap"].default,
        kernel=knobs["kernel"].default,
    )
    return dataclasses.replace(
        sp, workload=workload, knobs=knobs, baseline=base, _cache={}, _changes={}, _excluded={}
    )


def space_at(sp: SearchSpace, gpus: int, c: Cluster) -> SearchSpace:
    """The space at one world size: the baseline's world and node size follow the cluster."""
    base = dataclasses.replace(sp.baseline, world_size=gpus, ranks_per_node=ranks_per_node(gpus, c))
    return dataclasses.replace(sp, baseline=base, _cache={}, _changes={}, _excluded={})


def sample(sp: SearchSpace, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` distinct configurations, each knob drawn uniformly (seeded), as canonical knobs at the
    largest size (where every group size is a 2D one)."""
    rng, big = np.random.default_rng(seed), space_at(sp, max(SIZES), cluster_at("H100", max(SIZES)))
    seen: dict[tuple, dict[str, Any]] = {}
    for _ in range(50 * n):
        p = {k: kn.choices[int(rng.integers(len(kn.choices)))] for k, kn in sp.knobs.items()}
        t = big.tup(p)
        if t not in seen and big.valid(p):
            seen[t] = big.canonical(p)
        if len(seen) == n:
            break
    return list(seen.values())


def at_size(sp: SearchSpace, params: dict[str, Any]) -> dict[str, Any]:
    """`params` at the space's world size: a group size at or above it clamps to 0 (one group of
    all)."""
    g = params["sharding_group_size"]
    return sp.canonical({**params, "sharding_group_size": 0 if g >= sp.baseline.world_size else g})


class Pricer:
    """Prices configurations at targets once each (a configuration that clamps to another's is the
    same)."""

    def __init__(self, sp: SearchSpace) -> None:
        self.sp, self.spaces, self.clusters = sp, {}, {}
        self.cache: dict[tuple[Target, tuple], dict[str, Any]] = {}

    def space(self, tgt: Target) -> SearchSpace:
        if tgt not in self.spaces:
            self.clusters[tgt] = cluster_at(*tgt)
            self.spaces[tgt] = space_at(self.sp, tgt[1], self.clusters[tgt])
        return self.spaces[tgt]

    def price(self, params: dict[str, Any], tgt: Target) -> dict[str, Any]:
        sp = self.space(tgt)
        eff = at_size(sp, params)
        key = (tgt, sp.tup(eff))
        if key not in self.cache:
            try:
                r = simulate(sp.config(eff), self.clusters[tgt])
                row = {
                    "status": r.status,
                    "qps": r.qps if r.status == "ok" else 0.0,
                    "mem_gb": r.peak_mem_mb / 1024,
                    "error": r.error[:160],
                }
            except ConfigError as e:
                row = {"status": "invalid", "qps": 0.0, "mem_gb": 0.0, "error": str(e)[:160]}
            self.cache[key] = {**row, "knobs": eff}
        return self.cache[key]


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho (average ranks on ties); None where it is undefined (a constant side)."""
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    return float(spearmanr(x, y).statistic)


def ranked(pr: Pricer, pool: list[dict[str, Any]], src: Target, k: int) -> dict[str, Any]:
    """What a tune at the source ranks: its distinct configurations (several sampled ones may clamp
    to one) that run, fastest first; the top `k` as they would be copied (their group size as
    clamped there)."""
    src_rows: dict[tuple, tuple[dict[str, Any], dict[str, Any]]] = {}
    for p in pool:
        row = pr.price(p, src)
        src_rows.setdefault(pr.space(src).tup(row["knobs"]), (row["knobs"], row))
    ok = sorted(
        (v for v in src_rows.values() if v[1]["status"] == "ok"), key=lambda v: -v[1]["qps"]
    )
    return {
        "source": {"gpu": src[0], "gpus": src[1]},
        "distinct_at_source": len(src_rows),
        "run_at_source": len(ok),
        "top_k": [{"knobs": kn, "qps": r["qps"]} for kn, r in ok[:k]],
    }


def transfer(
    pr: Pricer, pool: list[dict[str, Any]], src: dict[str, Any], every_top: list[dict[str, Any]]
) -> dict[str, Any]:
    """The source's top K copied to every target: rank correlation, the winner's loss and status
    there. The best at a target is the best of the sample there and of every source's copied top K
    (one yardstick for every source)."""
    top = [t["knobs"] for t in src["top_k"]]
    src_qps = [t["qps"] for t in src["top_k"]]
    out: dict[str, Any] = {**src, "targets": []}
    for gpu in PRESETS:
        for n in SIZES:
            tgt = (gpu, n)
            pool_rows = [pr.price(p, tgt) for p in pool]
            top_rows = [pr.price(kn, tgt) for kn in top]
            cands = pool_rows + [pr.price(kn, tgt) for kn in every_top]
            best = max(cands, key=lambda r: r["qps"])
            win = top_rows[0]
            differs = {
                kk: [win["knobs"][kk], v]
                for kk, v in best["knobs"].items()
                if win["knobs"][kk] != v
            }
            tq = [r["qps"] for r in top_rows]
            distinct = {pr.space(tgt).tup(r["knobs"]): r["qps"] for r in cands}
            out["targets"].append(
                {
                    "gpu": gpu,
                    "gpus": n,
                    "cluster": pr.clusters[tgt].name,
                    "spearman": spearman(src_qps, tq),
                    "top_k_fail": int(sum(r["status"] != "ok" for r in top_rows)),
                    "top_k_fail_status": sorted(
                        {r["status"] for r in top_rows if r["status"] != "ok"}
                    ),
                    "winner_status": win["status"],
                    "winner_error": win["error"],
                    "winner_qps": win["qps"],
                    "winner_rank": 1 + int(sum(q > win["qps"] for q in distinct.values()))
                    if win["qps"]
                    else None,
                    "distinct_at_target": len(distinct),
                    "best_qps": best["qps"],
                    "best_knobs": best["knobs"],
                    "best_differs": differs,
                    "loss": best["qps"] / win["qps"] if win["qps"] else None,
                    "rerank_loss": best["qps"] / max(tq) if max(tq) else None,
                    "pool_fail": int(sum(r["status"] != "ok" for r in pool_rows)),
                    # every number behind the row: the sample's (hoisted, `hoist`) and the top K's
                    # samples/s here
                    "pool_qps": [round(r["qps"]) for r in pool_rows],
                    "top_k_qps": [round(q) for q in tq],
                    "not_run": {
                        i: r["status"] for i, r in enumerate(pool_rows) if r["status"] != "ok"
                    },
                }
            )
    return out


def hoist(sources: list[dict[str, Any]]) -> dict[str, Any]:
    """The sample's samples/s per target (the same whatever the source), once: "GPU GPUS" -> list in
    the sample's order, and which did not run (index -> status)."""
    out: dict[str, Any] = {}
    for res in sources:
        for r in res["targets"]:
            row = {"qps": r.pop("pool_qps"), "not_run": r.pop("not_run")}
            assert out.setdefault(f"{r['gpu']} {r['gpus']}", row) == row
    return out


def fmt_loss(x: float | None, status: str = "ok") -> str:
    return f"{x:.2f}x" if x is not None else status.upper()


def table(con: Console, wl: str, res: dict[str, Any], k: int) -> list[str]:
    """Print one source's transfer table; its markdown rows for the docs."""
    s = res["source"]
    t = Table(title=f"{wl}: top {k} of {s['gpus']} {s['gpu']} re-priced (simulated)")
    cols = (
        "GPU",
        "GPUs",
        "Spearman",
        "top-K not run",
        "winner",
        "x slower",
        "re-ranked x",
        "winner rank",
    )
    for c in cols:
        t.add_column(c, justify="right")
    md = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in res["targets"]:
        rho = "n/a" if r["spearman"] is None else f"{r['spearman']:+.2f}"
        cells = (
            r["gpu"],
            str(r["gpus"]),
            rho,
            str(r["top_k_fail"]),
            r["winner_status"],
            fmt_loss(r["loss"], r["winner_status"]),
            fmt_loss(r["rerank_loss"], "none run"),
            f"{r['winner_rank']} / {r['distinct_at_target']}" if r["winner_rank"] else "-",
        )
        t.add_row(*cells)
        md.append("| " + " | ".join(cells) + " |")
    con.print(t)
    return md


def plot(results: dict[str, Any], path: Path) -> None:
    """Rank correlation and loss against size, one line per GPU type; one row per workload and
    source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(wl, res) for wl in results for res in results[wl]["sources"]]
    fig, axes = plt.subplots(len(rows), 2, figsize=(12, 3.6 * len(rows)), squeeze=False)
    colours = dict(
        zip(PRESETS, ("tab:gray", "tab:blue", "tab:green", "tab:orange", "tab:red"), strict=True)
    )
    for (ax_rho, ax_loss), (wl, res) in zip(axes, rows, strict=True):
        s, k = res["source"], results[wl]["top_k"]
        for gpu in PRESETS:
            rs = [r for r in res["targets"] if r["gpu"] == gpu]
            x = [r["gpus"] for r in rs]
            ax_rho.plot(
                x,
                [np.nan if r["spearman"] is None else r["spearman"] for r in rs],
                "-o",
                color=colours[gpu],
                label=gpu,
                ms=4,
            )
            ax_loss.plot(
                x,
                [np.nan if r["loss"] is None else r["loss"] for r in rs],
                "-o",
                color=colours[gpu],
                ms=4,
            )
            ax_loss.plot(
                x,
                [np.nan if r["rerank_loss"] is None else r["rerank_loss"] for r in rs],
                ":",
                color=colours[gpu],
                lw=1,
            )
            for r in rs:
                if r["loss"] is None:  # the winner does not run there: marked on the axis
                    ax_loss.plot(r["gpus"], 1.0, "x", color=colours[gpu], ms=9, mew=2)
        for ax in (ax_rho, ax_loss):
            ax.set_xscale("log", base=2)
            ax.set_xticks(SIZES, [str(n) for n in SIZES])
            ax.axvline(s["gpus"], color="k", lw=0.6, ls="--")
            ax.grid(alpha=0.3)
        rhos = [r["spearman"] for r in res["targets"] if r["spearman"] is not None]
        ax_rho.set_ylim(min([0.0, *rhos]) - 0.05, 1.05)
        ax_rho.axhline(0, color="k", lw=0.5)
        ax_rho.set_ylabel(f"Spearman rho of the top {k}")
        ax_rho.set_title(
            f"{wl}, tuned on {s['gpus']} {s['gpu']}: does the order hold?", fontsize=10
        )
        ax_loss.yaxis.set_major_formatter(lambda v, _: f"{v:g}x")
        ax_loss.axhline(1, color="k", lw=0.5)
        ax_loss.set_ylabel("best there / source winner there")
        ax_loss.set_title(
            f"{wl}, tuned on {s['gpus']} {s['gpu']}: x slower than the best", fontsize=10
        )
    axes[-1][0].set_xlabel("GPUs at the target (dashed: the source's size)")
    axes[-1][1].set_xlabel("GPUs at the target (x on the 1 line: the winner does not run there)")
    axes[0][0].legend(fontsize=8, loc="lower left")
    axes[0][1].legend(
        [plt.Line2D([], [], color="k", marker="o", ms=4), plt.Line2D([], [], color="k", ls=":")],
        [
            "the source winner",
            f"the best of the top {results[rows[0][0]]['top_k']} there (re-ranked)",
        ],
        fontsize=8,
        loc="upper left",
    )
    fig.suptitle(
        "Does a plan transfer? The top configurations of one size re-priced at others (simulated)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--pool", type=int, default=300, help="sampled configurations, MLPerf DLRM-DCNv2"
    )
    ap.add_argument(
        "--pool-2022",
        type=int,
        default=60,
        help="sampled configurations, dlrm-datasets-2022 (its per-table plan takes 1-8 s a "
        "pricing); 0 skips it",
    )
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DATA / "transfer.json")
    ap.add_argument(
        "--replot", action="store_true", help="redraw the plot from --out, pricing nothing"
    )
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(args.out.read_text())["workloads"], args.out.with_suffix(".png"))
        return
    con = Console(width=160)
    t_all = time.perf_counter()
    results: dict[str, Any] = {}
    md: dict[str, list[list[str]]] = {}
    runs = [("mlperf-dcnv2", args.pool), ("dlrm-datasets-2022", args.pool_2022)]
    for wl_name, n in [(w, n) for w, n in runs if n > 0]:
        t0 = time.perf_counter()
        sp = base_space(Workload.preset(wl_name))
        pool = sample(sp, n, args.seed)
        pr = Pricer(sp)
        targets = [(g, s) for g in PRESETS for s in SIZES]
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=con,
        ) as prog:
            task = prog.add_task(
                f"{wl_name}: pricing {len(pool)} configurations", total=len(targets) * len(pool)
            )
            for tgt in targets:
                prog.update(task, description=f"{wl_name}: {tgt[1]} {tgt[0]}")
                for p in pool:
                    pr.price(p, tgt)
                    prog.advance(task)
        tops = [ranked(pr, pool, src, args.top_k) for src in SOURCES]
        every_top = [t["knobs"] for r in tops for t in r["top_k"]]
        sources = [transfer(pr, pool, r, every_top) for r in tops]
        pool_qps = hoist(sources)
        wall = time.perf_counter() - t0
        con.print(
            f"{wl_name}: {len(pool)} configurations x {len(targets)} targets, "
            f"{len(pr.cache):,} distinct pricings in {wall:.0f} s"
        )
        md[wl_name] = [table(con, wl_name, res, args.top_k) for res in sources]
        results[wl_name] = {
            "pool": len(pool),
            "top_k": args.top_k,
            "pricings": len(pr.cache),
            "wall_s": wall,
            "sample": pool,
            "pool_qps": pool_qps,
            "sources": sources,
        }
        write(
            args, results, md, time.perf_counter() - t_all
        )  # each workload's as soon as it is done
    wall = time.perf_counter() - t_all
    write(args, results, md, wall)
    con.print(f"wall time {wall:.0f} s; wrote {args.out} and {args.out.with_suffix('.png')}")


def dumps(obj: Any) -> str:
    """JSON one level per line, but each innermost list or mapping (a configuration's knobs, a
    target's samples/s) on one line: the file stays readable at a fraction of the size."""

    def one_line(m: re.Match[str]) -> str:
        return re.sub(
            r"([\[{])\s+|\s+([\]}])|\n\s*", lambda g: g.group(1) or g.group(2) or " ", m.group(0)
        )

    return re.sub(r"[\[{]\n[^\[\]{}]*?\n\s*[\]}]", one_line, json.dumps(obj, indent=1))


def preset_files() -> dict[str, dict[str, str]]:
    """Which preset files were read (they are edited as figures are measured): path, digest,
    modified."""
    out = {}
    for gpu, preset in PRESETS.items():
        p = shipped_cluster(f"{preset}.yaml").resolve()
        out[gpu] = {
            "file": str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p),
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "modified_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(p.stat().st_mtime)),
        }
    return out


def write(
    args: argparse.Namespace, results: dict[str, Any], md: dict[str, list[list[str]]], wall: float
) -> None:
    cmd = " ".join([".venv/bin/python", "benchmarks/bench_transfer.py", *sys.argv[1:]])
    args.out.write_text(
        dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "command": cmd,
                "wall_s": wall,
                "seed": args.seed,
                "space": str(SPACE.relative_to(ROOT)),
                "extra_knobs": EXTRA_KNOBS,
                "sizes": SIZES,
                "presets": PRESETS,
                "preset_files": preset_files(),
                "sources": SOURCES,
                "workloads": results,
                "markdown": {w: ["\n".join(m) for m in ms] for w, ms in md.items()},
            }
        )
    )
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
