"""`SearchSpace`: the loaded space (workload, knobs, baseline, objective, constraints, budget) and
its configurations: params <-> `TrialConfig`, canonical params (a knob whose condition fails or that
is inert for the configuration takes its default, so configurations that differ only in meaningless
knobs are one and never run twice), enumeration, sampling and neighbours, and the numerics rule
applied to its knobs."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from cubic.space import numerics
from cubic.space.codesign import CodesignSection
from cubic.space.knobs import Knob
from cubic.space.quality_runs import QualityRuns
from cubic_harness.config import TrialConfig, inert_knobs
from cubic_harness.errors import ConfigError
from cubic_harness.workload import Workload

ENUMERATE_LIMIT = 400_000  # spaces up to this many raw points are enumerated once (grid, pools)
REFERENCE_PLANNER = "torchrec_planner"  # the plan a TorchRec user gets by default


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
    target_dropped: dict[str, list] = field(default_factory=dict)  # knob -> values it cannot run
    lr_scaling: Any = "none"  # cubic/space/lr_scaling.py: a rule or a {global batch: rates} table
    quality_runs: QualityRuns | None = None  # the confirm's quality runs; None: the in-run NE gate
    codesign: CodesignSection | None = None  # the clusters a co-design study chooses among
    _cache: dict[tuple, TrialConfig | None] = field(default_factory=dict, repr=False)
    _changes: dict[tuple, frozenset] = field(default_factory=dict, repr=False)
    # cubic.quality.screen's cache
    _excluded: dict[frozenset, frozenset] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ params <-> configs
    @property
    def names(self) -> list[str]:
        return list(self.knobs)

    def baseline_params(self) -> dict[str, Any]:
        return {k: getattr(self.baseline, k) for k in self.knobs}

    def reference_params(self) -> dict[str, Any] | None:
        """The baseline planned by TorchRec's own planner, where the space's `sharding` knob offers
        it: every tune of such a space runs it once, after the baseline, and says what the winner
        gains over the plan a TorchRec user gets by default (`cubic.tune.summary.reference`). None
        where it is not offered, is the baseline, or is no valid configuration of the space."""
        kn = self.knobs.get("sharding")
        if (kn is None or REFERENCE_PLANNER not in kn.choices
                or self.baseline.sharding == REFERENCE_PLANNER):
            return None
        params = self.canonical({**self.baseline_params(), "sharding": REFERENCE_PLANNER})
        return params if self.valid(params) else None

    def canonical(self, params: dict[str, Any]) -> dict[str, Any]:
        """Params with every knob that means nothing set to its default: its condition fails, or it
        is inert for the configuration (`cubic_harness.config.inert_knobs`). A fixpoint: a knob set
        back may make another meaningless."""
        vals = {**vars(self.baseline),
                **{k: params.get(k, kn.default) for k, kn in self.knobs.items()}}
        # `inert_knobs` reads an unchecked view of vals: canonical runs for every point of an
        # enumerated space, where building and checking a TrialConfig each time would dominate
        view = object.__new__(TrialConfig)
        view.__dict__ = vals
        for _ in range(len(self.knobs) + 1):
            changed, inert = False, inert_knobs(view)
            for k, kn in self.knobs.items():
                meaningless = k in inert or not all(c.holds(vals) for c in kn.when)
                if meaningless and vals[k] != kn.default:
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
            cfg = self._scaled(dataclasses.replace(self.baseline, **self.params_of(tup)))
            try:
                cfg.validate(workload=False)  # the baseline's workload: validated at load
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

    def random_tuple(self, rng: np.random.Generator,
                     exclude: set[tuple] | frozenset = frozenset(),
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
            t = self.tup({k: kn.choices[int(rng.integers(len(kn.choices)))]
                          for k, kn in self.knobs.items()})
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
        return np.array([[index[i][v] for i, v in enumerate(t)] for t in tuples],
                        dtype=np.float32)

    def numerics_key(self, params: dict[str, Any]) -> tuple:
        """What decides the training numerics of params (`cubic.space.numerics`): configurations
        with equal keys train the same model on the same samples, so one quality run serves them
        all."""
        return numerics.key(self.config(params), self.quality_knobs)

    def model_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The params a quality run of params' model trains: each of `MODEL_NEUTRAL` set to the
        quality layout's value (the space's `quality.layout`, else the baseline's), and the kernel
        where the layout names one, wherever that keeps the same `numerics_key`. Configurations that
        train the same model then run one config, so one's runs answer the others' from the quality
        store (`cubic.quality.store`) seed by seed. Only knobs that change where and when the same
        math runs are reset (`numerics.LAYOUT_KNOBS`), never a precision."""
        layout = self.quality_runs.layout if self.quality_runs else {}
        key, out = self.numerics_key(params), dict(params)
        base = {**self.baseline_params(), **layout}
        for k in (*numerics.MODEL_NEUTRAL, *(k for k in layout if k not in numerics.MODEL_NEUTRAL)):
            if k in out and out[k] != base[k]:
                other = self.canonical({**out, k: base[k]})
                try:
                    if self.numerics_key(other) == key:
                        out = other
                except ConfigError:
                    continue
        return out

    def quality_config(self, params: dict[str, Any], seed: int,
                       runs: QualityRuns | None = None) -> TrialConfig:
        """The quality run of params' model at `seed` (under `runs`, else the space's): the config
        `model_params` picks for that model, with what `QualityRuns.config` sets for every run, so
        every configuration that trains the model shares the run (through the quality store)."""
        runs = runs or self.quality_runs or QualityRuns()
        return runs.config(self.config(self.model_params(params)), seed)

    def differs_in_numerics(self, params: dict[str, Any]) -> list[str]:
        """The quality knobs through which params train differently from the baseline
        (`numerics`)."""
        return numerics.changed_knobs(self.config(params), self.baseline, self.quality_knobs)

    def numerics_changes(self, params: dict[str, Any]) -> frozenset[tuple[str, Any]]:
        """The numerics changes of params from the baseline that the space's knobs make, one
        (aspect, value) each (`numerics.changes`). What a learning-rate rule derives from a changed
        batch is part of the batch's change, not one of its own. The quality screen
        (`cubic.quality.screen`) judges each alone."""
        tup = self.tup(params)
        hit = self._changes.get(tup)
        if hit is None:
            cfg = self.config(params)
            hit = numerics.changes(cfg, self.baseline, self.quality_knobs, self.knobs)
            self._changes[tup] = hit
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
            "constraints": {"mem_cap_mb": self.mem_cap_mb,
                            "quality_tolerance": self.quality_tolerance,
                            "quality_knobs": list(self.quality_knobs)},
            "trial": {"warmup_steps": self.baseline.warmup_steps,
                      "measure_steps": self.baseline.measure_steps,
                      "windows": self.baseline.windows, "timeout_s": self.baseline.timeout_s,
                      "seed": self.baseline.seed, "repeats": self.repeats},
            "budget": {"trials": self.budget, "confirm_top_k": self.confirm_top_k,
                       "max_concurrent": self.max_concurrent, "isolation": self.isolation},
            "lr_scaling": ({str(k): v for k, v in self.lr_scaling.items()}
                           if isinstance(self.lr_scaling, dict) else self.lr_scaling),
            "quality": self.quality_runs.to_dict() if self.quality_runs else None,
            **({"codesign": self.codesign.model_dump(by_alias=True)} if self.codesign else {}),
        }

