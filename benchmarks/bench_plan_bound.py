"""How fast can any plan be? A lower bound on the modelled step of every plan the backend runs for
`dlrm-datasets-2022` on 1,024 H100s (the case issue 57 sets 1.1x the best uniform type for), against what
the per-table planner finds.

The model's own step (`step.step_at`: its critical path, overlaps and all) over the least each part a plan
sets can be: the busiest position's lookups at least the mean position's share of the least total work
(splitting a table only adds to it); the pooled all-to-all at its least busiest-rank columns; the input
all-to-alls at their least busiest-rank ids and lengths (each column shard receives its table's every id).
Every other part (the dense layers, DDP's all-reduce) no plan changes. The step rises with each part, so no
plan is faster than its floor. The workload's 788 tables are alike (rows, width, bag length), so every plan
falls in one of three cases:

- a table data-parallel: its sparse all-gather over every rank, the rest at their least;
- some shard as wide as its table (a whole table or a row block): its position receives that many pooled
  columns;
- every table in column shards of at most half its width: pooled columns at least the mean position's, at
  least two shards on some position.

The bound is the least of the three.

    .venv/bin/python benchmarks/bench_plan_bound.py      # -> benchmarks/data/plan_bound.json
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_planner import cases  # noqa: E402

from cubic_harness.planning import plan_for  # noqa: E402
from cubic_harness.sim.perf import TableCosts  # noqa: E402
from cubic_harness.sim.rates import spans  # noqa: E402
from cubic_harness.sim.step import pooled_ms, step_at  # noqa: E402
from cubic_harness.sim.traffic import ID_BYTES  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "plan_bound.json"


def main() -> None:
    name, cfg, c = next(x for x in cases(False) if x[0].startswith("dlrm-datasets-2022, 1,024"))
    wl, G, B = cfg.workload, cfg.group_size, cfg.batch_size
    t0 = wl.tables[0]
    alike = {(t.rows, t.dim, t.lookups(wl.profiled), t.weighted) for t in wl.tables}
    assert len(alike) == 1, "the cases below hold for alike tables only"
    n, dim = wl.num_tables, t0.dim
    cost = TableCosts(c)
    tw_plan = plan_for(dataclasses.replace(cfg, sharding="table_wise"), c)
    tw, pl = cost.step_ms(cfg, tw_plan), cost.step_ms(cfg, plan_for(dataclasses.replace(cfg, sharding="plan"), c))
    group = spans(cfg.world_size, G, cfg.group_placement, c)[0]
    ids1 = cost.shard(t0, cfg, 0, t0.rows, dim)[2]  # id bytes one shard of a table receives
    lens1 = G * B * ID_BYTES

    def least(k: int, max_cols: float, shards: float, max_shards: float, tables: int = n) -> dict[str, float]:
        """The parts a plan of `tables` tables in `k` column shards each sets, at their least: lookups
        spread evenly, the exchanges at these busiest-rank columns and shards."""
        f, b, _ = cost.shard(t0, cfg, 0, t0.rows, dim // k)
        cols = tables * dim
        pooled = pooled_ms(cfg, c, group, cols, max_cols)
        ex, beside = cost.exchange_ms(cfg, cols, max_cols, shards * B * ID_BYTES, max_shards * lens1,
                                      shards * ids1 / G, max_shards * ids1)
        return {"emb_fwd": tables * k * f / G, "emb_bwd": tables * k * b / G, "pooled": pooled,
                "inp": ex - 2 * pooled, "beside": beside}

    # the floor reproduces table-wise from its own parts: one whole table on the busiest position
    own = least(1, dim, n, 1)
    own.update(emb_fwd=own["emb_fwd"] * G / n, emb_bwd=own["emb_bwd"] * G / n)
    assert math.isclose(step_at(cfg, tw_plan, c, **own), tw, rel_tol=1e-9), (step_at(cfg, tw_plan, c, **own), tw)
    split = min((least(k, n * dim / G, 2 * n, 2) for k in (2, 4, 8, 16, 32)),
                key=lambda p: step_at(cfg, tw_plan, c, **p))
    dp_ms, dp_bytes = cost.dp_lookups(t0, cfg)
    rest = least(2, (n - 1) * dim / G, 2 * (n - 1), 2, n - 1)
    bounds = {
        "a table data-parallel": step_at(cfg, tw_plan, c, **{**rest, "emb_fwd": rest["emb_fwd"] + dp_ms,
                                                            "dp_sync": cost.dp_sync_ms(cfg, dp_bytes)}),
        "a shard as wide as its table": step_at(cfg, tw_plan, c, **least(1, dim, n, n / G)),
        "every table in column shards": step_at(cfg, tw_plan, c, **split),
    }
    bound = min(bounds.values())
    out = {"case": name, "table_wise_ms": tw, "plan_ms": pl, "bounds_ms": bounds, "bound_ms": bound,
           "plan_x_table_wise": tw / pl, "bound_x_table_wise": tw / bound, "plan_over_bound": pl / bound,
           "goal_ms": tw / 1.1}
    print(f"{name}: table-wise {tw:.3f} ms, the per-table plan {pl:.3f} ms ({tw / pl:.3f}x)")
    for k, v in bounds.items():
        print(f"  no plan with {k} is faster than {v:.3f} ms ({tw / v:.3f}x table-wise)")
    print(f"  any plan: at least {bound:.3f} ms, at most {tw / bound:.3f}x table-wise; the plan is "
          f"{pl / bound - 1:.1%} above it; 1.1x needs {out['goal_ms']:.3f} ms")
    DATA.write_text(json.dumps(out, indent=1))
    print(f"wrote {DATA}")


if __name__ == "__main__":
    main()
