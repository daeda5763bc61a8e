"""Search space: a YAML file -> `SearchSpace` (workload, knobs, baseline, objective, constraints, budget).

Every knob is categorical (ranges are expanded to their grid points) so that every
searcher, the proxy and the store see the same finite set of values. A knob may
carry a condition (`when`); where it does not hold the knob takes its default
(the baseline's value), so configurations that differ only in meaningless knobs
are one configuration ("canonical" params) and are never run twice.

Errors are `cubic_harness.errors.ConfigError` with one line: `FILE:LINE: key: what is allowed`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cubic.space import numerics
from cubic.space.quality_runs import OFF, UPFRONT, QualityRuns
from cubic.space.spec import NOT_KNOBS, Budget, Constraints, Objective, SpaceFile, TrialSection
from cubic_harness.config import CHOICES, RETIRED, TrialConfig
from cubic_harness.errors import ConfigError, read_text
from cubic_harness.schema import validate
from cubic_harness.workload import Workload

ENUMERATE_LIMIT = 400_000  # spaces up to this many raw points are enumerated once (grid, pools)
REFERENCE_PLANNER = "torchrec_planner"  # the plan a TorchRec user gets by default

_OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
        ">=": operator.ge, "in": lambda a, b: a in b, "not in": lambda a, b: a not in b}
_COND_RE = re.compile(r"^\s*(\w+)\s*(==|!=|<=|>=|<|>|not in|in)\s*(.+?)\s*$")
_FIELDS = {f.name for f in dataclasses.fields(TrialConfig)}


@dataclass(frozen=True)
class Cond:
    """`lhs op rhs`: lhs a knob/field name, rhs a literal (YAML scalar or list) or a field name."""

    lhs: str
    op: str
    rhs: Any
    rhs_is_field: bool

    def holds(self, values: dict[str, Any]) -> bool:
        rhs = values[self.rhs] if self.rhs_is_field else self.rhs
        try:
            return bool(_OPS[self.op](values[self.lhs], rhs))
        except TypeError:
            return False

    def __str__(self) -> str:
        return f"{self.lhs} {self.op} {self.rhs}"


@dataclass(frozen=True)
class Knob:
    name: str
    choices: tuple[Any, ...]
    default: Any
    when: tuple[Cond, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"choices": list(self.choices), "default": self.default, "when": " and ".join(map(str, self.when))}


@dataclass
class SearchSpace:
    name: str
    path: str
    workload: Workload
    knobs: dict[str, Knob]
    baseline: TrialConfig  # the full baseline TrialConfig (trial settings and mem cap applied)
    objective: str = "qps"
    direction: str = "maximize"
    mem_cap_mb: float = 0.0
    quality_tolerance: float = 0.02
    quality_knobs: tuple[str, ...] = tuple(numerics.NUMERICS)
    repeats: int = 2
    budget: int = 20
    confirm_top_k: int = 3
    max_concurrent: int = 0  # 0 = as many as the Ray cluster's CPUs allow
    isolation: str = "node"  # one of ISOLATIONS
    description: str = ""
    target: str = "harness"  # one of TARGETS
    target_dropped: dict[str, list] = field(default_factory=dict)  # knob -> values the target cannot run
    lr_scaling: Any = "none"  # cubic/space/lr_scaling.py: a rule or a {global batch: rates} table
    quality_runs: QualityRuns | None = None  # the confirm's quality runs; None: the in-run NE gate
    _cache: dict[tuple, TrialConfig | None] = field(default_factory=dict, repr=False)
    _changes: dict[tuple, frozenset] = field(default_factory=dict, repr=False)
    _excluded: dict[frozenset, frozenset] = field(default_factory=dict, repr=False)  # cubic.quality.screen's cache

    # ------------------------------------------------------------------ params <-> configs
    @property
    def names(self) -> list[str]:
        return list(self.knobs)

    def baseline_params(self) -> dict[str, Any]:
        return {k: getattr(self.baseline, k) for k in self.knobs}

    def reference_params(self) -> dict[str, Any] | None:
        """The baseline planned by TorchRec's own planner, where the space's `sharding` knob offers it: every
        tune of such a space runs it once, after the baseline, and says what the winner gains over the plan a
        TorchRec user gets by default (`cubic.tune.summary.reference`). None where it is not offered, is the
        baseline, or is no valid configuration of the space."""
        kn = self.knobs.get("sharding")
        if kn is None or REFERENCE_PLANNER not in kn.choices or self.baseline.sharding == REFERENCE_PLANNER:
            return None
        params = self.canonical({**self.baseline_params(), "sharding": REFERENCE_PLANNER})
        return params if self.valid(params) else None

    def canonical(self, params: dict[str, Any]) -> dict[str, Any]:
        """Params with every knob whose condition fails set to its default (fixpoint over knobs)."""
        vals = {**{k: getattr(self.baseline, k) for k in _FIELDS if k not in NOT_KNOBS},
                **{k: params.get(k, kn.default) for k, kn in self.knobs.items()}}
        for _ in range(len(self.knobs) + 1):
            changed = False
            for k, kn in self.knobs.items():
                if kn.when and vals[k] != kn.default and not all(c.holds(vals) for c in kn.when):
                    vals[k], changed = kn.default, True
            if not changed:
                break
        return {k: vals[k] for k in self.knobs}

    def tup(self, params: dict[str, Any]) -> tuple:
        """Hashable canonical identity of params (same tuple <=> same TrialConfig)."""
        c = self.canonical(params)
        return tuple(c[k] for k in self.knobs)

    def config(self, params: dict[str, Any]) -> TrialConfig:
        """The TrialConfig to run for params; raises ConfigError if the combination is invalid."""
        cfg = self._config_or_none(self.tup(params))
        if cfg is None:
            cfg = self._scaled(dataclasses.replace(self.baseline, **self.canonical(params)))
            cfg.validate(f"{self.path}: knobs")  # raises with the reason
        return cfg

    def _scaled(self, cfg: TrialConfig) -> TrialConfig:
        """`cfg` at the learning rates the space's lr_scaling gives its global batch."""
        from cubic.space.lr_scaling import apply

        return apply(cfg, self.baseline, self.lr_scaling, tuple(self.knobs))

    def valid(self, params: dict[str, Any]) -> bool:
        return self._config_or_none(self.tup(params)) is not None

    def _config_or_none(self, tup: tuple) -> TrialConfig | None:
        if tup not in self._cache:
            cfg = self._scaled(dataclasses.replace(self.baseline, **dict(zip(self.knobs, tup, strict=True))))
            try:
                cfg.validate(workload=False)  # the baseline's workload, validated when the space loaded
            except ConfigError:
                cfg = None
            self._cache[tup] = cfg
        return self._cache[tup]

    def params_of(self, tup: tuple) -> dict[str, Any]:
        return dict(zip(self.knobs, tup, strict=True))

    # ------------------------------------------------------------------ enumeration / sampling
    @property
    def raw_size(self) -> int:
        return math.prod(len(k.choices) for k in self.knobs.values())

    @cached_property
    def all_tuples(self) -> list[tuple] | None:
        """Every canonical valid configuration, in grid (declaration) order; None if too large."""
        if self.raw_size > ENUMERATE_LIMIT:
            return None
        seen: dict[tuple, None] = {}
        for combo in itertools.product(*(k.choices for k in self.knobs.values())):
            t = self.tup(self.params_of(combo))
            if t not in seen and self._config_or_none(t) is not None:
                seen[t] = None
        return list(seen)

    def random_tuple(self, rng: np.random.Generator, exclude: set[tuple] | frozenset = frozenset(),
                     tries: int = 2000) -> tuple | None:
        """A uniformly drawn canonical valid configuration not in `exclude` (None if none found)."""
        pool = self.all_tuples
        if pool is not None:
            if len(exclude) >= len(pool):
                left = [t for t in pool if t not in exclude]
                return left[int(rng.integers(len(left)))] if left else None
            for _ in range(tries):
                t = pool[int(rng.integers(len(pool)))]
                if t not in exclude:
                    return t
            left = [t for t in pool if t not in exclude]
            return left[int(rng.integers(len(left)))] if left else None
        for _ in range(tries):
            t = self.tup({k: kn.choices[int(rng.integers(len(kn.choices)))] for k, kn in self.knobs.items()})
            if t not in exclude and self._config_or_none(t) is not None:
                return t
        return None

    def neighbours(self, tup: tuple) -> Iterator[tuple]:
        """All canonical valid configurations one knob away from `tup`."""
        for i, kn in enumerate(self.knobs.values()):
            for v in kn.choices:
                if v != tup[i]:
                    t = self.tup(self.params_of(tup[:i] + (v,) + tup[i + 1:]))
                    if t != tup and self._config_or_none(t) is not None:
                        yield t

    def size(self) -> int:
        """Number of distinct configurations (exact when enumerable, else the raw product)."""
        return len(self.all_tuples) if self.all_tuples is not None else self.raw_size

    def encode(self, tuples: list[tuple]) -> np.ndarray:
        """Ordinal index of every knob value (DeepSpeed-style flattened config values)."""
        index = [{v: i for i, v in enumerate(kn.choices)} for kn in self.knobs.values()]
        return np.array([[index[i][v] for i, v in enumerate(t)] for t in tuples], dtype=np.float32)

    def numerics_key(self, params: dict[str, Any]) -> tuple:
        """What decides the training numerics of params (`cubic.space.numerics`): configurations with equal
        keys train the same model on the same samples, so one quality run serves them all."""
        return numerics.key(self.config(params), self.quality_knobs)

    def model_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The params a quality run of params' model trains: each of `MODEL_NEUTRAL` set back to the baseline's
        value where that keeps the same `numerics_key`. Configurations that train the same model then run one
        config, so one's runs answer the others' from the quality store (`cubic.quality.store`) seed by seed.
        Only knobs that change where and when the same math runs are reset, never a kernel or a precision."""
        key, base, out = self.numerics_key(params), self.baseline_params(), dict(params)
        for k in numerics.MODEL_NEUTRAL:
            if k in out and out[k] != base[k]:
                other = self.canonical({**out, k: base[k]})
                try:
                    if self.numerics_key(other) == key:
                        out = other
                except ConfigError:
                    continue
        return out

    def differs_in_numerics(self, params: dict[str, Any]) -> list[str]:
        """The quality knobs through which params train differently from the baseline (`numerics`)."""
        return numerics.changed_knobs(self.config(params), self.baseline, self.quality_knobs)

    def numerics_changes(self, params: dict[str, Any]) -> frozenset[tuple[str, Any]]:
        """The numerics changes of params from the baseline that the space's knobs make, one (aspect, value)
        each (`numerics.changes`). What a learning-rate rule derives from a changed batch is part of the
        batch's change, not one of its own. The quality screen (`cubic.quality.screen`) judges each alone."""
        tup = self.tup(params)
        hit = self._changes.get(tup)
        if hit is None:
            self._changes[tup] = hit = numerics.changes(self.config(params), self.baseline, self.quality_knobs,
                                                        self.knobs)
        return hit

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """The resolved space, JSON-able (stored as the study's user attr "space")."""
        return {
            "name": self.name, "path": self.path, "description": self.description,
            "target": self.target, "target_dropped": self.target_dropped,
            "workload": self.workload.to_dict(),
            "knobs": {k: kn.to_dict() for k, kn in self.knobs.items()},
            "baseline_config": self.baseline.to_dict(),
            "objective": {"metric": self.objective, "direction": self.direction},
            "constraints": {"mem_cap_mb": self.mem_cap_mb, "quality_tolerance": self.quality_tolerance,
                            "quality_knobs": list(self.quality_knobs)},
            "trial": {"warmup_steps": self.baseline.warmup_steps, "measure_steps": self.baseline.measure_steps,
                      "windows": self.baseline.windows, "timeout_s": self.baseline.timeout_s,
                      "seed": self.baseline.seed, "repeats": self.repeats},
            "budget": {"trials": self.budget, "confirm_top_k": self.confirm_top_k,
                       "max_concurrent": self.max_concurrent, "isolation": self.isolation},
            "lr_scaling": ({str(k): v for k, v in self.lr_scaling.items()} if isinstance(self.lr_scaling, dict)
                           else self.lr_scaling),
            "quality": self.quality_runs.to_dict() if self.quality_runs else None,
        }


def _identity(space_dict: dict[str, Any]) -> dict[str, Any]:
    """What a trial measures (workload, knobs, baseline, trial settings), not the budget or name."""
    d = {k: space_dict.get(k) for k in ("workload", "knobs", "baseline_config", "objective")}
    if isinstance(d["baseline_config"], dict):  # fields since removed, at their one value: as `TrialConfig.key()`
        d["baseline_config"] = {**RETIRED, **d["baseline_config"]}
    d["trial"] = {k: v for k, v in (space_dict.get("trial") or {}).items() if k != "repeats"}
    if space_dict.get("lr_scaling") not in (None, "none"):  # (absent from older studies: "none")
        d["lr_scaling"] = space_dict["lr_scaling"]
    return json.loads(json.dumps(d, default=str))


def fingerprint(space_dict: dict[str, Any]) -> str:
    """Identity of what a trial measures: studies with equal fingerprints can share history (warm start)."""
    return hashlib.sha256(json.dumps(_identity(space_dict), sort_keys=True).encode()).hexdigest()[:16]


def first_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first dotted key where two spaces measure differently (None if they do not), e.g.
    'knobs.comm_precision.when' or 'baseline_config.batch_size: 1024 -> 2048'."""
    def walk(a: Any, b: Any, path: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                if (d := walk(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))) is not None:
                    return d
            return None
        if a == b:
            return None
        short = (lambda v: json.dumps(v)[:40])
        return f"{path}: {short(a)} -> {short(b)}"
    a, b = _identity(old), _identity(new)
    # the YAML's own sections first: the baseline config repeats the trial settings
    for k in ("workload", "knobs", "objective", "trial", "baseline_config"):
        if (d := walk(a.get(k), b.get(k), k)) is not None:
            return d
    return None


# ====================================================================== loading
class _Lines:
    """Line numbers of YAML keys (1-based), by dotted path, for error messages."""

    def __init__(self, text: str) -> None:
        self.lines: dict[str, int] = {}
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError:
            node = None
        if node is not None:
            self._walk(node, "")

    def _walk(self, node: yaml.Node, prefix: str) -> None:
        self.lines.setdefault(prefix, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                path = f"{prefix}.{k.value}" if prefix else str(k.value)
                self.lines[path] = k.start_mark.line + 1
                self._walk(v, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._walk(v, f"{prefix}[{i}]")

    def at(self, path: str) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path.rsplit(".", 1)[0] if "." in path else ""
        return None


class _Loader:
    def __init__(self, path: Path, text: str) -> None:
        self.path, self.lines = path, _Lines(text)

    def err(self, key: str, msg: str) -> ConfigError:
        line = self.lines.at(key)
        loc = f"{self.path}:{line}" if line else str(self.path)
        return ConfigError(f"{loc}: {key}: {msg}" if key else f"{loc}: {msg}")

    def mapping(self, d: Any, key: str) -> dict[str, Any]:
        """A section as a dict ({} where absent); its keys were checked by the file's model (`SpaceFile`)."""
        if d is None:
            return {}
        if not isinstance(d, dict):
            raise self.err(key, f"must be a mapping, got {type(d).__name__}")
        return d


def shipped_space(name: str) -> Path:
    from cubic_harness.sim.cluster import shipped_file

    return shipped_file("search_spaces", "cubic_search_spaces", name)


TWO_D_ONLY = ("sparse_sync", "sparse_sync_interval", "group_placement")


def _restrict_to_torchrec(ld: _Loader, knobs: dict[str, Knob], baseline: TrialConfig,
                          base_raw: dict[str, Any]) -> tuple[dict[str, Knob], dict[str, list]]:
    """Knob values TorchRec runs as measured on the baseline's device; the baseline must be one of them.
    Where no 2D value is left (CPU), the knobs that only matter in 2D leave the space."""
    from cubic_harness.torchrec_trial import torchrec_unsupported

    if baseline.workload.interaction == "wukong":
        raise ld.err("target", "torchrec: interaction 'wukong' has no TorchRec model")
    two_d = baseline.group_size < baseline.world_size
    for k in base_raw:
        if (k in TWO_D_ONLY or k == "emb_optimizer") and not two_d:
            continue  # the same training as plain model parallelism: nothing TorchRec would run differently
        why = torchrec_unsupported(k, getattr(baseline, k), baseline.device)
        if why:
            raise ld.err(f"baseline.{k}",
                         f"target torchrec: {k}={getattr(baseline, k)!r} cannot run as measured ({why})")
    out, dropped = {}, {}
    for k, kn in knobs.items():
        keep = tuple(v for v in kn.choices if not torchrec_unsupported(k, v, baseline.device))
        gone = [v for v in kn.choices if v not in keep]
        if gone:
            dropped[k] = gone
        if not keep:
            raise ld.err(f"knobs.{k}", f"target torchrec: none of {list(kn.choices)} runs in TorchRec on "
                         f"{baseline.device} ({torchrec_unsupported(k, kn.choices[0], baseline.device)})")
        out[k] = dataclasses.replace(kn, choices=keep)
    if "sharding_group_size" in out and set(out["sharding_group_size"].choices) <= {0} and not two_d:
        for k in TWO_D_ONLY:
            if out.pop(k, None) is not None:
                dropped[k] = list(knobs[k].choices)
    return out, dropped


def load_space(path: str | Path, *, check_choices: bool = True) -> SearchSpace:
    """Parse and validate a search-space YAML file, or a shipped space by name (`dlrm_cpu`, `tiny.yaml`: what
    `search_spaces/` holds, from any directory), ConfigError with file:line on any problem. `check_choices=False`
    skips only the check that every knob value is in some valid configuration, which enumerates the space (~2 s
    for the shipped CPU space): for a caller that wants the baseline alone (`cubic trial`)."""
    path = Path(path)
    if not path.exists() and path.parent == Path("."):
        named = shipped_space(path.name if path.suffix else f"{path.name}.yaml")
        path = named if named.exists() else path
    text = read_text(path, "search space file")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{line}: malformed YAML: {problem}") from None
    ld = _Loader(path, text)
    raw = ld.mapping(raw, "")
    if not raw:
        raise ld.err("", "empty search space; needs at least 'knobs'")
    f = validate(SpaceFile, raw, str(path), ld.lines.at)  # every key, type and range (cubic.space.spec)
    return _build(ld, raw, f, check_choices)  # type: ignore[arg-type]


def _workload_file(space_path: Path, raw: dict[str, Any]) -> Workload:
    """`workload: {file: PATH, KEY: VALUE...}`: the file (relative to the space file) with keys set over it,
    e.g. `id_source: trace` to replay the profiled sample instead of drawing like it."""
    raw = dict(raw)
    path = raw.pop("file")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"workload: file={path!r} must be the path of a workload file")
    wl, _ = Workload.from_json_file(space_path.parent / path)
    return Workload.from_dict({**wl.to_dict(), **raw}, where=f"workload ({path})") if raw else wl


def _build(ld: _Loader, raw: dict[str, Any], f: SpaceFile, check_choices: bool = True) -> SearchSpace:
    """The space from its file: `f` is the file as its model read it (every scalar setting with its default),
    `raw` the same file's sections where the config and the knobs are built and related to each other."""
    name = str(raw.get("name") or ld.path.stem)
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ld.err("name", f"{name!r} must be letters, digits, '_', '-' or '.'")
    wl_raw = raw.get("workload", {"preset": "small"})
    if isinstance(wl_raw, str):
        wl_raw = {"preset": wl_raw}
    try:
        if isinstance(wl_raw, dict) and "file" in wl_raw:  # a workload file (from-torchrec / profile) + overrides
            workload = _workload_file(ld.path, wl_raw)
        else:
            workload = Workload.from_dict(wl_raw, where="workload")
    except ConfigError as e:
        raise ld.err("workload", str(e).removeprefix("workload: ")) from None

    trial = ld.mapping(raw.get("trial"), "trial")
    cons = ld.mapping(raw.get("constraints"), "constraints")
    budget, constraints = f.budget or Budget(), f.constraints or Constraints()

    base_raw = ld.mapping(raw.get("baseline"), "baseline")
    if "plan" in base_raw:  # `plan: FILE`: the production plan, exactly (sharding: file)
        plan = base_raw.pop("plan")
        if not isinstance(plan, str) or not plan:
            raise ld.err("baseline.plan", f"{plan!r} must be the path of a plan file")
        base_raw = {**base_raw, "sharding": "file", "plan_file": str((ld.path.parent / plan).resolve())}
    for k in base_raw:
        if k not in _FIELDS or k in NOT_KNOBS:
            raise ld.err(f"baseline.{k}", f"unknown key; allowed: {sorted(_FIELDS - set(NOT_KNOBS))}")
    settings = {k: v for k, v in trial.items() if k != "repeats"}
    if "mem_cap_mb" in cons:
        settings["mem_cap_mb"] = cons["mem_cap_mb"]
    try:
        baseline = TrialConfig.from_dict({**base_raw, **settings, "workload": workload}, where="baseline")
    except ConfigError as e:
        key = next((f"baseline.{k}" for k in base_raw if f"{k}=" in str(e) or repr(k) in str(e)), "baseline")
        raise ld.err(key, str(e).removeprefix("baseline: ")) from None

    knobs_raw = ld.mapping(raw.get("knobs"), "knobs")
    if not knobs_raw:
        raise ld.err("knobs", "needs at least one knob")
    knobs: dict[str, Knob] = {}
    for k, spec in knobs_raw.items():
        knobs[k] = _knob(ld, k, spec, baseline)
    for k, kn in knobs.items():
        for c in kn.when:
            for n in (c.lhs, c.rhs if c.rhs_is_field else None):
                if n is not None and (n not in _FIELDS or n in NOT_KNOBS):
                    raise ld.err(f"knobs.{k}.when", f"unknown name {n!r} in condition '{c}'; allowed: "
                                 f"{sorted(_FIELDS - set(NOT_KNOBS))}")

    try:
        baseline.validate("baseline")
    except ConfigError as e:
        raise ld.err("baseline", str(e).removeprefix("baseline: ")) from None
    target = f.target
    dropped: dict[str, list] = {}
    if target == "torchrec":
        knobs, dropped = _restrict_to_torchrec(ld, knobs, baseline, base_raw)
    if baseline.sharding == "file" and "sharding" in knobs and "file" not in knobs["sharding"].choices:
        # the production plan stays a value of a space that varies the sharding: every global knob is tried on it
        knobs["sharding"] = dataclasses.replace(knobs["sharding"], choices=(*knobs["sharding"].choices, "file"))
    for k, kn in knobs.items():
        v = getattr(baseline, k)
        if v not in kn.choices:
            raise ld.err(f"baseline.{k}" if k in base_raw else f"knobs.{k}",
                         f"baseline value {v!r} is outside the space; knobs.{k} choices: {list(kn.choices)}")

    qknobs = tuple(numerics.NUMERICS) if constraints.quality_knobs is None else constraints.quality_knobs
    from cubic.space.lr_scaling import parse

    try:
        lr_scaling = parse(raw.get("lr_scaling", "none"), "lr_scaling")
    except ConfigError as e:
        raise ld.err("lr_scaling", str(e).removeprefix("lr_scaling: ")) from None
    quality_runs = None
    if raw.get("quality") is not None:
        given = {k: v for k, v in f.quality.model_dump().items() if v is not None}  # the rest: QualityRuns'
        if isinstance(given.get("screen"), bool):
            given["screen"] = UPFRONT if given["screen"] else OFF
        seeds = given.get("seeds", QualityRuns.seeds)
        quality_runs = QualityRuns(**{"max_seeds": max(QualityRuns.max_seeds, seeds), **given})
        if quality_runs.max_seeds < quality_runs.seeds:
            raise ld.err("quality.max_seeds", f"{quality_runs.max_seeds} must be at least quality.seeds "
                         f"({quality_runs.seeds})")
    space = SearchSpace(
        name=name, path=str(ld.path), workload=workload, knobs=knobs, baseline=baseline,
        objective=(f.objective or Objective()).metric, direction="maximize", mem_cap_mb=float(baseline.mem_cap_mb),
        quality_tolerance=float(constraints.quality_tolerance), quality_knobs=tuple(qknobs),
        repeats=(f.trial or TrialSection()).repeats, budget=budget.trials, confirm_top_k=budget.confirm_top_k,
        max_concurrent=budget.max_concurrent, isolation=budget.isolation,
        description=str(raw.get("description", "")),
        target=target, target_dropped=dropped, lr_scaling=lr_scaling, quality_runs=quality_runs,
    )
    if space.tup(space.baseline_params()) != tuple(space.baseline_params().values()):
        bad = [k for k, v in space.canonical(space.baseline_params()).items() if v != getattr(baseline, k)]
        raise ld.err(f"knobs.{bad[0]}", "the baseline's value must be the knob's default when its condition "
                     "does not hold")
    if check_choices:
        _check_every_choice_is_used(ld, space)
    return space


def _check_every_choice_is_used(ld: _Loader, space: SearchSpace) -> None:
    """A knob value that is in no valid configuration is a typo or a dead condition: say so instead
    of dropping it silently (spaces too large to enumerate are not checked)."""
    if space.all_tuples is None:
        return
    for i, (name, kn) in enumerate(space.knobs.items()):
        used = {t[i] for t in space.all_tuples}
        for v in kn.choices:
            if v in used:
                continue
            try:
                dataclasses.replace(space.baseline, **{name: v}).validate("with the baseline")
                why = "its condition never holds, or it is invalid with every other knob's values"
            except ConfigError as e:
                why = str(e)
            raise ld.err(f"knobs.{name}", f"value {v!r} is in no valid configuration: {why}")


def _knob(ld: _Loader, name: str, spec: Any, baseline: TrialConfig) -> Knob:
    key = f"knobs.{name}"
    if name not in _FIELDS or name in NOT_KNOBS:
        raise ld.err(key, f"unknown knob {name!r}; allowed: {sorted(_FIELDS - set(NOT_KNOBS))}")
    if isinstance(spec, list):
        spec = {"choices": spec}
    spec = ld.mapping(spec, key)
    if "choices" in spec:
        raw_choices = spec["choices"]
        if not isinstance(raw_choices, list):
            raise ld.err(f"{key}.choices", "must be a list")
    elif "low" in spec and "high" in spec:
        raw_choices = _range(ld, key, spec)
    else:
        raise ld.err(key, "needs 'choices: [...]' or 'low' and 'high' (with optional 'step' or 'log: true')")
    if not raw_choices:
        allowed = list(CHOICES.get(name, ())) or "at least one value"
        raise ld.err(f"{key}.choices", f"choices must not be empty; allowed: {allowed}")
    choices: list[Any] = []
    for i, v in enumerate(raw_choices):
        try:
            typed = getattr(TrialConfig.from_dict({name: v}), name)
        except ConfigError as e:
            raise ld.err(f"{key}.choices[{i}]", str(e).removeprefix("config: ")) from None
        if name in CHOICES and typed not in CHOICES[name]:
            raise ld.err(f"{key}.choices[{i}]" if "choices" in spec else key,
                         f"{typed!r} is not allowed; choose from {list(CHOICES[name])}")
        if typed not in choices:
            choices.append(typed)
    default = getattr(baseline, name)
    if "default" in spec:
        try:
            default = getattr(TrialConfig.from_dict({name: spec["default"]}), name)
        except ConfigError as e:
            raise ld.err(f"{key}.default", str(e).removeprefix("config: ")) from None
    when = _conditions(ld, f"{key}.when", spec.get("when"))
    if when and default not in choices:
        raise ld.err(f"{key}.default", f"default {default!r} must be one of the choices {choices}")
    return Knob(name, tuple(choices), default, when)


def _range(ld: _Loader, key: str, spec: dict[str, Any]) -> list[Any]:
    lo, hi, typ = spec["low"], spec["high"], spec.get("type", "int")
    if typ not in ("int", "float"):
        raise ld.err(f"{key}.type", f"{typ!r}; allowed: ['int', 'float']")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in (lo, hi)) \
            or lo > hi:
        raise ld.err(key, f"low={lo!r} high={hi!r} must be finite numbers with low <= high")
    if spec.get("log"):
        if lo <= 0:
            raise ld.err(f"{key}.low", "log ranges need low > 0")
        vals, v = [], float(lo)
        while v <= hi * (1 + 1e-9):  # powers of two from low: the natural grid for batch sizes, threads
            vals.append(v)
            v *= 2
        if len(vals) > 64:
            raise ld.err(key, f"{len(vals)} powers of two from low to high; at most 64")
    else:
        step = spec.get("step", 1)
        if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step) or step <= 0:
            raise ld.err(f"{key}.step", f"{step!r} must be > 0")
        n = int(math.floor((hi - lo) / step + 1e-9)) + 1
        if n > 1000:
            raise ld.err(key, f"{n} grid points; use a larger step or log: true (at most 1000)")
        vals = [lo + i * step for i in range(n)]
    return [int(round(v)) if typ == "int" else float(v) for v in vals]


def _conditions(ld: _Loader, key: str, when: Any) -> tuple[Cond, ...]:
    if when is None or when == "":
        return ()
    if not isinstance(when, str):
        raise ld.err(key, "must be a string like 'sharding_group_size < world_size' (joined with ' and ')")
    out = []
    for part in re.split(r"\s+and\s+", when.strip()):
        m = _COND_RE.match(part)
        if not m:
            raise ld.err(key, f"cannot parse '{part}'; write 'NAME OP VALUE' with OP in {list(_OPS)}")
        lhs, op, rhs_s = m.groups()
        if rhs_s in _FIELDS:
            out.append(Cond(lhs, op, rhs_s, True))
        else:
            try:
                rhs = yaml.safe_load(rhs_s)
            except yaml.YAMLError:
                raise ld.err(key, f"cannot parse the value in '{part}'") from None
            if isinstance(rhs, dict):
                raise ld.err(key, f"cannot parse the value in '{part}'")
            if op in ("in", "not in") and not isinstance(rhs, list):
                raise ld.err(key, f"'{part}': '{op}' needs a list like [a, b]")
            out.append(Cond(lhs, op, tuple(rhs) if isinstance(rhs, list) else rhs, False))
    return tuple(out)
