#!/usr/bin/env bash
# Everything the GPU path must show, in one call on a CUDA machine (issue 7): the Triton kernels
# against the torch reference on the GPU, the fp8 probe tests, the kernel bandwidth benchmark, and
# whole trials (kernel x dense precision) through `cubic trial`.
#
#   bash benchmarks/gpu_suite.sh [steps...]     # steps: env tests bench trials weighted dense calibrate tune
#                                               # (default: all but tune, dense and calibrate)
#
# Logs and JSON land in $OUT (default ./gpu_out). No step stops the others; each has a time limit.
# Needs torch, triton, numpy, pyyaml, typer, rich and pydantic (carried as a wheel): no fbgemm-gpu, optuna, ray or
# xgboost.
# The `tune` step runs `cubic tune` itself, which needs optuna, ray and xgboost: where the machine
# lacks them, make their wheels here with `python benchmarks/gpu_wheels.py` (51 MiB, fits the 64 MiB
# transfer) and carry `.whl`; the step installs them. TUNE_TRIALS (default 8) is the trial budget;
# a tune cut off by the call's time limit resumes in the next call on the same (warm) machine.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# this checkout's packages install under cubic's own names (cubic_harness, cubic_kernels, the shipped spaces and
# clusters): install it, without dependencies or the network, beside the repository on the path
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/cubic-self . >/dev/null
export PYTHONPATH=/tmp/cubic-self:$PWD PYTHONUNBUFFERED=1
# carried wheels (benchmarks/gpu_wheels.py): the harness needs pydantic, which the GPU image lacks; a tune needs the rest
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --upgrade --target /tmp/cubic-site .whl/*.whl >/dev/null
  export PYTHONPATH=/tmp/cubic-site:$PYTHONPATH
fi
STEPS=${*:-env tests bench trials weighted}
CYCLE=1048576  # distinct samples of a workload given by file, as search_spaces/dlrm_gpu.yaml's (no cycling in a trial)
LOG=$OUT/suite.log
: >"$LOG"  # this run's log only: the trials table and test summary are read back from it

run() {  # run NAME SECONDS CMD...: time-limited, output appended to the log
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T))" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "--- $name rc=$?" | tee -a "$LOG"
}

for s in $STEPS; do
  case $s in
  env)
    run env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
      $PY -c 'import torch, triton, numpy, sys; print(sys.version.split()[0], \"torch\", torch.__version__, \
      \"triton\", triton.__version__, \"numpy\", numpy.__version__, torch.cuda.get_device_name())'"
    ;;
  tests)
    # (with the interpreter's CPU cases in a fresh process: test_cpu_cases_in_fresh_interpreter_process)
    run tests 420 "$PY" -m pytest -q -p no:cacheprovider \
      tests/test_kernel_triton.py tests/test_fp8.py tests/test_gpu.py
    grep -E "passed|failed|error" "$LOG" | tail -n 3
    ;;
  bench)
    # BACKENDS=torch,triton:4x2,triton:16x4 sweeps the backward's rows per program x warps
    # (default: torch and triton, each also weighted (per-sample weights, TorchRec's weighted features), and
    # triton:singles, the sort-free path for rows hit once, side by side)
    # BENCH_ARGS=--profile adds where the triton backward's device time goes
    backends=${BACKENDS:-torch,torch:weighted,triton,triton:weighted,triton:singles}
    run bench_uniform 200 "$PY" benchmarks/bench_gpu_kernels.py --repeats 20 --backends "$backends" \
      ${BENCH_ARGS:-} --json "$OUT/bench_uniform.json"
    run bench_hot 150 "$PY" benchmarks/bench_gpu_kernels.py --repeats 20 --skew 4 --skip-fp8 \
      --backends "$backends" --json "$OUT/bench_hot.json"
    ;;
  trials)
    from=$(($(wc -l <"$LOG") + 1))  # this step's trial lines only
    echo "{\"preset\": \"criteo-mlperf-mini\", \"sample_cycle\": $CYCLE}" >"$OUT/mlperf.json"
    for wl in ${TRIAL_WORKLOADS:-small mlperf}; do
      extra=()
      bs=8192
      if [ "$wl" = mlperf ]; then extra=(--workload "$OUT/mlperf.json"); bs=16384; fi
      for k in torch triton; do
        precisions="fp32 bf16 fp8_auto"
        [ "$k" = triton ] && precisions="$precisions fp8_all"  # blanket fp8, for comparison
        for dp in $precisions; do
          run "trial_${wl}_${k}_${dp}" 90 "$PY" -m cubic trial --space search_spaces/dlrm_gpu.yaml \
            "${extra[@]}" --set kernel=$k --set dense_precision=$dp --set batch_size=$bs --set timeout_s=80 --json
        done
      done
    done
    tail -n "+$from" "$LOG" | grep -h '^{"status"' >"$OUT/trials.jsonl" || true
    "$PY" benchmarks/gpu_trials_table.py "$OUT/trials.jsonl" | tee -a "$LOG"
    ;;
  weighted)
    # per-sample weights in a whole trial: criteo-mlperf-mini with every table weighted (TorchRec's weighted
    # features) beside the same tables plain, both kernels, alternating, 2 repeats; the simulator's
    # weighted_cost (clusters/h200-8.yaml) is the kernel benchmark's ratio, and these trials check it
    from=$(($(wc -l <"$LOG") + 1))
    "$PY" -c 'import json, sys
from cubic_harness.workload import Workload
d = Workload.preset("criteo-mlperf-mini").to_dict() | {"sample_cycle": int(sys.argv[2])}
json.dump(d, open(sys.argv[1] + "/plain.json", "w"))
d = d | {"name": d["name"] + "-weighted", "tables": [t | {"weighted": True} for t in d["tables"]]}
json.dump(d, open(sys.argv[1] + "/weighted.json", "w"))' "$OUT" "$CYCLE"
    for r in 1 2; do
      for w in weighted plain; do
        for k in triton torch; do
          run "weighted_${w}_${k}_$r" 60 "$PY" -m cubic trial --space search_spaces/dlrm_gpu.yaml \
            --workload "$OUT/$w.json" --set kernel=$k --set batch_size=16384 --set timeout_s=55 --json
        done
      done
    done
    tail -n "+$from" "$LOG" | grep -h '^{"status"' >"$OUT/weighted.jsonl" || true
    ;;
  dense)
    # MLPerf DLRM-DCNv2's dense part at its per-GPU batches (benchmarks/gpu_dense.py)
    run dense 150 "$PY" benchmarks/gpu_dense.py --json "$OUT/dense_mlperf.json"
    ;;
  calibrate)
    # `cubic calibrate` on this GPU: the node a `base: local` cluster file composes a cluster from
    run calibrate 400 "$PY" -m cubic calibrate -o "$OUT/calibrated.yaml"
    ;;
  tune)
    run tune "${TUNE_LIMIT:-560}" "$PY" -m cubic tune --no-live --space search_spaces/dlrm_gpu.yaml --run-dir runs/gpu_tune \
      --trials "${TUNE_TRIALS:-8}"
    cp runs/gpu_tune/study.db "$OUT/gpu_tune.db" 2>/dev/null || true  # the whole study comes back
    ;;
  *) echo "unknown step $s (env tests bench trials weighted dense calibrate tune)" ;;
  esac
done
