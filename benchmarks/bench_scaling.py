"""Full model parallelism vs 2D sparse parallelism from 64 to 4,096 GPUs, on the simulator (issue 21).

Weak scaling (1,024 samples per GPU) of MLPerf's DLRM-DCNv2 with its tables 16x longer (1.6 TB of
fp32 tables: the size class of the 2D paper's 1.7 TB model) on clusters/h100-4096.yaml (512 DGX H100
nodes, 3,072-GPU pods, 7:1 above). For each world size: full model parallelism (one sharding group of
all GPUs) and 2D groups of 64, 256 and 1,024 GPUs, each with the best of the harness's
shardings (table-, column-wise, auto) and, for 2D, of its replica syncs (weight averaging every
step as TorchRec's DMPCollection does by default, or every 16 steps; gradient all-gather),
intra-node placement. Out of memory is marked. Writes benchmarks/data/scaling.json and scaling.png
(samples/s and memory per GPU vs GPUs, and the per-phase breakdown that explains the crossover).

    .venv/bin/python benchmarks/bench_scaling.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from harness.config import TrialConfig, TrialResult  # noqa: E402
from harness.sim.backend import simulate  # noqa: E402
from harness.sim.cluster import load_cluster, shipped_cluster  # noqa: E402
from harness.workload import Workload  # noqa: E402

WORLDS = (64, 128, 256, 512, 1024, 2048, 4096)
GROUPS = (0, 64, 256, 1024)  # 0: full model parallelism
SHARDINGS = ("table_wise", "column_wise", "auto")
SYNCS = (("weight_avg", 1), ("weight_avg", 16), ("grad_allreduce", 1))  # 2D: the replicas' sync
DATA = Path(__file__).resolve().parent / "data"


def big_model() -> Workload:
    wl = Workload.preset("mlperf-dcnv2")
    return dataclasses.replace(wl, name="mlperf-dcnv2-x16", tables=[dataclasses.replace(t, rows=t.rows * 16)
                                                                     for t in wl.tables])


def best(world: int, group: int, cluster, wl: Workload) -> tuple[str, TrialResult]:
    """The fastest sharding that fits (else the least-over OOM) for one world size and group."""
    runs = []
    syncs = SYNCS if group else SYNCS[:1]
    for sh in SHARDINGS:
        for sync, k in syncs:
            cfg = TrialConfig(workload=wl, world_size=world, sharding_group_size=group, batch_size=1024,
                              device="cuda", kernel="triton", sharding=sh, emb_precision="fp16",
                              dense_precision="bf16", comm_precision="bf16", pipeline_depth=1, ranks_per_node=8,
                              sparse_sync=sync, sparse_sync_interval=k)
            runs.append((f"{sh}, {sync}" + (f" k={k}" if sync == "weight_avg" else "") if group else sh,
                         simulate(cfg, cluster)))
    ok = [r for r in runs if r[1].status == "ok"]
    if ok:
        return max(ok, key=lambda r: r[1].qps)
    return min(runs, key=lambda r: r[1].peak_mem_mb)


def main() -> None:
    cluster = load_cluster(shipped_cluster("h100-4096.yaml"))
    wl = big_model()
    tb = sum(t.rows * t.dim * 4 for t in wl.tables) / 1e12
    rows: dict = {}
    for w in WORLDS:
        for g in GROUPS:
            if g and g >= w:
                continue
            sh, r = best(w, g, cluster, wl)
            rows[(w, g)] = {"sharding": sh, "status": r.status, "qps": r.qps, "mem_gb": r.peak_mem_mb / 1024,
                            "breakdown_ms": r.breakdown_ms, "comm_ms": (r.extra.get("sim") or {}).get("comm_ms"),
                            "error": r.error}
    tab = Table(title=f"{wl.name} ({tb:.1f} TB fp32 tables), 1,024 samples per GPU, h100-4096: best sharding and "
                "sync per cell; M samples/s (memory per GPU) [its sharding, sync]")
    tab.add_column("GPUs", justify="right")
    for g in GROUPS:
        tab.add_column("full model parallel" if g == 0 else f"2D, groups of {g}", justify="right")
    for w in WORLDS:
        cells = []
        for g in GROUPS:
            r = rows.get((w, g))
            cells.append("-" if r is None else (f"{r['qps'] / 1e6:,.1f}M ({r['mem_gb']:.0f} GB) [{r['sharding']}]"
                                                if r["status"] == "ok" else f"OOM ({r['mem_gb']:.0f} GB)"))
        tab.add_row(str(w), *cells)
    Console(width=160).print(tab)
    best_2d = {w: max((rows[(w, g)]["qps"] for g in GROUPS[1:] if (w, g) in rows and rows[(w, g)]["status"] == "ok"),
                      default=0.0) for w in WORLDS}
    if best_2d[256] and best_2d[4096]:
        eff = best_2d[4096] / best_2d[256] / 16
        print(f"best 2D scaling efficiency 256 -> 4,096 GPUs: {eff:.0%} (the 2D paper: ~90%)")
    (DATA / "scaling.json").write_text(json.dumps({"workload": wl.name, "tables_tb": tb, "rows": [
        {"gpus": w, "group": g, **v} for (w, g), v in rows.items()]}, indent=1))
    plot(rows)


def plot(rows: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for g in GROUPS:
        pts = [(w, rows[(w, g)]) for w in WORLDS if (w, g) in rows]
        label = "full model parallel" if g == 0 else f"2D, groups of {g}"
        ok = [(w, r) for w, r in pts if r["status"] == "ok"]
        line = axes[0].plot([w for w, _ in ok], [r["qps"] / 1e6 for _, r in ok], marker="o", label=label)[0]
        for w, r in pts:
            if r["status"] != "ok":
                axes[0].scatter([w], [axes[0].get_ylim()[0] if ok else 1], marker="x", color=line.get_color(), s=80)
        axes[1].plot([w for w, _ in pts], [r["mem_gb"] for _, r in pts], marker="o", label=label,
                     color=line.get_color())
    axes[1].axhline(80, color="red", linestyle="--", label="H100 memory (80 GB)")
    for ax, title, unit in ((axes[0], "throughput (x = out of memory)", "M samples/s"),
                            (axes[1], "memory per GPU", "GB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=8)
    w = 4096
    phases = ("emb_fwd", "emb_bwd", "comm", "dense", "optim")
    labels, bottoms = [], None
    for i, g in enumerate(GROUPS):
        r = rows.get((w, g))
        if r is None:
            continue
        labels.append("full MP" if g == 0 else f"G={g}")
        bottom = 0.0
        for j, p in enumerate(phases):
            v = r["breakdown_ms"].get(p, 0.0) if r["breakdown_ms"] else 0.0
            axes[2].bar(i, v, bottom=bottom, color=f"C{j}", label=p if i == 0 else None)
            bottom += v
    del bottoms
    axes[2].set_xticks(range(len(labels)), labels)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("ms per step")
    axes[2].set_title("4,096 GPUs: where the step goes")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DATA / "scaling.png", dpi=110)


if __name__ == "__main__":
    main()
