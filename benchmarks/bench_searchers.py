"""Compare cubic's searchers on landscapes where every configuration's throughput is known.

Two landscapes (docs/architecture.md "The searcher goal": cubic must need at most half the trials of TPE to
reach 98% of the best):
  (a) cpu:   a real tabular landscape measured once on this machine (`measure`): every configuration
             of the reduced space benchmarks/data/landscape_cpu_space.yaml, 2 repeats each, stored
             as benchmarks/data/landscape_cpu.parquet. A trial draws one of the repeats (real noise).
  (b) model: the simulator (cubic_harness.sim, priced on clusters/local.yaml) over a larger space
             (benchmarks/data/landscape_model_space.yaml), distorted by hidden per-knob effects and
             pairwise interactions (seeded), so the model the proxy sees as features is informative but
             not the truth - as on real hardware - with 3% log-normal measurement noise and the most
             memory-hungry quarter of the configurations failing (OOM).
Searchers run through their Optuna samplers exactly as `cubic tune` runs them, but each trial is a
table lookup, so a full comparison takes minutes. Reported per searcher, over seeds: the median
number of trials to reach 98% of the best configuration (by true value), the fraction of seeds
that reached it, and the median best (fraction of the optimum) after 10, 20 and 30 trials.

    python benchmarks/bench_searchers.py measure            # once: ~15 min of real trials
    python benchmarks/bench_searchers.py run [--seeds 10]   # the comparison (minutes)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import optuna
import pandas as pd

from cubic.search.samplers import SEARCHERS, distributions, make_sampler
from cubic.space.search_space import SearchSpace, load_space

DATA = Path(__file__).parent / "data"
NO_FEATURES = "cubic-nofeat"  # `--searchers cubic,cubic-nofeat`: the proxy with vs without the simulator
CPU_SPACE = DATA / "landscape_cpu_space.yaml"
CPU_TABLE = DATA / "landscape_cpu.parquet"
MODEL_SPACE = DATA / "landscape_model_space.yaml"
TARGET = 0.98
CHECKPOINTS = (10, 20, 30)


# ====================================================================== (a) measure the real landscape
def measure(repeats: int, out: Path) -> None:
    """Run every configuration of the reduced space `repeats` times (real trials, sequential)."""
    from cubic_harness.trial import run_trial

    space = load_space(CPU_SPACE)
    rows = []
    t0 = time.time()
    tuples = space.all_tuples or []
    for rep in range(repeats):
        for i, tup in enumerate(tuples):
            params = space.params_of(tup)
            cfg = space.config(params)
            t = time.time()
            r = run_trial(cfg)
            rows.append({**params, "repeat": rep, "status": r.status, "error": r.error, "qps": r.qps,
                         "qps_cv": r.qps_cv, "step_ms_p50": r.step_ms_p50, "peak_mem_mb": r.peak_mem_mb,
                         "ne": r.ne, "wall_s": time.time() - t})
            print(f"[{time.time() - t0:6.0f}s] rep {rep} {i + 1}/{len(tuples)} {params} {r.status} "
                  f"{r.qps:,.0f} qps", flush=True)
    df = pd.DataFrame(rows)
    meta = {"space": str(CPU_SPACE.relative_to(DATA.parent.parent)), "repeats": repeats,
            "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": str(__import__("os").cpu_count()),
            "python": sys.version.split()[0], "torch": __import__("torch").__version__,
            "machine_time_s": round(time.time() - t0)}
    df.attrs["cubic"] = meta
    table = __import__("pyarrow").Table.from_pandas(df, preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"cubic": json.dumps(meta).encode()})
    __import__("pyarrow.parquet").parquet.write_table(table, out)
    print(f"wrote {out} ({len(df)} rows, {meta['machine_time_s']} s)")


# ====================================================================== landscapes
class Landscape:
    """true[tup] = expected qps (0 = infeasible); observe(tup, rng) = one noisy measurement or None."""

    def __init__(self, name: str, space: SearchSpace, true: dict[tuple, float],
                 samples: dict[tuple, list[float]] | None = None, noise: float = 0.0,
                 features: dict[tuple, dict[str, float]] | None = None) -> None:
        self.name, self.space, self.true, self.samples, self.noise = name, space, true, samples, noise
        self.features = features
        self.best = max(true.values())

    def observe(self, tup: tuple, rng: np.random.Generator) -> float | None:
        if self.true.get(tup, 0.0) <= 0:
            return None
        if self.samples:
            s = self.samples[tup]
            return s[int(rng.integers(len(s)))]
        return self.true[tup] * math.exp(self.noise * rng.standard_normal())

    def feature_fn(self):
        """Precomputed simulator features (the proxy's derived inputs) for this landscape's space."""
        if self.features is None:
            return None
        space, feats = self.space, self.features
        return lambda cfg: feats[space.tup({k: getattr(cfg, k) for k in space.knobs})]


def cpu_landscape(table: Path | None = None) -> Landscape:
    space = load_space(CPU_SPACE)
    df = pd.read_parquet(table or CPU_TABLE)
    samples: dict[tuple, list[float]] = {}
    true: dict[tuple, float] = {}
    for tup in space.all_tuples or []:
        m = np.ones(len(df), dtype=bool)
        for k, v in space.params_of(tup).items():
            m &= (df[k] == v).to_numpy()
        ok = df[m & (df["status"] == "ok").to_numpy()]
        samples[tup] = [float(q) for q in ok["qps"]]
        true[tup] = float(np.mean(samples[tup])) if len(ok) == int(m.sum()) and len(ok) else 0.0
    return Landscape("cpu (measured)", space, true, samples, features=_features(space))


def model_landscape(seed: int = 1234) -> Landscape:
    """Cost-model qps x hidden distortion (main effects + interactions), top-memory quarter infeasible."""
    space = load_space(MODEL_SPACE)
    feats = _features(space)
    rng = np.random.default_rng(seed)
    knobs = list(space.knobs.values())
    main = {(k.name, v): rng.normal(0, 0.12) for k in knobs for v in k.choices}
    pairs = [tuple(rng.choice(len(knobs), 2, replace=False)) for _ in range(4)]
    inter = {(i, j, a, b): rng.normal(0, 0.12) for i, j in pairs
             for a in knobs[i].choices for b in knobs[j].choices}
    mem = {t: f.get("mem_mb_per_rank", 0.0) for t, f in feats.items()}
    cap = float(np.quantile(list(mem.values()), 0.75))
    true = {}
    for t, f in feats.items():
        est = f.get("est_qps", float("nan"))
        if not math.isfinite(est) or mem[t] > cap:
            true[t] = 0.0
            continue
        d = sum(main[(k.name, v)] for k, v in zip(knobs, t, strict=True))
        d += sum(inter[(i, j, t[i], t[j])] for i, j in pairs)
        true[t] = est * math.exp(d)
    return Landscape("model (simulator, distorted)", space, true, noise=0.03, features=feats)


def _features(space: SearchSpace) -> dict[tuple, dict[str, float]]:
    from cubic_harness.sim.backend import features

    return {t: features(space.config(space.params_of(t))) for t in space.all_tuples or []}


# ====================================================================== search on a landscape
def run_searcher(land: Landscape, searcher: str, seed: int, n_trials: int) -> list[float]:
    """True value (fraction of the optimum) of each trial's configuration, in trial order."""
    space = land.space
    base = "cubic" if searcher == NO_FEATURES else searcher
    sampler = make_sampler(base, space, seed=seed, budget=n_trials)
    if base == "cubic":  # cubic-nofeat: the same proxy on the knobs alone (no simulator features or prior)
        sampler.proxy.features.fn = None if searcher == NO_FEATURES else land.feature_fn()  # type: ignore[attr-defined]
    study = optuna.create_study(direction="maximize", sampler=sampler)
    dists = distributions(space)
    rng = np.random.default_rng(10_000 + seed)
    out: list[float] = []
    for _ in range(n_trials):
        if sampler.should_stop(study):
            break
        trial = study.ask(dists)
        tup = space.tup(trial.params)
        y = land.observe(tup, rng)
        if y is None:
            trial.set_user_attr("status", "oom")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, y)
        out.append(land.true.get(tup, 0.0) / land.best)
    return out


def summarize(curves: list[list[float]], n_trials: int) -> dict[str, object]:
    reach, at = [], {c: [] for c in CHECKPOINTS}
    for cur in curves:
        best = np.maximum.accumulate(cur) if cur else np.zeros(1)
        hit = np.flatnonzero(best >= TARGET)
        reach.append(int(hit[0]) + 1 if len(hit) else math.inf)
        for c in CHECKPOINTS:
            at[c].append(float(best[min(c, len(best)) - 1]))
    med = statistics.median(reach)
    return {"trials_to_98": med, "reached": sum(math.isfinite(r) for r in reach) / len(reach),
            **{f"best@{c}": statistics.median(at[c]) for c in CHECKPOINTS}, "raw": reach}


def compare(lands: list[Landscape], searchers: list[str], seeds: int, n_trials: int) -> pd.DataFrame:
    rows = []
    for land in lands:
        for s in searchers:
            t0 = time.time()
            curves = [run_searcher(land, s, seed, n_trials) for seed in range(seeds)]
            summ = summarize(curves, n_trials)
            rows.append({"landscape": land.name, "configs": len(land.true), "searcher": s, **summ,
                         "seconds": round(time.time() - t0, 1)})
            print(f"{land.name:32} {s:7} to98={summ['trials_to_98']} reached={summ['reached']:.0%} "
                  f"raw={summ['raw']} ({time.time() - t0:.0f}s)", flush=True)
    return pd.DataFrame(rows)


def to_markdown(df: pd.DataFrame) -> str:
    head = ("| landscape | configs | searcher | median trials to 98% | seeds reaching 98% "
            "| best@10 | best@20 | best@30 |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in df.itertuples():
        t98 = "never" if not math.isfinite(r.trials_to_98) else f"{r.trials_to_98:g}"
        lines.append(f"| {r.landscape} | {r.configs} | {r.searcher} | {t98} | {r.reached:.0%} | "
                     f"{r._6:.3f} | {r._7:.3f} | {r._8:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    m = sub.add_parser("measure", help="measure the real CPU landscape (real trials)")
    m.add_argument("--repeats", type=int, default=2)
    m.add_argument("--out", type=Path, default=CPU_TABLE)
    r = sub.add_parser("run", help="compare the searchers (default)")
    r.add_argument("--seeds", type=int, default=10)
    r.add_argument("--trials", type=int, default=40)
    r.add_argument("--searchers", default=",".join(SEARCHERS))
    r.add_argument("--landscapes", default="cpu,model")
    r.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    r.add_argument("--cpu-table", type=Path, default=None, help="another measurement of the cpu landscape")
    args = ap.parse_args()
    if args.cmd == "measure":
        measure(args.repeats, args.out)
        return
    if args.cmd is None:
        args = r.parse_args([])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    lands = []
    for name in args.landscapes.split(","):
        if name == "cpu":
            if not CPU_TABLE.exists():
                sys.exit(f"{CPU_TABLE} is missing: run `python {sys.argv[0]} measure` first")
            lands.append(cpu_landscape(args.cpu_table))
        elif name == "model":
            lands.append(model_landscape())
        else:
            sys.exit(f"unknown landscape {name!r}; choose from cpu, model")
    df = compare(lands, args.searchers.split(","), args.seeds, args.trials)
    md = to_markdown(df)
    print(md)
    if args.out:
        args.out.write_text(md + "\n")


if __name__ == "__main__":
    main()
