"""Profiling a sample of the user's data (harness/profile.py): every format's bags, the hashing into rows,
tables of several features, the trace, skew, and one-line errors on bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cubic_harness.errors import ConfigError
from cubic_harness.profile import (
    FORMATS,
    ReadWarning,
    hash_to_rows,
    load_trace,
    profile_data,
    read_features,
    write_trace,
)
from cubic_harness.workload import TableSpec, Workload


def workload(*tables: tuple[str, int, list[str]]) -> Workload:
    specs = [TableSpec(name, rows, 16, 1, features=feats) for name, rows, feats in tables]
    return Workload("w", specs, 4, [32, 16], [16, 1]).validate()


def profiles(wl: Workload) -> dict:
    return {t.name: t.profile for t in wl.tables}


@pytest.fixture
def frame() -> pd.DataFrame:
    rng = np.random.default_rng(1)
    n = 400
    return pd.DataFrame({
        "user": rng.integers(0, 5000, n),  # ids above the table's rows: they wrap
        "item": rng.zipf(1.3, n),
        "tags": [list(rng.integers(0, 50, k)) if k else None for k in rng.integers(0, 6, n)],
        "city": rng.choice(["paris", "lyon", "nice", "lille"], n),
    })


# ---------------------------------------------------------------------- formats
def test_parquet_scalar_and_list_columns_match_pandas(tmp_path, frame):
    path = tmp_path / "d.parquet"
    frame.to_parquet(path)
    rows = 1000
    out = profile_data(path, workload(("u", rows, ["user"]), ("t", rows, ["tags"]), ("c", rows, ["city"])))
    p = profiles(out)
    assert out.id_source == "profile" and out.data.format == "parquet" and out.data.sample_rows == len(frame)
    assert p["u"].distinct == (frame.user % rows).nunique() and p["u"].lookups == len(frame)
    lens = frame.tags.map(lambda x: 0 if x is None else len(x))
    assert p["t"].samples == len(frame) and p["t"].lookups == lens.sum()
    assert p["t"].bag_mean == pytest.approx(lens.mean()) and p["t"].bag_max == lens.max()
    assert p["t"].distinct == (frame.tags.explode().dropna().astype(int) % rows).nunique()
    assert p["c"].distinct == 4 and out.data.hashing == "modulo+hash64"
    assert [t.pooling for t in out.tables] == [1, max(1, round(lens.mean())), 1]
    again = Workload.from_dict(json.loads(json.dumps(out.to_dict())))  # the profiled workload reloads
    assert profiles(again)["t"] == p["t"]


def test_csv_delimited_multi_hot_integer_and_text_ids(tmp_path):
    path = tmp_path / "movies.csv"
    path.write_text("user_id,genres,zip,city,codes\n"
                    "7,Action|Comedy,75001,Paris,3|1003\n"
                    "12,Drama,,Nice,\n"
                    "7,,75001,,5\n"
                    "1007,Action|Drama|Comedy,13002,Paris,12|2\n")
    n, bags, fmt = read_features(path, "auto", ["user_id", "genres", "zip", "city", "codes"])
    assert (n, fmt) == (4, "csv")
    assert bags["genres"][0].tolist() == [2, 1, 0, 3] and bags["zip"][0].tolist() == [1, 0, 1, 1]
    assert bags["user_id"][1].dtype.kind == "i"  # an integer column stays integer ...
    assert bags["zip"][1].tolist() == [75001, 75001, 13002]  # ... with gaps too (pandas reads those as floats)
    assert bags["codes"][1].tolist() == [3, 1003, 5, 12, 2]  # a delimited list of integers becomes integers
    assert bags["city"][1].tolist() == ["Paris", "Nice", "Paris"]
    out = profile_data(path, workload(("u", 1000, ["user_id"]), ("g", 100, ["genres"]), ("z", 1000, ["zip"]),
                                      ("c", 10_007, ["city"]), ("k", 1000, ["codes"])))
    p = profiles(out)
    assert p["u"].distinct == 2  # 7 and 1007 share row 7
    assert p["g"].distinct == 3 and p["g"].lookups == 6 and p["g"].bag_max == 3 and p["g"].bag_mean == 1.5
    assert sorted(p["z"].hot_rows) == [1, 2]
    assert p["c"].hot_rows[0] == hash_to_rows(np.array(["Paris"]), 10_007)[0] and p["c"].distinct == 2
    assert p["k"].distinct == 4  # 3 and 1003 share row 3


def _clicks(seed: int, n: int = 600) -> tuple[list[list[int]], list[list[str]]]:
    """A Taobao-style click sequence per row (integer item ids, 0-7 of them) and a tag list (words)."""
    rng = np.random.default_rng(seed)
    seqs = [rng.zipf(1.4, k).tolist() for k in rng.integers(0, 8, n)]
    tags = [rng.choice(["sport", "mode", "tech", "food", "home"], k, replace=False).tolist()
            for k in rng.integers(1, 4, n)]
    return seqs, tags


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_multi_hot_text_joined_by_caret_or_comma_is_split_as_pandas_splits_it(tmp_path, fmt):
    """A click sequence joined by `^` (Taobao's ad-click log) and tags joined by `,` are read as multi-hot
    columns, not one id per joined string: each table's distinct rows and bag lengths equal pandas' own count
    after splitting, and the profile records how each column was split."""
    seqs, tags = _clicks(3)
    df = pd.DataFrame({"clicks": ["^".join(map(str, x)) for x in seqs], "tags": [",".join(x) for x in tags],
                       "user": np.arange(len(seqs)) % 97})
    path = tmp_path / f"taobao.{fmt}"
    df.to_csv(path, index=False) if fmt == "csv" else df.to_parquet(path)
    rows = 10**6
    out = profile_data(path, workload(("c", rows, ["clicks"]), ("t", rows, ["tags"]), ("u", rows, ["user"])))
    p = profiles(out)
    split = df.clicks.str.split("^").explode().replace("", np.nan).dropna()
    assert p["c"].distinct == split.astype(int).nunique() and p["c"].lookups == len(split)
    assert p["c"].bag_mean == pytest.approx(np.mean([len(x) for x in seqs]))
    assert p["c"].bag_max == max(len(x) for x in seqs)
    words = df.tags.str.split(",").explode()
    assert p["t"].distinct == words.nunique() == 5 and p["t"].lookups == len(words)
    assert dict(out.data.multi_hot) == {"clicks": "^", "tags": ","}
    # read whole (the bug this guards: every joined string hashed as one id), the counts are far off
    with pytest.warns(ReadWarning, match="'clicks'.*'\\^'"):
        whole = profiles(profile_data(path, workload(("c", rows, ["clicks"])), multi_hot_sep="none"))["c"]
    assert whole.bag_mean < p["c"].bag_mean and whole.distinct != p["c"].distinct


def test_a_column_that_looks_multi_hot_warns_and_one_that_cannot_be_told_is_refused(tmp_path):
    """Spaces inside ids ("New York") are read whole with a warning naming the column and the separator; a
    named separator warns of another one the column holds; two separators under auto are one line, exit 2."""
    from typer.testing import CliRunner

    from cubic.cli.app import app

    path = tmp_path / "d.csv"
    path.write_text("city,both\nNew York,1^2\nParis,3;4\nNew York,5\n")
    with pytest.warns(ReadWarning, match="feature 'city'.*' '.*--multi-hot-sep ' '"):
        n, bags, _ = read_features(path, "auto", ["city"])
    assert bags["city"][1].tolist() == ["New York", "Paris", "New York"]
    with pytest.warns(ReadWarning, match="feature 'both'.*';'"):
        n, bags, _ = read_features(path, "auto", ["both"], multi_hot_sep="^")
    assert bags["both"][0].tolist() == [2, 1, 1]
    with pytest.raises(ConfigError, match="feature 'both'.*several separators \\[';', '\\^'\\].*--multi-hot-sep"):
        read_features(path, "auto", ["both"])
    wl_file = tmp_path / "w.json"
    wl_file.write_text(json.dumps(workload(("b", 100, ["both"])).to_dict()))
    r = CliRunner().invoke(app, ["workload", "profile", str(path), "--workload", str(wl_file)])
    assert r.exit_code == 2 and "several separators" in r.output and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(app, ["workload", "profile", str(path), "--workload", str(wl_file), "--multi-hot-sep", ";"])
    assert r.exit_code == 0, r.output
    assert "warning: " in r.output and "'^'" in r.output and "both: multi-hot, ids joined by ';'" in r.output


def test_tsv_and_max_rows(tmp_path):
    path = tmp_path / "d.tsv"
    pd.DataFrame({"a": np.arange(100), "b": np.arange(100) % 7}).to_csv(path, sep="\t", index=False)
    n, bags, fmt = read_features(path, "auto", ["a", "b"], max_rows=30)
    assert (n, fmt) == (30, "tsv") and bags["a"][1].tolist() == list(range(30))


def test_criteo_tsv_hex_ids_and_feature_mapping(tmp_path):
    rng = np.random.default_rng(2)
    n = 300
    ids = rng.integers(0, 2**32, (n, 26))
    lines = []
    for i in range(n):
        cats = ["" if (i + j) % 11 == 0 else f"{ids[i, j]:08x}" for j in range(26)]
        lines.append("\t".join([str(i % 2)] + [str(i)] * 13 + cats))
    path = tmp_path / "day_0"
    path.write_text("\n".join(lines) + "\n")
    rows = 977
    wl = workload(*[(f"t{j}", rows, []) for j in range(25)], ("last", rows, ["C26"]))
    out = profile_data(path, wl, fmt="criteo")
    assert out.data.hashing == "hex-modulo" and out.data.sample_rows == n
    for j, t in enumerate(out.tables):
        present = [(i + j) % 11 != 0 for i in range(n)]
        assert t.profile.lookups == sum(present)
        assert t.profile.distinct == len({int(ids[i, j]) % rows for i in range(n) if present[i]})
    n2, bags, _ = read_features(path, "criteo", ["cat_3", "C4"], max_rows=50)
    assert n2 == 50 and np.array_equal(bags["cat_3"][1], bags["C4"][1])


def test_kjt_npz_batches(tmp_path):
    keys = np.array(["f1", "f2"])
    # batch 0: B=3, f1 lengths [1, 2, 0], f2 lengths [1, 1, 1]; batch 1: B=2
    b0 = dict(keys_0=keys, lengths_0=np.array([1, 2, 0, 1, 1, 1]), values_0=np.array([10, 11, 12, 20, 21, 22]))
    b1 = dict(keys_1=keys, lengths_1=np.array([3, 1, 0, 2]), values_1=np.array([13, 14, 15, 16, 23, 24]))
    path = tmp_path / "kjt.npz"
    np.savez(path, **b0, **b1)
    n, bags, fmt = read_features(path, "auto", ["f2", "f1"])
    assert (n, fmt) == (5, "kjt")
    assert bags["f1"][0].tolist() == [1, 2, 0, 3, 1] and bags["f1"][1].tolist() == [10, 11, 12, 13, 14, 15, 16]
    assert bags["f2"][0].tolist() == [1, 1, 1, 0, 2] and bags["f2"][1].tolist() == [20, 21, 22, 23, 24]
    n, bags, _ = read_features(path, "kjt", ["f1"], max_rows=4)
    assert n == 4 and bags["f1"][1].tolist() == [10, 11, 12, 13, 14, 15]
    single = tmp_path / "one.npz"
    np.savez(single, keys=keys, lengths=b0["lengths_0"], values=b0["values_0"])
    assert read_features(single, "kjt", ["f2"])[1]["f2"][1].tolist() == [20, 21, 22]


def test_directory_reads_files_in_name_order(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"x": np.arange(10) + 100 * i}), folder / f"part-{i}.parquet")
    (folder / "_SUCCESS").write_text("")
    n, bags, fmt = read_features(folder, "auto", ["x"], max_rows=25)
    assert (n, fmt) == (25, "parquet") and bags["x"][1].tolist() == [*range(10), *range(100, 110), *range(200, 205)]


# ---------------------------------------------------------------------- hashing
def test_hash_to_rows():
    assert hash_to_rows(np.array([3, 10, 17, -1, -10]), 7).tolist() == [3, 3, 3, 6, 4]  # Python's modulo
    assert hash_to_rows(np.array([2**64 - 1], dtype=np.uint64), 10).tolist() == [5]
    assert hash_to_rows(np.array([4.0, 11.0]), 7).tolist() == [4, 4]
    words = np.array(["Action", "Comedy", "Action"], dtype=object)
    first = hash_to_rows(words, 1000)
    assert first[0] == first[2] and np.array_equal(first, hash_to_rows(words.astype(str), 1000))
    assert first.tolist() == (pd.util.hash_array(words.astype(str)) % np.uint64(1000)).astype(np.int64).tolist()
    assert (0 <= first).all() and (first < 1000).all()
    hexes = ["05db9164", "ffffffff", "a", "00000000deadBEEF"]
    want = [int(h, 16) % 1_000_003 for h in hexes]
    assert hash_to_rows(np.array(hexes), 1_000_003, hex_ids=True).tolist() == want
    assert hash_to_rows(np.array([h.encode() for h in hexes]), 1_000_003, hex_ids=True).tolist() == want
    with pytest.raises(ConfigError, match="not a hex id"):
        hash_to_rows(np.array(["12g4"]), 10, hex_ids=True)


def test_strings_hash_to_the_same_row_across_files_and_calls(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.parquet"
    pd.DataFrame({"c": ["x", "y", "x"]}).to_csv(a, index=False)
    pd.DataFrame({"c": ["y", "x", "x", "z"]}).to_parquet(b)
    wl = workload(("t", 10_007, ["c"]))
    x_row = int(hash_to_rows(np.array(["x"]), 10_007)[0])
    hot = [profiles(profile_data(f, wl))["t"].hot_rows[0] for f in (a, b, a)]
    assert hot == [x_row] * 3


# ---------------------------------------------------------------------- tables, trace, skew
def test_table_of_two_features_and_trace_round_trip(tmp_path, frame):
    path = tmp_path / "d.parquet"
    frame.to_parquet(path)
    wl = workload(("both", 3000, ["user", "tags"]), ("c", 20, ["city"]))
    trace = tmp_path / "wl" / "trace.npz"
    out = profile_data(path, wl, trace_path=trace, batch_sizes=(64,))
    p = profiles(out)["both"]
    lens_tags = frame.tags.map(lambda x: 0 if x is None else len(x)).to_numpy()
    assert p.samples == 2 * len(frame) and p.lookups == len(frame) + lens_tags.sum()
    assert 64 in p.reuse and p.reuse[64] >= 1.0
    assert out.data.trace == str(trace.resolve())
    assert out.data.trace_sha256 == hashlib.sha256(trace.read_bytes()).hexdigest()
    assert [f.name for f in trace.parent.iterdir()] == ["trace.npz"]  # no temporary file left
    (lens, rows, no_scores), (lens_c, rows_c, _) = load_trace(trace, 2)
    assert no_scores is None and out.data.scores == ()  # no weighted table
    assert lens.dtype == np.int64 and lens.reshape(-1, 2)[:, 0].tolist() == [1] * len(frame)
    assert lens.reshape(-1, 2)[:, 1].tolist() == lens_tags.tolist()
    user_rows = hash_to_rows(frame.user.to_numpy(), 3000)
    tag_rows = hash_to_rows(frame.tags.explode().dropna().astype(np.int64).to_numpy(), 3000)
    starts = np.concatenate([[0], np.cumsum(lens)])
    assert rows[starts[0:-1:2]].tolist() == user_rows.tolist()  # each sample: its user id, then its tags
    assert np.concatenate([rows[starts[i]:starts[i + 1]] for i in range(1, lens.size, 2)]).tolist() == tag_rows.tolist()
    assert rows_c.tolist() == hash_to_rows(frame.city.to_numpy(), 20).tolist() and lens_c.sum() == len(frame)
    frame.loc[0, "user"] += 1
    frame.to_parquet(path)
    assert profile_data(path, wl, trace_path=trace).data.trace_sha256 != out.data.trace_sha256


def test_write_trace_rows_dtype_and_sha(tmp_path):
    path = tmp_path / "t.npz"
    sha = write_trace(path, [(np.array([2, 0, 1]), np.array([5, 6, 2**40]))])
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    (lens, rows, _), = load_trace(path, 1)
    assert lens.tolist() == [2, 0, 1] and rows.tolist() == [5, 6, 2**40] and rows.dtype == np.int64


def test_skew_one_id_half_the_lookups(tmp_path):
    rng = np.random.default_rng(3)
    ids = np.where(np.arange(2000) % 2 == 0, 42, rng.integers(1000, 10**6, 2000))
    path = tmp_path / "skew.parquet"
    pd.DataFrame({"x": ids}).to_parquet(path)
    p = profiles(profile_data(path, workload(("t", 10**6, ["x"]))))["t"]
    assert p.top1_share >= 0.5 and p.hot_rows[0] == 42


# ---------------------------------------------------------------------- a weighted feature's scores
def weighted(*tables: tuple[str, int, list[str]]) -> Workload:
    """A workload of weighted tables (sum pooling, TorchRec's id-score lists)."""
    import dataclasses

    wl = workload(*tables)
    return dataclasses.replace(wl, tables=[dataclasses.replace(t, weighted=True) for t in wl.tables]).validate()


def replayed(out: Workload):
    """The first batch of the profiled workload replaying its trace: what the kernels are handed."""
    import dataclasses

    from cubic_harness.data import make_batch

    return make_batch(dataclasses.replace(out, id_source="trace"), 0, 0, 4)


def test_the_datas_own_scores_are_replayed_beside_its_ids(tmp_path):
    """Parquet: `f_weights`, a list of scores per row shaped as f's ids, goes into the trace beside the rows, and a
    replay hands the kernels those scores; a weighted table whose data has none gets synthetic ones."""
    from cubic_harness.data import id_scores

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"tags": [[3, 4], [5], [], [6, 7, 8]], "tags_weights": [[0.5, 2.0], [1.5], [], [3, 4, 5]],
                             "user": [1, 2, 3, 4]}), path)
    out = profile_data(path, weighted(("t", 100, ["tags"]), ("u", 10, ["user"])), trace_path=tmp_path / "tr.npz")
    assert out.data.scores == ("t",)
    (_, rows, scores), (_, _, none) = load_trace(tmp_path / "tr.npz", 2)
    assert rows.tolist() == [3, 4, 5, 6, 7, 8] and scores.tolist() == [0.5, 2.0, 1.5, 3, 4, 5] and none is None
    b = replayed(out)
    assert b.ids.tolist() == [3, 4, 5, 6, 7, 8, 1, 2, 3, 4]
    assert b.scores[:6].tolist() == [0.5, 2.0, 1.5, 3, 4, 5]  # the data's
    assert b.scores[6:].tolist() == id_scores(0, 1, np.array([1, 2, 3, 4])).tolist()  # no user_weights: synthetic
    again = Workload.from_dict(json.loads(json.dumps(out.to_dict())))
    assert again.data.scores == ("t",)


def test_scores_from_csv_and_kjt_weights(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("genres,genres_weights\n1|2,0.25|0.75\n3,2\n,\n")
    out = profile_data(csv, weighted(("g", 10, ["genres"])), trace_path=tmp_path / "c.npz")
    assert out.data.scores == ("g",) and load_trace(tmp_path / "c.npz", 1)[0][2].tolist() == [0.25, 0.75, 2.0]
    kjt = tmp_path / "k.npz"
    np.savez(kjt, keys=np.array(["f1", "f2"]), lengths=np.array([1, 2, 1, 0]), values=np.array([10, 11, 12, 20]),
             weights=np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32))
    out = profile_data(kjt, weighted(("a", 100, ["f2", "f1"])), trace_path=tmp_path / "k.trace.npz")
    lens, rows, scores = load_trace(tmp_path / "k.trace.npz", 1)[0]
    assert out.data.scores == ("a",) and rows.tolist() == [20, 10, 11, 12]  # per sample: f2's bag, then f1's
    assert scores.tolist() == pytest.approx([0.4, 0.1, 0.2, 0.3])


def test_profile_cli_says_where_scores_come_from_and_a_trial_replays_them(tmp_path):
    """`cubic workload profile` marks each weighted table's scores (the data's, or synthetic where it has none), and
    a real 2-rank trial on the replayed trace trains with them (the scores' all-to-all beside the ids')."""
    import dataclasses

    from typer.testing import CliRunner

    from cubic.cli.app import app
    from cubic_harness.config import TrialConfig
    from cubic_harness.trial import run_trial

    rng = np.random.default_rng(5)
    n = 512
    tags = [list(rng.integers(0, 500, k)) for k in rng.integers(1, 5, n)]
    pq.write_table(pa.table({"tags": tags, "tags_weights": [list(rng.uniform(0.1, 2.0, len(x))) for x in tags],
                             "user": rng.integers(0, 1000, n)}), tmp_path / "d.parquet")
    wl_file = tmp_path / "w.json"
    wl_file.write_text(json.dumps(weighted(("t", 500, ["tags"]), ("u", 1000, ["user"])).to_dict()))
    r = CliRunner().invoke(app, ["workload", "profile", str(tmp_path / "d.parquet"), "--workload", str(wl_file)])
    assert r.exit_code == 0, r.output
    assert "scores of weighted tables: t from the data (tags_weights); u synthetic (no user_weights in the data)" \
        in r.output
    wl, _ = Workload.from_json_file(wl_file)
    assert wl.data.scores == ("t",)
    res = run_trial(TrialConfig(workload=dataclasses.replace(wl, id_source="trace"), world_size=2, batch_size=64,
                                warmup_steps=1, measure_steps=3, kernel="native", sharding="row_wise", timeout_s=120))
    assert res.status == "ok", res.error
    assert res.env["ids"]["id_source"] == "trace"
    assert len(res.losses) == 4 and all(0 < x < 2 for x in res.losses), res.losses


@pytest.mark.parametrize("case, says", [
    ("count", "column 'tags_weights' has 1 scores in row 0 where feature 'tags' has 2 ids; one score per id"),
    ("text", "column 'tags_weights': scores must be numbers; found 'high'"),
    ("nan", "column 'tags_weights': scores must be finite"),
    ("files", "column 'tags_weights' is in some of the data's files and not in others"),
])
def test_bad_scores_are_one_line(tmp_path, case, says):
    folder = tmp_path / "parts"
    folder.mkdir()
    data = {"count": {"tags": [[1, 2]], "tags_weights": [[0.5]]}, "text": {"tags": [[1]], "tags_weights": [["high"]]},
            "nan": {"tags": [[1]], "tags_weights": [[float("nan")]]}, "files": {"tags": [[1]], "tags_weights": [[1.0]]}}
    pq.write_table(pa.table(data[case]), folder / "a.parquet")
    if case == "files":
        pq.write_table(pa.table({"tags": [[2]]}), folder / "b.parquet")
    with pytest.raises(ConfigError) as e:
        profile_data(folder, weighted(("t", 10, ["tags"])), trace_path=tmp_path / "tr.npz")
    assert "\n" not in str(e.value) and says in str(e.value), str(e.value)
    assert not (tmp_path / "tr.npz").exists()


# ---------------------------------------------------------------------- bad input
def _bad_inputs(tmp: Path) -> dict:
    """name -> (path, format, features, what the message must also say)."""
    (tmp / "empty.csv").write_text("")
    (tmp / "header.csv").write_text("a,b\n")
    (tmp / "bin.csv").write_bytes(b"a,b\n\x00\x01\x02")
    (tmp / "latin.csv").write_bytes("a\ncaf\xe9\n".encode("latin-1"))
    (tmp / "ok.csv").write_text("a,b\n1,2\n")
    pq.write_table(pa.table({"a": [{"k": 1}, {"k": 2}]}), tmp / "dict.parquet")
    pq.write_table(pa.table({"a": [[[1, 2]], [[3]]]}), tmp / "nested.parquet")
    (tmp / "notpq.parquet").write_text("hello")
    (tmp / "c.tsv").write_text("1\t2\t3\n")
    np.savez(tmp / "k.npz", keys=np.array(["f1"]), lengths=np.array([1]), values=np.array([3]))
    (tmp / "k.safetensors").write_bytes(b"x")
    return {
        "missing file": (tmp / "nope.csv", "csv", ["a"], "not found"),
        "empty file": (tmp / "empty.csv", "csv", ["a"], "empty"),
        "no rows": (tmp / "header.csv", "csv", ["a"], "no rows"),
        "binary": (tmp / "bin.csv", "csv", ["a"], "binary"),
        "not utf-8": (tmp / "latin.csv", "csv", ["a"], "UTF-8"),
        "no column": (tmp / "ok.csv", "csv", ["zz"], "columns found: ['a', 'b']"),
        "unknown format": (tmp / "ok.csv", "xls", ["a"], str(list(FORMATS))),
        "dict column": (tmp / "dict.parquet", "parquet", ["a"], "struct"),
        "nested lists": (tmp / "nested.parquet", "parquet", ["a"], "list<"),
        "not parquet": (tmp / "notpq.parquet", "auto", ["a"], "parquet"),
        "criteo fields": (tmp / "c.tsv", "criteo", ["C1"], "40"),
        "criteo feature": (tmp / "c.tsv", "criteo", ["price"], "C1..C26"),
        "kjt key": (tmp / "k.npz", "kjt", ["f9"], "keys found: ['f1']"),
        "safetensors": (tmp / "k.safetensors", "auto", ["f1"], "npz"),
    }


BAD = [
    "missing file", "empty file", "no rows", "binary", "not utf-8", "no column", "unknown format", "dict column",
    "nested lists", "not parquet", "criteo fields", "criteo feature", "kjt key", "safetensors"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_naming_file_and_feature(tmp_path, case):
    path, fmt, feats, says = _bad_inputs(tmp_path)[case]
    trace = tmp_path / "trace.npz"
    with pytest.raises(ConfigError) as e:
        profile_data(path, workload(("t", 100, feats)), fmt=fmt, trace_path=trace)
    msg = str(e.value)
    assert "\n" not in msg and path.name in msg and says in msg
    if case in ("no column", "dict column", "nested lists", "criteo feature", "kjt key"):
        assert repr(feats[0]) in msg
    assert not trace.exists() and not list(tmp_path.glob(".trace*"))  # nothing written


def test_bad_trace(tmp_path):
    good = tmp_path / "t.npz"
    write_trace(good, [(np.array([1]), np.array([0]))])
    (tmp_path / "bad.npz").write_bytes(good.read_bytes()[:40])
    for path, n, says in ((tmp_path / "none.npz", 1, "not found"), (tmp_path / "bad.npz", 1, "not a trace"),
                          (good, 2, "holds 1 tables")):
        with pytest.raises(ConfigError, match=says) as e:
            load_trace(path, n)
        assert path.name in str(e.value) and "\n" not in str(e.value)
