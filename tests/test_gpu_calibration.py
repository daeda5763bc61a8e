"""`cubic calibrate` on one GPU validated on what it was not fitted on: the H200 calibration in
benchmarks/data/gpu_h200/calibrate prices whole harness trials measured on H200s, and MLPerf
DCNv2's dense part (benchmarks/bench_gpu_calibration.py; docs/clusters.md, "On a GPU node").
Runs anywhere: the measurements are stored, the predictions made here."""

from __future__ import annotations

import functools
import statistics

from cubic_harness.sim.cluster import load_cluster
from tests.test_mlperf_gpu_presets import _bench


@functools.cache
def _errors(label: str) -> dict[str, list[float]]:
    """Per measurement set, the relative errors of the cluster file `label` (bench's CLUSTERS)."""
    b = _bench("bench_gpu_calibration")
    path = dict(b.CLUSTERS)[label]
    c = b.one_gpu_preset() if path is None else load_cluster(path)
    out = {t: [r["err"] for r in b.trial_errors(c, p)] for t, p in b.TRIALS}
    for prec in ("fp32", "bf16"):
        out[f"dense {prec}"] = [r["err"] for r in b.dense_errors(c, b.CAL / "dense_mlperf.json")
                                if r["precision"] == prec]
    return out


def _median(errs: list[float]) -> float:
    return statistics.median(abs(e) for e in errs)


def test_a_gpu_calibration_predicts_the_harness_trials_on_that_gpu() -> None:
    """21 trials on two H200 leases (two workloads, both kernels, four dense precisions): the
    calibration within 20% at the median, and nearer than the preset, which prices the device's
    work alone where one GPU's harness step is bound by its launches."""
    cal, preset = _errors("calibrated"), _errors("preset h200-8, one GPU")
    trials = [t for t in cal if t.startswith("trials")]
    for t in trials:
        assert _median(cal[t]) < 0.20, (t, cal[t])
        assert _median(cal[t]) < _median(preset[t]), t
    every = [e for t in trials for e in cal[t]]
    assert len(every) == 21 and max(abs(e) for e in every) < 0.6


def test_a_gpu_calibration_measured_at_a_cpu_steps_size_misprices_the_gpu() -> None:
    """The probes sized for a CPU (4 x 200k rows, 2,048 bags) and the dense part launched eagerly
    measure the host's launches, not the GPU: 4x and more the error on the same trials."""
    cal = _errors("calibrated")
    for label in ("calibrated, CPU-sized probes", "calibrated, dense eager"):
        before = _errors(label)
        for t in (t for t in cal if t.startswith("trials")):
            assert _median(before[t]) > 2 * _median(cal[t]), (label, t)


def test_a_gpu_calibration_prices_mlperfs_dense_part_in_fp32() -> None:
    """MLPerf DCNv2's dense part, graphed, at its per-GPU batches: the GEMM-bound fp32 step within
    10% at 6,912 and above (the 1,728 batch's small GEMMs are +50%). bf16 is not yet: the small
    model's non-GEMM rate does not carry to 15x its activations (docs/clusters.md)."""
    dense = _errors("calibrated")["dense fp32"]
    assert max(abs(e) for e in dense[2:]) < 0.10, dense
