"""The 2D replica merge's speed (issue 33 item 5): k = 8 against k = 1 and against full model parallelism, and where
a merge's time goes, for this code and an earlier commit side by side in one run.

On 2 gloo ranks of this machine (groups of 1, 2 replicas), the default space's settings (row-wise AdaGrad: the
plain rule, DMPCollection's average) on its workload (small-zipf) and on the uniform `small` one, at the same
global batch: full model parallelism, `weight_avg` every step (k = 1) and every 8 steps (k = 8). Each
configuration runs `--repeats` times, alternating code and configuration, so drift of the shared machine
hits all alike; the table gives medians with min..max and the merge's parts (payload, wire, apply) per sync.

    .venv/bin/python benchmarks/bench_merge.py [--before GITREF] [--repeats 3] [--steps 40]

--before checks GITREF out under /tmp and runs its harness in child processes (PYTHONPATH over the installed
packages), so both sides share this venv's torch and gloo. Writes benchmarks/data/merge_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"cubic": "cubic", "cubic_harness": "harness", "cubic_kernels": "kernels",
            "cubic_search_spaces": "search_spaces", "cubic_clusters": "clusters"}
VARIANTS = {"full MP": {}, "k=1": {"sharding_group_size": 1, "sparse_sync": "weight_avg", "sparse_sync_interval": 1},
            "k=8": {"sharding_group_size": 1, "sparse_sync": "weight_avg", "sparse_sync_interval": 8}}
WORKLOADS = ("small-zipf", "small")

CHILD = """
import json, sys
from cubic.space.search_space import load_space
from cubic_harness.trial import run_trial
from cubic_harness.workload import Workload

def main():
    wl, knobs, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    base = load_space("search_spaces/dlrm_cpu.yaml").baseline
    w = Workload.from_dict({**Workload.preset(wl).to_dict(), "sample_cycle": 1 << 24})
    r = run_trial(base.replace(workload=w, warmup_steps=8, measure_steps=steps, windows=1, **knobs))
    rs = r.extra.get("replica_sync") or {}
    print(json.dumps({"status": r.status, "error": r.error, "qps": r.qps,
                      "sync_ms_per_step": r.breakdown_ms.get("sync"),
                      "ms_per_sync": rs.get("ms_per_sync"), "sparse_syncs": rs.get("sparse_syncs"),
                      "dense_syncs": rs.get("dense_syncs"), "touched_frac_max": rs.get("touched_frac_max")}))

if __name__ == "__main__":
    main()
"""


def checkout(ref: str) -> Path:
    """GITREF's files under /tmp, with its packages under their installed names (PYTHONPATH goes there)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = Path(f"/tmp/cubic_before_{sha}")
    if not tree.exists():
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    pkgs = tree / "_packages"
    pkgs.mkdir(exist_ok=True)
    for name, folder in PACKAGES.items():
        if not (pkgs / name).exists():
            (pkgs / name).symlink_to(tree / folder)
    return tree


def run(tree: Path, wl: str, knobs: dict, steps: int) -> dict:
    env = dict(os.environ)
    if tree != ROOT:
        env["PYTHONPATH"] = str(tree / "_packages")
    out = subprocess.run([sys.executable, "-c", CHILD, wl, json.dumps(knobs), str(steps)], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=900)
    line = (out.stdout.strip().splitlines() or ["{}"])[-1]
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return {"status": "error", "error": out.stderr.strip()[-300:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="", help="an earlier commit to run beside this code")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "merge_speed.json")
    a = ap.parse_args()
    con = Console()
    codes = {"now": ROOT} | ({f"before ({a.before})": checkout(a.before)} if a.before else {})
    runs: dict = {}
    for rep in range(a.repeats):
        for wl in WORKLOADS:
            for code, tree in codes.items():
                for name, knobs in VARIANTS.items():
                    r = run(tree, wl, knobs, a.steps)
                    con.log(f"rep {rep} {wl} {code} {name}: {r.get('status')} {r.get('qps', 0):,.0f} samples/s "
                            f"{r.get('ms_per_sync') or ''} {r.get('error') or ''}")
                    runs.setdefault(wl, {}).setdefault(code, {}).setdefault(name, []).append(r)
    out = {"repeats": a.repeats, "steps": a.steps, "runs": runs}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    for wl, by_code in runs.items():
        t = Table(title=f"{wl}: median samples/s over {a.repeats} (min..max); the merge per sync (ms)")
        for c in ("code", "variant", "samples/s", "x full MP", "x k=1", "transport", "payload / wire / apply"):
            t.add_column(c)
        for code, by_var in by_code.items():
            med = {n: statistics.median(x["qps"] for x in rs if x.get("status") == "ok") for n, rs in by_var.items()
                   if any(x.get("status") == "ok" for x in rs)}
            for n, rs in by_var.items():
                ok = [x for x in rs if x.get("status") == "ok"]
                if not ok:
                    t.add_row(code, n, "failed", "", "", "", "")
                    continue
                q = [x["qps"] for x in ok]
                parts = [x.get("ms_per_sync") or {} for x in ok]
                p = ({k: statistics.median(pp.get(k, 0.0) for pp in parts) for k in parts[0]} if parts[0] else {})
                tr = "sparse" if ok[0].get("sparse_syncs") else ("dense" if ok[0].get("dense_syncs") else "")
                t.add_row(code, n, f"{med[n]:,.0f} ({min(q):,.0f}..{max(q):,.0f})",
                          f"{med[n] / med['full MP']:.2f}x", f"{med[n] / med['k=1']:.2f}x" if n != "full MP" else "",
                          tr, " / ".join(f"{v:.0f}" for v in p.values()))
        con.print(t)


if __name__ == "__main__":
    main()
