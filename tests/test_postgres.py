"""The trial store on a real PostgreSQL server (`--storage URL`), not only SQLite.

The server is a throwaway one from `pgserver` (a pip-installed PostgreSQL 16, reached over its
Unix socket). The URL is written as users write it, `postgresql://...` without a driver name:
`cubic.study.store.normalize_url` picks psycopg 3, the driver `cubic[postgres]` installs.

PostgreSQL refuses to run as root; as root pgserver runs it as the system user `pgserver`, which it
creates with `useradd`. Containers without `useradd` (CI runs as root in one) get that user from
`_ensure_server_user`. Under CI (CI=true) a missing pgserver or server fails these tests instead of
skipping them.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from optuna.trial import TrialState

from cubic.results.analysis import load_study, open_study
from cubic.study.lease import TunerLease
from cubic.study.store import open_storage
from cubic_harness.errors import ConfigError
from tests.test_analysis import cubic_cli
from tests.test_tune import FAST, cubic_tune, space_file

try:
    import pgserver
except ImportError:  # the dev extra is not installed
    pgserver = None

CI = os.environ.get("CI") == "true"
SERVER_USER = "pgserver"  # the system user pgserver runs PostgreSQL as when we are root


def _unavailable(why: str) -> None:
    """No server to test against: a failure under CI (the tests must run there), a skip elsewhere."""
    if CI:
        pytest.fail(f"CI=true: {why}", pytrace=False)
    pytest.skip(why)


def _ensure_server_user() -> None:
    """As root, make sure the unprivileged user pgserver runs the server as exists. pgserver creates it
    with `useradd`; where there is none (slim containers), it is written into /etc/passwd and /etc/group
    here, as `useradd` would (a free uid/gid, no login, no home needed)."""
    if os.geteuid() != 0:
        return
    try:
        pwd.getpwnam(SERVER_USER)
        return
    except KeyError:
        pass
    if shutil.which("useradd"):
        return  # pgserver adds it itself
    import grp

    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    uid = next(i for i in range(1000, 60000) if i not in taken)  # uid == gid, like useradd's user group
    with open("/etc/group", "a") as f:
        f.write(f"{SERVER_USER}:x:{uid}:\n")
    with open("/etc/passwd", "a") as f:
        f.write(f"{SERVER_USER}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin\n")
    pwd.getpwnam(SERVER_USER)


@pytest.fixture(scope="module")
def pg_server() -> Iterator[Any]:
    if pgserver is None:
        _unavailable("pgserver (dev extra) provides the throwaway PostgreSQL: pip install -e '.[dev]'")
    try:
        _ensure_server_user()
    except OSError as e:
        _unavailable(f"running as root, and cannot create the unprivileged user {SERVER_USER!r} PostgreSQL "
                     f"needs: {e}")
    # pgserver runs the server as an unprivileged user when we are root: a world-traversable dir
    # (not pytest's 0700 tmp) with a short path (the socket path must fit in 107 bytes)
    d = Path(tempfile.mkdtemp(prefix="cubic-pg-"))
    d.chmod(0o755)
    srv = pgserver.get_server(d / "data", cleanup_mode="stop")
    try:
        yield srv
    finally:
        srv.cleanup()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_url(pg_server: Any) -> str:
    pg_server.psql("CREATE DATABASE cubic_test;")
    return pg_server.get_uri("cubic_test")


def test_the_server_runs_here_even_as_root(pg_server: Any) -> None:
    """The fixture itself: a server that answers (as root through the unprivileged user), never a skip."""
    assert "1" in pg_server.psql("SELECT 1;")
    if os.geteuid() == 0:
        assert pwd.getpwnam(SERVER_USER).pw_uid != 0


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
    sid = optuna.create_study(study_name="lease", storage=rdb, load_if_exists=True).study_name
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

    from cubic.study import lease as lease_mod

    monkeypatch.setattr(lease_mod, "HEARTBEAT_S", 0.002)
    rdb = open_storage(pg_url)
    sid = optuna.create_study(study_name="race", storage=rdb, load_if_exists=True).study_name
    a = TunerLease(rdb, sid, "study 'race'").acquire()
    beats = []
    cas = a._cas
    monkeypatch.setattr(a, "_cas", lambda old, new: beats.append(cas(old, new)) or beats[-1])
    false_losses = 0
    try:
        for _ in range(3000):
            try:
                a.check(fresh=True)
            except lease_mod.LeaseLost:
                false_losses += 1
        mine = lease_mod._holder(a._read()).get("owner") == a.me["owner"]
    finally:
        a.release()
    assert sum(beats) >= 20, f"the heartbeat renewed the lease only {sum(beats)} times: nothing raced"
    assert false_losses == 0 and a._lost is None  # never "taken over by" itself
    assert mine  # and the row is still this tuner's


def test_unreachable_postgresql_is_one_line_exit_2(tmp_path: Path) -> None:
    r = cubic_tune("--space", str(space_file(tmp_path, FAST)), "--storage", "postgresql://u:secret@127.0.0.1:1/db")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot open the trial store" in lines[0] and "Connection refused" in lines[0]
    assert "secret" not in r.stderr


# A password as users have them: with characters a URL must escape ('@', '/'); it and each of its pieces
# (a parser that cuts it at '@' or '/' takes the rest for the host or the database) long and odd enough to
# never turn up by chance (in a report's base64 plots, a uuid).
PASSWORD = "Kq9-sEcr3t@pwZx7Q/Yh42Wv"
SECRET_TOKENS = (PASSWORD, quote(PASSWORD, safe=""), *re.split(r"[@/]", PASSWORD))


def _leaks(text: str | bytes) -> list[str]:
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    return [t for t in SECRET_TOKENS if t in text]


def test_a_storage_password_appears_in_no_output_report_export_or_log(pg_server: Any, tmp_path: Path) -> None:
    """`--storage postgresql://user:PASSWORD@...`: the password is in none of what tune, report, export and
    verify print, the report HTML, the export files, the run directory's trial logs, the study's records,
    nor the one-line error of a store that cannot be reached."""
    import sqlalchemy

    from cubic.results import analysis

    pg_server.psql(f"CREATE ROLE cubic_secret LOGIN PASSWORD '{PASSWORD}';")
    pg_server.psql("CREATE DATABASE cubic_secret OWNER cubic_secret;")
    base = sqlalchemy.engine.make_url(pg_server.get_uri("cubic_secret"))
    url = base.set(username="cubic_secret", password=PASSWORD).render_as_string(hide_password=False)
    assert quote(PASSWORD, safe="") in url and url.startswith("postgresql://cubic_secret:")
    run = tmp_path / "run"
    space = str(space_file(tmp_path, FAST))
    outputs: dict[str, str] = {}

    # a short simulated tune in PostgreSQL, its trial logs in --run-dir
    r = cubic_tune("--space", space, "--storage", url, "--run-dir", str(run), "--backend", "sim", "--cluster",
                   "local", "--trials", "4", "--seed", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "postgresql+psycopg://cubic_secret:***@" in r.stdout  # where the study lives, its password masked
    outputs["tune"] = r.stdout + r.stderr
    html = run / "report.html"
    r = cubic_cli("report", url, "-o", str(html))
    assert r.returncode == 0 and html.is_file(), r.stderr
    assert "cubic_secret:***@" in html.read_text()
    outputs["report"] = r.stdout + r.stderr
    for fmt in ("json", "yaml", "torchrec"):
        r = cubic_cli("export", url, "--format", fmt, "-o", str(run / f"winner.{fmt}"))
        assert r.returncode == 0, r.stderr
        outputs[f"export {fmt}"] = r.stdout + r.stderr
    r = cubic_cli("export", url, "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["provenance"]["storage"].startswith("postgresql://cubic_secret:***@/cubic_secret")
    outputs["export to stdout"] = r.stdout + r.stderr
    # the Python API a notebook uses
    df = load_study(url)
    outputs["load_study"] = json.dumps(analysis.summary(df), default=str)
    # what the store itself holds: every row of every table (the study's and trials' attrs, the lease)
    engine = open_storage(url).engine
    with engine.connect() as conn:
        for table in sqlalchemy.inspect(engine).get_table_names():
            outputs[f"table {table}"] = str(conn.execute(sqlalchemy.text(f'SELECT * FROM "{table}"')).fetchall())
    engine.dispose()
    assert "fast@sim:local" in outputs["table studies"]

    files = [p for p in run.rglob("*") if p.is_file()]
    assert len([p for p in files if p.parent.name == "trials"]) == 4 and html in files
    for p in files:
        outputs[str(p.relative_to(run))] = p.read_bytes().decode("utf-8", "replace")

    # a store that cannot be reached (the wrong port), a URL SQLAlchemy cannot parse, a path that is none:
    # one line each, exit 2, the password masked
    wrong = f"postgresql://cubic_secret:{quote(PASSWORD, safe='')}@127.0.0.1:1/cubic_secret"
    unparsable = f"postgresql//cubic_secret:{quote(PASSWORD, safe='')}@127.0.0.1/cubic_secret"
    raw = f"postgresql://cubic_secret:{PASSWORD}@127.0.0.1:1/cubic_secret"  # its '@' and '/' not escaped
    for name, cmd in {
        "tune, wrong port": ["tune", "--no-live", "--space", space, "--storage", wrong],
        "tune, unescaped password": ["tune", "--no-live", "--space", space, "--storage", raw],
        "tune, unparsable": ["tune", "--no-live", "--space", space, "--storage", unparsable],
        "tune --warm-start, wrong port": ["tune", "--no-live", "--space", space, "--run-dir", str(tmp_path / "w"),
                                          "--backend", "sim", "--cluster", "local", "--warm-start", wrong],
        "report, wrong port": ["report", wrong, "-o", str(tmp_path / "r.html")],
        "report, unparsable": ["report", unparsable],
        "export, wrong port": ["export", wrong],
        "export, unescaped password": ["export", raw],
        "verify, wrong port": ["verify", wrong],
    }.items():
        r = cubic_cli(*cmd, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, r.stderr)
        # the URL is named, without its password (verify first asks for TorchRec where it is missing)
        assert "cubic_secret:***@" in lines[0] or "verify needs TorchRec" in lines[0], (name, lines)
        outputs[name] = r.stdout + r.stderr
    assert "Connection refused" in outputs["tune, wrong port"], outputs["tune, wrong port"]

    leaked = {name: _leaks(text) for name, text in outputs.items() if _leaks(text)}
    assert not leaked, leaked
