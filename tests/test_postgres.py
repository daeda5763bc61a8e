"""The trial store on a real PostgreSQL server (`--storage URL`), not only SQLite.

The server is a throwaway one from `pgserver` (a pip-installed PostgreSQL 16, reached over its
Unix socket). The URL is written as users write it, `postgresql://...` without a driver name:
`cubic.store.normalize_url` picks psycopg 3, the driver `cubic[postgres]` installs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from optuna.trial import TrialState

from cubic.analysis import load_study, open_study
from cubic.lease import TunerLease
from cubic.store import open_storage
from harness.errors import ConfigError
from tests.test_analysis import cubic_cli
from tests.test_tune import FAST, cubic_tune, space_file

pgserver = pytest.importorskip("pgserver", reason="pgserver (dev extra) provides the throwaway PostgreSQL")


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    if os.geteuid() == 0 and not shutil.which("useradd"):  # PostgreSQL refuses root; pgserver adds a user
        pytest.skip("running as root without useradd: pgserver cannot create the unprivileged server user")
    # pgserver runs the server as an unprivileged user when we are root: a world-traversable dir
    # (not pytest's 0700 tmp) with a short path (the socket path must fit in 107 bytes)
    d = Path(tempfile.mkdtemp(prefix="cubic-pg-"))
    d.chmod(0o755)
    srv = pgserver.get_server(d / "data", cleanup_mode="stop")
    try:
        srv.psql("CREATE DATABASE cubic_test;")
        yield srv.get_uri("cubic_test")
    finally:
        srv.cleanup()
        shutil.rmtree(d, ignore_errors=True)


def test_tune_resume_report_and_export_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    assert pg_url.startswith("postgresql://")
    space = space_file(tmp_path, FAST)
    r = cubic_tune("--space", str(space), "--storage", pg_url, "--trials", "3", "--seed", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "winner" in r.stdout and "postgresql+psycopg://" in r.stdout  # where the study lives
    df = load_study(pg_url)
    assert len(df) == 3 and (df["state"] == "COMPLETE").all() and (df["qps"] > 0).all()
    assert df.attrs["winner"]["trial"] in set(df["number"])
    # the same command with a larger budget resumes the study in PostgreSQL: 2 more, none twice
    r = cubic_tune("--space", str(space), "--storage", pg_url, "--trials", "5", "--seed", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    st = open_study(pg_url)
    done = [t for t in st.get_trials() if t.state == TrialState.COMPLETE]
    assert len(done) == 5 == len(st.get_trials())
    assert len({t.user_attrs["config_key"] for t in done}) == 5
    # report and export read the study from the URL
    html = tmp_path / "report.html"
    rep = cubic_cli("report", pg_url, "-o", str(html))
    assert rep.returncode == 0 and html.stat().st_size > 10_000, rep.stderr
    exp = cubic_cli("export", pg_url, "--format", "json")
    assert exp.returncode == 0, exp.stderr
    rec = json.loads(exp.stdout)
    assert rec["config"]["batch_size"] in (32, 64, 128, 256) and rec["provenance"]["storage"].startswith("postgresql")


def test_the_tuner_lease_is_atomic_on_postgresql(pg_url: str) -> None:
    import optuna

    rdb = open_storage(pg_url)
    sid = optuna.create_study(study_name="lease", storage=rdb, load_if_exists=True)._study_id
    a = TunerLease(rdb, sid, "study 'lease'").acquire()
    try:
        with pytest.raises(ConfigError, match="is being tuned by pid"):
            TunerLease(open_storage(pg_url), sid, "study 'lease'").acquire()
    finally:
        a.release()
    TunerLease(rdb, sid, "study 'lease'").acquire().release()


def test_fresh_checks_racing_the_heartbeat_never_report_a_false_loss(pg_url: str, monkeypatch) -> None:
    """The heartbeat commits its new row before it records it; a fresh check reading in between must
    still see its own lease (ownership is the row's owner id, not its exact text). With the text
    compared, about 1 check in 200 reported this tuner "taken over by" itself on PostgreSQL."""
    import optuna

    from cubic import lease as lease_mod

    monkeypatch.setattr(lease_mod, "HEARTBEAT_S", 0.002)
    rdb = open_storage(pg_url)
    sid = optuna.create_study(study_name="race", storage=rdb, load_if_exists=True)._study_id
    a = TunerLease(rdb, sid, "study 'race'").acquire()
    try:
        for _ in range(3000):
            a.check(fresh=True)
    finally:
        a.release()


def test_unreachable_postgresql_is_one_line_exit_2(tmp_path: Path) -> None:
    r = cubic_tune("--space", str(space_file(tmp_path, FAST)), "--storage", "postgresql://u:secret@127.0.0.1:1/db")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot open the trial store" in lines[0] and "Connection refused" in lines[0]
    assert "secret" not in r.stderr
