"""Summarise `cubic trial --json` lines (benchmarks/gpu_suite.sh) as one table: samples/s per
workload x kernel x dense precision, with the ratio to the workload's torch/fp32 trial."""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    base: dict[str, float] = {}
    out = []
    for r in rows:
        c = r["config"]
        wl = c["workload"]["name"]
        key = (wl, c["kernel"], c["dense_precision"], c["batch_size"])
        if r["status"] == "ok" and c["kernel"] == "torch" and c["dense_precision"] == "fp32":
            base[wl] = r["qps"]
        fp8 = r.get("extra", {}).get("fp8_probe") or []
        out.append((key, r, sum(bool(p["use_fp8"]) for p in fp8), len(fp8)))
    print(f"{'workload':20} {'kernel':7} {'dense':9} {'batch':>6} {'samples/s':>12} {'cv':>6} {'vs torch/fp32':>13} "
          f"{'step ms':>8} {'peak MB':>8} {'NE':>7} fp8 layers")
    for (wl, k, dp, bs), r, n8, nl in out:
        if r["status"] != "ok":
            print(f"{wl:20} {k:7} {dp:9} {bs:>6} {r['status']}: {r['error'][:90]}")
            continue
        ratio = f"{r['qps'] / base[wl]:.2f}x" if wl in base else "-"
        print(f"{wl:20} {k:7} {dp:9} {bs:>6} {r['qps']:12,.0f} {r['qps_cv']:6.1%} {ratio:>13} "
              f"{r['step_ms_p50']:8.2f} {r['peak_mem_mb']:8.0f} {r['ne']:7.4f} "
              f"{f'{n8}/{nl}' if nl else '-'}")
        bd = r["breakdown_ms"]
        print(f"{'':20} breakdown ms: " + " ".join(f"{p} {v:.2f}" for p, v in bd.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
