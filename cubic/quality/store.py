"""Quality runs paid for once: held-out quality results kept by what they train, reused across tunes.

A quality run (`cubic.space.quality_runs.QualityRuns.config`) is deterministic in what it trains: its config (the
workload, every knob, the budget's steps, the data seed) and the code that trains it (`harness/`,
`kernels/`). Its result is kept in a table cubic owns, `cubic_quality_runs`, in the trial store's
database (or the one `--quality-store` names), keyed by a digest of both. So a second tune of the same
space (another searcher seed, a quick `--trials 4`, another study in the same store) reuses every screen,
check and confirm run it shares with earlier tunes instead of training it again.

What is kept, and why only that: a run that finished with an eval NE. A failure may be the machine's
(a timeout under load, a node lost), not the config's, so the next tune tries it again. What the key
leaves out: `timeout_s` (how long a run may take changes nothing it trains). What it adds: a digest of
the harness's and kernels' sources and torch's version, so changed training code never reads a result
the old code produced.

The table is SQLAlchemy Core with a `schema` column per row (`SCHEMA`); rows of another schema are
ignored, not misread. Optuna's own tables are not touched."""

from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from cubic.execution.runner import Pending, Runner
from cubic_harness.config import TrialConfig, TrialResult, json_safe

SCHEMA = 1
_META = sa.MetaData()
RUNS = sa.Table(
    "cubic_quality_runs", _META,
    sa.Column("key", sa.String(64), primary_key=True),  # run_key(): sha256 hex
    sa.Column("schema", sa.Integer, nullable=False),
    sa.Column("config", sa.Text, nullable=False),  # TrialConfig.to_dict() as JSON (what it trained)
    sa.Column("result", sa.Text, nullable=False),  # TrialResult.to_dict() as JSON
    sa.Column("created", sa.Float, nullable=False),  # unix time
)


@functools.cache
def code_digest() -> str:
    """sha256 over the sources that train a model (harness/ and kernels/, every .py, by relative path)."""
    import cubic_harness
    import cubic_kernels

    h = hashlib.sha256()
    for pkg in (cubic_harness, cubic_kernels):
        root = Path(pkg.__file__).parent
        for p in sorted(root.rglob("*.py")):
            h.update(f"{pkg.__name__}/{p.relative_to(root).as_posix()}\0".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def run_key(cfg: TrialConfig, backend: str = "real") -> str:
    """What a quality run trains, as one digest: its config without `timeout_s`, the code, torch's version, and
    for a trial trained in TorchRec (`backend`) that fact and TorchRec's version."""
    d = cfg.to_dict()
    d.pop("timeout_s", None)
    key: dict[str, Any] = {"config": d, "code": code_digest(), "torch": version("torch")}
    if backend != "real":
        key.update(backend=backend, torchrec=version("torchrec"))
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def quality_store_url(where: str) -> str:
    """`--quality-store`: a storage URL as given, a run directory's store (which must exist), or a SQLite `.db`
    file, created if missing (so several run directories can share one: `make tune` keeps runs/quality.db)."""
    from cubic.study.store import storage_url
    from cubic_harness.errors import ConfigError

    p = Path(where).expanduser()
    if "://" not in where and p.suffix == ".db" and not p.exists():
        if not p.parent.is_dir():
            raise ConfigError(f"--quality-store {where}: no such directory {p.parent}")
        return f"sqlite:///{p.resolve()}"
    try:
        return storage_url(where)
    except ConfigError as e:
        raise ConfigError(f"--quality-store {e}") from None


def open_quality_store(where: str) -> QualityStore:
    """`--quality-store WHERE` opened, or one line (ConfigError) naming it and why it cannot be."""
    from cubic.study.store import redact, safe_url
    from cubic_harness.errors import ConfigError

    url = quality_store_url(where)
    try:
        return QualityStore(url)
    except sa.exc.SQLAlchemyError as e:
        why = redact(" ".join(str(getattr(e, "orig", None) or e).split()), where)[:160]
        raise ConfigError(f"--quality-store {safe_url(where)}: cannot open it as a store "
                          f"({type(e).__name__}: {why})") from None


def is_quality_run(cfg: TrialConfig) -> bool:
    """A run that trains to a held-out evaluation (what `QualityRuns.config` makes); speed runs never are."""
    return cfg.eval_samples > 0


class QualityStore:
    """`cubic_quality_runs` in one database: `get` a kept result, `put` a finished one."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = sa.create_engine(url)
        _META.create_all(self.engine, checkfirst=True)

    def count(self) -> int:
        with self.engine.connect() as c:
            return int(c.execute(sa.select(sa.func.count()).select_from(RUNS)
                                 .where(RUNS.c.schema == SCHEMA)).scalar_one())

    def get(self, cfg: TrialConfig, backend: str = "real") -> TrialResult | None:
        with self.engine.connect() as c:
            row = c.execute(sa.select(RUNS.c.result).where(RUNS.c.key == run_key(cfg, backend),
                                                           RUNS.c.schema == SCHEMA)).first()
        return None if row is None else TrialResult.from_dict(json.loads(row[0]))

    def put(self, cfg: TrialConfig, res: TrialResult, backend: str = "real") -> bool:
        """Keep a finished run (True if kept; a failed one, or one another tuner kept first, is not)."""
        if res.status != "ok" or res.extra.get("eval_ne") is None:
            return False
        row = {"key": run_key(cfg, backend), "schema": SCHEMA,
               "config": json.dumps(json_safe(cfg.to_dict()), sort_keys=True),
               "result": json.dumps(json_safe(res.to_dict())), "created": time.time()}
        try:
            with self.engine.begin() as c:
                c.execute(RUNS.insert().values(**row))
        except sa.exc.IntegrityError:  # the same run, kept by another tuner meanwhile: one row is enough
            return False
        return True

    def close(self) -> None:
        self.engine.dispose()


@dataclass
class ReusingRunner:
    """A runner whose quality runs are answered from a `QualityStore` where it holds them.

    The contract stays the runner's (`submit` a config, `wait` for results): a reused run comes back from
    the next `wait` as if it had run, marked `Pending.reused`, and costs no CPU; a quality run that really
    ran is kept when it finishes. Everything else (speed runs, capacity, Ray) is the wrapped runner's."""

    runner: Runner  # the one that runs what the store does not hold
    store: QualityStore
    reused: int = 0  # this tune's counts, for its summary line
    ran: int = 0
    _answered: list[tuple[Pending, TrialResult]] = field(default_factory=list)

    @property
    def simulated(self) -> bool:
        return self.runner.simulated

    @property
    def backend(self) -> str:
        return self.runner.backend

    @property
    def cpus(self) -> float:
        return self.runner.cpus

    def submit(self, cfg: TrialConfig, tag: Any = None) -> Pending:
        if is_quality_run(cfg):
            res = self.store.get(cfg, self.backend)
            if res is not None:
                p = Pending(cfg, None, 0.0, tag=tag, reused=True)
                self._answered.append((p, res))
                self.reused += 1
                return p
            self.ran += 1
        return self.runner.submit(cfg, tag)

    def has_room(self, pending: list[Pending]) -> bool:
        return self.runner.has_room([p for p in pending if not p.reused])

    def stop(self) -> None:
        self.runner.stop()

    def wait(self, pending: list[Pending], timeout: float = 1.0) -> list[tuple[Pending, TrialResult]]:
        done = [(p, r) for p, r in self._answered if any(p is q for q in pending)]
        if done:
            self._answered = [(p, r) for p, r in self._answered if not any(p is d for d, _ in done)]
            return done
        out = self.runner.wait([p for p in pending if not p.reused], timeout)
        for p, res in out:
            if is_quality_run(p.cfg):
                self.store.put(p.cfg, res, self.backend)
        return out
