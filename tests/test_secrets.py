"""No secret in any output: a storage URL's password is masked by one function (`cubic.study.store.safe_url`)
wherever a URL is printed, stored or embedded, and `cubic.study.store.redact` masks it in free text (a driver's
error message). Fast checks without a server; tests/test_postgres.py runs a tune, report and export on a
real PostgreSQL with a password and looks for it everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy
from typer.testing import CliRunner

from cubic.cli.app import app
from cubic.study.store import redact, safe_url, url_secrets
from tests.test_tune import FAST, space_file

PW = "Kq9-sEcr3t"


@pytest.mark.parametrize("url, shown", [
    # SQLAlchemy parses it: its own rendering, hide_password=True
    (f"postgresql://alice:{PW}@db.example:5432/cubic", "postgresql://alice:***@db.example:5432/cubic"),
    (f"postgresql+psycopg://alice:{PW}%40x@db.example/cubic", "postgresql+psycopg://alice:***@db.example/cubic"),
    (f"mysql://alice:{PW}@db.example/cubic?charset=utf8", "mysql://alice:***@db.example/cubic?charset=utf8"),
    # an unescaped '@' or '/' in the password: SQLAlchemy would take its tail for the host
    (f"postgresql://alice:{PW}@xq7Lm/yR2dP@db.example/cubic", "postgresql://alice:***@db.example/cubic"),
    # URLs SQLAlchemy cannot parse: the userinfo masked generically
    (f"postgresql//alice:{PW}@db.example/cubic", "postgresql//alice:***@db.example/cubic"),
    (f"postgresql:/alice:{PW}@db.example/cubic", "postgresql:/alice:***@db.example/cubic"),
    (f"postgresql://alice:{PW}@db.example:port/cubic", "postgresql://alice:***@db.example:port/cubic"),
    (f"alice:{PW}@db.example", "alice:***@db.example"),
    # a password as a query parameter
    (f"postgresql://alice@db.example/cubic?password={PW}&sslmode=require",
     "postgresql://alice@db.example/cubic?password=***&sslmode=require"),
    # nothing secret: exactly as given (no re-quoting of paths or query values)
    ("postgresql://postgres:@/cubic?host=/tmp/pg", "postgresql://postgres:@/cubic?host=/tmp/pg"),
    ("sqlite:////runs/a@b/study.db", "sqlite:////runs/a@b/study.db"),
    ("runs/fast", "runs/fast"),
    ("", ""),
])
def test_safe_url_masks_the_password_of_every_url(url: str, shown: str) -> None:
    assert safe_url(url) == shown
    assert PW not in safe_url(url) and safe_url(safe_url(url)) == safe_url(url)


def test_safe_url_is_sqlalchemys_rendering_where_it_parses() -> None:
    url = f"postgresql+psycopg://alice:{PW}@db.example:5432/cubic?sslmode=require"
    assert safe_url(url) == sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)


def test_redact_masks_urls_conninfo_and_the_given_urls_secrets_in_free_text() -> None:
    url = f"postgresql://alice:{PW}@xq7Lm/yR2dP@db.example/cubic"
    text = (f"(psycopg.OperationalError) connection to postgresql+psycopg://bob:hunter22@h/db) failed; "
            f"dsn host=h password={PW}x user=bob: failed to resolve host 'xq7Lm/yR2dP@db.example'; {PW}.")
    out = redact(text, url)
    assert "hunter22" not in out and PW not in out and "xq7Lm" not in out and "yR2dP" not in out
    assert out.startswith("(psycopg.OperationalError) connection to postgresql+psycopg://bob:***@h/db) failed; ")
    assert "password=*** user=bob" in out and out.endswith("***.")  # the sentence's punctuation stays
    assert redact("nothing secret here: Connection refused", url, None) == "nothing secret here: Connection refused"
    # the password as written, decoded and encoded, and the pieces a parser cuts it into; never 1-3 letters
    assert set(url_secrets(f"postgresql://a:{PW}%40pw@h/db")) >= {f"{PW}%40pw", f"{PW}@pw"}
    assert url_secrets("postgresql://a:pw@h/db") == [] and redact("pwned by pw", "postgresql://a:pw@h/db") == \
        "pwned by pw"


def _cli(*args: str) -> tuple[int, list[str], str]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stderr.strip().splitlines(), r.output


URLS = {
    "refused": f"postgresql://alice:{PW}@127.0.0.1:1/cubic",  # nothing listens on port 1
    "unescaped": f"postgresql://alice:{PW}@xq7Lm/yR2dP@127.0.0.1:1/cubic",  # '@' and '/' in the password
    "query": f"postgresql://alice@127.0.0.1:1/cubic?password={PW}",
    # a brace: Optuna's str.format of the URL failed with KeyError('Zt8kQ'), a piece of the password
    "brace": f"postgresql+psycopg://alice:{PW}{{Zt8kQ}}@127.0.0.1:1/cubic",
    "unparsable": f"postgresql//alice:{PW}@127.0.0.1/cubic",
    "no-slashes": f"postgresql:/alice:{PW}@127.0.0.1/cubic",  # taken for a path by report/export/verify
    "no-driver": f"nosuchdb://alice:{PW}@127.0.0.1/cubic",
}


@pytest.mark.parametrize("url", list(URLS.values()), ids=list(URLS))
@pytest.mark.parametrize("command", ["tune", "tune --warm-start", "report", "export", "verify"])
def test_a_bad_or_unreachable_storage_url_is_one_line_exit_2_without_its_password(
        tmp_path: Path, command: str, url: str) -> None:
    space = str(space_file(tmp_path, FAST))
    args = {"tune": ["tune", "--no-live", "--space", space, "--storage", url],
            "tune --warm-start": ["tune", "--no-live", "--space", space, "--run-dir", str(tmp_path / "run"),
                                  "--backend", "sim", "--cluster", "local", "--warm-start", url],
            "report": ["report", url, "-o", str(tmp_path / "r.html")],
            "export": ["export", url],
            "verify": ["verify", url]}[command]
    code, lines, out = _cli(*args)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), out
    assert not [s for s in (PW, "xq7Lm", "yR2dP", "Zt8kQ") if s in out], out
    assert "***" in lines[0] or "verify needs TorchRec" in lines[0], out  # names the URL, masked
    if url in (URLS["refused"], URLS["query"], URLS["brace"]) and "TorchRec" not in lines[0]:
        assert "Connection refused" in lines[0], out


def test_a_store_failing_mid_tune_is_one_redacted_line(tmp_path: Path, monkeypatch) -> None:
    """A driver error after trials ran (the server went away while the tune stores its fourth trial) ends the
    tune in one line that names no password either; the trials stored before it are kept."""
    from cubic.study.store import Store

    finish, stored = Store.finish, []

    def finish_until_the_server_goes(self, trial, result):
        if len(stored) == 3:
            raise sqlalchemy.exc.OperationalError("UPDATE trials", {}, Exception(
                f"connection to postgresql://alice:{PW}@db.example/cubic lost; password={PW}"))
        stored.append(trial.number)
        return finish(self, trial, result)

    monkeypatch.setattr(Store, "finish", finish_until_the_server_goes)
    code, lines, out = _cli("tune", "--no-live", "--space", str(space_file(tmp_path, FAST)), "--run-dir",
                            str(tmp_path / "run"), "--backend", "sim", "--cluster", "local")
    assert stored == [0, 1, 2], out  # mid-tune: three trials ran and were stored before the failure
    assert code == 1 and len(lines) == 1 and "the trial store failed" in lines[0], out
    assert PW not in out and "postgresql://alice:***@db.example/cubic" in lines[0], out
    import optuna

    kept = optuna.load_study(study_name=None, storage=f"sqlite:///{tmp_path / 'run' / 'study.db'}").trials
    assert [t.number for t in kept if t.state == optuna.trial.TrialState.COMPLETE] == [0, 1, 2]
