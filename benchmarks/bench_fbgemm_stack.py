"""FBGEMM's CPU table-batched embedding, its fused backward timed apart, in several installed stacks side by side.

Why: the move to torch 2.14.1 + fbgemm-gpu-cpu 1.9.0 (issue 32) made the default task's step 2.5x slower. This
times the one kernel that changed in every interpreter given, alternating, so the ratio between stacks is
measured in one run on one machine state. Each run builds one rank's share of the default task (4 tables x
`--rows` x 64, 20 ids a bag) and times `--steps` backward passes (after 5 untimed), per optimizer and batch size;
ids are uniform, so the work per step does not depend on the stack's random numbers.

    .venv/bin/python benchmarks/bench_fbgemm_stack.py --python .venv/bin/python --python /path/to/other/bin/python

Each `--python` is an interpreter with torch and fbgemm-gpu(-cpu) installed (nothing of cubic's is imported
there). Writes benchmarks/data/fbgemm_stack.json: per stack (torch, fbgemm versions), per case, the median
backward ms of each repeat, and the ratio of each stack's median to the first stack's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

CASES = [(opt, b) for opt in ("rowwise_adagrad", "sgd") for b in (256, 1024, 4096)]

CHILD = """
import ctypes, json, os, statistics, sys, time
import torch, fbgemm_gpu
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

rows, steps, cases = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(1)  # one rank's thread, as the default task's baseline runs
T, D, L = 4, 64, 20
opts = {"rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "sgd": EmbOptimType.EXACT_SGD}
out = {"torch": torch.__version__, "fbgemm": fbgemm_gpu.__version__, "ms": {}}
for opt, B in cases:
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(rows, D, EmbeddingLocation.HOST, ComputeDevice.CPU)] * T,
                                                optimizer=opts[opt], learning_rate=0.01, eps=1e-8,
                                                pooling_mode=PoolingMode.SUM)
    gen, ts = torch.Generator().manual_seed(0), []
    offsets = torch.arange(0, T * B * L + 1, L, dtype=torch.int64)
    for i in range(5 + steps):
        pooled = tbe(torch.randint(0, rows, (T * B * L,), generator=gen), offsets)
        grad = torch.full_like(pooled, 1e-3)
        t0 = time.perf_counter()
        pooled.backward(grad)
        if i >= 5:
            ts.append((time.perf_counter() - t0) * 1e3)
    out["ms"][f"{opt} B={B}"] = statistics.median(ts)
# What FBGEMM's kernel generators are gated on: its AVX2 check reads cpuinfo's ISA table, which fbgemm_gpu's
# fbgemm.so imports from torch's libc10 (the first in the global scope). Without AVX2 it runs its reference
# kernels (EmbeddingSpMDM_ref, rowwise_sparse_adagrad_ref) instead of the JIT ones.
c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
c10.cpuinfo_initialize.restype = ctypes.c_bool
fb = ctypes.CDLL(os.path.join(os.path.dirname(fbgemm_gpu.__file__), "fbgemm.so"))
avx2 = fb._ZN6fbgemm20fbgemmHasAvx2SupportEv
avx2.restype = ctypes.c_bool
isa = (ctypes.c_uint8 * 64).in_dll(c10, "cpuinfo_isa")
out["isa"] = {"cpuinfo_initialize": c10.cpuinfo_initialize(), "fbgemm_has_avx2": avx2(),
              "cpuinfo_isa_flags_set": sum(isa)}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", required=True, help="an interpreter of a stack (repeatable)")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "fbgemm_stack.json")
    a = ap.parse_args()
    console = Console()
    runs: dict[str, list[dict]] = {p: [] for p in a.python}
    with console.status("timing") as status:
        for r in range(a.repeats):
            for py in a.python:  # alternating: each repeat sees every stack under the same machine state
                status.update(f"repeat {r + 1}/{a.repeats}: {py}")
                p = subprocess.run([py, "-c", CHILD, str(a.rows), str(a.steps), json.dumps(CASES)],
                                   capture_output=True, text=True, timeout=600)
                if p.returncode != 0:
                    sys.exit(f"error: {py}: {(p.stderr.strip().splitlines() or ['no output'])[-1]}")
                runs[py].append(json.loads(p.stdout.strip().splitlines()[-1]))
    stacks = []
    for py, rs in runs.items():
        ms = {case: [round(x["ms"][case], 3) for x in rs] for case in rs[0]["ms"]}
        stacks.append({"python": py, "torch": rs[0]["torch"], "fbgemm": rs[0]["fbgemm"], "isa": rs[0]["isa"],
                       "backward_ms": ms,
                       "median_ms": {c: round(statistics.median(v), 3) for c, v in ms.items()}})
    first = stacks[0]["median_ms"]
    for s in stacks:
        s["ratio_to_first"] = {c: round(v / first[c], 2) for c, v in s["median_ms"].items()}
    table = Table(title=f"FBGEMM CPU fused backward, ms (median of {a.repeats} alternating repeats), "
                        f"4 x {a.rows:,} x 64, 20 ids a bag, 1 thread")
    table.add_column("case")
    for s in stacks:
        table.add_column(f"torch {s['torch']}\nfbgemm {s['fbgemm']}", justify="right")
    for case in first:
        table.add_row(case, *(f"{s['median_ms'][case]:.2f} ({s['ratio_to_first'][case]:.2f}x)" for s in stacks))
    table.add_row("FBGEMM sees AVX2 (cpuinfo flags set)",
                  *(f"{s['isa']['fbgemm_has_avx2']} ({s['isa']['cpuinfo_isa_flags_set']})" for s in stacks))
    console.print(table)
    a.out.write_text(json.dumps({"rows": a.rows, "steps": a.steps, "repeats": a.repeats, "stacks": stacks},
                                indent=1) + "\n")
    console.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
