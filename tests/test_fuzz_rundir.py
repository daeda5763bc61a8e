"""Broken run directories and trial stores, fed to every command that reads one: `cubic report`, `cubic export`,
`cubic verify`, `cubic tune --run-dir/--storage` (a resume) and `cubic tune --warm-start`. Each case ends as the
command's result where the command is right to go on (exit 0, said why below), or as exactly one line on stderr
("error: ..." naming what is wrong) with exit 2: never a traceback, never another exit code, nothing on stdout,
and nothing written (no run directory, no store, no half-written report or export), checked by listing every
file with its size and mtime before and after.

The valid store the broken ones are cut from is one simulated tune of search_spaces/tiny.yaml (a second or
two, no training); the others are built with sqlite3 and Optuna's own API."""

from __future__ import annotations

import os
import re
import socket
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from optuna.storages import RDBStorage
from typer.testing import CliRunner

from cubic.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
SPACE = str(ROOT / "search_spaces" / "tiny.yaml")
SIM = ["--backend", "sim", "--cluster", "h100-8", "--space", SPACE, "--no-live"]
STUDY = "tiny@sim:h100-8"  # the study a simulated tune of tiny.yaml makes (and resumes)
SECRET = "s3cretpw"


@pytest.fixture(scope="module")
def good_db(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of a valid study.db: a simulated tune (baseline, a proposal or two, the confirm)."""
    run = tmp_path_factory.mktemp("good") / "run"
    r = CliRunner().invoke(app, ["tune", *SIM, "--run-dir", str(run), "--trials", "3"])
    assert r.exit_code == 0, r.output[-2000:]
    return (run / "study.db").read_bytes()


def _closed_port() -> int:
    """A local TCP port nobody listens on (bound, then released): a connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- the corpus
def _run_dir(root: Path, db: bytes | None = None) -> Path:
    d = root / "run"
    d.mkdir()
    if db is not None:
        (d / "study.db").write_bytes(db)
    return d


def _sql(root: Path, good: bytes, *statements: str) -> Path:
    d = _run_dir(root, good)
    with sqlite3.connect(d / "study.db") as con:
        for s in statements:
            con.execute(s)
    con.close()
    return d


def _study(root: Path, state: optuna.trial.TrialState | None) -> Path:
    """A store holding the tuner's study with no trial, or with one trial in `state`."""
    d = _run_dir(root)
    storage = RDBStorage(f"sqlite:///{d / 'study.db'}")
    study = optuna.create_study(study_name=STUDY, storage=storage, direction="maximize")
    if state is optuna.trial.TrialState.RUNNING:  # a tuner that died mid-trial
        study.ask()
    elif state is optuna.trial.TrialState.FAIL:  # a baseline that ran out of memory
        study.add_trial(optuna.trial.create_trial(state=state, user_attrs={
            "status": "oom", "error": "out of memory", "phase": "baseline"}))
    storage.engine.dispose()
    return d


def _other_sqlite(root: Path) -> Path:
    d = _run_dir(root)
    with sqlite3.connect(d / "study.db") as con:
        con.execute("CREATE TABLE x (a)")
    con.close()
    return d


def _no_study(root: Path) -> Path:
    d = _run_dir(root)
    RDBStorage(f"sqlite:///{d / 'study.db'}").engine.dispose()  # Optuna's schema, no study in it
    return d


def _other_study(root: Path, good: bytes) -> Path:
    d = _run_dir(root, good)
    storage = RDBStorage(f"sqlite:///{d / 'study.db'}")
    optuna.create_study(study_name="other", storage=storage)
    storage.engine.dispose()
    return d


def _file(root: Path) -> Path:
    f = root / "run"
    f.write_text("not a run directory\n")
    return f


def _dir_as_db(root: Path) -> Path:
    d = _run_dir(root)
    (d / "study.db").mkdir()
    return d


# name -> (builder(root, good store bytes) -> the run dir or URL, what the one line must say)
CASES: dict[str, tuple[Callable[[Path, bytes], Path | str], str]] = {
    "missing_dir": (lambda r, g: r / "nope", "no such run directory"),
    "empty_dir": (lambda r, g: _run_dir(r), "no study in this run directory"),
    "run_dir_is_a_file": (lambda r, g: _file(r), "not a database|not a directory"),
    "empty_store": (lambda r, g: _run_dir(r, b""), "not a cubic/Optuna trial store"),
    "truncated_store": (lambda r, g: _run_dir(r, g[: len(g) // 2]), "malformed"),
    "store_header_only": (lambda r, g: _run_dir(r, g[:100]), "malformed|not a database"),
    "binary_store": (lambda r, g: _run_dir(r, bytes(range(256)) * 8), "not a database"),
    "text_store": (lambda r, g: _run_dir(r, b"a text file, not SQLite\n" * 20), "not a database"),
    "store_is_a_dir": (lambda r, g: _dir_as_db(r), "no study in this run directory|is not a file"),
    "other_sqlite_db": (lambda r, g: _other_sqlite(r), "not a cubic/Optuna trial store"),
    "schema_no_study": (lambda r, g: _no_study(r), "holds no study|no study of search space"),
    "two_studies": (lambda r, g: _other_study(r, g), "2 studies in this store"),
    "wrong_study_name": (lambda r, g: _run_dir(r, g), "no study named 'nosuch'"),
    "study_no_trials": (lambda r, g: _study(r, None), "has no trials yet|no study of search space"),
    "study_running_only": (lambda r, g: _study(r, optuna.trial.TrialState.RUNNING),
                           "no completed trial|no study of search space"),
    "study_failed_only": (lambda r, g: _study(r, optuna.trial.TrialState.FAIL),
                          "no completed trial.*out of memory|no study of search space"),
    "no_winner": (lambda r, g: _sql(r, g, "DELETE FROM study_user_attributes WHERE key = 'winner'"), ""),
    "schema_of_another_optuna": (lambda r, g: _sql(r, g, "UPDATE alembic_version SET version_num = 'v9.9.9.x'"),
                                 "no longer compatible"),
    "url_bad_scheme": (lambda r, g: "nosuch://host/db", "nosuch"),
    "url_not_a_url": (lambda r, g: "::::", "no such run directory|parse"),
    "url_postgres_closed_port": (lambda r, g: f"postgresql://cubic:{SECRET}@127.0.0.1:{_closed_port()}/db",
                                 "refused|connect|driver"),
    "url_sqlite_missing_file": (lambda r, g: f"sqlite:///{r}/nodir/study.db", "no such SQLite|unable to open"),
    "url_no_driver": (lambda r, g: f"mysql://cubic:{SECRET}@127.0.0.1:{_closed_port()}/db", "mysql"),
}

# (command, case) that succeed, and why that is right. Everything else must be exit 2 and one line.
SUCCEEDS = {
    # tune: a run directory or store without the tuner's study is a new tune; one with it, a resume
    ("tune", "missing_dir"): "a new run directory",
    ("tune", "empty_dir"): "a new run in an existing directory",
    ("tune", "empty_store"): "a 0-byte file is an empty SQLite database: a new store",
    ("tune", "schema_no_study"): "an empty Optuna store: the tuner makes its study in it",
    ("tune", "two_studies"): "its own study resumes; the other one is left alone",
    ("tune", "study_no_trials"): "resumes a study that had not started",
    ("tune", "study_running_only"): "resumes a dead tuner's study (its RUNNING trial becomes 'interrupted')",
    ("tune", "study_failed_only"): "resumes: the failed baseline stays failed, the budget goes on",
    ("tune", "no_winner"): "resumes a tune killed before its confirm",
    # report / export: completed trials but no confirmed winner (a tune killed before its confirm): the fastest
    # measured trial, marked "not confirmed" (documented in `cubic export --help`)
    ("report", "no_winner"): "reports the best measured trial, not yet confirmed",
    ("export", "no_winner"): "exports the best measured trial, marked not confirmed",
    # --warm-start: a store holding a study of the same space (beside another) is a good source
    ("warm-start", "two_studies"): "learns from the study of the same space",
    ("warm-start", "no_winner"): "learns from the trials; a winner is not needed",
}
# verify would train in TorchRec where it may go on; --study exists only on the readers
SKIP = {("verify", "no_winner"), ("tune", "wrong_study_name"), ("warm-start", "wrong_study_name")}
COMMANDS = ("report", "export", "verify", "tune", "warm-start")


def _argv(command: str, target: str, root: Path, case: str) -> list[str]:
    url = "://" in target or target == "::::"
    study = ["--study", "nosuch"] if case == "wrong_study_name" else []
    if command == "report":
        return ["report", target, *study]  # default output: RUN_DIR/report.html, or ./report.html
    if command == "export":
        return ["export", target, "--format", "json", "-o", str(root / "out" / "winner.json"), *study]
    if command == "verify":
        return ["verify", target, "--repeats", "1", *study]
    if command == "tune":
        return ["tune", *SIM, "--trials", "1", "--storage" if url else "--run-dir", target]
    return ["tune", *SIM, "--trials", "1", "--run-dir", str(root / "fresh"), "--warm-start", target]


def _listing(*dirs: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `dirs`, with its size and mtime: what a command wrote."""
    out = {}
    for d in dirs:
        for p in [d, *d.rglob("*")]:
            st = p.lstat()
            out[str(p)] = (st.st_size if p.is_file() else -1, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", COMMANDS)
def test_broken_run_dir_is_one_line_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        good_db: bytes, command: str, case: str) -> None:
    if (command, case) in SKIP:
        pytest.skip("not applicable")
    root, cwd = tmp_path / "root", tmp_path / "cwd"
    root.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # `cubic report URL` writes ./report.html: it must not, on an error
    build, says = CASES[case]
    target = str(build(root, good_db))
    argv = _argv(command, target, root, case)
    before = _listing(root, cwd)
    t0 = time.monotonic()
    r = CliRunner().invoke(app, argv)
    took = time.monotonic() - t0
    after = _listing(root, cwd)
    where = f"{command} {case}: exit {r.exit_code}, stdout {r.stdout[-300:]!r}, stderr {r.stderr[-600:]!r}"
    assert isinstance(r.exception, SystemExit | None), f"{where}: {r.exception!r}"
    assert "Traceback" not in r.output and SECRET not in r.output, where
    # a server that cannot be reached fails at once (refused), never after retries or a TCP timeout (minutes);
    # the bound is loose for a loaded machine and a first import of the command's modules
    assert took < 30 or not case.startswith("url_"), f"{where}: took {took:.0f} s"
    if (command, case) in SUCCEEDS:
        assert r.exit_code == 0, where
        if command == "report":  # the whole page, in the run directory
            assert (Path(target) / "report.html").read_text().rstrip().endswith("</html>"), where
        return
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), where
    assert not r.stdout.strip(), where
    assert re.search(says, lines[0]), f"{where}: expected {says!r}"
    changed = sorted(set(before.items()) ^ set(after.items()))
    assert not changed, f"{where}: wrote {changed[:4]}"


def test_the_corpus_and_the_expectations_agree() -> None:
    """Every exception to "exit 2" names a real command and case (a renamed case must not pass silently)."""
    for command, case in [*SUCCEEDS, *SKIP]:
        assert command in COMMANDS and case in CASES, (command, case)
    assert not set(SUCCEEDS) & SKIP
    assert os.path.isfile(SPACE)
