"""`cubic workload from-torchrec | profile`: the user's own model and data as a workload file.

    cubic workload from-torchrec mymodels.ranker:build -o ranker.json   # tables and dense part
    cubic workload profile sample.parquet --workload ranker.json         # + each table's ids, and a trace

The file is what `cubic trial --workload` and a space's `workload: {file: ...}` read.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import typer

from cubic_harness.errors import ConfigError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Make a workload file from your TorchRec model and a sample of your data.")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _write_json(path: Path, obj: dict) -> None:
    """Whole or not at all: a temp file in the same folder, then one rename."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot write the workload file: {e.strerror or e}") from None


def _summary(wl, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    tab = Table(title=title)
    for col in ("table", "features", "rows", "dim", "ids/sample", "distinct", "top 1%", "zipf a (err)", "reuse"):
        tab.add_column(col, justify="left" if col in ("table", "features") else "right")
    for t in wl.tables:
        p = t.profile
        features = ",".join(t.feature_names) + (" (weighted)" if t.weighted else "")
        tab.add_row(t.name, features, f"{t.rows:,}", str(t.dim), f"{t.lookups(wl.profiled):.2f}",
                    f"{p.distinct:,}" if p else "-", f"{p.top1_share:.1%}" if p else "-",
                    f"{p.zipf_alpha:.2f} ({p.zipf_fit_err:.2f})" if p else "-",
                    " ".join(f"{b}:{r:.2f}" for b, r in sorted(p.reuse.items())) if p else "-")
    Console(stderr=True).print(tab)
    if wl.data is not None and wl.weighted:
        typer.echo(_scores_line(wl), err=True)


def _scores_line(wl) -> str:
    """Where each weighted table's scores come from once profiled: the data's (a trace replays them), or
    synthetic where the data has no score column (`cubic_harness.profile.score_column`)."""
    from cubic_harness.profile import score_column

    def one(t) -> str:
        cols = ", ".join(score_column(f) for f in t.feature_names)
        return f"{t.name} from the data ({cols})" if t.name in wl.data.scores else (
            f"{t.name} synthetic (no {cols} in the data)")

    return "scores of weighted tables: " + "; ".join(one(t) for t in wl.tables if t.weighted)


@app.command("from-torchrec")
def from_torchrec(
    factory: str = typer.Argument(..., help="MODULE:FACTORY, a callable returning your TorchRec nn.Module."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Workload file to write (default: stdout)."),
    name: str = typer.Option("", "--name", help="The workload's name (default: the factory's)."),
    dense_features: int = typer.Option(0, "--dense-features", min=0,
                                       help="Dense inputs of a model TorchRec does not know (default: the first "
                                            "Linear's width)."),
    example_inputs: str = typer.Option("", "--example-inputs",
                                       help="MODULE:FUNCTION: FUNCTION(dense, kjt) returns your forward's arguments "
                                            "(a tuple, or a dict of keyword arguments), for a forward that takes "
                                            "a dict or another order than (dense, kjt)."),
) -> None:
    """Build the model on the meta device and write its tables, features and dense part as a workload."""
    import logging

    from cubic_harness.torchrec_import import import_workload

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    try:
        wl = import_workload(factory, name, dense_features, example_inputs)
        if output is not None:
            _write_json(output, wl.to_dict())
    except ConfigError as e:
        _fail(str(e))
    _summary(wl, f"{factory}: {len(wl.tables)} tables, interaction {wl.interaction}"
             + (f", dense part measured: {wl.dense_model.params:,} params, {wl.dense_model.flops_per_sample:,} "
                "FLOPs/sample" if wl.dense_model else ""))
    if output is None:
        print(json.dumps(wl.to_dict(), indent=1))
    else:
        typer.echo(f"wrote {output}: profile your data next: cubic workload profile DATA --workload {output}",
                   err=True)


@app.command("profile")
def profile(
    data: Path = typer.Argument(..., help="A sample of your data: Parquet, CSV/TSV, Criteo TSV, or TorchRec "
                                          "KeyedJaggedTensor batches (npz / safetensors), or a folder of them."),
    workload: Path = typer.Option(..., "--workload", "-w", help="The workload file whose tables the data feeds."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Where to write (default: the workload file)."),
    fmt: str = typer.Option("auto", "--format", help="auto, parquet, csv, tsv, criteo or kjt."),
    batch_sizes: str = typer.Option("1024,4096", "--batch-sizes",
                                    help="Comma-separated batch sizes to measure in-batch reuse at."),
    max_rows: int = typer.Option(0, "--max-rows", min=0, help="Read at most this many rows (0: all)."),
    multi_hot_sep: str = typer.Option("auto", "--multi-hot-sep",
                                      help="What joins the ids of a multi-hot text column: auto (the one of | , ; "
                                           "^ its values hold), none (each value is one id), or the separator."),
) -> None:
    """Profile each table's ids in the data (bag lengths, skew, in-batch reuse) into the workload, and save the
    sample's own rows as a trace beside it (id_source profile, or trace to replay them)."""
    import warnings

    from cubic_harness.profile import ReadWarning, profile_data
    from cubic_harness.workload import Workload

    out = output or workload
    try:
        sizes = tuple(int(x) for x in batch_sizes.split(",") if x.strip())
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        _fail(f"--batch-sizes {batch_sizes!r}: expected positive integers separated by commas")
    if not multi_hot_sep:
        _fail("--multi-hot-sep '': expected auto, none or the separator joining a column's ids (e.g. '^')")
    try:
        wl, _ = Workload.from_json_file(workload)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", ReadWarning)
            profiled = profile_data(data, wl, fmt=fmt, batch_sizes=sizes, max_rows=max_rows,
                                    trace_path=out.with_name(out.stem + ".trace.npz"), multi_hot_sep=multi_hot_sep)
        for w in said:
            if issubclass(w.category, ReadWarning):
                typer.echo(f"warning: {w.message}", err=True)
        _write_json(out, profiled.to_dict() | {"data": _relative_trace(profiled)})
    except ConfigError as e:
        _fail(str(e))
    for feature, sep in profiled.data.multi_hot:
        typer.echo(f"{feature}: multi-hot, ids joined by {sep!r}", err=True)
    _summary(profiled, f"{data.name}: {profiled.data.sample_rows:,} rows profiled ({profiled.data.format})")
    typer.echo(f"wrote {out} (id_source: profile; set id_source: trace to replay the sample itself)", err=True)


def _relative_trace(wl) -> dict:
    """The data record as written: the trace named relative to the workload file (they travel together)."""
    import dataclasses

    d = dataclasses.asdict(wl.data)
    d["trace"] = Path(d["trace"]).name if d["trace"] else ""
    return d
