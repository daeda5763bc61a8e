"""Held-out quality of numerics changes on the default CPU workload: eval NE after a quality budget.

Every configuration trains the same non-repeating sample stream (the `small` workload with a sample
cycle longer than the budget) for `--budget` samples, then is evaluated on held-out samples it never
trained on (TrialConfig.eval_samples: eval NE and AUC, harness/train.py `evaluate`). Each runs with
`--seeds` data/initialisation seeds; differences are paired by seed (the same data and teacher). The
baseline's seed-to-seed spread is the noise floor a quality gate has to live with.

    python benchmarks/bench_quality.py [--budget 524288] [--seeds 3] [--curve] [--only A,B] [--workload PRESET]
                                       [--world W] [--batch B] [--out F]

--world W: W ranks (oversubscribed here), so 2D's variants (groups of 1) train W replicas apart and merge every
k steps: the sync interval's quality with more replicas than this machine has cores.

--curve first prints the baseline's eval NE at growing budgets (how the budget was chosen).
Writes benchmarks/data/quality_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cubic.space.lr_scaling import apply  # noqa: E402
from cubic.space.search_space import load_space  # noqa: E402
from cubic_harness.config import TrialConfig  # noqa: E402
from cubic_harness.trial import run_trial  # noqa: E402
from cubic_harness.workload import Workload  # noqa: E402

VARIANTS: dict[str, tuple[dict, str]] = {  # name -> (knobs, lr scaling rule)
    "baseline": ({}, "none"),
    "column_wise (layout only)": ({"sharding": "column_wise"}, "none"),
    "SGD tables": ({"emb_optimizer": "sgd"}, "none"),
    "fp16 tables": ({"emb_precision": "fp16"}, "none"),
    "bf16 dense": ({"dense_precision": "bf16"}, "none"),
    "bf16 comm": ({"comm_precision": "bf16"}, "none"),
    "fp16 comm": ({"comm_precision": "fp16"}, "none"),
    "fp16 all-reduce": ({"allreduce_comm_precision": "fp16"}, "none"),
    "bf16 all-reduce": ({"allreduce_comm_precision": "bf16"}, "none"),
    "2x batch": ({"batch_size": 2048}, "none"),
    "2x batch, sqrt lr": ({"batch_size": 2048}, "sqrt"),
    "2x batch, linear lr": ({"batch_size": 2048}, "linear"),
    "4x batch": ({"batch_size": 4096}, "none"),
    "4x batch, sqrt lr": ({"batch_size": 4096}, "sqrt"),
    "4x batch, linear lr": ({"batch_size": 4096}, "linear"),
    # 2D sparse parallelism on the 2 ranks: groups of 1, 2 replicas training apart and merging every k steps
    # (weight_avg): the sync interval that decides a step across data centers (bench_scale_across.py)
    **{f"2D k={k}": ({"sharding_group_size": 1, "sparse_sync": "weight_avg", "sparse_sync_interval": k}, "none")
       for k in (1, 8, 32, 128)},
    # half-precision tables in 2D: their merge averages the rows in place (transport.averages_in_place)
    **{f"2D k={k} fp16 tables": ({"sharding_group_size": 1, "sparse_sync": "weight_avg", "sparse_sync_interval": k,
                                   "emb_precision": "fp16"}, "none") for k in (1, 8)},
}


def quality_cfg(base: TrialConfig, knobs: dict, rule: str, budget: int, eval_samples: int, seed: int) -> TrialConfig:
    cfg = apply(base.replace(**knobs), base, rule)
    steps = max(2, budget // cfg.global_batch)
    return cfg.replace(warmup_steps=1, measure_steps=steps - 1, windows=1, eval_samples=eval_samples, seed=seed,
                       timeout_s=1800).validate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=1 << 19, help="training samples per quality run")
    ap.add_argument("--eval-samples", type=int, default=1 << 16)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--curve", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "quality_cpu.json")
    ap.add_argument("--workload", default="", help="a preset instead of the default space's (e.g. small)")
    ap.add_argument("--world", type=int, default=0, help="ranks (default: the space's 2); 2D's variants then train "
                    "that many replicas, oversubscribing this machine's cores (quality runs judge no speed)")
    ap.add_argument("--batch", type=int, default=0, help="batch per rank (default: the space's)")
    a = ap.parse_args()
    con = Console()
    space = load_space(ROOT / "search_spaces" / "dlrm_cpu.yaml")
    wl = Workload.preset(a.workload) if a.workload else space.baseline.workload
    wl = Workload.from_dict({**wl.to_dict(), "sample_cycle": 1 << 26})
    base = space.baseline.replace(workload=wl, **({"world_size": a.world} if a.world else {}),
                                  **({"batch_size": a.batch} if a.batch else {}))
    old = json.loads(a.out.read_text()) if a.out.exists() else {}
    out: dict = {"budget": a.budget, "eval_samples": a.eval_samples, "seeds": a.seeds,
                 "world_size": base.world_size, "batch_size": base.batch_size,
                 "curve": old.get("curve", []), "runs": {}}
    if a.curve:
        out["curve"] = []
    if a.curve:  # (written over the earlier curve; without --curve the earlier one is kept)
        for b in (1 << 16, 1 << 18, 1 << 19, 1 << 20, 1 << 21):
            r = run_trial(quality_cfg(base, {}, "none", b, a.eval_samples, 0))
            con.log(f"curve: {b:>9,} samples: eval NE {r.extra.get('eval_ne')} AUC {r.extra.get('eval_auc')} "
                    f"({r.env.get('wall_s')} s) {r.error}")
            out["curve"].append({"samples": b, "eval_ne": r.extra.get("eval_ne"), "eval_auc": r.extra.get("eval_auc"),
                                 "wall_s": r.env.get("wall_s")})
    names = [n for n in VARIANTS if not a.only or n in a.only.split(",")]
    for seed in range(a.seeds):  # seed-major: drift of the machine hits every variant alike
        for n in names:
            knobs, rule = VARIANTS[n]
            cfg = quality_cfg(base, knobs, rule, a.budget, a.eval_samples, seed)
            r = run_trial(cfg)
            con.log(f"seed {seed} {n}: {r.status} eval NE {r.extra.get('eval_ne')} AUC {r.extra.get('eval_auc')} "
                    f"lr {cfg.emb_lr:.4g}/{cfg.dense_lr:.4g} ({r.env.get('wall_s')} s) {r.error}")
            out["runs"].setdefault(n, []).append({"seed": seed, "status": r.status, "eval_ne": r.extra.get("eval_ne"),
                                                  "eval_auc": r.extra.get("eval_auc"), "wall_s": r.env.get("wall_s"),
                                                  "emb_lr": cfg.emb_lr, "dense_lr": cfg.dense_lr})
            a.out.write_text(json.dumps(out, indent=1))
    if "baseline" not in out["runs"]:
        return
    b = {x["seed"]: x["eval_ne"] for x in out["runs"]["baseline"]}
    sd = statistics.stdev(b.values()) if len(b) > 1 else float("nan")
    tab = Table(title=f"eval NE after {a.budget:,} samples (held-out {a.eval_samples:,}), {a.seeds} seeds; baseline "
                f"seed-to-seed sd {sd / statistics.mean(b.values()):.3%}")
    for c in ("config", "eval NE (mean)", "paired diff vs baseline (mean, min..max)", "s.e.", "eval AUC (mean)"):
        tab.add_column(c)
    for n, rs in out["runs"].items():
        ok = [x for x in rs if x["eval_ne"] is not None]
        if not ok:
            tab.add_row(n, "failed", "", "", "")
            continue
        d = [(x["eval_ne"] - b[x["seed"]]) / b[x["seed"]] for x in ok]
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        tab.add_row(n, f"{statistics.mean(x['eval_ne'] for x in ok):.5f}",
                    f"{statistics.mean(d):+.3%} ({min(d):+.3%}..{max(d):+.3%})", f"{se:.3%}",
                    f"{statistics.mean(x['eval_auc'] for x in ok):.4f}")
    con.print(tab)


if __name__ == "__main__":
    main()
