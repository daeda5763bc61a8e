"""Per-sample weights (TorchRec's weighted features) in the embedding kernels: what they cost, side by side.

On the `small` workload's shape (8 tables x 200k x 64, batch 1024, pooling 20), one process, kernels interleaved
call by call, warm-up excluded, the median (min..max) of forward + fused backward/optimizer ms per call:

* `native` unweighted, `native` weighted: what scores add to cubic's kernel (a multiply per element, and the
  backward's sort keyed by id position, which then looks up each id's bag);
* `fbgemm` unweighted and weighted: the same for FBGEMM's TBE;
* with `--before REF`: `native` unweighted at git revision REF (its kernels loaded under another package name),
  so the unweighted path is compared before and after in the same run.

The order of the variants rotates every repeat (the first after a batch change meets its ids cold).

`--torchrec N`: also a model with two weighted tables beside two plain ones, on 2 ranks: in TorchRec (the TorchRec
backend, `harness/torchrec_trial.py`) with FBGEMM and with cubic's native kernel, and in cubic's harness with the
native and FBGEMM kernels; FBGEMM in TorchRec and both harness kernels also with the same tables unweighted;
alternating, N repeats each: samples/s, beside the simulator's prediction of each and of the unweighted over
weighted ratio (the validation of `weighted_cost`, which the kernel micro-measurements of `cubic calibrate` fit).

    python benchmarks/bench_weighted.py [--before REF] [--repeats 20] [--threads 1,2] [--dist zipf]
                                        [--torchrec N] [--out F]
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cubic_harness.data import make_batch
from cubic_harness.workload import Workload
from cubic_kernels import OptimSpec, make_kernel

ROOT = Path(__file__).resolve().parents[1]


def scratch() -> Path:
    """A temp folder that goes when the benchmark exits (its ranks have ended by then)."""
    folder = Path(tempfile.mkdtemp(prefix="cubic-bench-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def kernels_at(ref: str) -> str:
    """The kernels package at git revision `ref`, importable as `cubic_kernels_<commit>`: its files written to a
    temp folder with `cubic_kernels` renamed in their imports (numba caches it beside those files). Named by the
    commit, as `HEAD~3` or a branch with `/` is no module name."""
    sha = subprocess.run(["git", "rev-parse", "--short", f"{ref}^{{commit}}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    name = f"cubic_kernels_{sha}"
    folder = scratch() / name
    folder.mkdir()
    files = subprocess.run(["git", "ls-tree", "--name-only", ref, "kernels/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        if f.endswith(".py"):
            text = subprocess.run(["git", "show", f"{ref}:{f}"], cwd=ROOT, check=True, capture_output=True,
                                  text=True).stdout
            (folder / Path(f).name).write_text(text.replace("cubic_kernels", name))
    sys.path.insert(0, str(folder.parent))
    return name


MODEL = """
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig


class Scored(nn.Module):
    \"\"\"Two plain tables and two weighted ones (id-score lists), 200k x 64 each, and a small dense part.\"\"\"

    def __init__(self):
        super().__init__()
        cfg = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=200_000, embedding_dim=64, feature_names=[f"f{i}"])
               for i in range(4)]
        self.ebc = EmbeddingBagCollection(tables=cfg[:2])
        self.wbc = EmbeddingBagCollection(tables=cfg[2:], is_weighted=True)
        self.tower = nn.Sequential(nn.Linear(13, 64), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(64 * 5, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense, kjt):
        a, b = self.ebc(kjt).to_dict(), self.wbc(kjt).to_dict()
        return self.head(torch.cat([self.tower(dense), a["f0"], a["f1"], b["f2"], b["f3"]], dim=1))


class Plain(Scored):
    \"\"\"The same four tables, none weighted.\"\"\"

    def __init__(self):
        super().__init__()
        cfg = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=200_000, embedding_dim=64, feature_names=[f"f{i}"])
               for i in range(4)]
        self.ebc = EmbeddingBagCollection(tables=cfg)
        self.wbc = None

    def forward(self, dense, kjt):
        a = self.ebc(kjt).to_dict()
        return self.head(torch.cat([self.tower(dense), *(a[f"f{i}"] for i in range(4))], dim=1))


def scored():
    return Scored()


def plain():
    return Plain()
"""


RANKS, BATCH = 2, 1024  # the weighted model's trials


def torchrec_runs(repeats: int, dist: str, console: Console,
                  cluster: Path) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Samples/s of the weighted model per variant (see the module docstring), alternating `repeats` times, and
    the simulator's prediction of each on `cluster` (TorchRec's by its framework profile, where it has one): the
    kernel micro-measurements its `weighted_cost` came from never ran these trials."""
    from cubic_harness.config import TrialConfig
    from cubic_harness.sim.backend import simulate
    from cubic_harness.sim.cluster import load_cluster
    from cubic_harness.torchrec_import import import_workload
    from cubic_harness.torchrec_trial import run_torchrec
    from cubic_harness.trial import run_trial

    folder = scratch()
    (folder / "scoredmodel.py").write_text(MODEL)
    sys.path.insert(0, str(folder))
    wl = import_workload("scoredmodel:scored", dense_features=13)
    wl = dataclasses.replace(wl, tables=[dataclasses.replace(t, pooling=20, id_dist=dist) for t in wl.tables])
    cfg = TrialConfig(workload=wl, world_size=RANKS, batch_size=BATCH, sharding="table_wise", warmup_steps=3,
                      measure_steps=24, windows=3, timeout_s=300)
    plain = dataclasses.replace(wl, tables=[dataclasses.replace(t, weighted=False) for t in wl.tables],
                                factory="scoredmodel:plain", collections=1)  # (one collection)
    cfgs = {"TorchRec fbgemm": ("torchrec", cfg.replace(kernel="fbgemm")),
            "TorchRec fbgemm, unweighted": ("torchrec", cfg.replace(kernel="fbgemm", workload=plain)),
            "TorchRec native": ("torchrec", cfg.replace(kernel="native")),
            "harness native": ("harness", cfg.replace(kernel="native")),
            "harness native, unweighted": ("harness", cfg.replace(kernel="native", workload=plain)),
            "harness fbgemm": ("harness", cfg.replace(kernel="fbgemm")),
            "harness fbgemm, unweighted": ("harness", cfg.replace(kernel="fbgemm", workload=plain))}
    local = load_cluster(cluster)
    profiles = {"harness": local, **({"torchrec": local.for_framework("torchrec")} if local.frameworks else {})}
    predicted = {k: simulate(c, profiles[fw]).qps for k, (fw, c) in cfgs.items() if fw in profiles}
    runs = {k: (lambda c=c: run_torchrec(c, cwd=str(folder))) if fw == "torchrec" else (lambda c=c: run_trial(c))
            for k, (fw, c) in cfgs.items()}
    qps: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(repeats):
        for k in list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]:
            res = runs[k]()
            if res.status != "ok":
                raise SystemExit(f"{k} failed: {res.error}")
            qps[k].append(res.qps)
            console.print(f"{k}: {res.qps:,.0f} samples/s")
    return qps, predicted


Variants = dict[str, tuple[object, bool]]  # name -> (kernel, whether it is passed the scores)


def kernel_variants(wl: Workload, before: str) -> Variants:
    """Each kernel unweighted and weighted, loaded with the same tables; `before`: also the unweighted native
    kernel at that git revision."""
    rows, dims = [t.rows for t in wl.tables], [t.dim for t in wl.tables]
    init = [torch.randn(r, d, generator=torch.Generator().manual_seed(t)) * 0.01
            for t, (r, d) in enumerate(zip(rows, dims, strict=True))]
    opt = OptimSpec("rowwise_adagrad", lr=0.01)
    variants: Variants = {}
    for name in ("native", "fbgemm"):
        k = make_kernel(name, rows, dims, optim=opt)
        k.load(init)
        w = make_kernel(name, rows, dims, optim=opt)
        w.load(init)
        variants[f"{name}"], variants[f"{name} weighted"] = (k, False), (w, True)
    if before:
        old = importlib.import_module(kernels_at(before))
        k = old.make_kernel("native", rows, dims, optim=old.OptimSpec("rowwise_adagrad", lr=0.01))
        k.load(init)
        variants[f"native at {before}"] = (k, False)
    return variants


def time_variants(variants: Variants, batches: list, grad: torch.Tensor,
                  repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(forward ms, backward+optimizer ms) of each variant per repeat, after 3 warm-up rounds."""
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    names = list(variants)
    for i in range(3 + repeats):
        b = batches[i % len(batches)]
        # the order rotates every repeat: the first kernel after a batch change meets its ids cold
        for v in names[i % len(names):] + names[:i % len(names)]:
            k, weighted = variants[v]
            psw = [b.scores] if weighted else []
            t0 = time.perf_counter()
            k.forward(b.ids, b.offsets, *psw)
            t1 = time.perf_counter()
            k.backward_update(b.ids, b.offsets, grad, *psw)
            t2 = time.perf_counter()
            if i >= 3:
                times[v].append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))
    return times


def add_kernel_rows(table: Table, nt: int, times: dict[str, list[tuple[float, float]]]) -> None:
    """One row per variant at `nt` threads; a weighted (or older) variant beside its unweighted one."""
    step = {v: [f + b for f, b in ts] for v, ts in times.items()}
    med = {v: statistics.median(s) for v, s in step.items()}
    for v, ts in times.items():
        base = v.replace(" weighted", "") if v.endswith("weighted") else "native" if " at " in v else ""
        ratio = f"{med[v] / med[base]:.2f}x" if base else ""
        fw, bw = [f for f, _ in ts], [b for _, b in ts]
        table.add_row(str(nt), v, f"{statistics.median(fw):.2f}", f"{statistics.median(bw):.2f}",
                      f"{med[v]:.2f} ({min(step[v]):.2f}..{max(step[v]):.2f})", ratio,
                      end_section=v == list(times)[-1])


def print_torchrec(console: Console, torchrec: dict[str, list[float]], predicted: dict[str, float],
                   dist: str, repeats: int, cluster: Path) -> None:
    """The weighted model's samples/s per variant beside the simulator's prediction."""
    t = Table(title=f"{RANKS} ranks, 2 plain + 2 weighted tables (200k x 64, {dist}, 20 ids a bag), "
                    f"batch {BATCH}: samples/s, median (min..max) of {repeats}")
    for col in ("variant", "samples/s", "over TorchRec fbgemm", "predicted", "unweighted over weighted",
                "predicted ratio", "weighting adds ms/step", "predicted ms"):
        t.add_column(col, justify="right")
    ref = statistics.median(torchrec["TorchRec fbgemm"])
    samples = RANKS * BATCH  # a step's
    for k, v in torchrec.items():
        plain = torchrec.get(f"{k}, unweighted")
        pw, pu = predicted.get(k), predicted.get(f"{k}, unweighted")
        ratio = f"{statistics.median(plain) / statistics.median(v):.2f}x" if plain else ""
        added = f"{samples * 1e3 * (1 / statistics.median(v) - 1 / statistics.median(plain)):.1f}" if plain else ""
        t.add_row(k, f"{statistics.median(v):,.0f} ({min(v):,.0f}..{max(v):,.0f})",
                  f"{statistics.median(v) / ref:.2f}x", f"{pw:,.0f}" if pw else "-", ratio,
                  f"{pu / pw:.2f}x" if pu and pw else "", added,
                  f"{samples * 1e3 * (1 / pw - 1 / pu):.1f}" if pu and pw else "")
    console.print(t)
    console.print(f"predicted: the simulator on {cluster} (TorchRec's framework profile for TorchRec); "
                  "its weighted_cost and collection_ms are calibrate's micro-measurements, not fitted on these "
                  "trials. Weighting adds: the weighted step's ms minus the unweighted one's (the ratio also "
                  "carries the simulator's level error; the added time does not)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="", help="git revision whose unweighted native kernel runs beside")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dist", default="zipf", choices=["uniform", "zipf"])
    ap.add_argument("--torchrec", type=int, default=0, help="repeats of the TorchRec runs (0: none)")
    ap.add_argument("--cluster", type=Path, default=ROOT / "clusters" / "local.yaml",
                    help="the cluster file that prices the --torchrec runs (TorchRec's need its torchrec profile: "
                         "`cubic calibrate --framework torchrec`)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    console = Console(width=140)

    wl = Workload.small()
    # every table weighted: the batches carry each id's score (harness/data.py), passed only to the weighted variants
    wl = dataclasses.replace(wl, tables=[dataclasses.replace(t, id_dist=args.dist, weighted=True) for t in wl.tables])
    B = 1024
    batches = [make_batch(wl, 0, s * B, B) for s in range(4)]
    grad = torch.randn(B, sum(t.dim for t in wl.tables), generator=torch.Generator().manual_seed(1)) * 1e-3
    variants = kernel_variants(wl, args.before)

    console.print(f"{wl.name}, {args.dist} ids: {len(wl.tables)} tables x {wl.tables[0].rows} x "
                  f"{wl.tables[0].dim}, batch {B}; load average {os.getloadavg()[0]:.1f}")
    table = Table(title=f"ms per step (forward + backward/optimizer): median (min..max), {args.repeats} "
                        "interleaved repeats after 3 warm-up")
    for col in ("threads", "variant", "forward", "backward+opt", "step", "over unweighted"):
        table.add_column(col, justify="right")
    out: dict[str, dict] = {}
    for nt in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(nt)
        times = time_variants(variants, batches, grad, args.repeats)
        out[str(nt)] = {v: {"forward_ms": [f for f, _ in ts], "backward_ms": [b for _, b in ts]}
                        for v, ts in times.items()}
        add_kernel_rows(table, nt, times)
    console.print(table)
    console.print("over unweighted: a weighted variant's median step over its kernel's unweighted one; "
                  "`native at REF` over today's unweighted native (above 1: today's is faster)")
    torchrec, predicted = torchrec_runs(args.torchrec, args.dist, console, args.cluster) if args.torchrec else ({}, {})
    if torchrec:
        print_torchrec(console, torchrec, predicted, args.dist, args.torchrec, args.cluster)
    console.print(f"load average at end {os.getloadavg()[0]:.1f} (on 2 cores, >1: other work shared them)")
    if args.out:
        Path(args.out).write_text(json.dumps({"workload": wl.name, "dist": args.dist, "batch": B,
                                              "repeats": args.repeats, "before": args.before, "runs": out,
                                              "torchrec_qps": torchrec, "predicted_qps": predicted}, indent=1))


if __name__ == "__main__":
    main()
