"""The search-space file format, as typed models: what `load_space` accepts and `cubic schema space` exports.

The knobs are `TrialConfig`'s fields (less `NOT_KNOBS`), each typed as the config types it and, where
the config enumerates its values (`CHOICES`), as exactly those values: an editor with the exported JSON
Schema completes knob names and values, and a typo fails at the key it is in. What relates several keys
(a baseline inside its knobs' choices, a knob value in no valid configuration, conditions) is checked
by `cubic.space.search_space` after the model has vouched for every type.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, create_model

from cubic.space.codesign import CodesignSection
from cubic.space.lr_scaling import LRS, RULES
from cubic.space.numerics import LAYOUT_KNOBS
from cubic.space.quality_runs import SCREENS
from cubic_harness.config import CHOICES, TrialConfig
from cubic_harness.schema import Strict

TARGETS = ("harness", "torchrec")  # `target: torchrec` keeps only knob values TorchRec runs as measured
ISOLATIONS = ("node", "cores")  # how search trials share a Ray node: see cubic.execution.runner
OBJECTIVES = {"qps": "maximize"}
NOT_KNOBS = ("workload", "mem_cap_mb")  # config fields a space sets elsewhere (its workload, constraints)
KNOB_FIELDS = tuple(f.name for f in dataclasses.fields(TrialConfig) if f.name not in NOT_KNOBS)

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Pos = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def value_type(name: str) -> Any:
    """The type of knob `name`'s values: its allowed values where the config enumerates them."""
    if name in CHOICES:
        return Literal[CHOICES[name]]  # type: ignore[valid-type]
    return typing.get_type_hints(TrialConfig)[name]


def _shorthand(v: Any) -> Any:
    return {"choices": v} if isinstance(v, list) else v  # `knob: [a, b]` is `knob: {choices: [a, b]}`


@functools.cache
def knob_model(name: str) -> Any:
    """One knob's spec: `choices`, or a `low`..`high` range (`step`, or powers of two with `log: true`), an
    optional condition (`when: "sharding_group_size > 0"`) and the value it takes where that does not hold."""
    typ = value_type(name)
    spec = create_model(
        f"Knob_{name}", __base__=Strict,
        choices=(list[typ] | None, None),  # type: ignore[valid-type]
        low=(float | None, None), high=(float | None, None),
        type=(Literal["int", "float"], "int"), step=(Pos | None, None), log=(bool, False),
        when=(str | None, Field(None, description="conditions joined with ' and ': NAME OP VALUE")),
        default=(typ | None, None),  # type: ignore[valid-type]
    )
    return Annotated[spec, BeforeValidator(_shorthand, json_schema_input_type=list[typ] | spec)]  # type: ignore


Baseline = create_model("Baseline", __base__=Strict,
                        plan=(str | None, Field(None, description="a plan file (a team's production plan: cubic "
                                                "export's torchrec JSON, TorchRec's per-parameter shardings, or "
                                                "cubic's plan), relative to the space file; sets sharding: file")),
                        **{k: (value_type(k) | None, None) for k in KNOB_FIELDS})  # type: ignore[call-overload]
Knobs = create_model("Knobs", __base__=Strict,
                     **{k: (knob_model(k) | None, None) for k in KNOB_FIELDS})  # type: ignore[call-overload]


class Objective(Strict):
    metric: Literal[tuple(OBJECTIVES)] = "qps"  # type: ignore[valid-type]
    direction: Literal["maximize", "max"] = "maximize"


class TrialSection(Strict):
    """How each trial measures (TrialConfig checks the ranges) and how often the confirm re-measures."""

    warmup_steps: int | None = None
    measure_steps: int | None = None
    windows: int | None = None
    timeout_s: float | None = None
    seed: int | None = None
    repeats: PosInt = 2


class Budget(Strict):
    trials: PosInt = 20
    confirm_top_k: NonNegInt = 3
    max_concurrent: NonNegInt = 0
    isolation: Literal[ISOLATIONS] = "node"  # type: ignore[valid-type]


class Constraints(Strict):
    mem_cap_mb: NonNeg | None = None
    quality_tolerance: NonNeg = 0.02
    quality_knobs: list[Literal[tuple(f.name for f in dataclasses.fields(TrialConfig))]] | None = None  # type: ignore


class Quality(Strict):
    """Held-out quality runs (`cubic.space.quality_runs.QualityRuns`): the screen, the checks and the gate."""

    samples: PosInt | None = None
    eval_samples: PosInt | None = None
    seeds: PosInt | None = None
    tolerance: NonNeg | None = None
    screen: bool | Literal[SCREENS] | None = None  # type: ignore[valid-type]  # true: upfront, false: off
    confidence: Annotated[float, Field(ge=0.5, lt=1)] | None = None
    max_seeds: PosInt | None = None
    layout: dict[str, Any] | None = Field(
        None, description=f"model-neutral knobs ({', '.join(LAYOUT_KNOBS)}) and the values every quality "
        "run takes instead of the baseline's: the same model, trained faster")


class SpaceFile(Strict):
    """A search space (`search_spaces/*.yaml`): the workload, the baseline, the knobs and how to judge them."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]+$")] | None = None
    description: str = ""
    target: Literal[TARGETS] = "harness"  # type: ignore[valid-type]
    workload: str | dict[str, Any] = Field(
        "small", description="a preset name; {preset: NAME, KEY: VALUE...}; {file: PATH, KEY: VALUE...} (a workload "
        "file, `cubic schema workload`); or a whole workload")
    baseline: Baseline | None = None  # type: ignore[valid-type]
    knobs: Knobs  # type: ignore[valid-type]
    objective: Objective | None = None
    constraints: Constraints | None = None
    trial: TrialSection | None = None
    budget: Budget | None = None
    lr_scaling: Literal[RULES] | dict[PosInt, dict[Literal[LRS], Pos]] = "none"  # type: ignore[valid-type]
    quality: Quality | None = None
    codesign: CodesignSection | None = Field(None, description="the cluster as knobs of a simulated "
                                             "study and its objectives (`cubic codesign`)")
