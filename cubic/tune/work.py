"""The tuner's pending work, one type per kind: what a run on the cluster was for, so the loop that
collects it dispatches on the type (`Pending.tag` holds one of these; the runner never reads it)."""

from __future__ import annotations

from dataclasses import dataclass

import optuna

from cubic.quality.screen import Screened
from cubic.study.record import TrialRecord


@dataclass(frozen=True, eq=False)
class SearchRun:
    """A search trial: its result becomes the Optuna trial's."""

    trial: optuna.Trial


@dataclass(frozen=True, eq=False)
class CheckRun:
    """A held-out quality run while searching, for the model `rec` trains, at `seed`."""

    rec: TrialRecord
    seed: int


@dataclass(frozen=True, eq=False)
class ScreenRun:
    """A quality-screen run: one numerics change alone (`cubic.quality.screen`), at `seed`."""

    change: Screened
    seed: int


@dataclass(frozen=True, eq=False)
class RemeasureRun:
    """A confirm re-measurement of `rec`'s configuration (speed, and NE over the baseline's samples); `beside`:
    the candidate whose next run pairs with this one of the baseline (`cubic.tune.confirm`, step 3)."""

    rec: TrialRecord
    beside: TrialRecord | None = None


@dataclass(frozen=True, eq=False)
class BackoffRun:
    """A confirm back-off trial: a rejected candidate's layout with fewer of its numerics changes
    (`cubic.tune.confirm`); its result becomes the Optuna trial's, as a search trial's does."""

    trial: optuna.Trial


@dataclass(frozen=True, eq=False)
class GateRun:
    """A confirm quality run of `rec`'s model at `seed` (the gate's paired judgement)."""

    rec: TrialRecord
    seed: int


QUALITY_RUNS = (CheckRun, ScreenRun)  # search-time runs that spend no trial budget
