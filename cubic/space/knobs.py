"""A space's knobs: each categorical (ranges expanded to their grid points), so every searcher, the
proxy and the store see the same finite set of values, with an optional condition and the default it
takes where the condition fails or the knob is inert (`cubic_harness.config.inert_knobs`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cubic.space.conditions import FIELDS, Cond, parse_conditions
from cubic.space.loader import Loader
from cubic.space.spec import NOT_KNOBS
from cubic_harness.config import CHOICES, TrialConfig
from cubic_harness.errors import ConfigError

#: The names a space may set or search: every config field but those it sets elsewhere.
SETTABLE = sorted(FIELDS - set(NOT_KNOBS))


@dataclass(frozen=True)
class Knob:
    name: str
    choices: tuple[Any, ...]
    default: Any
    when: tuple[Cond, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"choices": list(self.choices), "default": self.default,
                "when": " and ".join(map(str, self.when))}


def parse_knob(ld: Loader, name: str, spec: Any, baseline: TrialConfig) -> Knob:
    """`knobs.NAME`: its choices typed as the config types them and within `CHOICES`, its default
    (the baseline's value unless given) and its condition."""
    key = f"knobs.{name}"
    if name not in FIELDS or name in NOT_KNOBS:
        raise ld.err(key, f"unknown knob {name!r}; allowed: {SETTABLE}")
    if isinstance(spec, list):
        spec = {"choices": spec}
    spec = ld.mapping(spec, key)
    if "choices" in spec:
        raw_choices = spec["choices"]
        if not isinstance(raw_choices, list):
            raise ld.err(f"{key}.choices", "must be a list")
    elif "low" in spec and "high" in spec:
        raw_choices = grid(ld, key, spec)
    else:
        raise ld.err(key, "needs 'choices: [...]' or 'low' and 'high' (with optional 'step' or "
                     "'log: true')")
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
    when = parse_conditions(ld, f"{key}.when", spec.get("when"))
    if (when or "default" in spec) and default not in choices:  # taken where it means nothing
        raise ld.err(f"{key}.default", f"default {default!r} must be one of the choices {choices}")
    return Knob(name, tuple(choices), default, when)


def grid(ld: Loader, key: str, spec: dict[str, Any]) -> list[Any]:
    """`low`..`high` as grid points: every `step`, or powers of two from low with `log: true`."""
    lo, hi, typ = spec["low"], spec["high"], spec.get("type", "int")
    if typ not in ("int", "float"):
        raise ld.err(f"{key}.type", f"{typ!r}; allowed: ['int', 'float']")
    finite = all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                 for x in (lo, hi))
    if not finite or lo > hi:
        raise ld.err(key, f"low={lo!r} high={hi!r} must be finite numbers with low <= high")
    if spec.get("log"):
        if lo <= 0:
            raise ld.err(f"{key}.low", "log ranges need low > 0")
        vals, v = [], float(lo)
        while v <= hi * (1 + 1e-9):  # powers of two from low: the grid for batch sizes, threads
            vals.append(v)
            v *= 2
        if len(vals) > 64:
            raise ld.err(key, f"{len(vals)} powers of two from low to high; at most 64")
    else:
        step = spec.get("step", 1)
        if (isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step)
                or step <= 0):
            raise ld.err(f"{key}.step", f"{step!r} must be > 0")
        n = int(math.floor((hi - lo) / step + 1e-9)) + 1
        if n > 1000:
            raise ld.err(key, f"{n} grid points; use a larger step or log: true (at most 1000)")
        vals = [lo + i * step for i in range(n)]
    return [int(round(v)) if typ == "int" else float(v) for v in vals]
