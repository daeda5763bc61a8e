"""2D sparse parallelism: quality and speed of the replica sync, over real trials on the same samples.

For the small workload (uniform ids) and a hot variant (the same tables, Zipf ids), with world 2 (groups
of 1) and world 4 (groups of 2) at the same global batch, so every run trains on the same samples:
full model parallelism, 2D with `grad_allreduce`, 2D `weight_avg` with the momentum-scaled row-wise
AdaGrad at sync intervals k = 1, 4, 8, 32, and with plain row-wise AdaGrad (DMPCollection's average) at
k = 1 and 8. The stream does not repeat (sample_cycle above the samples trained), so NE measures learning,
not memorisation. Then the transport table: sparse vs dense sync forced, at k = 1, 2, 4, 8.

    .venv/bin/python benchmarks/bench_2d.py [--steps 60] [--out benchmarks/data/bench_2d.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from cubic_harness.config import TrialConfig
from cubic_harness.trial import run_trial
from cubic_harness.workload import Workload

GLOBAL_BATCH = 2048


def workloads() -> dict[str, Workload]:
    small = Workload.small().to_dict()
    hot = {**small, "name": "small-zipf", "tables": [{**t, "id_dist": "zipf", "zipf_alpha": 1.05}
                                                    for t in small["tables"]]}
    return {"small": Workload.from_dict({**small, "sample_cycle": 1 << 20}),
            "small-zipf": Workload.from_dict({**hot, "sample_cycle": 1 << 20})}


def variants() -> list[tuple[str, dict]]:
    two_d = dict(sharding_group_size=-1)  # resolved per world below
    out = [("full model parallel", {}), ("2D grad_allreduce", {**two_d, "sparse_sync": "grad_allreduce"})]
    for k in (1, 4, 8, 32):
        out.append((f"2D momentum-scaled k={k}", {**two_d, "sparse_sync": "weight_avg", "sparse_sync_interval": k,
                                                  "emb_optimizer": "momentum_scaled_rowwise_adagrad"}))
    for k in (1, 8):
        out.append((f"2D plain rowwise k={k}", {**two_d, "sparse_sync": "weight_avg", "sparse_sync_interval": k}))
    return out


def run(cfg: TrialConfig) -> dict:
    r = run_trial(cfg)
    assert r.status == "ok", r.error
    return {"qps": r.qps, "ne": r.ne, "sync_ms_per_step": r.breakdown_ms.get("sync", 0.0),
            "step_ms": r.step_ms_p50, "replica_sync": r.extra.get("replica_sync")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/data/bench_2d.json"))
    a = ap.parse_args()
    rows = []
    for wname, wl in workloads().items():
        for world, group in ((2, 1), (4, 2)):
            base = TrialConfig(workload=wl, world_size=world, batch_size=GLOBAL_BATCH // world, kernel="native",
                               warmup_steps=3, measure_steps=a.steps, windows=3, timeout_s=900)
            full = None
            for name, kw in variants():
                kw = {**kw, "sharding_group_size": group} if "sharding_group_size" in kw else kw
                m = run(base.replace(**kw))
                full = full or m
                rel = m["ne"] / full["ne"] - 1
                rows.append({"workload": wname, "world": world, "group": group, "variant": name, **m,
                             "ne_vs_full": rel, "qps_vs_full": m["qps"] / full["qps"]})
                print(f"{wname:10} W={world} G={group} {name:26} NE {m['ne']:.4f} ({rel:+.2%})  "
                      f"{m['qps']:8.0f} samples/s ({m['qps'] / full['qps']:.2f}x full)  "
                      f"sync {m['sync_ms_per_step']:.0f} ms/step", flush=True)
    transport = []
    base = TrialConfig(workload=workloads()["small"], world_size=2, batch_size=1024, kernel="native", warmup_steps=1,
                       measure_steps=16, windows=2, sharding_group_size=1, sparse_sync="weight_avg",
                       emb_optimizer="momentum_scaled_rowwise_adagrad", timeout_s=900)
    for k in (1, 2, 4, 8):
        for how in ("sparse", "dense"):
            os.environ["CUBIC_REPLICA_SYNC"] = how  # the rank processes inherit it
            m = run(base.replace(sparse_sync_interval=k))
            rs = m["replica_sync"]
            transport.append({"k": k, "transport": how, "sync_ms_p50": rs["sync_ms_p50"],
                              "touched_frac": rs["touched_frac_max"], "qps": m["qps"]})
            print(f"transport k={k} {how:6}: sync {rs['sync_ms_p50']:.0f} ms, touched {rs['touched_frac_max']:.0%}, "
                  f"{m['qps']:.0f} samples/s", flush=True)
    os.environ.pop("CUBIC_REPLICA_SYNC", None)

    print("\n| workload | world / group | variant | NE | vs full MP | samples/s | vs full MP | sync ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['world']} / {r['group']} | {r['variant']} | {r['ne']:.4f} | "
              f"{r['ne_vs_full']:+.2%} | {r['qps']:,.0f} | {r['qps_vs_full']:.2f}x | {r['sync_ms_per_step']:.0f} |")
    print("\n| k | touched rows | sparse sync ms | dense sync ms |")
    print("|---|---|---|---|")
    for k in (1, 2, 4, 8):
        sp, de = (next(t for t in transport if t["k"] == k and t["transport"] == h) for h in ("sparse", "dense"))
        print(f"| {k} | {sp['touched_frac']:.0%} | {sp['sync_ms_p50']:.0f} | {de['sync_ms_p50']:.0f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"global_batch": GLOBAL_BATCH, "steps": a.steps, "rows": rows,
                                 "transport": transport}, indent=1) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
