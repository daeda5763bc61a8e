"""The harness vs the TorchRec reference (../shared/anchors) on the same workload, side by side.

For each sharding type TorchRec's CPU path runs (table_wise, column_wise, data_parallel) it
alternates TorchRec and cubic trials, `--repeats` times each, and prints median samples/s,
spread and the ratio; then cubic alone for every sharding type x pipeline depth x comm
precision (`--matrix`). Warm-up steps are excluded on both sides (the workload file fixes
them). The machine is shared and noisy: only ratios measured in this one run mean much.

    python benchmarks/bench_torchrec.py [--workload W.json] [--kernels fbgemm,native] [--matrix]

Make the TorchRec environment once with ../shared/anchors/setup_torchrec_env.sh .venv-torchrec.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
ANCHORS = ROOT.parent / "shared" / "anchors"
TORCHREC_TYPES = ("table_wise", "column_wise", "data_parallel")
# data_parallel has no all-to-all (pipelining and comm precision do not apply): left out of the matrix
MATRIX_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrec_qps(py: Path, workload: Path, sharding: str) -> float:
    p = subprocess.run([str(py), str(ANCHORS / "torchrec_dlrm.py"), str(workload), sharding, str(free_port())],
                       capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(f"torchrec {sharding} failed: {p.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(p.stdout.strip().splitlines()[-1])["qps"])


def cubic_result(workload: Path, **knobs) -> dict:
    sets = [x for k, v in knobs.items() for x in ("--set", f"{k}={v}")]
    p = subprocess.run([sys.executable, "-m", "cubic", "trial", "--workload", str(workload), *sets, "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(f"cubic trial failed: {p.stderr.strip()}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if r["status"] != "ok":
        raise RuntimeError(f"cubic trial {knobs}: {r['status']}: {r['error']}")
    return r


def spread(xs: list[float]) -> str:
    return f"{min(xs):,.0f}-{max(xs):,.0f}" if len(xs) > 1 else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", type=Path, default=ANCHORS / "workload-small.json")
    ap.add_argument("--torchrec-python", type=Path, default=ROOT / ".venv-torchrec" / "bin" / "python")
    ap.add_argument("--kernels", default="fbgemm", help="comma-separated cubic kernels to compare")
    ap.add_argument("--types", default=",".join(TORCHREC_TYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--matrix-comm", default="fp32,bf16,fp16", help="comm precisions of the matrix")
    ap.add_argument("--matrix-kernel", default=None, help="kernel of the matrix [default: the first of --kernels]")
    ap.add_argument("--matrix", action="store_true", help="also every type x pipeline depth x comm precision")
    args = ap.parse_args()
    con = Console(width=180)
    kernels = args.kernels.split(",")
    have_torchrec = args.torchrec_python.exists()
    if not have_torchrec:
        con.print(f"[yellow]no TorchRec env at {args.torchrec_python}: run "
                  f"../shared/anchors/setup_torchrec_env.sh .venv-torchrec (cubic-only numbers follow)[/]")

    tab = Table(title=f"cubic vs TorchRec on {args.workload.name} (median samples/s of {args.repeats}, "
                      f"alternating runs)")
    for c in ["sharding", "torchrec", *[f"cubic {k}" for k in kernels], *[f"ratio {k}" for k in kernels],
              f"breakdown ms ({kernels[0]})"]:
        tab.add_column(c, justify="right")
    for sharding in [t for t in args.types.split(",") if t]:
        tr, cu = [], {k: [] for k in kernels}
        last = {}
        for i in range(args.repeats):
            con.print(f"[dim]{sharding}: repeat {i + 1}/{args.repeats}[/]")
            if have_torchrec and sharding in TORCHREC_TYPES:
                tr.append(torchrec_qps(args.torchrec_python, args.workload, sharding))
            for k in kernels:
                r = cubic_result(args.workload, sharding=sharding, kernel=k)
                cu[k].append(r["qps"])
                last[k] = r
        trm = statistics.median(tr) if tr else float("nan")
        bd = last[kernels[0]]["breakdown_ms"]
        tab.add_row(sharding, f"{trm:,.0f} ({spread(tr)})" if tr else "n/a",
                    *[f"{statistics.median(cu[k]):,.0f} ({spread(cu[k])})" for k in kernels],
                    *[f"{statistics.median(cu[k]) / trm:.2f}x" if tr else "-" for k in kernels],
                    " ".join(f"{n} {v:.1f}" for n, v in bd.items()))
    con.print(tab)

    if args.matrix:
        m = Table(title="cubic: sharding x pipeline depth x comm precision (samples/s, one run each)")
        cols = [(d, p) for d in (0, 1, 2) for p in args.matrix_comm.split(",")]
        m.add_column("sharding")
        for d, p in cols:
            m.add_column(f"d{d} {p}", justify="right")
        for sharding in MATRIX_TYPES:
            row = []
            for d, p in cols:
                con.print(f"[dim]{sharding} depth {d} {p}[/]")
                r = cubic_result(args.workload, sharding=sharding, kernel=args.matrix_kernel or kernels[0],
                                 pipeline_depth=d,
                                 comm_precision=p)
                row.append(f"{r['qps']:,.0f}")
            m.add_row(sharding, *row)
        con.print(m)


if __name__ == "__main__":
    main()
