"""How fast `cubic_harness.profile.profile_data` profiles 1M rows x 26 features, and whether its counts on DeepCTR's
sample data equal pandas' own.

1. Speed: 1M rows x 26 categorical features (Zipf-skewed integer ids, 4 of them multi-hot list columns, a few
   nulls) as a parquet file, and the same ids as a Criteo TSV (label, I1..I13, C1..C26 as 8-hex-digit ids,
   multi-hot features as their first id), in a temporary folder. Each is profiled against a 26-table
   workload with reuse at batch 4096: a warm-up on 10k rows, then 3 timed full runs (median, min-max), and
   one more writing the trace. -> benchmarks/data/profile_speed.json
2. `--deepctr DIR`: DeepCTR's criteo_sample.txt (C1..C26), avazu_sample.txt (every column but id, click,
   hour) and movielens_sample.txt (user_id, movie_id, gender, age, occupation, zip; genres multi-hot "|"),
   one table per feature (10,000 rows, dim 16), read as CSV. Each profile's distinct rows, lookups and bag
   mean/p95/max are checked against pandas' own counts of the same column. -> benchmarks/data/profile_deepctr.json

    .venv/bin/python benchmarks/bench_profile.py [--rows 1000000] [--deepctr /tmp/deepctr]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv as pv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cubic_harness.profile import profile_data  # noqa: E402
from cubic_harness.workload import TableSpec, Workload  # noqa: E402

FEATURES = 26
MULTI_HOT = {20: 3, 21: 8, 22: 20, 23: 5}  # feature -> mean bag length
TABLE_ROWS = [1_000_000, 40_000, 17_000, 7_400, 20_000, 3, 7_100, 1_500, 63, 1_000_000, 500_000, 400_000, 10,
              2_200, 12_000, 155, 4, 976, 14, 1_000_000, 1_000_000, 1_000_000, 590_000, 13_000, 108, 36]
DATA = Path(__file__).resolve().parent / "data"
console = Console(width=132)


def _workload(name: str, features: list[str], rows: list[int]) -> Workload:
    tables = [TableSpec(f"t{i}", r, 16, 1, features=[f]) for i, (f, r) in enumerate(zip(features, rows, strict=True))]
    return Workload(name, tables, 13, [64, 16], [64, 1]).validate(name)


def make_data(folder: Path, n: int, seed: int = 0) -> tuple[Path, Path]:
    """The parquet file and the Criteo TSV of the same ids."""
    rng = np.random.default_rng(seed)
    cols, first = {}, []
    for i in range(FEATURES):
        alpha = 1.05 + 0.45 * i / (FEATURES - 1)
        mean = MULTI_HOT.get(i, 1)
        lens = np.maximum(rng.poisson(mean, n), 1) if i in MULTI_HOT else np.ones(n, dtype=np.int64)
        ranks = rng.zipf(alpha, int(lens.sum())) % 5_000_000
        ids = (ranks * 2_654_435_761) % (1 << 31)  # hot ids scattered, not 1, 2, 3
        valid = rng.random(n) >= (0.03 if i % 5 == 0 else 0.0)
        if i in MULTI_HOT:
            offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            cols[f"f{i}"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids), mask=pa.array(~valid))
            first.append(np.where(valid, ids[offsets[:-1]], -1))
        else:
            cols[f"f{i}"] = pa.array(ids, mask=~valid)
            first.append(np.where(valid, ids, -1))
    pq_path = folder / "synthetic.parquet"
    pq.write_table(pa.table(cols), pq_path, row_group_size=1 << 17)
    hexes = b"0123456789abcdef"
    crit = {"label": pa.array(rng.integers(0, 2, n))}
    for j in range(1, 14):
        crit[f"I{j}"] = pa.array(rng.integers(0, 1000, n), mask=rng.random(n) < 0.1)
    lut = np.frombuffer(hexes, np.uint8)
    for i, ids in enumerate(first):
        nib = (ids[:, None].astype(np.uint64) >> (np.uint64(4) * np.arange(7, -1, -1, dtype=np.uint64))) & np.uint64(15)
        text = lut[nib].reshape(-1).view("S8")
        crit[f"C{i + 1}"] = pa.array(np.where(ids >= 0, text, b""), type=pa.binary()).cast(pa.string())
    tsv = folder / "criteo_synthetic.tsv"
    pv.write_csv(pa.table(crit), tsv, pv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"))
    return pq_path, tsv


def time_format(path: Path, wl: Workload, fmt: str, folder: Path) -> dict:
    profile_data(path, wl, fmt=fmt, batch_sizes=(4096,), max_rows=10_000)  # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = profile_data(path, wl, fmt=fmt, batch_sizes=(4096,))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    trace = folder / f"{fmt}_trace.npz"
    profile_data(path, wl, fmt=fmt, batch_sizes=(4096,), trace_path=trace)
    with_trace = time.perf_counter() - t0
    p = [t.profile for t in out.tables]
    return {"file_mb": round(path.stat().st_size / 2**20, 1), "rows": out.data.sample_rows, "features": len(p),
            "median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
            "max_s": round(max(times), 3),
            "with_trace_s": round(with_trace, 3), "trace_mb": round(trace.stat().st_size / 2**20, 1),
            "lookups": sum(x.lookups for x in p), "hashing": out.data.hashing,
            "top1_share_range": [round(min(x.top1_share for x in p), 3), round(max(x.top1_share for x in p), 3)],
            "zipf_alpha_range": [round(min(x.zipf_alpha for x in p), 3), round(max(x.zipf_alpha for x in p), 3)]}


def speed(n: int) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        pq_path, tsv = make_data(folder, n)
        console.print(f"made {n:,} rows x {FEATURES} features in {time.perf_counter() - t0:.1f} s")
        out["parquet"] = time_format(pq_path, _workload("bench-parquet", [f"f{i}" for i in range(FEATURES)],
                                                        TABLE_ROWS), "parquet", folder)
        out["criteo"] = time_format(tsv, _workload("bench-criteo", [f"C{i + 1}" for i in range(FEATURES)],
                                                   TABLE_ROWS), "criteo", folder)
    table = Table(title=f"profile_data, {n:,} rows x {FEATURES} features (3 runs after a warm-up)")
    for c in ("format", "file MB", "median s", "min-max s", "+trace s", "trace MB", "lookups", "hashing"):
        table.add_column(c, justify="right" if c not in ("format", "hashing") else "left")
    for fmt, r in out.items():
        table.add_row(fmt, f"{r['file_mb']}", f"{r['median_s']:.2f}", f"{r['min_s']:.2f}-{r['max_s']:.2f}",
                      f"{r['with_trace_s']:.2f}", f"{r['trace_mb']}", f"{r['lookups']:,}", r["hashing"])
    console.print(table)
    return out


# ---------------------------------------------------------------------- DeepCTR's samples
DEEPCTR = {
    "criteo": ("criteo_sample.txt", lambda cols: [c for c in cols if c.startswith("C")], ()),
    "avazu": ("avazu_sample.txt", lambda cols: [c for c in cols if c not in ("id", "click", "hour")], ()),
    "movielens": ("movielens_sample.txt",
                  lambda cols: ["user_id", "movie_id", "gender", "age", "occupation", "zip", "genres"], ("genres",)),
}
ROWS = 10_000


def pandas_counts(s: pd.Series, multi_hot: bool) -> dict:
    """What pandas itself says of a column: bag lengths, raw distinct ids and distinct rows after hashing
    (integers mod rows, text by pandas' stable hash mod rows)."""
    if multi_hot:
        parts = s.str.split("|")
        lengths = parts.str.len().fillna(0).astype(np.int64).to_numpy()
        ids = parts.explode().dropna()
    else:
        lengths = s.notna().astype(np.int64).to_numpy()
        ids = s.dropna()
    if pd.api.types.is_integer_dtype(ids.dtype):
        hashed = ids.to_numpy() % ROWS
    else:
        hashed = pd.util.hash_array(ids.astype(str).to_numpy()) % np.uint64(ROWS)
    return {"lengths": lengths, "raw_distinct": int(ids.nunique()), "distinct": int(pd.Series(hashed).nunique())}


def deepctr(folder: Path) -> dict:
    out = {}
    for name, (file, pick, multi) in DEEPCTR.items():
        path = folder / file
        df = pd.read_csv(path)
        feats = pick(list(df.columns))
        wl = _workload(f"deepctr-{name}", feats, [ROWS] * len(feats))
        t0 = time.perf_counter()
        prof = profile_data(path, wl, fmt="csv")
        secs = time.perf_counter() - t0
        rows = {}
        for f, t in zip(feats, prof.tables, strict=True):
            p, ref = t.profile, pandas_counts(df[f], f in multi)
            lens = ref["lengths"]
            want = {"distinct": ref["distinct"], "lookups": int(lens.sum()), "bag_mean": float(lens.mean()),
                    "bag_p95": int(np.percentile(lens, 95, method="inverted_cdf")), "bag_max": int(lens.max())}
            got = {k: getattr(p, k) for k in want}
            rows[f] = {"raw_distinct": ref["raw_distinct"], **got, "top1_share": round(p.top1_share, 4),
                       "top10_share": round(p.top10_share, 4), "zipf_alpha": p.zipf_alpha,
                       "zipf_fit_err": p.zipf_fit_err, "pooling": t.pooling,
                       "matches_pandas": all(np.isclose(got[k], v) for k, v in want.items())}
        out[name] = {"file": file, "rows": prof.data.sample_rows, "table_rows": ROWS, "hashing": prof.data.hashing,
                     "seconds": round(secs, 3), "all_match": all(r["matches_pandas"] for r in rows.values()),
                     "features": rows}
        table = Table(title=f"DeepCTR {file}: {prof.data.sample_rows} rows, {len(feats)} features, "
                            f"tables of {ROWS:,} rows ({secs:.2f} s)")
        for c in ("feature", "raw distinct", "distinct", "bag mean", "p95", "max", "top1", "top10", "alpha",
                  "= pandas"):
            table.add_column(c, justify="left" if c == "feature" else "right")
        for f, r in rows.items():
            table.add_row(f, str(r["raw_distinct"]), str(r["distinct"]), f"{r['bag_mean']:.3f}", str(r["bag_p95"]),
                          str(r["bag_max"]), f"{r['top1_share']:.3f}", f"{r['top10_share']:.3f}",
                          f"{r['zipf_alpha']:.2f}", "yes" if r["matches_pandas"] else "NO")
        console.print(table)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--deepctr", type=Path, default=None, help="folder of DeepCTR's *_sample.txt files")
    args = ap.parse_args()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    DATA.mkdir(exist_ok=True)
    res = speed(args.rows)
    (DATA / "profile_speed.json").write_text(json.dumps({"measured": stamp, "rows": args.rows, "results": res},
                                                        indent=1) + "\n")
    if args.deepctr:
        res = deepctr(args.deepctr)
        (DATA / "profile_deepctr.json").write_text(json.dumps({"measured": stamp, "results": res}, indent=1) + "\n")
        if not all(r["all_match"] for r in res.values()):
            raise SystemExit("a profile disagrees with pandas' own counts (see the tables above)")


if __name__ == "__main__":
    main()
