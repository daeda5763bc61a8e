"""The 2D replica merge's speed (issue 33 item 5): k = 8 against k = 1 and against full model parallelism, and where
a merge's time goes, for this code and an earlier commit side by side in one run.

On 2 gloo ranks of this machine (groups of 1, 2 replicas), the default space's settings (row-wise AdaGrad: the
plain rule, DMPCollection's average) on its workload (small-zipf) and on the uniform `small` one, at the same
global batch: full model parallelism, `weight_avg` every step (k = 1) and every 8 steps (k = 8). Each
configuration runs `--repeats` times, alternating code and configuration, so drift of the shared machine
hits all alike; the table gives medians with min..max and the merge's parts (wait, payload, wire, apply) per sync.

    .venv/bin/python benchmarks/bench_merge.py [--before GITREF] [--repeats 3] [--steps 40] [--workloads A,B]
                                               [--cluster ~/.config/cubic/local.yaml] [--set emb_precision=fp16]
    .venv/bin/python benchmarks/bench_merge.py --transport [--repeats 3]

--transport measures what the transport rule (`cubic_harness.sharding.transport`) needs instead: k = 8 with each
transport forced (CUBIC_REPLICA_SYNC), alternating, and a sparse byte's cost over a dense one's: (sparse ms per
sync / the rule's sparse MB) / (dense ms per sync / the rule's dense MB). Writes merge_transport.json.

--cluster adds the simulator's prediction of each ratio on that calibration of this machine (nothing here is
fitted to these runs). small-meta (the default task's model on Meta's 2022 trace reuse) is a third workload.

--set KNOB=VALUE (repeatable) changes a knob of every variant from the default space's baseline, e.g. fp16 tables.

--before checks GITREF out under /tmp and runs its harness in child processes (PYTHONPATH over the installed
packages), so both sides share this venv's torch and gloo. Writes benchmarks/data/merge_speed.json.
"""

from __future__ import annotations

import argparse
import functools
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
WORKLOADS = ("small-zipf", "small", "small-meta")

CHILD = """
import json, sys
from cubic.space.search_space import load_space
from cubic_harness.trial import run_trial
from cubic_harness.workload import Workload

def main():
    wl, knobs, steps = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    base = load_space("search_spaces/dlrm_cpu.yaml").baseline
    w = Workload.from_dict({**wl, "sample_cycle": 1 << 24})
    r = run_trial(base.replace(workload=w, warmup_steps=8, measure_steps=steps, windows=1, **knobs))
    rs = r.extra.get("replica_sync") or {}
    print(json.dumps({"status": r.status, "error": r.error, "qps": r.qps,
                      "sync_ms_per_step": r.breakdown_ms.get("sync"),
                      "ms_per_sync": rs.get("ms_per_sync"), "sparse_syncs": rs.get("sparse_syncs"),
                      "dense_syncs": rs.get("dense_syncs"), "touched_frac_max": rs.get("touched_frac_max"),
                      "union_frac_max": rs.get("union_frac_max"),
                      "rule_mb_per_sync": rs.get("rule_mb_per_sync"), "env": r.env.get("env_overrides")}))

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


@functools.cache
def preset_json(wl: str) -> str:
    """The preset as this code defines it (an earlier commit may not have it), built once: small-meta's profile
    takes a second to fit."""
    from cubic_harness.workload import Workload

    return json.dumps(Workload.preset(wl).to_dict())


def run(tree: Path, wl: str, knobs: dict, steps: int, transport: str = "") -> dict:
    env = dict(os.environ)
    if transport:
        env["CUBIC_REPLICA_SYNC"] = transport  # the ranks inherit it; the result records it (env_overrides)
    if tree != ROOT:
        env["PYTHONPATH"] = str(tree / "_packages")
    out = subprocess.run([sys.executable, "-c", CHILD, preset_json(wl), json.dumps(knobs), str(steps)], cwd=tree,
                         env=env, capture_output=True, text=True, timeout=900)
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
    ap.add_argument("--transport", action="store_true", help="measure a sparse byte's cost over a dense one's")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated presets")
    ap.add_argument("--cluster", type=Path, help="a calibration of this machine: the simulator's ratios beside")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="a knob of every variant, as `cubic trial --set` takes it (repeatable)")
    a = ap.parse_args()
    from cubic.cli.trial import parse_sets
    from cubic_harness.errors import ConfigError

    try:
        common = parse_sets(a.set)  # cubic trial's --set: the same names and values
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    con = Console()
    if a.transport:
        transport_cost(con, a.repeats, a.steps)
        return
    codes = {"now": ROOT} | ({f"before ({a.before})": checkout(a.before)} if a.before else {})
    runs: dict = {}
    workloads = a.workloads.split(",")
    for rep in range(a.repeats):
        for wl in workloads:
            for code, tree in codes.items():
                for name, knobs in VARIANTS.items():
                    r = run(tree, wl, {**common, **knobs}, a.steps)
                    con.log(f"rep {rep} {wl} {code} {name}: {r.get('status')} {r.get('qps', 0):,.0f} samples/s "
                            f"{r.get('ms_per_sync') or ''} {r.get('error') or ''}")
                    runs.setdefault(wl, {}).setdefault(code, {}).setdefault(name, []).append(r)
    predicted = predict(a.cluster, workloads, common) if a.cluster else {}
    out = {"repeats": a.repeats, "steps": a.steps, "set": common, "runs": runs, "predicted": predicted,
           "cluster": str(a.cluster or "")}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    for wl, by_code in runs.items():
        t = Table(title=f"{wl}{' ' + str(common) if common else ''}: median samples/s over {a.repeats} (min..max); "
                        "the merge per sync (ms)"
                        + ("; predicted: the simulator on --cluster" if predicted else ""))
        for c in ("code", "variant", "samples/s", "x full MP", "x k=1", "transport", "wait / payload / wire / apply",
                  *(("predicted x full MP", "predicted x k=1") if predicted else ())):
            t.add_column(c)
        pq = predicted.get(wl, {})
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
                tr = "sparse" if ok[0].get("sparse_syncs") else (
                    f"union ({ok[0]['union_frac_max']:.0%} of rows)" if ok[0].get("union_frac_max") else
                    "dense" if ok[0].get("dense_syncs") else "")
                pred = ((f"{pq[n] / pq['full MP']:.2f}x", f"{pq[n] / pq['k=1']:.2f}x" if n != "full MP" else "")
                        if pq and code == "now" else ("", "") if pq else ())
                t.add_row(code, n, f"{med[n]:,.0f} ({min(q):,.0f}..{max(q):,.0f})",
                          f"{med[n] / med['full MP']:.2f}x", f"{med[n] / med['k=1']:.2f}x" if n != "full MP" else "",
                          tr, " / ".join(f"{v:.0f}" for v in p.values()), *pred)
        con.print(t)


def predict(cluster: Path, workloads: list[str], common: dict) -> dict[str, dict[str, float]]:
    """The simulator's samples/s for every workload and variant as the runs configure them."""
    from cubic.space.search_space import load_space
    from cubic_harness.sim.backend import simulate
    from cubic_harness.sim.cluster import load_cluster
    from cubic_harness.workload import Workload

    c = load_cluster(cluster)
    base = load_space(ROOT / "search_spaces" / "dlrm_cpu.yaml").baseline
    out: dict[str, dict[str, float]] = {}
    for wl in workloads:
        w = Workload.from_dict({**Workload.preset(wl).to_dict(), "sample_cycle": 1 << 24})
        out[wl] = {n: simulate(base.replace(workload=w, **common, **knobs), c).qps for n, knobs in VARIANTS.items()}
    return out


RULES = {"plain": {}, "momentum": {"emb_optimizer": "momentum_scaled_rowwise_adagrad"}}
REPLICAS = 2  # 2 ranks, groups of 1


def transport_cost(con: Console, repeats: int, steps: int) -> None:
    """k = 8 with each transport forced, alternating: a sparse byte's cost relative to a dense byte's, in the
    transport rule's terms (`sparse_pays`: the all-gather's R x touched bytes against the ring all-reduce's
    2 (R - 1) / R x shard bytes), for the plain rule (whose dense merge averages in place) and the momentum rule
    (whose dense merge builds payloads)."""
    runs: dict = {}
    for rep in range(repeats):
        for rule, extra in RULES.items():
            for wl in WORKLOADS:
                for how in ("sparse", "dense") + (("union",) if rule == "plain" else ()):
                    r = run(ROOT, wl, {**VARIANTS["k=8"], **extra}, steps, transport=how)
                    con.log(f"rep {rep} {rule} {wl} k=8 {how}: {r.get('status')} {r.get('qps', 0):,.0f} samples/s "
                            f"{r.get('ms_per_sync') or ''} {r.get('rule_mb_per_sync') or ''} {r.get('error') or ''}")
                    runs.setdefault(rule, {}).setdefault(wl, {}).setdefault(how, []).append(r)
    t = Table(title=f"a sparse byte's cost over a dense one's (k = 8, each transport forced; median of {repeats})")
    for c in ("rule", "workload", "touched", "sparse ms / sync", "rule MB", "dense ms / sync", "rule MB",
              "cost per byte"):
        t.add_column(c)
    out: dict = {"repeats": repeats, "steps": steps, "replicas": REPLICAS, "runs": runs, "cost": {}}
    R = REPLICAS
    for rule, by_wl in runs.items():
        for wl, by in by_wl.items():
            med = {}
            for how, rs in by.items():
                ok = [x for x in rs if x.get("status") == "ok" and x.get("ms_per_sync")]
                med[how] = (statistics.median(sum(x["ms_per_sync"].values()) for x in ok),
                            statistics.median(x["rule_mb_per_sync"].get(how, 0.0) for x in ok),
                            [sum(x["ms_per_sync"].values()) for x in ok]) if ok else None
            if med["sparse"] is None or med["dense"] is None:
                t.add_row(rule, wl, "failed", "", "", "", "", "")
                continue
            (sm, smb, sall), (dm, dmb, dall) = med["sparse"], med["dense"]
            cost = (sm / (R * smb)) / (dm / (2 * (R - 1) / R * dmb))
            frac = by["sparse"][0].get("touched_frac_max") or 0.0
            out["cost"].setdefault(rule, {})[wl] = {"cost": cost, "sparse_ms": sall, "dense_ms": dall,
                                                    "sparse_mb": smb, "dense_mb": dmb, "touched_frac_max": frac}
            t.add_row(rule, wl, f"{frac:.0%}", f"{sm:.0f} ({min(sall):.0f}..{max(sall):.0f})", f"{smb:.0f}",
                      f"{dm:.0f} ({min(dall):.0f}..{max(dall):.0f})", f"{dmb:.0f}", f"{cost:.2f}")
            if med.get("union"):  # the union's rows at their own cost per byte, over the dense in-place merge's
                um, _, uall = med["union"]
                uf = statistics.median(x.get("union_frac_max") or 1.0 for x in by["union"] if x.get("status") == "ok")
                ucost = (um / (uf * dmb)) / (dm / dmb)
                out["cost"][rule][wl].update(union_ms=uall, union_frac=uf, union_cost=ucost)
                t.add_row(rule, wl, f"union {uf:.0%}", f"{um:.0f} ({min(uall):.0f}..{max(uall):.0f})",
                          f"{uf * dmb:.0f}", "", "", f"{ucost:.2f} (union)")
    con.print(t)
    (ROOT / "benchmarks" / "data" / "merge_transport.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
