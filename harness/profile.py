"""Profile a sample of the user's data against a workload: each table's id statistics and a replayable trace.

A trial's speed follows the ids it looks up (which rows are hot, how often a batch repeats an id, how
long the bags are), so `cubic workload profile DATA --workload FILE` reads a sample of the user's own
data, hashes every feature's raw ids into its table's rows as training would, and stores per table an
`IdProfile` (harness/ids.py) and, beside the workload file, the hashed bags themselves (the trace).

Formats (`FORMATS`; `auto` picks by suffix, a directory by its files' common suffix, read in name order):

- parquet (.parquet, .pq): a column per feature, read with pyarrow (pandas.read_parquet's engine, without
  the per-row Python objects pandas makes of list columns): a scalar id (one id; null: none) or a list of
  ids (multi-hot; null: none). Struct, map and nested-list columns are refused.
- csv (.csv, .txt) / tsv (.tsv): pandas.read_csv with a header, a column per feature: a scalar id, or a
  string of ids (multi-hot, below); empty: no id. A column pandas reads as integers stays integer; only a
  column of non-integral numbers is read again as text.
- criteo: Criteo's TSV without a header: label, I1..I13, C1..C26 (39 fields: no label), categoricals as
  hex strings (empty: no id). A workload feature maps to a categorical by name: C1..C26, or positionally
  cat_0..cat_25 and t0..t25 (so the `criteo-mlperf-mini` preset's tables t0..t25 read C1..C26).
- kjt (.npz): TorchRec KeyedJaggedTensor parts: `keys` (feature names, a string array), `values` and
  `lengths` (feature-major: lengths[f * B + b]), one batch per file or several as keys_0/values_0/
  lengths_0, keys_1/... . The .safetensors form is not read: the `safetensors` package is not installed.

Scores of a weighted table's feature f (TorchRec's id-score lists, `TableSpec.weighted`), where the data has
them: parquet and CSV/TSV a column `f_weights` (`score_column`) beside f's ids, one number per id in the same
shape (a list, a delimited string, or a scalar); a KJT npz its `weights` array (`weights_0`, ...) beside
`values`. They go into the trace beside the rows, and a replay hands them to the kernels. A weighted table
whose features' scores are not all in the data takes synthetic ones (`data.id_scores`); Criteo has none.

Multi-hot text (parquet and CSV/TSV string columns): ids joined by a separator (MovieLens' "Action|Comedy",
Taobao's "12^7^12") are split by it, never hashed as one id. `multi_hot_sep` (`--multi-hot-sep`) names it;
`auto` (the default) splits a column by the one of `MULTI_HOT_SEPS` but the space that its values hold, and
refuses a column holding several of them (which one joins the ids cannot be told); a space alone is read
as part of the id ("New York"), with a warning, as is any separator a column holds that is not the one named.
`DataSample.multi_hot` records each column split and by what. Warnings are `ReadWarning`s (the CLI prints
each as one line).

Raw ids become rows (`hash_to_rows`; DataSample.hashing names the rules used): integers `id % rows`
("modulo", Python's sign rule), Criteo hex `int(hex, 16) % rows` ("hex-modulo"), text (and non-integral
numbers) pandas' stable 64-bit hash `% rows` ("hash64"); a workload mixing them joins the names by "+".
A table fed by several features gets one bag per (sample, feature), in that order.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import os
import re
import tempfile
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pv
import pyarrow.parquet as pq

from cubic_harness.errors import ConfigError
from cubic_harness.ids import profile_ids
from cubic_harness.workload import DataSample, Workload

FORMATS = ("auto", "parquet", "csv", "tsv", "criteo", "kjt")
MULTI_HOT_SEPS = ("|", ",", ";", "^", " ")  # the separators `auto` looks for, in text id columns


class ReadWarning(UserWarning):
    """Data read in a way the user may not expect (a column that looks multi-hot read whole): one line."""
SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".tsv": "tsv", ".csv": "csv", ".txt": "csv",
            ".npz": "kjt", ".safetensors": "kjt"}
CRITEO_DENSE, CRITEO_CATS = 13, 26
_COMPRESSED = (".gz", ".bz2", ".xz", ".zip", ".zst")
_HEX = np.full(256, 255, dtype=np.uint8)  # byte -> nibble; 16: NUL padding of a numpy bytes string; 255: bad
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
_HEX[0] = 16

Bags = tuple[np.ndarray, np.ndarray]  # (lengths int64 [bags], values concatenated in bag order)


# ---------------------------------------------------------------------- public API
def score_column(feature: str) -> str:
    """The column holding a weighted feature's scores, one per id (KJT: the batch's `weights`)."""
    return f"{feature}_weights"


def read_features(path: Path, fmt: str, features: list[str], *, max_rows: int = 0, multi_hot_sep: str = "auto",
                  scores: list[str] = (), split: dict[str, str] | None = None) -> tuple[int, dict[str, Bags], str]:
    """-> (rows read, feature -> (lengths int64 [rows], raw values concatenated), format actually used).
    `max_rows` > 0 reads at most that many rows (over a directory's files, in name order). `scores`: features
    whose scores to read too where the data has them (in every file), as `score_column(f)` -> (lengths,
    float64 scores). `multi_hot_sep`: how text ids are joined (module docstring); `split` (out): each column
    split, and by what."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: data file not found")
    files = _files(path)
    fmt = _resolve_format(path, fmt, files)
    features = list(dict.fromkeys(features))
    score_cols = [score_column(f) for f in dict.fromkeys(scores)] if fmt != "criteo" else []
    rows, parts = 0, {f: [] for f in features}
    found: set[str] | None = None  # the score columns every file read so far has
    for file in files:
        left = max_rows - rows if max_rows else 0
        if max_rows and left <= 0:
            break
        if file.stat().st_size == 0:
            raise ConfigError(f"{file}: empty file; expected {fmt} data with features {features}")
        if fmt == "parquet":
            n, bags = _read_parquet(file, features, left, _Split(multi_hot_sep, split), score_cols)
        elif fmt in ("csv", "tsv"):
            n, bags = _read_csv(file, features, left, "," if fmt == "csv" else "\t", _Split(multi_hot_sep, split),
                                fmt, score_cols)
        elif fmt == "criteo":
            n, bags = _read_criteo(file, features, left)
        else:
            n, bags = _read_kjt(file, features, left, score_cols)
        here = {c for c in score_cols if c in bags}
        if found is not None and here != found:
            odd = sorted(here ^ found)[0]
            raise ConfigError(f"{file}: column {odd!r} is in some of the data's files and not in others; scores "
                              "come from every file or none")
        found = here
        rows += n
        for f in [*features, *sorted(here)]:
            parts.setdefault(f, []).append(bags[f])
    if rows == 0:
        raise ConfigError(f"{path}: no rows (a header or empty batches only); expected at least one sample "
                          f"of features {features}")
    out = {}
    for f, ps in parts.items():
        vals = [v for _, v in ps if v.size] or [ps[0][1]]
        lens = ps[0][0] if len(ps) == 1 else np.concatenate([ln for ln, _ in ps])
        out[f] = lens.astype(np.int64, copy=False), vals[0] if len(vals) == 1 else np.concatenate(vals)
    for c in found or ():
        out[c] = out[c][0], _numbers(out[c][1], f"{path}: column {c!r}")
    return rows, out, fmt


def hash_to_rows(values: np.ndarray, rows: int, *, hex_ids: bool = False) -> np.ndarray:
    """Raw ids -> table rows in [0, rows), int64: integers (and integral floats) `value % rows` with Python's
    sign rule; `hex_ids` (Criteo) `int(hex, 16) % rows`; anything else its text's stable 64-bit hash
    (pandas.util.hash_array, the same in every process) `% rows`: the same string is always the same row."""
    if not isinstance(rows, int) or rows < 1:
        raise ConfigError(f"rows={rows!r} must be a positive integer")
    values = np.asarray(values)
    if values.size == 0:
        return np.empty(0, dtype=np.int64)
    if hex_ids:
        return (_parse_hex(values) % np.uint64(rows)).astype(np.int64)
    kind = values.dtype.kind
    if kind == "O" and pd.api.types.infer_dtype(values, skipna=False) == "integer":
        try:
            values, kind = values.astype(np.int64), "i"
        except OverflowError:
            pass
    if kind == "f" and np.isfinite(values).all() and (values == np.floor(values)).all() \
            and np.abs(values).max() < 2.0**63:
        values, kind = values.astype(np.int64), "i"
    if kind in "bi":
        return np.mod(values.astype(np.int64, copy=False), rows)  # numpy's % on signed ints floors, as Python's
    if kind == "u":
        return (values.astype(np.uint64, copy=False) % np.uint64(rows)).astype(np.int64)
    text = values if kind == "U" else values.astype(str)
    return (pd.util.hash_array(text) % np.uint64(rows)).astype(np.int64)


def profile_data(path: Path, wl: Workload, *, fmt: str = "auto", batch_sizes: tuple[int, ...] = (),
                 max_rows: int = 0, trace_path: Path | None = None, multi_hot_sep: str = "auto") -> Workload:
    """A copy of `wl` whose tables carry their IdProfile of the data at `path` (id_source 'profile', pooling
    the rounded mean bag length, at least 1) and whose `data` says where it came from. `trace_path`: also
    write the hashed bags there (`write_trace`; `data.trace` is its absolute path, which the CLI writes
    relative to the workload file).

    1. Read every table's features (`read_features`).
    2. Hash each feature's ids into its table's rows; a table of several features gets one bag per
       (sample, feature), in that order.
    3. Profile each table (cubic_harness.ids.profile_ids), reuse measured at `batch_sizes`.
    4. Only once the profiled workload validates, write the trace: bad input leaves nothing written.
    """
    path = Path(path)
    features = [f for t in wl.tables for f in t.feature_names]
    weighted = [f for t in wl.tables if t.weighted for f in t.feature_names]
    split: dict[str, str] = {}
    rows, bags, used = read_features(path, fmt, features, max_rows=max_rows, multi_hot_sep=multi_hot_sep,
                                     scores=weighted, split=split)
    kinds, tables, traces, scored = [], [], [], []
    for t in wl.tables:
        parts, score_parts = [], []
        for f in t.feature_names:
            lengths, values = bags[f]
            kinds.append("hex-modulo" if used == "criteo" else _hash_kind(values))
            try:
                parts.append((lengths, hash_to_rows(values, t.rows, hex_ids=used == "criteo")))
            except ConfigError as e:
                raise ConfigError(f"{path}: feature {f!r}: {e}") from None
            if t.weighted and score_column(f) in bags:
                score_lengths, s = bags[score_column(f)]
                if not np.array_equal(score_lengths, lengths):
                    row = int(np.flatnonzero(score_lengths != lengths)[0])
                    raise ConfigError(f"{path}: column {score_column(f)!r} has {score_lengths[row]} scores in row "
                                      f"{row} where feature {f!r} has {lengths[row]} ids; one score per id")
                score_parts.append((lengths, s))
        if score_parts and len(score_parts) == len(parts):  # every feature's scores, or the table's are synthetic
            scored.append(t.name)
        lengths, rows_hit = _interleave(parts)
        if rows_hit.size == 0:
            raise ConfigError(f"{path}: table {t.name!r} (features {t.feature_names}) has no ids in the {rows} rows "
                              "read; a profile needs at least one id")
        p = profile_ids(lengths, rows_hit, t.rows, tuple(batch_sizes), bags_per_sample=len(parts))
        tables.append(dataclasses.replace(t, profile=p, pooling=max(1, round(p.bag_mean * len(t.feature_names)))))
        traces.append((lengths, rows_hit, _interleave(score_parts)[1] if t.name in scored else None))
    hashing = "+".join(k for k in ("modulo", "hex-modulo", "hash64") if k in kinds)
    data = DataSample(source=path.name, format=used, sample_rows=rows, hashing=hashing, scores=tuple(scored),
                      multi_hot=tuple(sorted((f, sep) for f, sep in split.items() if f in features)))
    out = dataclasses.replace(wl, tables=tables, id_source="profile", data=data).validate(str(path))
    if trace_path is not None:
        sha = write_trace(Path(trace_path), traces)
        out.data = dataclasses.replace(data, trace=str(Path(trace_path).resolve()), trace_sha256=sha)
    return out


def write_trace(path: Path, tables: list[Bags | tuple[np.ndarray, np.ndarray, np.ndarray | None]]) -> str:
    """Write each table's (lengths, rows[, scores]) as an npz (lengths_{i}, rows_{i}: int32 where they fit, half
    the file, else int64; scores_{i} fp32 where a table has the data's scores; no pickle) and return its sha256.
    Written to a temporary file beside it, then renamed over it: a reader sees the old trace or the new one,
    never half of one."""
    path = Path(path)
    arrays = {}
    for i, (lengths, rows, *scores) in enumerate(tables):
        if scores and scores[0] is not None:
            arrays[f"scores_{i}"] = np.asarray(scores[0], dtype=np.float32)
        rows = np.asarray(rows)
        fits = rows.size == 0 or (int(rows.min()) >= -(2**31) and int(rows.max()) < 2**31)
        lengths = np.asarray(lengths, dtype=np.int64)
        arrays[f"lengths_{i}"] = lengths.astype(np.int32 if lengths.size == 0 or lengths.max() < 2**31 else np.int64)
        arrays[f"rows_{i}"] = rows.astype(np.int32 if fits else np.int64, copy=False)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        sha = _sha256(Path(tmp))
        os.replace(tmp, path)
        tmp = None
        return sha
    except OSError as e:
        raise ConfigError(f"{path}: cannot write the trace: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load_trace(path: Path, num_tables: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """The trace `write_trace` wrote: per table (lengths int64, rows int32 or int64, the data's scores fp32 or
    None), checked against the workload's table count and for lengths that add up to the rows (and scores)."""
    path = Path(path)
    rerun = "run `cubic workload profile DATA --workload FILE` again"
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ConfigError(f"{path}: trace not found; {rerun}") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{path}: not a trace (an npz of lengths_i, rows_i): {_line(e)}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ConfigError(f"{path}: not a trace (an npz of lengths_i, rows_i): a single array")
    with z:
        want = {f"{k}_{i}" for i in range(num_tables) for k in ("lengths", "rows")}
        if set(z.files) - {f"scores_{i}" for i in range(num_tables)} != want:
            held = sum(1 for k in z.files if k.startswith("lengths_"))
            raise ConfigError(f"{path}: trace holds {held} tables (arrays {sorted(z.files)[:6]}...); the workload "
                              f"has {num_tables}; {rerun}")
        out = []
        for i in range(num_tables):
            try:
                lengths, rows = z[f"lengths_{i}"], z[f"rows_{i}"]
                scores = z[f"scores_{i}"] if f"scores_{i}" in z.files else None
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise ConfigError(f"{path}: trace table {i} is corrupt: {_line(e)}; {rerun}") from None
            if (lengths.ndim != 1 or rows.ndim != 1 or lengths.dtype.kind not in "iu" or rows.dtype.kind not in "iu"
                    or (lengths.size and lengths.min() < 0) or int(lengths.sum()) != rows.size):
                raise ConfigError(f"{path}: trace table {i} is malformed (lengths must be >= 0 integers adding up "
                                  f"to the rows' count); {rerun}")
            if scores is not None and (scores.shape != rows.shape or scores.dtype.kind != "f"):
                raise ConfigError(f"{path}: trace table {i}'s scores are malformed (one float per row); {rerun}")
            out.append((lengths.astype(np.int64, copy=False), rows, scores))
    return out


# ---------------------------------------------------------------------- formats
def _files(path: Path) -> list[Path]:
    """The file, or a directory's data files in name order (hidden and _SUCCESS-style files left out)."""
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
    if not files:
        raise ConfigError(f"{path}: directory holds no data files")
    return files


def _resolve_format(path: Path, fmt: str, files: list[Path]) -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"{path}: unknown format {fmt!r}; choose one of {list(FORMATS)}")
    if fmt != "auto":
        return fmt
    suffixes = sorted({f.suffix.lower() for f in files})
    if len(suffixes) != 1:
        raise ConfigError(f"{path}: files with several suffixes {suffixes}; give the format (one of {list(FORMATS)})")
    if suffixes[0] not in SUFFIXES:
        raise ConfigError(f"{path}: cannot tell the format from the suffix {suffixes[0] or '(none)'!r} "
                          f"(known: {sorted(SUFFIXES)}); give the format (one of {list(FORMATS)})")
    return SUFFIXES[suffixes[0]]


def _missing(path: Path, features: list[str], found: list[str], what: str = "column") -> None:
    miss = [f for f in features if f not in found]
    if miss:
        shown = ", ".join(map(repr, found[:40])) + (f", ... ({len(found)} in all)" if len(found) > 40 else "")
        raise ConfigError(f"{path}: feature {miss[0]!r} has no {what}; {what}s found: [{shown}]")


def _read_parquet(path: Path, features: list[str], max_rows: int, sep: _Split,
                  optional: list[str] = ()) -> tuple[int, dict[str, Bags]]:
    try:
        pf = pq.ParquetFile(path)
        _missing(path, features, pf.schema_arrow.names)
        features = [*features, *(c for c in optional if c in pf.schema_arrow.names)]
        if max_rows:
            batches, n = [], 0
            for b in pf.iter_batches(batch_size=min(max_rows, 65536), columns=features):
                batches.append(b)
                n += b.num_rows
                if n >= max_rows:
                    break
            table = pa.Table.from_batches(batches, schema=pf.schema_arrow.empty_table().select(features).schema)
            table = table.slice(0, max_rows)
        else:
            table = pf.read(columns=features)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: not a readable parquet file: {_line(e)}") from None
    return table.num_rows, {f: _arrow_bags(table[f], f"{path}: feature {f!r}", sep.of(f)) for f in features}


def _read_csv(path: Path, features: list[str], max_rows: int, sep: str, multi_hot: _Split,
              fmt: str, optional: list[str] = ()) -> tuple[int, dict[str, Bags]]:
    _check_text(path, fmt)

    def read(**kw: object) -> pd.DataFrame:
        try:
            return pd.read_csv(path, sep=sep, **kw)
        except pd.errors.EmptyDataError:
            raise ConfigError(f"{path}: empty file; expected {fmt} with a header naming {features}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); expected {fmt}") from None
        except (pd.errors.ParserError, ValueError) as e:
            raise ConfigError(f"{path}: not readable as {fmt}: {_line(e)}") from None

    header = [str(c) for c in read(nrows=0).columns]
    _missing(path, features, header)
    features = [*features, *(c for c in optional if c in header)]
    df = read(usecols=features, nrows=max_rows or None, low_memory=False)
    # a column of non-integral numbers is an id column of text ("1.50" is not "1.5"): read those again as text
    floats = [f for f in features if df[f].dtype.kind == "f" and not _integral(df[f].dropna().to_numpy())]
    if floats:
        df[floats] = read(usecols=floats, nrows=max_rows or None, dtype=str, low_memory=False)[floats]
    out = {f: _arrow_bags(pa.array(df[f], from_pandas=True), f"{path}: feature {f!r}", multi_hot.of(f))
           for f in features}
    return len(df), out


def _criteo_column(feature: str) -> str | None:
    """C1..C26 by name; cat_0..cat_25 and t0..t25 by position."""
    m = re.fullmatch(r"C(\d+)|(?:cat_|t)(\d+)", feature)
    if not m:
        return None
    i = int(m[1]) - 1 if m[1] else int(m[2])
    return f"C{i + 1}" if 0 <= i < CRITEO_CATS else None


def _read_criteo(path: Path, features: list[str], max_rows: int) -> tuple[int, dict[str, Bags]]:
    _check_text(path, "criteo")
    cols = {f: _criteo_column(f) for f in features}
    bad = next((f for f, c in cols.items() if c is None), None)
    if bad is not None:
        raise ConfigError(f"{path}: feature {bad!r} is not a Criteo categorical; expected C1..C26 "
                          "(or cat_0..cat_25, t0..t25 by position)")
    try:
        with pa.input_stream(str(path), compression="detect") as fh:  # Arrow decompresses day_0.gz as it reads
            first = fh.read(1 << 16).split(b"\n", 1)[0]
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: not readable as Criteo TSV: {_line(e)}") from None
    fields = first.count(b"\t") + 1
    if fields not in (1 + CRITEO_DENSE + CRITEO_CATS, CRITEO_DENSE + CRITEO_CATS):
        raise ConfigError(f"{path}: line 1 has {fields} tab-separated fields; Criteo has 40 (label, I1..I13, "
                          "C1..C26) or 39 (no label)")
    names = (["label"] if fields == 40 else []) + [f"I{i}" for i in range(1, CRITEO_DENSE + 1)] + [
        f"C{i}" for i in range(1, CRITEO_CATS + 1)]
    want = sorted(set(cols.values()), key=lambda c: int(c[1:]))
    try:
        reader = pv.open_csv(path, read_options=pv.ReadOptions(column_names=names, block_size=1 << 24),
                             parse_options=pv.ParseOptions(delimiter="\t", quote_char=False),
                             convert_options=pv.ConvertOptions(include_columns=want,
                                                               column_types={c: pa.binary() for c in want}))
        batches, n = [], 0
        for b in reader:
            batches.append(b)
            n += b.num_rows
            if max_rows and n >= max_rows:
                break
        table = pa.Table.from_batches(batches, schema=reader.schema)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{path}: not Criteo TSV (label, I1..I13, C1..C26): {_line(e)}") from None
    if max_rows:
        table = table.slice(0, max_rows)
    bags = {c: _binary_bags(table[c]) for c in want}
    return table.num_rows, {f: bags[c] for f, c in cols.items()}


def _read_kjt(path: Path, features: list[str], max_rows: int, optional: list[str] = ()) -> tuple[int, dict[str, Bags]]:
    if path.suffix.lower() == ".safetensors":
        raise ConfigError(f"{path}: .safetensors needs the `safetensors` package, which is not installed; save the "
                          "KeyedJaggedTensor as .npz (keys, values, lengths)")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{path}: not a KJT npz (keys, values, lengths): {_line(e)}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ConfigError(f"{path}: a single array, not a KJT npz (keys, values, lengths)")
    with z:
        names = set(z.files)
        if {"keys", "values", "lengths"} <= names:
            tags = [""]
        else:
            tags = sorted((k[5:] for k in names if re.fullmatch(r"keys_\d+", k)), key=int)
            tags = [f"_{t}" for t in tags]
            if not tags:
                raise ConfigError(f"{path}: not a KJT npz: arrays {sorted(names)}; expected keys, values, lengths "
                                  "(or keys_0, values_0, lengths_0, ...)")
        weighted = [f for f in features if score_column(f) in optional] if all(f"weights{t}" in names for t in tags) \
            else []
        rows, parts = 0, {f: [] for f in [*features, *map(score_column, weighted)]}
        for tag in tags:
            if max_rows and rows >= max_rows:
                break
            try:
                keys, values, lengths = (z[f"{k}{tag}"] for k in ("keys", "values", "lengths"))
            except KeyError as e:
                raise ConfigError(f"{path}: batch{tag or ''} lacks {e.args[0]!r}; a KJT batch has keys, values, "
                                  "lengths") from None
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise ConfigError(f"{path}: KJT batch{tag} is unreadable (keys must be a string array, saved "
                                  f"without pickle): {_line(e)}") from None
            if keys.dtype.kind not in "US" or values.dtype.kind not in "iu" or lengths.dtype.kind not in "iu":
                raise ConfigError(f"{path}: KJT batch{tag}: keys must be strings, values and lengths integers "
                                  f"(got {keys.dtype}, {values.dtype}, {lengths.dtype})")
            keys = [k.decode() if isinstance(k, bytes) else str(k) for k in keys.reshape(-1)]
            _missing(path, features, keys, "key")
            nf = len(keys)
            if lengths.ndim != 1 or lengths.size % nf or (lengths.size and lengths.min() < 0) \
                    or int(lengths.sum()) != values.size:
                raise ConfigError(f"{path}: KJT batch{tag}: lengths must be {nf} features x B samples of counts "
                                  f">= 0 adding up to the {values.size} values")
            b = lengths.size // nf
            lens = lengths.reshape(nf, b).astype(np.int64)
            ends = np.cumsum(lens.sum(axis=1))
            take = min(b, max_rows - rows) if max_rows else b
            weights = None
            if weighted:
                weights = z[f"weights{tag}"].reshape(-1)
                if weights.dtype.kind not in "fiu" or weights.size != values.size:
                    raise ConfigError(f"{path}: KJT batch{tag}: weights must be numbers, one per value "
                                      f"({values.size}); got {weights.size} of {weights.dtype}")
            for f in features:
                i = keys.index(f)
                start = int(ends[i - 1]) if i else 0
                fl = lens[i, :take]
                parts[f].append((fl, values.reshape(-1)[start:start + int(fl.sum())]))
                if weights is not None and f in weighted:
                    parts[score_column(f)].append((fl, weights[start:start + int(fl.sum())]))
            rows += take
    return rows, {f: (np.concatenate([p[0] for p in ps]) if ps else np.empty(0, np.int64),
                      np.concatenate([p[1] for p in ps]) if ps else np.empty(0, np.int64))
                  for f, ps in parts.items()}


# ---------------------------------------------------------------------- columns -> bags
class _Split:
    """One read's multi-hot rule (`multi_hot_sep`) and its record of the columns it split."""

    def __init__(self, sep: str, record: dict[str, str] | None) -> None:
        self.sep, self.record = sep, record if record is not None else {}

    def of(self, feature: str) -> _Column:
        return _Column(self, feature)


@dataclasses.dataclass(frozen=True)
class _Column:
    rule: _Split
    feature: str

    def separator(self, arr: pa.Array, where: str) -> str | None:
        """The separator to split this text column by (None: its values are whole ids), warning where the
        values hold a separator that is not used."""
        def holding(c: str) -> pa.Array:
            return pc.fill_null(pc.match_substring(arr, c), False)

        seen = [c for c in MULTI_HOT_SEPS if pc.any(holding(c)).as_py()]
        sep = self.rule.sep

        def example(c: str) -> str:
            return str(arr.filter(holding(c))[0].as_py())[:40]

        if sep == "auto":
            joined = [c for c in seen if c != " "]
            if len(joined) > 1:
                raise ConfigError(f"{where}: its text holds several separators {joined} (e.g. {example(joined[0])!r}"
                                  f", {example(joined[1])!r}); name the one joining its ids: --multi-hot-sep SEP, "
                                  "or none to read each value as one id")
            use = joined[0] if joined else None
        else:
            use = sep if sep != "none" and sep in seen else None
        for c in seen:
            if c != use and not (use and c in use):
                warnings.warn(f"{where}: read as whole ids, but its values hold {c!r} (e.g. {example(c)!r}); if "
                              f"they are ids joined by it: --multi-hot-sep {c!r}", ReadWarning, stacklevel=2)
        if use is not None:
            self.rule.record[self.feature] = use
        return use


def _arrow_bags(arr: pa.Array | pa.ChunkedArray, where: str, column: _Column | None = None) -> Bags:
    """A column's bags: a scalar id per row (null or empty text: none), a list of ids, or text of ids joined by
    a separator (`_Column.separator`; each id trimmed of spaces). Ids of a split string that are all integers
    become integers."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    split = False
    sep = column.separator(arr, where) if column is not None and _is_text(arr.type) and len(arr) else None
    if sep is not None:
        parts = pc.split_pattern(arr, sep)
        arr, split = pa.ListArray.from_arrays(parts.offsets, pc.utf8_trim_whitespace(parts.values),
                                              mask=parts.is_null()), True
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        if not _is_scalar(t.value_type):
            raise ConfigError(f"{where}: a column of {t} is not read; expected integer or string ids, or a list "
                              "of them")
        flat, parent = pc.list_flatten(arr), pc.list_parent_indices(arr).to_numpy()
        if pa.types.is_dictionary(flat.type):
            flat = flat.dictionary_decode()
        keep = _present(flat)
        if keep is not None:
            flat, parent = flat.filter(pa.array(keep)), parent[keep]
        values = _to_numpy(flat)
        if split:
            try:
                values = pc.cast(flat, pa.int64()).to_numpy()
            except pa.ArrowInvalid:
                pass
        return np.bincount(parent, minlength=len(arr)).astype(np.int64), values
    if not _is_scalar(t):
        raise ConfigError(f"{where}: a column of {t} is not read; expected integer or string ids, or a list of them")
    keep = _present(arr)
    if keep is None:
        return np.ones(len(arr), dtype=np.int64), _to_numpy(arr)
    return keep.astype(np.int64), _to_numpy(arr.filter(pa.array(keep)))


def _binary_bags(col: pa.ChunkedArray) -> Bags:
    """A Criteo categorical's bags straight from Arrow's buffers (no Python object per id), chunk by chunk:
    empty -> no id, else the id's bytes as a numpy bytes string (hex, parsed by `hash_to_rows`)."""
    parts = [_chunk_bags(c) for c in col.chunks] or [(np.empty(0, np.int64), np.empty(0, dtype="S1"))]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _chunk_bags(arr: pa.Array) -> Bags:
    n = len(arr)
    offs = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset:arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8) if arr.buffers()[2] is not None else np.empty(0, np.uint8)
    lens = np.diff(offs)
    if arr.null_count:
        lens = np.where(arr.is_valid().to_numpy(zero_copy_only=False), lens, 0)
    present = lens > 0
    width = int(lens.max()) if n else 0
    if width == 0:
        return np.zeros(n, dtype=np.int64), np.empty(0, dtype="S1")
    if (lens[present] == width).all() and int(lens.sum()) == int(offs[-1] - offs[0]):  # contiguous, equal widths
        values = data[offs[0]:offs[-1]].view(f"S{width}")
    else:
        at = offs[:-1][present][:, None] + np.arange(width)
        inside = np.arange(width) < lens[present][:, None]
        values = np.where(inside, data[np.minimum(at, data.size - 1)], 0).astype(np.uint8).reshape(-1).view(
            f"S{width}")
    return present.astype(np.int64), values


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_scalar(t: pa.DataType) -> bool:
    return (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t)
            or _is_text(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
            or (pa.types.is_dictionary(t) and _is_scalar(t.value_type)))


def _present(arr: pa.Array) -> np.ndarray | None:
    """Which entries are ids (not null, not empty text); None: all of them."""
    if pa.types.is_null(arr.type):
        return np.zeros(len(arr), dtype=bool)
    keep = arr.is_valid()
    if _is_text(arr.type) or pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
        keep = pc.and_(keep, pc.fill_null(pc.greater(pc.binary_length(arr), 0), False))
    keep = keep.to_numpy(zero_copy_only=False)
    return None if keep.all() else keep


def _to_numpy(arr: pa.Array) -> np.ndarray:
    """Ids without nulls as numpy: integers as they are, booleans as 0/1, text as an object array of str."""
    t = arr.type
    if pa.types.is_null(t):
        return np.empty(0, dtype=np.int64)
    if pa.types.is_boolean(t):
        return arr.to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        try:
            arr = arr.cast(pa.large_string())
        except pa.ArrowInvalid:
            pass  # not UTF-8: each id's bytes are hashed as they are
    return arr.to_numpy(zero_copy_only=False)


def _parse_hex(values: np.ndarray) -> np.ndarray:
    """Hex strings -> uint64, vectorised over the bytes (a lookup table per byte, a shift per digit)."""
    try:
        v = values if values.dtype.kind == "S" else np.char.encode(values.astype(str), "ascii")
    except UnicodeEncodeError as e:
        raise ConfigError(f"not a hex id ({e.object!r}); expected up to 16 hex digits") from None
    width = v.dtype.itemsize
    if width > 16:
        raise ConfigError(f"hex id {v[np.char.str_len(v).argmax()].decode(errors='replace')!r} has more than 16 "
                          "digits")
    mat = np.ascontiguousarray(v).view(np.uint8).reshape(v.size, width)
    nib = _HEX[mat]
    full = bool(mat[:, -1].all())  # every id `width` digits long (Criteo's 8): no padding to find
    length = np.full(v.size, width) if full else width - np.argmax(mat[:, ::-1] != 0, axis=1)
    if not full:
        length[~mat.any(axis=1)] = 0
    bad = (nib >= 16).any(axis=1) if full else ((nib >= 16) & (np.arange(width) < length[:, None])).any(axis=1)
    bad |= length == 0
    if bad.any():
        raise ConfigError(f"not a hex id: {v[bad.argmax()].decode(errors='replace')!r}; expected 1 to 16 hex digits")
    digits = nib if full else np.where(nib == 16, 0, nib)
    acc = np.zeros(v.size, dtype=np.uint64)
    for j in range(width):
        acc = (acc << np.uint64(4)) | digits[:, j]
    return acc if full else acc >> (np.uint64(4) * (width - length).astype(np.uint64))


def _interleave(parts: list[Bags]) -> Bags:
    """Several features' bags of one table -> one bag per (sample, feature), sample-major, as TorchRec's
    table of shared features sees them."""
    if len(parts) == 1:
        return parts[0]
    s, nf = parts[0][0].size, len(parts)
    lens = np.stack([p[0] for p in parts], axis=1)  # [samples, features]
    starts = (np.cumsum(lens.ravel()) - lens.ravel()).reshape(s, nf)
    out = np.empty(int(lens.sum()), dtype=np.result_type(*(p[1].dtype for p in parts)))
    for f, (fl, rows) in enumerate(parts):
        own = np.cumsum(fl) - fl  # where each of this feature's bags starts in its own values
        out[np.arange(rows.size) + np.repeat(starts[:, f] - own, fl)] = rows
    return lens.ravel(), out


# ---------------------------------------------------------------------- small helpers
def _numbers(values: np.ndarray, where: str) -> np.ndarray:
    """Scores as float64 (CSV's may come as text): one line naming the column where one is not a finite number."""
    try:
        out = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        bad = next((v for v in values if not _is_number(v)), values[:1])
        raise ConfigError(f"{where}: scores must be numbers; found {bad!r}") from None
    if out.size and not np.isfinite(out).all():
        raise ConfigError(f"{where}: scores must be finite; found {out[~np.isfinite(out)][0]}")
    return out


def _is_number(v: object) -> bool:
    try:
        float(v)  # type: ignore[arg-type]
        return True
    except (TypeError, ValueError):
        return False


def _hash_kind(values: np.ndarray) -> str:
    k = values.dtype.kind
    return "modulo" if k in "biu" or (k == "f" and _integral(values)) or (
        k == "O" and pd.api.types.infer_dtype(values, skipna=False) == "integer") else "hash64"


def _integral(values: np.ndarray) -> bool:
    return bool(np.isfinite(values).all() and (values == np.floor(values)).all())


def _check_text(path: Path, fmt: str) -> None:
    """A text format's file must be text: no NUL byte, UTF-8 in its first 64 KiB (compressed files: pandas'
    and Arrow's readers decompress them)."""
    if path.suffix.lower() in _COMPRESSED:
        return
    with open(path, "rb") as fh:
        head = fh.read(1 << 16)
    nul = head.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"{path}: a binary file (NUL byte at {nul}); expected {fmt} text")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); expected {fmt} text") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
