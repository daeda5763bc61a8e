"""cubic.load_study, the analysis helpers, the plots and the notebook, on a study from a real tiny tune."""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.figure import Figure

from cubic.results import analysis, plots
from cubic_harness import scratch
from cubic_harness.errors import ConfigError
from tests.helpers import require

ROOT = Path(__file__).resolve().parents[1]
TUNE_TRIALS = 4
# What a tune could leave in the temp folder besides Ray's session logs: multiprocessing's folder
# for a Ray worker's fork servers' sockets, and the Ray runner's folder that holds it
LEFT_BEHIND = ("pymp-*", f"{scratch.PREFIX}*")


def cubic_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `cubic` command (from the repo root, as a user would)."""
    return subprocess.run([sys.executable, "-m", "cubic", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def tiny_tune(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy, for the calling module, of one real `cubic tune` on search_spaces/tiny.yaml.

    The tune is the slow part, so a session runs it once: the first module to ask (on any xdist worker) tunes
    into the session's shared temp root under a file lock while the others wait for it, and each module then
    works on its own copy (the commands it runs write reports and exports into the run directory)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the root the workers share
    run = shared / "tiny_tune"
    done, failed = run / ".tune_done", shared / "tiny_tune.failed"
    with open(shared / "tiny_tune.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if failed.exists():  # one failed tune is enough: do not rerun it for every module
            pytest.fail(failed.read_text(), pytrace=False)
        if not done.exists():
            # in a temp folder of its own (Ray's session too), to see what it leaves behind; a
            # short one, as Ray's socket paths live under it
            tmp = Path(tempfile.mkdtemp(prefix="cubic-t-"))
            try:
                r = cubic_cli("tune", "--space", "search_spaces/tiny.yaml", "--run-dir", str(run),
                              "--trials", str(TUNE_TRIALS), env={"TMPDIR": str(tmp)})
                left = sorted(p.name for pattern in LEFT_BEHIND for p in tmp.rglob(pattern))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            if r.returncode != 0:
                failed.write_text(f"cubic tune failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
                pytest.fail(failed.read_text(), pytrace=False)
            run.joinpath(".tmp_left.json").write_text(json.dumps(left))
            done.write_text("ok")
    own = tmp_path_factory.mktemp("tiny_tune")
    shutil.copytree(run, own, dirs_exist_ok=True)
    return own


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tune(tmp_path_factory)


@pytest.fixture(scope="module")
def df(run_dir: Path) -> pd.DataFrame:
    return analysis.load_study(run_dir)


def test_a_tune_on_ray_leaves_no_folder_of_its_own_in_the_temp_folder(run_dir: Path) -> None:
    """A Ray worker ends without running exit handlers, so the folder of its fork servers' sockets
    (pymp-*) outlived every tune; the runner gives the workers a folder of its own and removes it
    when the tune ends."""
    assert json.loads((run_dir / ".tmp_left.json").read_text()) == []


# ---------------------------------------------------------------------------------------------- load_study
def test_load_study_one_row_per_trial_with_every_metric(df: pd.DataFrame, run_dir: Path) -> None:
    assert len(df) >= TUNE_TRIALS
    assert df["number"].is_unique and df["number"].is_monotonic_increasing
    knobs = ["sharding", "batch_size", "emb_precision", "pipeline_depth"]  # search_spaces/tiny.yaml
    assert df.attrs["knobs"] == knobs
    for col in [*knobs, *analysis.SCALAR_METRICS, *(f"bd_{k}" for k in analysis.BREAKDOWN_KEYS),
                "state", "status", "reason", "datetime_start", "datetime_complete", "duration_s", "searcher",
                "phase", "predicted_qps", "predicted_std", "speedup", "ok", "is_winner", "config", "plan"]:
        assert col in df, col
    assert pd.api.types.is_datetime64_any_dtype(df["datetime_start"])
    ok = df[df["ok"]]
    assert len(ok) >= 1
    assert (ok["qps"] > 0).all() and (ok["bd_comm"].notna()).all() and (ok["duration_s"] >= 0).all()
    # the baseline runs first; every speed-up is relative to it
    base = df[df["phase"] == "baseline"]
    assert len(base) >= 1 and base["number"].min() == 0
    if base["ok"].iloc[0]:
        assert base["speedup"].iloc[0] == pytest.approx(1.0)
    # every trial's knob columns equal the config it ran
    for r in df.itertuples():
        if r.config:
            assert all(getattr(r, k) == r.config[k] for k in knobs), r.number
    # one study in the store: found without a name, by name, by .db path and by URL alike
    db = run_dir / "study.db"
    for src, name in ((str(db), None), (f"sqlite:///{db}", df.attrs["study"]), (run_dir, "tiny")):
        other = analysis.load_study(src, name)
        assert other["number"].tolist() == df["number"].tolist()
        assert other["qps"].fillna(-1).tolist() == df["qps"].fillna(-1).tolist()


def test_winner_and_summary(df: pd.DataFrame) -> None:
    win = df.attrs["winner"]
    assert win is not None and df["is_winner"].sum() == 1
    row = df[df["is_winner"]].iloc[0]
    assert row["ok"] and win["trial"] == row["number"]
    s = analysis.summary(df)
    assert s["trials"] + s["not_run"] == len(df) and s["winner_trial"] == win["trial"] and s["ok"] >= 1
    # the speed-up is the winner's qps over the baseline trial's, from the numbers the store holds: medians of
    # the confirm's re-measurements for a confirmed winner, else the first measurements
    base = analysis.baseline_rows(df).iloc[0]
    if s["confirmed"]:
        want_qps = row["confirm_qps_median"]
        want_base = base["qps"] if math.isnan(base["confirm_qps_median"]) else base["confirm_qps_median"]
    else:
        want_qps, want_base = row["qps"], base["qps"]
    assert s["winner_qps"] == pytest.approx(want_qps) and s["winner_baseline_qps"] == pytest.approx(want_base)
    # a confirmed winner's speed-up: the median ratio of its re-measurements to the baseline's run beside each
    paired = row["confirm_paired_speedup"] if s["confirmed"] else math.nan
    assert s["speedup"] == pytest.approx(want_qps / want_base if math.isnan(paired) else paired)
    if s["confirmed"] and not math.isnan(base["confirm_qps_median"]):  # the table's column agrees
        assert row["confirm_speedup"] == pytest.approx(s["speedup"])


def test_helpers_best_so_far_importance_top_k(df: pd.DataFrame) -> None:
    bsf = analysis.best_so_far(df)
    assert len(bsf) == len(df)
    best = bsf["best_qps"].dropna()
    assert best.is_monotonic_increasing and best.iloc[-1] == pytest.approx(df.loc[df["ok"], "qps"].max())
    imp = analysis.knob_importance(df)
    assert set(imp.index) == set(analysis.varying_knobs(df))
    assert (imp >= 0).all() and imp.sum() == pytest.approx(1.0)  # the fixture's trials vary: shares of it
    # ranked by the one speed-up every view shows: paired re-measurements where the confirm re-measured a trial
    top = analysis.top_k(df, k=3)
    ok = analysis.usable(df)
    # the order: the winner, then the re-measured, then those measured once, each by speed-up; a trial the
    # confirm spared after a pair may show a higher figure than the winner's median and still rank below it
    order = sorted(ok.itertuples(), key=lambda r: (not r.is_winner, math.isnan(r.confirm_qps_median), -r.speedup))
    assert 1 <= len(top) <= 3 and top["number"].tolist() == [r.number for r in order[:len(top)]]
    assert top["number"].iloc[0] == df.loc[df["is_winner"], "number"].iloc[0]
    own = ok["confirm_qps_median"].where(ok["speedup_remeasured"], ok["qps"]) / df.attrs["baseline_qps"]
    paired = ok["confirm_paired_speedup"].where(ok["speedup_remeasured"])
    assert ok["speedup"].tolist() == pytest.approx(paired.fillna(own).tolist())
    # a trial measured once never ranks above one the confirm re-measured, however high its one figure
    # (which trials the fixture's confirm re-measures depends on their speeds: one is made measured once here)
    assert ok["confirm_qps_median"].notna().sum() >= 2, "the fixture's confirm re-measured some"
    once = ok[ok["confirm_qps_median"].isna() | ~ok["is_winner"]]
    lucky = df.copy()
    at = lucky["number"] == once["number"].iloc[-1]
    lucky.loc[at, ["confirm_qps_median", "confirm_paired_speedup"]] = math.nan
    lucky.loc[at, "speedup"] = 10.0
    ranked = analysis.top_k(lucky, k=len(ok))
    re_measured = ranked["confirm_qps_median"].notna()
    assert re_measured.iloc[0] and not re_measured[re_measured.idxmin():].any()  # all re-measured first
    assert ranked.loc[~re_measured, "speedup"].iloc[0] == 10.0
    # the winner heads the table, above one the confirm spared after a pair whose figure is higher
    assert df["is_winner"].any(), "the fixture has a winner"
    spared = lucky.copy()
    other = ok.loc[ok["confirm_qps_median"].notna() & ~ok["is_winner"], "number"].iloc[0]
    spared.loc[spared["number"] == other, "speedup"] = 20.0
    assert bool(analysis.top_k(spared, k=len(ok))["number"].iloc[0] == df.loc[df["is_winner"], "number"].iloc[0])
    # tiny inputs are normal early in a tune: no exception, just nothing to rank
    one = df[df["number"] == 0]
    assert (analysis.knob_importance(one) == 0).all()
    assert analysis.knob_importance(df.iloc[0:0]).empty


def test_every_plot_is_a_figure_even_for_tiny_frames(df: pd.DataFrame) -> None:
    for frame in (df, df[df["number"] == 0], df[~df["ok"]], df.iloc[0:0]):
        for name, fn in plots.FIGURES.items():
            fig = fn(frame)
            assert isinstance(fig, Figure), name
            assert fig.axes, name


def test_bad_inputs_are_one_line_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such run directory"):
        analysis.load_study(tmp_path / "missing")
    with pytest.raises(ConfigError, match="no study in this run directory"):
        analysis.load_study(tmp_path)
    assert not (tmp_path / "study.db").exists()  # looking must not create an empty store
    (tmp_path / "study.db").write_text("not a database")
    with pytest.raises(ConfigError, match="cannot read the trial store") as e:
        analysis.load_study(tmp_path)
    assert "\n" not in str(e.value)


def test_wrong_study_name(run_dir: Path) -> None:
    with pytest.raises(ConfigError, match="no study named 'nope'"):
        analysis.load_study(run_dir, "nope")


def test_analysis_imports_without_torch() -> None:
    code = "import sys, cubic.results.analysis, cubic.deploy.export; print(json.dumps('torch' in sys.modules))"
    r = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) is False


# ---------------------------------------------------------------------------------------------- notebook
def test_notebook_runs_clean_on_a_real_study(run_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Executed by a real Jupyter kernel: the `python3` kernelspec is installed into a temp dir pointing at
    this interpreter (the venv), so no other Python on the machine can answer."""
    nbformat = require("nbformat")
    nbclient = require("nbclient")
    from ipykernel.kernelspec import install
    from jupyter_client.kernelspec import KernelSpecManager

    install(prefix=str(tmp_path / "jp"), kernel_name="python3")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jp" / "share" / "jupyter"))
    monkeypatch.setenv("CUBIC_RUN_DIR", str(run_dir))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable

    nb = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=180,
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) >= len(plots.FIGURES)
    html = "".join(o["data"].get("text/html", "") for o in outputs if "data" in o)
    assert "qps" in html  # the top-k / trials tables rendered
