"""The trial record: everything cubic knows about one trial, typed, read and written in this module only.

A trial lives in two places of one database, for two reasons:

1. Optuna's trial: params, state, value, and what is known by the time it finishes
   (`TrialRecord.run`: its phase, searcher, the proxy's prediction, its config and whole result),
   as Optuna user attrs, so
   Optuna's CLI and optuna-dashboard read a study as they always did.
2. What cubic learns after it finished (`TrialRecord`'s own fields: the in-run quality estimate,
   held-out quality runs, confirm re-measurements, the gate's verdict), in `cubic_trial_attrs`
   (`cubic.study.tables`): Optuna forbids changing a finished trial through its API.

Stores written before that table existed kept (2) as Optuna user attrs too; a record reads both, the
table winning, so an old store opens, reports and resumes unchanged.

Three quality verdicts exist because three checks of different cost run at different times; which one
counts is written once, here:
- `quality_est_ok`: the in-run estimate (`cubic.quality.rules.matched_ne`), free, from the trial's own losses;
- `quality_heldout_ok`: held-out quality runs while searching (or inherited from a trial that trains
  the same model, or the screen's); overrides the estimate (`feasible`);
- `quality_ok`: the confirm's gate, with its reason; the only one that crowns a winner.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, fields
from typing import Any

import sqlalchemy as sa
from optuna.trial import FrozenTrial, TrialState

from cubic.study import tables
from cubic_harness.config import json_safe

# Optuna user attrs written while a trial runs (before it finishes); `TrialResult`'s flat metrics
FLAT_KEYS = ("status", "error", "qps", "qps_cv", "step_ms_p50", "peak_mem_mb", "ne")
INTERRUPTED = "interrupted"
NOT_RUN = (INTERRUPTED, "skipped")  # FAIL statuses that did not spend budget
REFERENCE = "reference"  # the phase of the baseline planned by TorchRec's own planner (`SearchSpace.reference_params`)
BACKOFF = "backoff"  # the phase of a confirm back-off trial (`cubic.tune.confirm`): not a search trial


@dataclass(eq=False)
class TrialRecord:
    """One trial: Optuna's `FrozenTrial` (params, state, value, run attrs) plus cubic's findings.

    The tuner holds one object per finished trial (`cubic.study.store.Store.records`) and updates it only
    through `Store.update`, which writes the table and the object together."""

    trial: FrozenTrial
    # the in-run quality estimate (cubic.quality.rules.matched_ne over the baseline's samples)
    ne_matched: float | None = None
    quality_est_ok: bool | None = None
    quality_est_tol: float | None = None  # the tolerance it was judged with: a resume with another re-judges
    # held-out quality runs: its own, a twin's (`quality_runs_of`) or a screened change's
    quality_eval_ne: list[float | None] = field(default_factory=list)
    quality_eval_auc: list[float | None] = field(default_factory=list)
    quality_failed: str | None = None
    quality_runs_of: int | None = None
    quality_screen_runs: str | None = None
    quality_screened_out: list[str] | None = None
    quality_heldout_ok: bool | None = None
    # the confirm: re-measurements, each right after one of the baseline (`confirm_base_qps`, None where
    # that run failed): the machine drifts between runs minutes apart, and a pair shares its spell
    confirm_qps: list[float] = field(default_factory=list)
    confirm_base_qps: list[float | None] = field(default_factory=list)
    confirm_ne: list[float | None] = field(default_factory=list)
    confirm_failed: list[str] = field(default_factory=list)
    # the gate's verdict and its numbers (cubic.quality.rules.sequential)
    quality_ok: bool | None = None
    quality_reason: str | None = None
    quality_verdict: str | None = None
    quality_eval_diff: float | None = None
    quality_se: float | None = None
    quality_noise: float | None = None
    quality_resolved: bool | None = None
    quality_ci: list[float] | None = None

    # ------------------------------------------------------------------ Optuna's part
    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def params(self) -> dict[str, Any]:
        return self.trial.params

    @property
    def state(self) -> TrialState:
        return self.trial.state

    @property
    def value(self) -> float | None:
        return self.trial.value if self.trial.values else None

    @property
    def run(self) -> dict[str, Any]:
        """The attrs written while it ran (phase, searcher, predicted_qps, config_key, config, result, ...)."""
        return self.trial.user_attrs

    @property
    def config_key(self) -> str | None:
        return self.run.get("config_key")

    @property
    def status(self) -> str | None:
        return self.run.get("status")

    @property
    def result(self) -> dict[str, Any]:
        return self.run.get("result") or {}

    @property
    def ran(self) -> bool:
        """It spent budget: finished for a reason of its own (not skipped, not interrupted)."""
        return self.state in (TrialState.COMPLETE, TrialState.FAIL) and self.status not in NOT_RUN

    # ------------------------------------------------------------------ the precedence of the verdicts
    @property
    def feasible(self) -> bool | None:
        """What the searcher believes of its quality: held-out quality's verdict where one was reached,
        else the in-run estimate's; None where neither judged it."""
        return self.quality_heldout_ok if self.quality_heldout_ok is not None else self.quality_est_ok

    # ------------------------------------------------------------------ its re-measured speed
    @property
    def paired_ratios(self) -> list[float]:
        """Each re-measurement over the baseline's run just before it (pairs where both ran)."""
        return [q / b for q, b in zip(self.confirm_qps, self.confirm_base_qps, strict=False) if b]

    def confirm_speedup(self, base_qps: float | None) -> float | None:
        """Its re-measured speed over the baseline's: the median of `paired_ratios`, where drift between runs
        cancels; a record with no pair (the baseline itself, an older store) by its median over `base_qps`
        (None: not re-measured, or nothing to divide by)."""
        if r := self.paired_ratios:
            return statistics.median(r)
        if not self.confirm_qps or not base_qps:
            return None
        return statistics.median(self.confirm_qps) / base_qps

    def heldout(self, verdict: bool = True) -> dict[str, Any]:
        """What a trial that trains the same model inherits: its quality runs and (`verdict`) held-out verdict;
        `quality_runs_of` names the trial that ran them (this one, or the one it holds them from)."""
        keep = ("quality_eval_ne", "quality_eval_auc", "quality_failed") + (("quality_heldout_ok",) if verdict else ())
        owner = self.number if self.quality_runs_of is None else self.quality_runs_of
        return {k: v for k in keep if (v := getattr(self, k)) not in (None, [])} | {"quality_runs_of": owner}

    def findings(self) -> dict[str, Any]:
        """cubic's fields that hold something, by name (the report's and the tests' view of the record)."""
        return {f.name: v for f in FIELDS.values() if (v := getattr(self, f.name)) not in (None, [])}


FIELDS = {f.name: f for f in fields(TrialRecord) if f.name != "trial"}
_LISTS = {n for n, f in FIELDS.items() if f.default_factory is list}  # (never None: [] when absent)


def coerce(name: str, value: Any) -> Any:
    """A stored value as its field's type."""
    if name in _LISTS:  # older stores kept confirm_ne as one number
        return [] if value is None else list(value) if isinstance(value, list) else [value]
    return value


def build(trial: FrozenTrial, found: dict[str, Any] | None = None) -> TrialRecord:
    """A trial's record: cubic's table (`found`) over what older stores kept as Optuna user attrs."""
    merged = {k: v for k, v in trial.user_attrs.items() if k in FIELDS} | (found or {})
    return TrialRecord(trial, **{k: coerce(k, v) for k, v in merged.items()})


def check_fields(changes: dict[str, Any]) -> None:
    unknown = set(changes) - set(FIELDS)
    if unknown:
        raise TypeError(f"not TrialRecord fields: {sorted(unknown)}")


# ---------------------------------------------------------------------------------------------- the table
def read(engine: sa.Engine, study: str) -> dict[int, dict[str, Any]]:
    """cubic's fields of every trial of `study`, by trial number (rows of another schema skipped)."""
    if not tables.exists(engine, tables.TRIAL_ATTRS):
        return {}
    t = tables.TRIAL_ATTRS
    out: dict[int, dict[str, Any]] = {}
    with engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.trial, t.c.key, t.c.value_json)
                            .where(t.c.study == study, t.c.schema == tables.SCHEMA))
        for trial, key, value in rows:
            if key in FIELDS:
                out.setdefault(int(trial), {})[key] = json.loads(value)
    return out


def write(engine: sa.Engine, study: str, number: int, changes: dict[str, Any]) -> dict[str, Any]:
    """Upsert `changes` (field -> value) for trial `number` in one transaction; returns them JSON-safe."""
    check_fields(changes)
    safe = json_safe(changes)
    t = tables.TRIAL_ATTRS
    with engine.begin() as conn:
        for k, v in safe.items():
            conn.execute(t.delete().where(t.c.study == study, t.c.trial == number, t.c.key == k))
            conn.execute(t.insert().values(study=study, trial=number, key=k, schema=tables.SCHEMA,
                                           value_json=json.dumps(v)))
    return safe


def load(engine: sa.Engine, study: str, trials: list[FrozenTrial]) -> list[TrialRecord]:
    """The records of `trials` (one study's), read in one query."""
    found = read(engine, study)
    return [build(t, found.get(t.number)) for t in trials]
