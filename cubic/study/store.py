"""The trial store: one Optuna study on RDB storage is the single source of truth of a tune.

Schema (analysis and export read exactly this):

- Storage: `--run-dir DIR` -> `sqlite:///DIR/study.db` (and per-trial result logs in
  `DIR/trials/NNNN.json`); `--storage URL` -> any SQLAlchemy URL (e.g. PostgreSQL).
- Study name = the space's `name`; direction maximize.
- Study user_attrs:
  - "space": the resolved space as a JSON-able dict (`SearchSpace.to_dict()`), including the
    baseline TrialConfig dict under "baseline_config".
  - "winner" (after confirm; `cubic.study.winner.Winner.to_dict`): {"trial": number, "qps": median
    of the confirm re-measurements, "qps_spread": [min, max], "speedup": x over baseline,
    "speedup_spread": [min, max] (winner's min / baseline's max .. winner's max / baseline's min),
    "baseline_qps": median baseline confirm qps, "config": TrialConfig dict, "config_key",
    "confirm_qps", "quality_reason", "searcher", "short_config" (knobs that differ from the
    baseline)}.
- The lease of the running tuner ({"owner", "host", "node", "pid", "started", "heartbeat"}; absent when
  none runs): a row of cubic's table `cubic_leases`, see `cubic.study.lease`.
- Trial params = the knob values (categorical distributions, canonical: a knob whose condition
  does not hold carries its default).
- Trial user_attrs (written while it runs, through Optuna): "result" (the whole `TrialResult.to_dict()`,
  NaN/inf as null), flat copies "status", "error", "qps", "qps_cv", "step_ms_p50", "peak_mem_mb", "ne",
  plus "searcher" (name), "phase" ("baseline" | "warmup" | "proxy" | "random" | "grid" | "tpe" | "ds-xgb";
  a re-run of an interrupted trial keeps its phase and adds "resumed_from": the interrupted trial's
  number), "predicted_qps" and "predicted_std" (the proxy's prediction at proposal time, null if none),
  "config_key" (`TrialConfig.key()`), "config" (TrialConfig dict).
- What cubic learns after a trial finished (quality estimates, held-out quality runs, confirm
  re-measurements, the gate's verdict) is `cubic.study.record.TrialRecord`, kept in cubic's own table
  `cubic_trial_attrs` (`cubic.study.tables`), never in Optuna's tables: `Store.records`, `Store.update`.
- State: COMPLETE trials have value = qps. Failed trials are FAIL with "status"
  (oom | error | timeout) and a one-line "error". Trials found RUNNING when a tune resumes
  (the tuner died) become FAIL with status "interrupted" and error "interrupted"; their
  configuration is enqueued again.
- Proposals the tuner refused to run (a duplicate of a completed or running configuration, or a
  searcher with nothing left) are FAIL with status "skipped"; like "interrupted" they spend no budget.
- Confirm walks down the ranking (skipping trials with quality_est_ok false) until confirm_top_k
  configurations pass the quality gate, screening at most 3 x confirm_top_k.
- Confirm re-measurements are not new trials: they are fields of the original trial's record
  ("confirm_qps", "confirm_ne", "confirm_failed"), as are its verdict ("quality_ok", "quality_reason").
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import optuna
import sqlalchemy
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from cubic.space.search_space import SearchSpace, fingerprint, first_difference
from cubic.study import record, tables
from cubic.study.record import BACKOFF, FLAT_KEYS, INTERRUPTED, NOT_RUN, TrialRecord
from cubic.study.winner import Winner
from cubic_harness.config import TrialResult, json_safe
from cubic_harness.errors import ConfigError

__all__ = ["FLAT_KEYS", "INTERRUPTED", "NOT_RUN", "Store", "TrialRecord", "open_storage", "safe_url", "storage_url"]
# Optuna's tables, by name (a database holding one of them is an Optuna store)
META_TABLES = tables.META.tables
OPTUNA_TABLES = frozenset({"studies", "trials", "version_info", "alembic_version", "trial_user_attributes"})




STUDY_FILE = "study.db"  # a run directory's trial store
FIGURES_ATTR = "cluster_figures"  # a simulated study's cluster, as numbers (`Store.figures`)


def storage_url(where: str | Path, must_exist: bool = True) -> str:
    """THE storage URL of a trial store named by a run directory (DIR/study.db), a SQLite file or a SQLAlchemy
    URL (as given). `must_exist` (reading: report, export, warm start, a quality store): ConfigError unless it
    is there, checked first because SQLite silently creates an empty database for a path that is not; False:
    the run directory a tune creates its store in.
    """
    s = str(where)
    if "://" in s:
        db = s.split(":///", 1)[1] if s.startswith("sqlite:///") else ""
        if must_exist and db and db != ":memory:" and not Path(db).is_file():
            raise ConfigError(f"{safe_url(s)}: no such SQLite trial store")
        return s
    p = Path(s).expanduser()
    if not must_exist:
        return f"sqlite:///{p.resolve() / STUDY_FILE}"
    if p.is_dir():
        db = p / STUDY_FILE
        if not db.is_file():
            raise ConfigError(f"{s}: no study in this run directory (expected {db}); run `cubic tune` first")
        return f"sqlite:///{db.resolve()}"
    if p.is_file():
        return f"sqlite:///{p.resolve()}"
    raise ConfigError(f"{safe_url(s)}: no such run directory or storage URL")


# Secrets in storage URLs. Every storage URL that cubic prints, stores or embeds (terminal, error
# messages, the report, exports, the study's summary) goes through `safe_url`; free text that may hold
# one (a database driver's error message) goes through `redact`.

# `?password=...` in a URL, `password=...` in a libpq connection string
_SECRET_PARAM = re.compile(  # (the value stops before punctuation that ends a sentence)
    r"(?i)(\b(?:ssl)?(?:password|passwd|pwd|secret|token)\s*=\s*)('[^']*'|[^\s&;'\"]*[^\s&;'\".,:)\]}]|)")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:/+")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
MASK = "***"


def _userinfo(url: str) -> tuple[str, str, str, str] | None:
    """(scheme, user, password, rest) read generically (no URL parser: a URL SQLAlchemy cannot parse
    must not leak either): the userinfo is everything between the scheme and the LAST '@' (a password
    may hold an unescaped '@' or '/'); None where there is no '@'."""
    m = _SCHEME.match(url)
    scheme = m.group(0) if m else ""
    body = url[len(scheme):]
    if "@" not in body:
        return None
    info, rest = body.rsplit("@", 1)
    user, sep, password = info.partition(":")
    return scheme, user, password if sep else "", rest


def safe_url(url: str) -> str:
    """The storage URL without its password: THE redaction of a storage URL, for every message, report,
    export and record. SQLAlchemy's own rendering where it parses the URL, else the userinfo masked
    generically; password-like query parameters (`?password=...`) are masked as well."""
    url = str(url)
    ui = _userinfo(url)
    out = url  # no password: as written (a rendering would re-quote paths and query values)
    if ui is not None and ui[2]:
        try:
            u = sqlalchemy.engine.make_url(url)
            # the parser's password must be all of it: an unescaped '@' in a password makes SQLAlchemy
            # read its tail as the host, which its rendering would print
            if (u.password or "") != unquote(ui[2]):
                raise ValueError("ambiguous userinfo")
            out = u.render_as_string(hide_password=True)
        except Exception:  # an unusual URL: still never print credentials
            scheme, user, password, rest = ui
            out = f"{scheme}{user}:{MASK}@{rest}"
    return _SECRET_PARAM.sub(rf"\g<1>{MASK}", out)


def url_secrets(url: str) -> list[str]:
    """The secrets a storage URL carries (its password, as written and decoded, and password-like query
    values), longest first, for `redact`."""
    url = str(url)
    found = set()
    ui = _userinfo(url)
    if ui is not None and ui[2]:
        found |= {ui[2], unquote(ui[2]), quote(unquote(ui[2]), safe="")}
        # and its pieces: a parser that cuts an unescaped password at '@', ':' or '/' takes the rest for the
        # host or database, which a driver then names ("failed to resolve host 'ss3cret@127.0.0.1'")
        found |= set(re.split(r"[@:/]", ui[2]))
    try:
        if (pw := sqlalchemy.engine.make_url(url).password):
            found |= {str(pw), quote(str(pw), safe="")}
    except Exception:
        pass
    for m in _SECRET_PARAM.finditer(url):
        v = m.group(2).strip("'")
        found |= {v, unquote(v)}
    # a very short "password" would mask letters of every word: URLs in the text still lose it
    return sorted((s for s in found if len(s) >= 4), key=len, reverse=True)


def redact(text: str, *urls: str | None) -> str:
    """`text` (an error message, a driver's exception) with every URL in it passed through `safe_url`,
    and every secret of `urls` (the URLs the user gave) masked wherever else it appears."""
    def one(m: re.Match) -> str:  # punctuation that ends a sentence is not part of the URL
        url = m.group(0).rstrip(".,;:)]}")
        return safe_url(url) + m.group(0)[len(url):]

    text = _URL_IN_TEXT.sub(one, str(text))
    text = _SECRET_PARAM.sub(rf"\g<1>{MASK}", text)
    for url in urls:
        for secret in url_secrets(url) if url else ():
            text = text.replace(secret, MASK)
    return text


def _schema_race(e: Exception) -> bool:
    """Two processes creating a new store's schema at once (a tuner starting while a notebook,
    `cubic report` or a second tuner opens the same URL): the loser sees the winner's half-made
    tables. Retrying after the winner finishes is safe: Optuna's schema creation is idempotent."""
    text = str(e).lower()
    return isinstance(e, sqlalchemy.exc.IntegrityError) or (
        isinstance(e, sqlalchemy.exc.OperationalError) and ("locked" in text or "already exists" in text))


def normalize_url(url: str) -> str:
    """`postgresql://` and `postgres://` name no driver; SQLAlchemy then wants psycopg2 (and knows no
    `postgres://` at all), while `cubic[postgres]` installs psycopg 3: use psycopg 3 where installed."""
    try:
        u = sqlalchemy.engine.make_url(url)
    except Exception:  # not a URL: RDBStorage says what is wrong
        return url
    if u.drivername in ("postgres", "postgresql"):
        driver = "postgresql+psycopg" if importlib.util.find_spec("psycopg") else "postgresql"
        if driver != u.drivername:
            return u.set(drivername=driver).render_as_string(hide_password=False)
    return url


def rdb_storage(url: str, attempts: int = 20, **kw: Any) -> RDBStorage:
    """`RDBStorage(url)` that survives a concurrent first open of the same store."""
    url = normalize_url(url)
    for i in range(attempts):
        try:
            # Optuna fills `{SCHEMA_VERSION}` into the URL with str.format: a password with a brace would
            # fail there with a KeyError naming part of it; escaped, the URL reaches SQLAlchemy as given
            return RDBStorage(url.replace("{", "{{").replace("}", "}}"), **kw)
        except ImportError as e:  # Optuna's "Failed to import DB access module": say which and how
            driver = safe_url(url).split("://", 1)[0]
            hint = "pip install 'cubic[postgres]'" if driver.startswith("postgres") else "install its driver"
            cause = redact(" ".join(str(e.__cause__ or e).split()), url)[:150]
            raise ConfigError(f"no usable database driver for {driver}:// ({cause}): {hint}") from None
        except sqlalchemy.exc.SQLAlchemyError as e:
            if i == attempts - 1 or not _schema_race(e):
                raise
            time.sleep(0.05 * (i + 1))
    raise AssertionError("unreachable")


def check_run_dir(run_dir: Path, holds_store: bool = True) -> None:
    """ConfigError (one line, before anything is written) for a `--run-dir` that cannot hold a tune: a file,
    or (`holds_store`: no --storage) a study.db that is some other program's SQLite database (Optuna would add
    its tables to it). A missing or empty study.db is a new store; an unreadable one is left to
    `open_storage`, which says why."""
    import sqlite3

    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: not a directory; give a run directory (it holds study.db)")
    db = run_dir / STUDY_FILE
    if not holds_store:
        return
    if db.exists() and not db.is_file():
        raise ConfigError(f"--run-dir {run_dir}: {db} is not a file; it must be the run's SQLite trial store")
    if not db.is_file() or db.stat().st_size == 0:
        return
    try:  # read-only: looking never writes
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.Error:
        return
    # any of Optuna's tables: its store (maybe half made by a tuner starting beside this one)
    if names and not names & (OPTUNA_TABLES | set(META_TABLES)):
        raise ConfigError(f"--run-dir {run_dir}: {db.name} is not a cubic/Optuna trial store (tables "
                          f"{sorted(names)[:5]}); use another --run-dir")


def open_storage(url: str, label: str | None = None) -> RDBStorage:
    """Connect (and create the schema); any failure is bad input -> ConfigError, one line naming
    `label` (what the user gave: "--run-dir DIR"; default "--storage URL")."""
    try:
        rdb = rdb_storage(url, engine_kwargs={"pool_pre_ping": True} if not url.startswith("sqlite") else None)
        with rdb.engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT 1"))
        return rdb
    except Exception as e:  # sqlalchemy/driver errors of every kind: one clear line
        msg = redact(" ".join(str(getattr(e, "orig", None) or e).split()), url)[:300] or type(e).__name__
        raise ConfigError(f"{label or '--storage ' + safe_url(url)}: cannot open the trial store: {msg}") from None


class Store:
    """The study and its records: the tuner's one door to the trial store (Optuna's public API for
    Optuna's tables, `cubic.study.record` for cubic's)."""

    def __init__(self, space: SearchSpace, rdb: RDBStorage, run_dir: Path | None,
                 sampler: optuna.samplers.BaseSampler | None = None, backend: str = "real",
                 figures: Mapping[str, float] | None = None) -> None:
        """`backend`: "real", or "sim:CLUSTER" for simulated trials, which live in their own study
        (NAME@sim:CLUSTER) so that predictions and measurements are never mixed or taken for each other;
        `figures`: the simulated cluster's (`Cluster.features`), kept with the study so that a study
        warm-started from it learns how the cluster differs from its own."""
        self.space, self.rdb, self.run_dir, self.backend = space, rdb, run_dir, backend
        self.figures = dict(figures or {})
        name = space.name if backend == "real" else f"{space.name}@{backend}"
        self.study = optuna.create_study(study_name=name, storage=rdb, sampler=sampler,
                                         direction="maximize", load_if_exists=True)
        self.name = self.study.study_name
        self.study_id = rdb.get_study_id_from_name(self.name)
        tables.ensure(rdb.engine)
        old = self.study.user_attrs.get("space")
        new = space.to_dict()
        if old is not None and fingerprint(old) != fingerprint(new):
            raise ConfigError(
                f"study {space.name!r} in {safe_url(rdb.url)} was made with a different search space "
                f"({old.get('path')}; first difference: {first_difference(old, new)}); use another "
                f"--run-dir/--storage or another space name")
        if run_dir is not None:
            (run_dir / "trials").mkdir(parents=True, exist_ok=True)
        # one object per finished trial, as Optuna's cache keeps one FrozenTrial: every holder of a record
        # sees each `update` (only the tuner holding the lease writes cubic's fields of this study)
        self._records: dict[int, TrialRecord] = {}

    def record_space(self) -> None:
        """Store the resolved space (with its constraints) as the study's "space" attr: only by the
        tuner holding the lease, so a refused second tuner never rewrites a running study's record."""
        self.study.set_user_attr("space", self.space.to_dict())
        self.study.set_user_attr("backend", self.backend)
        if self.figures:
            self.study.set_user_attr(FIGURES_ATTR, self.figures)

    # ------------------------------------------------------------------ reading
    def trials(self, *states: TrialState) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states or None)

    def records(self, *states: TrialState) -> list[TrialRecord]:
        """The trials in `states` (all by default) as records, cubic's table read once per new finished trial."""
        out, found = [], None
        for t in self.trials(*states):
            rec = self._records.get(t.number)
            if rec is None:
                if not t.state.is_finished():
                    out.append(record.build(t))
                    continue
                if found is None:
                    found = record.read(self.rdb.engine, self.name)
                rec = self._records[t.number] = record.build(t, found.get(t.number))
            rec.trial = t
            out.append(rec)
        return out

    def feasible(self) -> dict[int, bool | None]:
        """Each finished trial's quality verdict (what the searchers learn from: `TrialRecord.feasible`)."""
        return {r.number: r.feasible for r in self.records(TrialState.COMPLETE)}

    def budget_used(self) -> int:
        """Search trials that ran (COMPLETE, or FAIL for a reason of their own); the confirm's back-off
        trials are the confirm's cost, as its re-measurements are, not the search's."""
        return sum(1 for t in self.trials(TrialState.COMPLETE, TrialState.FAIL)
                   if t.user_attrs.get("status") not in NOT_RUN and t.user_attrs.get("phase") != BACKOFF)

    def completed_keys(self) -> dict[str, int]:
        return {t.user_attrs["config_key"]: t.number for t in self.trials(TrialState.COMPLETE)
                if "config_key" in t.user_attrs}

    def history(self) -> list[FrozenTrial]:
        """Finished trials of other studies in this storage on the same space (warm start)."""
        fp = fingerprint(self.space.to_dict())
        out: list[FrozenTrial] = []
        for s in self.rdb.get_all_studies():
            if (s.study_name == self.name or fingerprint(s.user_attrs.get("space") or {}) != fp
                    or s.user_attrs.get("backend", "real") != self.backend):  # measured and simulated apart
                continue
            out += [t for t in self.rdb.get_all_trials(self.rdb.get_study_id_from_name(s.study_name),
                                                       deepcopy=False)
                    if t.state in (TrialState.COMPLETE, TrialState.FAIL)]
        return out

    # ------------------------------------------------------------------ writing
    def _set_running_attr(self, number: int, key: str, value: Any) -> None:
        """A user attr of a trial that has not finished (Optuna's public storage API)."""
        tid = self.rdb.get_trial_id_from_study_id_trial_number(self.study_id, number)
        self.rdb.set_trial_user_attr(tid, key, value)

    def recover_interrupted(self) -> list[FrozenTrial]:
        """Mark trials left RUNNING by a dead tuner FAIL(interrupted) and enqueue their configs again
        (unless an equal config completed meanwhile). Returns the interrupted trials."""
        done = self.completed_keys()
        stale = self.trials(TrialState.RUNNING)
        waiting = {t.user_attrs.get("config_key") for t in self.trials(TrialState.WAITING)}
        recovered = []
        for t in stale:
            # killed between ask and start: params but no attrs yet -> derive the key from the params
            # (before the FAIL: a finished trial's attrs can no longer be set)
            key = t.user_attrs.get("config_key") or (self.space.config(t.params).key() if t.params else None)
            try:
                if key and "config_key" not in t.user_attrs:
                    self._set_running_attr(t.number, "config_key", key)
                self._set_running_attr(t.number, "status", INTERRUPTED)
                self._set_running_attr(t.number, "error", INTERRUPTED)
                self.study.tell(t.number, state=TrialState.FAIL)
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
                continue  # its silent tuner finished it after all, just now: nothing to recover
            recovered.append(t)
            if t.params and key not in done and key not in waiting:
                self.enqueue(t.params, {"phase": t.user_attrs.get("phase", "resume"), "resumed_from": t.number})
                waiting.add(key)
        return recovered

    def enqueue(self, params: dict[str, Any], attrs: dict[str, Any]) -> None:
        key = self.space.config(params).key()
        self.study.enqueue_trial(params, user_attrs={**attrs, "config_key": key}, skip_if_exists=False)

    def start(self, trial: optuna.Trial, attrs: dict[str, Any]) -> None:
        for k, v in attrs.items():
            trial.set_user_attr(k, json_safe(v))

    def finish(self, trial: optuna.Trial, result: TrialResult) -> TrialRecord:
        """Store the whole result, then COMPLETE (value = qps) or FAIL with status and reason."""
        rd = result.to_json_dict()
        trial.set_user_attr("result", rd)
        for k in FLAT_KEYS:
            trial.set_user_attr(k, rd.get(k))
        ok = result.status == "ok" and result.qps > 0 and math.isfinite(result.qps)
        if result.status == "ok" and not ok:
            trial.set_user_attr("status", "error")
            trial.set_user_attr("error", f"trial returned qps={result.qps!r}")
        self.study.tell(trial, result.qps if ok else None, state=TrialState.COMPLETE if ok else TrialState.FAIL)
        if self.run_dir is not None:
            log = {"trial": trial.number, "phase": trial.user_attrs.get("phase"), **rd}
            (self.run_dir / "trials" / f"{trial.number:04d}.json").write_text(json.dumps(log, indent=1))
        return next(r for r in self.records(TrialState.COMPLETE, TrialState.FAIL) if r.number == trial.number)

    def skip(self, trial: optuna.Trial, reason: str) -> None:
        trial.set_user_attr("status", "skipped")
        trial.set_user_attr("error", reason)
        self.study.tell(trial, state=TrialState.FAIL)

    def update(self, rec: TrialRecord, **changes: Any) -> None:
        """Set cubic's fields of a finished trial (`TrialRecord`): in its table and on the object at once."""
        for k, v in record.write(self.rdb.engine, self.name, rec.number, changes).items():
            setattr(rec, k, record.coerce(k, v))

    def set_winner(self, winner: Winner | None) -> None:
        """Store the winner in its JSON form (`Winner.to_dict`); None clears one an earlier
        confirm left."""
        self.study.set_user_attr("winner", json_safe(winner.to_dict() if winner else None))
