"""The tables cubic owns in the trial store's database, beside Optuna's.

Why cubic has tables of its own: Optuna forbids changing a finished trial through its API, and its
own table models are private API, so a row cubic wrote there could break with
any Optuna release. What cubic adds after a trial finished, and the tuner's lease, live here
instead; Optuna's tables are read and written only through Optuna's public API. (The quality store's
`cubic_quality_runs`, `cubic.quality.store`, follows the same rule in its own module.)

Every row carries the `schema` it was written with. A reader skips rows of a schema it does not
know rather than misread them; `SCHEMA` moves when a row's meaning changes.
"""

from __future__ import annotations

import time

import sqlalchemy as sa

SCHEMA = 1
META = sa.MetaData()

TRIAL_ATTRS = sa.Table(
    "cubic_trial_attrs", META,  # what cubic learned about a finished trial (cubic.study.record)
    sa.Column("study", sa.String(512), primary_key=True),  # Optuna's study name (unique in a store)
    sa.Column("trial", sa.Integer, primary_key=True),  # the trial's number in its study
    sa.Column("key", sa.String(64), primary_key=True),  # a `TrialRecord` field
    sa.Column("schema", sa.Integer, nullable=False),
    sa.Column("value_json", sa.Text, nullable=False),
)

LEASES = sa.Table(
    "cubic_leases", META,  # the tuner that holds a study (cubic.study.lease)
    sa.Column("study", sa.String(512), primary_key=True),
    sa.Column("schema", sa.Integer, nullable=False),
    sa.Column("value_json", sa.Text, nullable=False),
)


def ensure(engine: sa.Engine, attempts: int = 20) -> None:
    """Create cubic's tables where missing. Two processes opening a new store at once race on the
    DDL; the loser sees the winner's half-made tables and retries (creation is idempotent)."""
    for i in range(attempts):
        try:
            META.create_all(engine, checkfirst=True)
            return
        except (sa.exc.OperationalError, sa.exc.IntegrityError, sa.exc.ProgrammingError):
            if i == attempts - 1:
                raise
            time.sleep(0.05 * (i + 1))


def exists(engine: sa.Engine, table: sa.Table) -> bool:
    """Whether `table` is in the database: readers of a store written before it existed find nothing
    there, and never create it (a report only reads)."""
    return sa.inspect(engine).has_table(table.name)
