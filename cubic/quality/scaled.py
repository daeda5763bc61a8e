"""Quality verdicts a simulated study of one space takes from the real quality runs of another space
that trains the same workload at another size (`cubic tune --backend sim --quality-from SPACE`).

Why: a space at scale (the same model on 64-1024 GPUs) never trains here, so no real run of its own
exists and, left alone, it crowns no numerics change. A space that trains the same workload here did
judge the same changes, at its own size. A verdict compares one change with its space's baseline,
so what carries is decided by `CARRIES` (`cubic.quality.carried`) and the two baselines:

- a change whose aspect carries to any size (a precision, the optimizer, column-wise sharding) takes
  the other space's verdict on the same (aspect, value) where the two baselines are one model apart
  from its size: they agree on every aspect that carries to any size;
- a change that is a verdict of the value judged only (a global batch, replicas, a sync interval, a
  learning rate) carries only where the two baselines agree on every aspect (one size: the other
  space judged exactly this value from exactly this baseline); elsewhere it is "not judged at this
  size".

A configuration whose changes all carry is first judged as its model: the other space's baseline with
the same changes, where its real runs judged that whole model (a stack of changes that each passed alone
may not pass together). Otherwise each change alone decides, as `CarriedVerdicts.crown` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from cubic.quality.carried import (
    ANY_SIZE,
    AS_JUDGED,
    CARRIES,
    UNCHANGED,
    CarriedVerdicts,
    ChangeVerdict,
    Crown,
    crown_of,
)
from cubic.quality.screen import one_knob_changes
from cubic.space import numerics
from cubic.space.search_space import SearchSpace
from cubic_harness.config import TrialConfig
from cubic_harness.errors import ConfigError

_BY_NAME = {a.name: a for a in numerics.NUMERICS.values()}  # aspect name -> how a config shows it


def _aspect_value(cfg: TrialConfig, name: str) -> Any:
    return (_BY_NAME.get(name) or numerics.aspect(name)).of(cfg)


def check_judges(space: SearchSpace, source: SearchSpace) -> None:
    """ConfigError (one line) unless `source`'s real runs can judge `space`: it trains quality runs
    and the same workload (a model's quality runs say nothing of another model)."""
    if source.quality_runs is None:
        raise ConfigError(f"{source.path}: quality: missing: its real runs judge no numerics "
                          "change; name a space that trains quality runs here (one with a "
                          "quality: section, e.g. dlrm_cpu)")
    mine, theirs = space.workload.to_dict(), source.workload.to_dict()
    diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if diff:
        k = diff[0]
        raise ConfigError(f"{source.path}: workload.{k}: {_short(theirs.get(k))} there, "
                          f"{_short(mine.get(k))} in {space.path}; only a space that trains the "
                          f"same workload ({space.workload.name}) judges its quality")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:39] + "…"


@dataclass
class ScaledVerdicts:
    """The real quality runs of `source`'s space, as a simulated study of `space` (the same workload
    at another size) reads them (`changes`, `crown`: the interface of `carried.Carried`)."""

    space: SearchSpace
    source: CarriedVerdicts
    _judged: dict[tuple[str, Any], ChangeVerdict] | None = None
    _apart: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_judges(self.space, self.source.space)

    @property
    def judged_in(self) -> str:
        return self.source.space.name

    def verdict(self, change: tuple[str, Any],
                params: dict[str, Any] | None = None) -> ChangeVerdict:
        """The source space's verdict on `change`, where it carries here (else ok None, and why)."""
        params = params or {}
        apart = self._apart_on(change[0])
        if apart:
            return ChangeVerdict(change, None, "", params, self.judged_in, apart)
        hit = self.judged().get(change)
        if hit is None:
            return ChangeVerdict(change, None, f"space {self.judged_in}'s screen never judged it",
                                 params, self.judged_in)
        return replace(hit, params=params, judged_in=self.judged_in)

    def judged(self) -> dict[tuple[str, Any], ChangeVerdict]:
        """The source space's verdict on each change it screened alone, by change (read once)."""
        if self._judged is None:
            self._judged = {v.change: v for v in self.source.changes()}
        return self._judged

    def _apart_on(self, name: str) -> str:
        """Where the two baselines differ on what a verdict on aspect `name` needs them to share
        ("": nowhere): every aspect that carries to any size, and every aspect besides for one that
        is a verdict of the value judged only (`CARRIES`)."""
        if name not in self._apart:
            whole = CARRIES.get(name, AS_JUDGED) == AS_JUDGED
            names = [n for n, c in CARRIES.items() if whole or c == ANY_SIZE]
            names += [name] if name not in names else []
            sp, src = self.space, self.source.space
            mine, theirs = sp.config(sp.baseline_params()), src.config(src.baseline_params())
            differ = [(n, _aspect_value(theirs, n), _aspect_value(mine, n)) for n in names
                      if _aspect_value(theirs, n) != _aspect_value(mine, n)]
            self._apart[name] = "" if not differ else (
                ("not judged at this size" if whole else "not judged from this model")
                + f": space {src.name}'s baseline has "
                + ", ".join(f"{n}={a}" for n, a, _ in differ) + ", this space's "
                + ", ".join(f"{n}={b}" for n, _, b in differ))
        return self._apart[name]

    def changes(self) -> list[ChangeVerdict]:
        """Every numerics change this space makes alone, with the verdict carried to it (or why
        not)."""
        return [self.verdict(s.change, s.params) for s in one_knob_changes(self.space)]

    def crown(self, params: dict[str, Any]) -> Crown:
        """May params be crowned: each of its changes passed alone in the source space's real runs,
        and each of those verdicts carries to this size."""
        made = self.space.numerics_changes(params)
        if not made:
            return UNCHANGED
        verdicts = [self.verdict(c) for c in sorted(made, key=str)]
        whole = self._whole(verdicts)
        if whole is not None:
            return whole
        return crown_of(verdicts, f" of space {self.judged_in}")

    def _whole(self, verdicts: list[ChangeVerdict]) -> Crown | None:
        """The source space's verdict on the same stack of changes on its own baseline, where every
        change carries here and its runs judged that whole model (None: not judged whole)."""
        if len(verdicts) < 2 or any(v.not_carried for v in verdicts):
            return None
        judged = self.judged()
        base = self.source.space.baseline_params()
        stack = dict(base)
        for v in verdicts:
            alone = judged.get(v.change)
            if alone is None:  # never screened there: no baseline-with-it to build the stack from
                return None
            stack.update({k: x for k, x in alone.params.items() if base.get(k) != x})
        crown = self.source.whole(stack)
        if crown is None:
            return None
        return Crown(crown.ok, f"in space {self.judged_in}: {crown.reason}")

    @property
    def source_note(self) -> str:
        return f"space {self.judged_in}, {self.source.source_note}"
