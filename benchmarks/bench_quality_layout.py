"""Does a quality layout train the same model, and how much sooner? `quality.layout` (a space's
model-neutral knobs for its quality runs, `cubic.space.numerics.LAYOUT_KNOBS`) against the
baseline's.

For each model (the default space's baseline, and its fp16/bf16 stack), the quality run `make tune`
trains (1M samples, 64k held out; `QualityRuns.config`) is run in the baseline's layout and in the
space's quality layout, alternating within each seed. Reported per model: the paired eval NE
difference per seed (the layout's verdict must not move: well inside the gate's 0.10% tolerance) and
the median wall seconds of each layout with their ratio.

    .venv/bin/python benchmarks/bench_quality_layout.py [--seeds 3] [--layout kernel=native]
        -> benchmarks/data/quality_layout.json   (--more: seeds after its own; --show: its tables)

`--against KNOB=VALUE...` sets the layout compared with instead of the baseline's (one layout
against the next: `--out` keeps it apart from the file above). A knob that is not the space's is set
on the run's config as the space's quality runs set it (`QualityRuns.config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cubic.space.search_space import load_space  # noqa: E402
from cubic_harness.trial import run_trial  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "quality_layout.json"
SPACE = Path(__file__).resolve().parent.parent / "search_spaces" / "dlrm_cpu.yaml"
MODELS = {  # name -> the numerics over the baseline's
    "baseline (fp32)": {},
    "fp16 tables, bf16 dense, fp16 comm": {
        "emb_precision": "fp16", "dense_precision": "bf16", "comm_precision": "fp16"},
}


def parse_layout(items: list[str]) -> dict[str, str | int]:
    out: dict[str, str | int] = {}
    for item in items:
        k, _, v = item.partition("=")
        out[k] = int(v) if v.isdigit() else v
    return out


def knobs_of(space, layout: dict[str, str | int]) -> dict[str, str | int]:
    """The layout's values of the space's knobs (the rest are set on the config)."""
    return {k: v for k, v in layout.items() if k in space.knobs}


def show(data: dict, con: Console) -> None:
    """The layout's cost to each model's eval NE, its seconds saved, and the verdict it leaves
    alone: each model's paired difference from the baseline model, in either layout."""
    rows, layout = data["rows"], data["rows"][0]["layout"]
    seeds = len(rows[0]["paired_diff"])
    against = rows[0].get("against") or "the baseline's"
    tab = Table(title=f"quality runs in the layout {layout} vs {against} ({seeds} seeds)")
    ref = "the layout against" if rows[0].get("against") else "baseline layout"
    for col in ("model", "eval NE diff per seed", "max |diff|", ref, "quality layout",
                "x sooner"):
        tab.add_column(col, justify="right")
    for r in rows:
        tab.add_row(r["model"], ", ".join(f"{d:+.4%}" for d in r["paired_diff"]),
                    f"{max(abs(d) for d in r['paired_diff']):.4%}",
                    f"{r['median_wall_s']['baseline layout']:.1f} s",
                    f"{r['median_wall_s']['quality layout']:.1f} s", f"{r['speedup']:.2f}x")
    con.print(tab)
    verdict = Table(title=f"the gate's paired difference from {rows[0]['model']} "
                          f"(tolerance {data['tolerance']:.2%}), in either layout")
    for col in ("model", f"{ref}: mean (per seed)", "quality layout: mean (per seed)"):
        verdict.add_column(col, justify="right")
    for r in rows[1:]:
        cells = []
        for lay in ("baseline layout", "quality layout"):
            d = [c / b - 1 for c, b in zip(r["eval_ne"][lay], rows[0]["eval_ne"][lay], strict=True)]
            cells.append(f"{statistics.mean(d):+.4%} (" + ", ".join(f"{x:+.3%}" for x in d) + ")")
        verdict.add_row(r["model"], *cells)
    con.print(verdict)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--more", action="store_true",
                    help=f"run the seeds after those in {DATA.name} and add them to it")
    ap.add_argument("--show", action="store_true", help=f"only print the tables of {DATA.name}")
    ap.add_argument("--layout", nargs="*", default=None,
                    help="KNOB=VALUE... (default: the space's quality.layout)")
    ap.add_argument("--against", nargs="*", default=[],
                    help="KNOB=VALUE... the layout compared with (default: the baseline's)")
    ap.add_argument("--out", type=Path, default=DATA, help="the data file")
    args = ap.parse_args()
    con = Console(width=140)
    data_file: Path = args.out
    if args.show:
        show(json.loads(data_file.read_text()), con)
        return
    space = load_space(SPACE)
    qr = space.quality_runs
    layout = parse_layout(args.layout) if args.layout is not None else dict(qr.layout)
    if not layout:
        sys.exit("the space has no quality.layout; give --layout KNOB=VALUE")
    against = parse_layout(args.against)
    bare = dataclasses.replace(qr, layout={})  # each arm's layout is the one it names, no more
    base = space.baseline_params()
    before = {r["model"]: r for r in json.loads(data_file.read_text())["rows"]} if args.more else {}
    rows = []
    for name, numerics in MODELS.items():
        old = before.get(name)
        if old is not None and (old["layout"], old.get("against", {})) != (layout, against):
            sys.exit(f"{data_file.name} holds the layout {old['layout']} against "
                     f"{old.get('against', {})}, not {layout} against {against}")
        runs: dict[str, list[tuple[float, float]]] = {
            k: list(zip(old["eval_ne"][k], old["wall_s"][k], strict=True)) if old else []
            for k in ("baseline layout", "quality layout")}
        first = len(runs["baseline layout"])
        for seed in range(first, first + args.seeds):
            for label, over in (("baseline layout", against), ("quality layout", layout)):
                cfg = bare.config(space.config({**base, **numerics, **knobs_of(space, over)}), seed)
                cfg = cfg.replace(**{k: v for k, v in over.items() if k not in space.knobs})
                t0 = time.perf_counter()
                res = run_trial(cfg)
                wall = time.perf_counter() - t0
                if res.status != "ok":
                    sys.exit(f"{name} {label} seed {seed}: {res.status} {res.error}")
                ne = float(res.extra["eval_ne"])
                runs[label].append((ne, wall))
                con.print(f"{name} | {label} seed {seed}: eval NE {ne:.5f}, {wall:.1f} s",
                          highlight=False)
        diffs = [(q[0] - b[0]) / b[0]
                 for b, q in zip(runs["baseline layout"], runs["quality layout"], strict=True)]
        walls = {k: statistics.median(w for _, w in v) for k, v in runs.items()}
        rows.append({"model": name, "numerics": numerics, "layout": layout, "against": against,
                     "eval_ne": {k: [ne for ne, _ in v] for k, v in runs.items()},
                     "wall_s": {k: [w for _, w in v] for k, v in runs.items()},
                     "paired_diff": diffs, "median_wall_s": walls,
                     "speedup": walls["baseline layout"] / walls["quality layout"]})
    data_file.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "tolerance": qr.tolerance,
                                     "rows": rows}, indent=1))
    show(json.loads(data_file.read_text()), con)
    con.print(f"wrote {data_file}")


if __name__ == "__main__":
    main()
