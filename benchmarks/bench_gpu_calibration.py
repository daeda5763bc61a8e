"""Does `cubic calibrate` on one GPU predict what that GPU runs? Each cluster file (a calibration
written there, or a preset resized to one GPU) prices measurements it was not fitted on:

- whole harness trials on that GPU (`cubic trial`, benchmarks/gpu_suite.sh `trials`): step time;
- MLPerf DLRM-DCNv2's dense part (benchmarks/gpu_dense.py): forward + backward replayed as one CUDA
  graph (the device's time, as HugeCTR's submissions run it) at MLPerf's per-GPU batches.

    .venv/bin/python benchmarks/bench_gpu_calibration.py            # the H200 data in benchmarks/data

Writes benchmarks/data/gpu_h200/calibrate/validation.json and prints one table per file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cubic_harness.config import TrialConfig
from cubic_harness.dense_cost import dense_cost
from cubic_harness.sim import step
from cubic_harness.sim.backend import simulate
from cubic_harness.sim.cluster import Cluster, load_cluster, shipped_cluster
from cubic_harness.sim.rates import speeds
from cubic_harness.workload import Workload

DATA = Path(__file__).resolve().parent / "data" / "gpu_h200"
CAL = DATA / "calibrate"
# (label, cluster file): the calibration as it is now; before its probes were a GPU step's size and
# its dense part replayed as a graph; and the preset (its figures from the kernel benchmark)
CLUSTERS = (("calibrated", CAL / "calibrated.yaml"),
            ("calibrated, dense eager", CAL / "calibrated_eager_dense.yaml"),
            ("calibrated, CPU-sized probes", CAL / "calibrated_cpu_sized_probes.yaml"),
            ("preset h200-8, one GPU", None))
TRIALS = (("trials, same lease (small)", CAL / "trials_small.jsonl"),
          ("trials, 2026-11-27 lease", DATA / "trials.jsonl"))


def one_gpu_preset() -> Cluster:
    return dataclasses.replace(load_cluster(shipped_cluster("h200-8.yaml")), devices_per_node=1)


def trial_errors(c: Cluster, path: Path) -> list[dict]:
    """Each measured trial's step against the simulator's for the same configuration."""
    out = []
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        cfg = TrialConfig.from_dict(r["config"])
        p = simulate(cfg, c)
        out.append({"workload": cfg.workload.name, "kernel": cfg.kernel, "dense": cfg.dense_precision,
                    "batch": cfg.batch_size, "meas_ms": r["step_ms_p50"],
                    "pred_ms": p.step_ms_p50 if p.status == "ok" else None,
                    "err": p.step_ms_p50 / r["step_ms_p50"] - 1 if p.status == "ok" else None})
    return out


def dense_errors(c: Cluster, path: Path) -> list[dict]:
    """MLPerf DCNv2's dense forward + backward (GEMMs and the rest), graphed, against the model's."""
    meas = json.loads(path.read_text())
    wl = Workload.preset("mlperf-dcnv2")
    dc = dense_cost(wl)
    out = []
    for r in meas["rows"]:
        cfg = TrialConfig(workload=wl, world_size=1, batch_size=r["batch"], dense_precision=r["precision"],
                          kernel="triton", device="cuda")
        d = step._dense(cfg, c, speeds(cfg, c), dc)
        pred, m = d.fwd + d.bwd + d.other, r["fwd_bwd_graph"]["median_ms"]
        out.append({"precision": r["precision"], "batch": r["batch"], "meas_ms": m, "pred_ms": round(pred, 4),
                    "err": pred / m - 1})
    return out


def summary(rows: list[dict]) -> dict:
    errs = [r["err"] for r in rows if r["err"] is not None]
    return {"n": len(errs), "median_abs_err": statistics.median(abs(e) for e in errs),
            "worst_err": max(errs, key=abs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=CAL / "validation.json")
    args = ap.parse_args()
    console = Console(width=150)
    result: dict = {}
    tab = Table(title="cubic calibrate on one H200: predicted vs measured (median |error|, worst)")
    for col in ("cluster file", *(t for t, _ in TRIALS), "MLPerf dense fp32 (graphed)", "MLPerf dense bf16"):
        tab.add_column(col, justify="right")
    for label, path in CLUSTERS:
        c = one_gpu_preset() if path is None else load_cluster(path)
        res = {t: trial_errors(c, p) for t, p in TRIALS}
        dense = dense_errors(c, CAL / "dense_mlperf.json")
        res["dense"] = dense
        cells = [summary(res[t]) for t, _ in TRIALS]
        cells += [summary([r for r in dense if r["precision"] == p]) for p in ("fp32", "bf16")]
        result[label] = {"file": str(path.relative_to(DATA.parent.parent.parent)) if path else "h200-8",
                         "rows": res, "summary": dict(zip([t for t, _ in TRIALS] + ["dense fp32", "dense bf16"],
                                                          cells, strict=True))}
        tab.add_row(label, *(f"{s['median_abs_err']:.0%} ({s['worst_err']:+.0%}), n={s['n']}" for s in cells))
    console.print(tab)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
