"""The trial store: one Optuna study on RDB storage is the single source of truth of a tune.

Schema (analysis and export read exactly this):

- Storage: `--run-dir DIR` -> `sqlite:///DIR/study.db` (and per-trial result logs in
  `DIR/trials/NNNN.json`); `--storage URL` -> any SQLAlchemy URL (e.g. PostgreSQL).
- Study name = the space's `name`; direction maximize.
- Study user_attrs:
  - "space": the resolved space as a JSON-able dict (`SearchSpace.to_dict()`), including the
    baseline TrialConfig dict under "baseline_config".
  - "winner" (after confirm): {"trial": number, "qps": median of the confirm re-measurements,
    "qps_spread": [min, max], "speedup": x over baseline, "speedup_spread": [min, max] (winner's
    min / baseline's max .. winner's max / baseline's min), "baseline_qps": median baseline confirm
    qps, "config": TrialConfig dict, "config_key", "confirm_qps", "quality_reason", "searcher",
    "short_config" (knobs that differ from the baseline)}.
- Study system attr "cubic:tuner": the lease of the running tuner ({"owner", "host", "node", "pid",
  "started", "heartbeat"}; absent when none runs), see `cubic.lease`.
- Trial params = the knob values (categorical distributions, canonical: a knob whose condition
  does not hold carries its default).
- Trial user_attrs: "result" (the whole `TrialResult.to_dict()`, NaN/inf as null), flat copies
  "status", "error", "qps", "qps_cv", "step_ms_p50", "peak_mem_mb", "ne", plus "searcher" (name),
  "phase" ("baseline" | "warmup" | "proxy" | "random" | "grid" | "tpe" | "ds-xgb"; a re-run of an
  interrupted trial keeps its phase and adds "resumed_from": the interrupted trial's number),
  "predicted_qps" and "predicted_std" (the proxy's prediction at proposal time, null if none),
  "config_key" (`TrialConfig.key()`), "config" (TrialConfig dict). Trials that change numerics also
  get "ne_matched" (their NE over the baseline's measured samples, from their own per-step losses;
  null where their steps do not cover those samples, see `cubic.quality`) and "quality_est_ok"
  (that NE at most the quality tolerance above the baseline's; absent where ne_matched is null),
  with "quality_est_tol" (the tolerance it was judged with: a resume with another one re-judges).
- State: COMPLETE trials have value = qps. Failed trials are FAIL with "status"
  (oom | error | timeout) and a one-line "error". Trials found RUNNING when a tune resumes
  (the tuner died) become FAIL with status "interrupted" and error "interrupted"; their
  configuration is enqueued again.
- Proposals the tuner refused to run (a duplicate of a completed or running configuration, or a
  searcher with nothing left) are FAIL with status "skipped"; like "interrupted" they spend no budget.
- Confirm walks down the ranking (skipping trials with quality_est_ok false) until confirm_top_k
  configurations pass the quality gate, screening at most 3 x confirm_top_k.
- Confirm re-measurements are not new trials: they are stored on the original trial as user_attrs
  "confirm_qps" (list of floats), "confirm_ne" (list: NE over the baseline's samples per
  re-measurement, null where unavailable), "quality_ok" (bool),
  "quality_reason" (str), and "confirm_failed" (list of "status: error" strings) if one failed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import optuna
import sqlalchemy
from optuna.storages import RDBStorage
from optuna.storages._rdb import models
from optuna.trial import FrozenTrial, TrialState

from cubic.space import SearchSpace, fingerprint, first_difference
from cubic_harness.config import TrialResult, json_safe
from cubic_harness.errors import ConfigError

FLAT_KEYS = ("status", "error", "qps", "qps_cv", "step_ms_p50", "peak_mem_mb", "ne")
INTERRUPTED = "interrupted"
NOT_RUN = (INTERRUPTED, "skipped")  # FAIL statuses that did not spend budget




def storage_url(run_dir: Path | None, storage: str | None) -> str:
    if storage:
        return storage
    assert run_dir is not None
    return f"sqlite:///{Path(run_dir).resolve() / 'study.db'}"


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
    db = run_dir / "study.db"
    if not holds_store:
        return
    if db.exists() and not db.is_file():
        raise ConfigError(f"--run-dir {run_dir}: {db} is not a file; it must be the run's SQLite trial store")
    if not db.is_file() or db.stat().st_size == 0:
        return
    try:  # read-only: looking never writes
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.Error:
        return
    # any of Optuna's tables: its store (maybe half made by a tuner starting beside this one)
    if tables and not tables & {*models.BaseModel.metadata.tables, "alembic_version"}:
        raise ConfigError(f"--run-dir {run_dir}: {db.name} is not a cubic/Optuna trial store (tables "
                          f"{sorted(tables)[:5]}); use another --run-dir")


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
    """The study plus the few operations the tuner needs that Optuna does not offer directly."""

    def __init__(self, space: SearchSpace, rdb: RDBStorage, run_dir: Path | None,
                 sampler: optuna.samplers.BaseSampler | None = None, backend: str = "real") -> None:
        """`backend`: "real", or "sim:CLUSTER" for simulated trials, which live in their own study
        (NAME@sim:CLUSTER) so that predictions and measurements are never mixed or taken for each other."""
        self.space, self.rdb, self.run_dir, self.backend = space, rdb, run_dir, backend
        name = space.name if backend == "real" else f"{space.name}@{backend}"
        self.study = optuna.create_study(study_name=name, storage=rdb, sampler=sampler,
                                         direction="maximize", load_if_exists=True)
        old = self.study.user_attrs.get("space")
        new = space.to_dict()
        if old is not None and fingerprint(old) != fingerprint(new):
            raise ConfigError(
                f"study {space.name!r} in {safe_url(rdb.url)} was made with a different search space "
                f"({old.get('path')}; first difference: {first_difference(old, new)}); use another "
                f"--run-dir/--storage or another space name")
        if run_dir is not None:
            (run_dir / "trials").mkdir(parents=True, exist_ok=True)

    def record_space(self) -> None:
        """Store the resolved space (with its constraints) as the study's "space" attr: only by the
        tuner holding the lease, so a refused second tuner never rewrites a running study's record."""
        self.study.set_user_attr("space", self.space.to_dict())
        self.study.set_user_attr("backend", self.backend)

    # ------------------------------------------------------------------ reading
    def trials(self, *states: TrialState) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=states or None)

    def budget_used(self) -> int:
        """Trials that ran (COMPLETE, or FAIL for a reason of their own)."""
        return sum(1 for t in self.trials(TrialState.COMPLETE, TrialState.FAIL)
                   if t.user_attrs.get("status") not in NOT_RUN)

    def completed_keys(self) -> dict[str, int]:
        return {t.user_attrs["config_key"]: t.number for t in self.trials(TrialState.COMPLETE)
                if "config_key" in t.user_attrs}

    def history(self) -> list[FrozenTrial]:
        """Finished trials of other studies in this storage on the same space (warm start)."""
        fp = fingerprint(self.space.to_dict())
        out: list[FrozenTrial] = []
        for s in self.rdb.get_all_studies():
            if (s.study_name == self.study.study_name or fingerprint(s.user_attrs.get("space") or {}) != fp
                    or s.user_attrs.get("backend", "real") != self.backend):  # measured and simulated apart
                continue
            out += [t for t in self.rdb.get_all_trials(s._study_id, deepcopy=False)
                    if t.state in (TrialState.COMPLETE, TrialState.FAIL)]
        return out

    # ------------------------------------------------------------------ writing
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
                    self.study._storage.set_trial_user_attr(t._trial_id, "config_key", key)
                self.study._storage.set_trial_user_attr(t._trial_id, "status", INTERRUPTED)
                self.study._storage.set_trial_user_attr(t._trial_id, "error", INTERRUPTED)
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

    def finish(self, trial: optuna.Trial, result: TrialResult) -> FrozenTrial:
        """Store the whole result, then COMPLETE (value = qps) or FAIL with status and reason."""
        rd = json_safe(result.to_dict())
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
        return self.study._storage.get_trial(trial._trial_id)

    def skip(self, trial: optuna.Trial, reason: str) -> None:
        trial.set_user_attr("status", "skipped")
        trial.set_user_attr("error", reason)
        self.study.tell(trial, state=TrialState.FAIL)

    def set_finished_attrs(self, trial: FrozenTrial, attrs: dict[str, Any]) -> None:
        """Add user attrs to a finished trial (confirm results). Optuna forbids updating finished
        trials through its API, so this upserts into its `trial_user_attributes` table directly."""
        table = models.TrialUserAttributeModel.__table__
        with self.rdb.engine.begin() as conn:
            for k, v in attrs.items():
                conn.execute(table.delete().where(table.c.trial_id == trial._trial_id, table.c.key == k))
                conn.execute(table.insert().values(trial_id=trial._trial_id, key=k,
                                                   value_json=json.dumps(json_safe(v))))
        trial.user_attrs.update(json_safe(attrs))

    def set_winner(self, winner: dict[str, Any] | None) -> None:
        self.study.set_user_attr("winner", json_safe(winner))
