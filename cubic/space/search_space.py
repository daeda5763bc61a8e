"""Search space: a YAML file -> `SearchSpace` (workload, knobs, baseline, objective, constraints,
budget).

The file is typed by its model (`cubic.space.spec`), then what relates its keys is checked here: the
baseline inside its knobs' choices, each condition's names, every knob value in some valid
configuration. The parts live by role: the file with its lines (`loader`), conditions
(`conditions`), knobs (`knobs`), `target: torchrec` (`torchrec_target`), the loaded type and its
configurations (`space`), and what a study is identified by (`identity`); this module re-exports
their public names.

Errors are `cubic_harness.errors.ConfigError` with one line: `FILE:LINE: key: what is allowed`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from cubic.space import numerics
from cubic.space.codesign import CodesignSection
from cubic.space.conditions import FIELDS, Cond
from cubic.space.identity import fingerprint, first_difference
from cubic.space.knobs import SETTABLE, Knob, parse_knob
from cubic.space.loader import Loader, read_space_file, shipped_space
from cubic.space.quality_runs import OFF, UPFRONT, QualityRuns
from cubic.space.space import ENUMERATE_LIMIT, REFERENCE_PLANNER, SearchSpace
from cubic.space.spec import NOT_KNOBS, Budget, Constraints, Objective, SpaceFile, TrialSection
from cubic.space.torchrec_target import restrict_to_torchrec
from cubic_harness.config import TrialConfig
from cubic_harness.errors import ConfigError
from cubic_harness.schema import validate
from cubic_harness.workload import Workload

__all__ = ["ENUMERATE_LIMIT", "REFERENCE_PLANNER", "Cond", "Knob", "SearchSpace",
           "first_difference", "fingerprint", "load_space", "shipped_space"]


def load_space(path: str | Path, *, check_choices: bool = True) -> SearchSpace:
    """Parse and validate a search-space YAML file, or a shipped space by name (`dlrm_cpu`,
    `tiny.yaml`: what `search_spaces/` holds, from any directory), ConfigError with file:line on any
    problem. `check_choices=False` skips only the check that every knob value is in some valid
    configuration, which enumerates the space (~2 s for the shipped CPU space): for a caller that
    wants the baseline alone (`cubic trial`)."""
    path = Path(path)
    if not path.exists() and path.parent == Path("."):
        named = shipped_space(path.name if path.suffix else f"{path.name}.yaml")
        path = named if named.exists() else path
    ld, raw = read_space_file(path)
    f = validate(SpaceFile, raw, str(path), ld.lines.at)  # every key, type and range (spec.py)
    return _build(ld, raw, f, check_choices)  # type: ignore[arg-type]


def _build(ld: Loader, raw: dict[str, Any], f: SpaceFile,
           check_choices: bool = True) -> SearchSpace:
    """The space from its file: `f` is the file as its model read it (every scalar setting with its
    default), `raw` the same file's sections where the config and the knobs are built and related to
    each other."""
    name = str(raw.get("name") or ld.path.stem)
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ld.err("name", f"{name!r} must be letters, digits, '_', '-' or '.'")
    workload = _workload(ld, raw)
    budget, constraints = f.budget or Budget(), f.constraints or Constraints()
    baseline, base_raw = _baseline(ld, raw, workload)
    knobs = _knobs(ld, raw, baseline)
    try:
        baseline.validate("baseline")
    except ConfigError as e:
        raise ld.err("baseline", str(e).removeprefix("baseline: ")) from None
    knobs, dropped = _fit_to_baseline(ld, knobs, baseline, base_raw, f.target)
    qknobs = constraints.quality_knobs
    qknobs = tuple(numerics.NUMERICS) if qknobs is None else qknobs
    lr_scaling = _lr_scaling(ld, raw)
    space = SearchSpace(
        name=name, path=str(ld.path), workload=workload, knobs=knobs, baseline=baseline,
        objective=(f.objective or Objective()).metric, direction="maximize",
        mem_cap_mb=float(baseline.mem_cap_mb),
        quality_tolerance=float(constraints.quality_tolerance), quality_knobs=tuple(qknobs),
        repeats=(f.trial or TrialSection()).repeats, budget=budget.trials,
        confirm_top_k=budget.confirm_top_k, max_concurrent=budget.max_concurrent,
        isolation=budget.isolation, description=str(raw.get("description", "")), target=f.target,
        target_dropped=dropped, lr_scaling=lr_scaling,
        quality_runs=_quality_runs(ld, raw, f, knobs, baseline),
        codesign=_codesign(ld, f, knobs),
    )
    base = space.baseline_params()
    if space.tup(base) != tuple(base.values()):
        bad = [k for k, v in space.canonical(base).items() if v != getattr(baseline, k)]
        raise ld.err(f"knobs.{bad[0]}", "the baseline's value must be the knob's default when its "
                     "condition does not hold or it is inert (cubic_harness.config.inert_knobs)")
    if check_choices:
        _check_every_choice_is_used(ld, space)
    return space


def _codesign(ld: Loader, f: SpaceFile, knobs: dict[str, Any]) -> CodesignSection | None:
    """`codesign:` with its knobs layout-only: a co-design study's time to train counts the samples
    its quality target took at the baseline's numerics, which a numerics knob would change."""
    if f.codesign is None:
        return None
    bad = [k for k in knobs if k in numerics.NUMERICS and k not in numerics.MODEL_NEUTRAL]
    if bad:
        raise ld.err(f"knobs.{bad[0]}", "a space with codesign: searches layout knobs only (its time to "
                     f"train counts samples at the baseline's numerics); numerics knobs: {bad}")
    return f.codesign


def _workload(ld: Loader, raw: dict[str, Any]) -> Workload:
    """`workload:` as a preset name, a workload mapping, or a workload file with keys set over
    it."""
    wl_raw = raw.get("workload", {"preset": "small"})
    if isinstance(wl_raw, str):
        wl_raw = {"preset": wl_raw}
    try:
        if isinstance(wl_raw, dict) and "file" in wl_raw:  # a workload file, keys set over it
            return _workload_file(ld.path, wl_raw)
        return Workload.from_dict(wl_raw, where="workload")
    except ConfigError as e:
        raise ld.err("workload", str(e).removeprefix("workload: ")) from None


def _workload_file(space_path: Path, raw: dict[str, Any]) -> Workload:
    """`workload: {file: PATH, KEY: VALUE...}`: the file (relative to the space file, from
    `cubic workload from-torchrec` or a profile) with keys set over it, e.g. `id_source: trace` to
    replay the profiled sample instead of drawing like it."""
    raw = dict(raw)
    path = raw.pop("file")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"workload: file={path!r} must be the path of a workload file")
    wl, _ = Workload.from_json_file(space_path.parent / path)
    return Workload.from_dict({**wl.to_dict(), **raw}, where=f"workload ({path})") if raw else wl


def _baseline(ld: Loader, raw: dict[str, Any],
              workload: Workload) -> tuple[TrialConfig, dict[str, Any]]:
    """The baseline config (the trial settings and the mem cap applied, not yet validated) and the
    keys `baseline:` set (`plan: FILE` read as the production plan, exactly)."""
    trial = ld.mapping(raw.get("trial"), "trial")
    cons = ld.mapping(raw.get("constraints"), "constraints")
    base_raw = ld.mapping(raw.get("baseline"), "baseline")
    if "plan" in base_raw:  # `plan: FILE`: the production plan, exactly (sharding: file)
        plan = base_raw.pop("plan")
        if not isinstance(plan, str) or not plan:
            raise ld.err("baseline.plan", f"{plan!r} must be the path of a plan file")
        plan_file = str((ld.path.parent / plan).resolve())
        base_raw = {**base_raw, "sharding": "file", "plan_file": plan_file}
    for k in base_raw:
        if k not in FIELDS or k in NOT_KNOBS:
            raise ld.err(f"baseline.{k}", f"unknown key; allowed: {SETTABLE}")
    settings = {k: v for k, v in trial.items() if k != "repeats"}
    if "mem_cap_mb" in cons:
        settings["mem_cap_mb"] = cons["mem_cap_mb"]
    try:
        baseline = TrialConfig.from_dict({**base_raw, **settings, "workload": workload},
                                         where="baseline")
    except ConfigError as e:
        key = next((f"baseline.{k}" for k in base_raw if f"{k}=" in str(e) or repr(k) in str(e)),
                   "baseline")
        raise ld.err(key, str(e).removeprefix("baseline: ")) from None
    return baseline, base_raw


def _knobs(ld: Loader, raw: dict[str, Any], baseline: TrialConfig) -> dict[str, Knob]:
    """`knobs:`, each parsed, and every name a condition reads a knob or config field."""
    knobs_raw = ld.mapping(raw.get("knobs"), "knobs")
    if not knobs_raw:
        raise ld.err("knobs", "needs at least one knob")
    knobs = {k: parse_knob(ld, k, spec, baseline) for k, spec in knobs_raw.items()}
    for k, kn in knobs.items():
        for c in kn.when:
            for n in c.names():
                if n not in FIELDS or n in NOT_KNOBS:
                    raise ld.err(f"knobs.{k}.when",
                                 f"unknown name {n!r} in condition '{c}'; allowed: {SETTABLE}")
    return knobs


def _fit_to_baseline(ld: Loader, knobs: dict[str, Knob], baseline: TrialConfig,
                     base_raw: dict[str, Any],
                     target: str) -> tuple[dict[str, Knob], dict[str, list]]:
    """The knobs as the space searches them, and what `target: torchrec` dropped: the production
    plan stays a value of a space that varies the sharding (every global knob is tried on it), and
    the baseline's value of each knob must be one of its choices."""
    dropped: dict[str, list] = {}
    if target == "torchrec":
        knobs, dropped = restrict_to_torchrec(ld, knobs, baseline, base_raw)
    sharding = knobs.get("sharding")
    if baseline.sharding == "file" and sharding is not None and "file" not in sharding.choices:
        knobs["sharding"] = dataclasses.replace(sharding, choices=(*sharding.choices, "file"))
    for k, kn in knobs.items():
        v = getattr(baseline, k)
        if v not in kn.choices:
            raise ld.err(f"baseline.{k}" if k in base_raw else f"knobs.{k}",
                         f"baseline value {v!r} is outside the space; knobs.{k} choices: "
                         f"{list(kn.choices)}")
    return knobs, dropped


def _lr_scaling(ld: Loader, raw: dict[str, Any]) -> Any:
    from cubic.space.lr_scaling import parse

    try:
        return parse(raw.get("lr_scaling", "none"), "lr_scaling")
    except ConfigError as e:
        raise ld.err("lr_scaling", str(e).removeprefix("lr_scaling: ")) from None


def _quality_runs(ld: Loader, raw: dict[str, Any], f: SpaceFile, knobs: dict[str, Any],
                  baseline: TrialConfig) -> QualityRuns | None:
    """`quality:` as the confirm's quality runs; None (the in-run NE gate) where the file has
    none. Its `layout` names model-neutral knobs of the space, each at one of its values, and
    settings the space fixes that never change the model (`numerics.ALWAYS_NEUTRAL`), each at a
    value the baseline (and TorchRec, for `target: torchrec`) runs."""
    if raw.get("quality") is None:
        return None
    given = {k: v for k, v in f.quality.model_dump().items() if v is not None}  # the rest: defaults
    for k, v in given.get("layout", {}).items():
        if k not in numerics.LAYOUT_KNOBS:
            raise ld.err(f"quality.layout.{k}", "not a model-neutral knob; choose from "
                         f"{list(numerics.LAYOUT_KNOBS)}")
        if k in knobs:
            if v not in knobs[k].choices:
                raise ld.err(f"quality.layout.{k}",
                             f"{v!r}; choose one of {list(knobs[k].choices)}")
        elif k not in numerics.ALWAYS_NEUTRAL:
            raise ld.err(f"quality.layout.{k}", "not a knob of this space; a quality run keeps the "
                         "baseline's value of a fixed setting other than "
                         f"{list(numerics.ALWAYS_NEUTRAL)}")
        else:
            _fixed_layout_setting(ld, k, v, baseline, f.target)
    if isinstance(given.get("screen"), bool):
        given["screen"] = UPFRONT if given["screen"] else OFF
    seeds = given.get("seeds", QualityRuns.seeds)
    quality_runs = QualityRuns(**{"max_seeds": max(QualityRuns.max_seeds, seeds), **given})
    if quality_runs.max_seeds < quality_runs.seeds:
        raise ld.err("quality.max_seeds", f"{quality_runs.max_seeds} must be at least "
                     f"quality.seeds ({quality_runs.seeds})")
    return quality_runs


def _fixed_layout_setting(ld: Loader, k: str, v: Any, baseline: TrialConfig,
                          target: str | None) -> None:
    """A layout's value for a setting the space fixes: one the baseline's config takes, and one
    TorchRec runs where the space targets it."""
    try:
        dataclasses.replace(baseline, **{k: v}).validate("quality layout")
    except ConfigError as e:
        raise ld.err(f"quality.layout.{k}", str(e).removeprefix("quality layout: ")) from None
    except (TypeError, ValueError):  # a value of another type than the setting's
        raise ld.err(f"quality.layout.{k}", f"{v!r} is not a value of {k} "
                     f"({type(getattr(baseline, k)).__name__})") from None
    if target == "torchrec":
        from cubic_harness.torchrec_rules import torchrec_unsupported

        why = torchrec_unsupported(k, v, baseline.device)
        if why:
            raise ld.err(f"quality.layout.{k}",
                         f"target torchrec: {v!r} does not run in TorchRec ({why})")


def _check_every_choice_is_used(ld: Loader, space: SearchSpace) -> None:
    """A knob value that is in no valid configuration is a typo or a dead condition: say so
    instead of dropping it silently (spaces too large to enumerate are not checked)."""
    if space.all_tuples is None:
        return
    for i, (name, kn) in enumerate(space.knobs.items()):
        used = {t[i] for t in space.all_tuples}
        for v in kn.choices:
            if v in used:
                continue
            try:
                dataclasses.replace(space.baseline, **{name: v}).validate("with the baseline")
                why = ("its condition never holds, it is inert wherever it could hold "
                       "(inert_knobs), or it is invalid with every other knob's values")
            except ConfigError as e:
                why = str(e)
            raise ld.err(f"knobs.{name}", f"value {v!r} is in no valid configuration: {why}")
