"""Quality verdicts a simulated study takes from real quality runs, so it never crowns what they
ruled out.

A simulation predicts speed and memory, never what a model learns (`cubic.tune.policy`). Left alone,
a simulated tune of the default space crowns SGD tables at 4x the batch in fp16, a model the real
tune's screen rules out at +3.6% eval NE. The real runs that judged it are kept in a quality store
(`cubic.quality.store`; `make tune` keeps runs/quality.db), keyed by the exact run they train. A
simulated study of the same space asks that store, for each configuration it would crown:

- its whole model: the quality runs of exactly that model and the baseline's, paired by seed, judged
  by the confirm's own rule (`rules.sequential`);
- else each numerics change alone: the screen's runs of the baseline with that one change
  (`screen.decide`).

A configuration is crowned only where every change it makes passed (a layout-only one always is); a
change ruled out, or never judged, keeps it off the throne, and the summary says which and why.
Changes judged alone are not judged together: the summary says so where that is the basis.

What carries to a simulated target (`CARRIES`, one row per aspect of `cubic.space.numerics`): a run
judges one (aspect, value). A precision or an optimizer rounds and updates each value the same at
any size, so its verdict carries; a global batch, a replica count, a sync interval or a learning
rate is a verdict of that value only, and a target whose value was never trained is not judged.
A space at another size that trains the same workload takes its verdicts by that table from the real
runs of one that trains here (`cubic.quality.scaled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from cubic.quality.rules import Verdict, sequential
from cubic.quality.screen import Screened, decide, single_changes
from cubic.quality.store import QualityStore
from cubic.space.quality_runs import QualityRuns
from cubic.space.search_space import SearchSpace

ANY_SIZE = "carries to any size"
AS_JUDGED = "only the value judged"

#: Per aspect of `cubic.space.numerics`: whether its verdict carries to a target of another size.
CARRIES: dict[str, str] = {
    "emb_precision": ANY_SIZE,
    "dense_precision": ANY_SIZE,
    "comm_precision": ANY_SIZE,
    "allreduce_comm_precision": ANY_SIZE,
    "emb_optimizer": ANY_SIZE,
    "sharding": ANY_SIZE,
    "global_batch": AS_JUDGED,
    "replicas": AS_JUDGED,
    "sparse_sync": AS_JUDGED,
    "sparse_sync_interval": AS_JUDGED,
    "emb_lr": AS_JUDGED,
    "dense_lr": AS_JUDGED,
}


@dataclass(frozen=True)
class ChangeVerdict:
    """One numerics change alone, as the quality store judged it (ok None: never judged)."""

    change: tuple[str, Any]
    ok: bool | None
    reason: str
    params: dict[str, Any] = field(default_factory=dict)  # the baseline with this change
    judged_in: str = ""  # the space whose real runs judged it ("": the study's own)
    not_carried: str = ""  # why judged_in's verdict is not this space's (ok is then None)

    @property
    def label(self) -> str:
        return f"{self.change[0]}={self.change[1]}"

    @property
    def carries(self) -> str:
        return CARRIES.get(self.change[0], AS_JUDGED)

    def to_screened(self) -> Screened:
        """As the study's screen (`cubic.quality.screen.ATTR`), which keeps the searcher off a
        change: only a change that passed stays in a simulated search, since nothing else can be
        crowned."""
        why = (
            self.reason
            if self.ok is not None
            else f"never judged by a real quality run: {self.not_carried or self.reason}"
        )
        return Screened(*self.change, self.params, [], [], self.ok is True, why)

    def to_row(self) -> dict[str, Any]:
        """A row of the summary's screen table (`Summary.screen`)."""
        verdict = {True: "passes", False: "ruled out", None: "not judged"}[self.ok]
        src = f" from space {self.judged_in}" if self.judged_in else ""
        return {
            "change": self.label,
            "verdict": f"not carried{src}" if self.not_carried else f"{verdict} (carried{src})",
            "ok": self.ok,
            "reason": f"{self.not_carried or self.reason}; {self.carries}",
            "carried": True,
            "judged_in": self.judged_in or None,
        }


@dataclass(frozen=True)
class Crown:
    """Whether a simulated configuration may be crowned, and on what evidence."""

    ok: bool
    reason: str


class Carried(Protocol):
    """What a simulated study crowns by: the real runs of its own space (`CarriedVerdicts`) or of
    one of the same workload at another size (`cubic.quality.scaled.ScaledVerdicts`)."""

    def changes(self) -> list[ChangeVerdict]: ...

    def crown(self, params: dict[str, Any]) -> Crown: ...

    @property
    def source_note(self) -> str: ...


UNCHANGED = Crown(True, "numerics unchanged: no quality verdict needed")


def crown_of(verdicts: list[ChangeVerdict], of: str = "") -> Crown:
    """A configuration's crown from the verdicts on each of its changes alone: crowned only where
    every one passed; `of` names the runs' space where it is another ("of space dlrm_cpu")."""
    out = [v.label for v in verdicts if v.ok is False]
    if out:
        return Crown(False, f"ruled out by real quality runs{of}: {', '.join(out)}")
    unjudged = [v.label + (f" ({v.not_carried})" if v.not_carried else "")
                for v in verdicts if v.ok is None]
    if unjudged:
        return Crown(False, f"never judged by a real quality run{of}: {', '.join(unjudged)}")
    labels = ", ".join(v.label for v in verdicts)
    return Crown(
        True, f"each change passed alone in real quality runs{of} ({labels}), not judged together"
    )


@dataclass
class CarriedVerdicts:
    """The real quality runs of one space, as a simulated study of it reads them (`crown`)."""

    space: SearchSpace
    store: QualityStore | None
    where: str = ""  # the store, as the summary names it (no password)
    backend: str = "real"  # which trainer's runs count (`run_key`)
    _base: list[float | None] | None = None
    _changes: dict[tuple[str, Any], ChangeVerdict] = field(default_factory=dict)

    @property
    def qr(self) -> QualityRuns:
        return self.space.quality_runs or QualityRuns()

    def eval_ne(self, params: dict[str, Any]) -> list[float | None]:
        """The held-out eval NE of params' model per seed 0, 1, ... the store holds in a row."""
        if self.store is None:
            return []
        sp, out = self.space, []
        for seed in range(self.qr.max_seeds):
            res = self.store.get(sp.quality_config(params, seed, self.qr), self.backend)
            if res is None:
                break
            out.append(res.extra.get("eval_ne"))
        return out

    @property
    def base_ne(self) -> list[float | None]:
        if self._base is None:
            self._base = self.eval_ne(self.space.baseline_params())
        return self._base

    def changes(self) -> list[ChangeVerdict]:
        """Every numerics change the space makes alone, with the store's verdict on it."""
        return [self.change(s) for s in single_changes(self.space)]

    def change(self, s: Screened) -> ChangeVerdict:
        hit = self._changes.get(s.change)
        if hit is None:
            hit = self._judge_change(s)
            self._changes[s.change] = hit
        return hit

    def _judge_change(self, s: Screened) -> ChangeVerdict:
        if self.store is None:
            return ChangeVerdict(s.change, None, "no quality store", s.params)
        s.eval_ne = self.eval_ne(s.params)
        if not s.eval_ne or not self.base_ne:
            who = "the change alone" if not s.eval_ne else "the baseline"
            return ChangeVerdict(
                s.change, None, f"the store holds no quality run of {who}", s.params
            )
        ok, why = decide(s, self.base_ne, self.qr)
        return ChangeVerdict(
            s.change, ok, why or f"{len(s.eval_ne)} seed(s) stored: undecided", s.params
        )

    def crown(self, params: dict[str, Any]) -> Crown:
        """May params be crowned: its model judged passing whole, or each of its changes alone."""
        sp = self.space
        made = sp.numerics_changes(params)
        if not made:
            return UNCHANGED
        whole = self.whole(params)
        if whole is not None:
            return whole
        alone = {c.change: c for c in self.changes()}
        return crown_of([
            alone.get(c) or ChangeVerdict(c, None, "not a change the screen judges alone")
            for c in sorted(made, key=str)
        ])

    def whole(self, params: dict[str, Any]) -> Crown | None:
        """The confirm's verdict on params' whole model from stored runs (None: too few)."""
        ne, bne = self.eval_ne(params), self.base_ne
        n = min(len(ne), len(bne))
        if n < self.qr.seeds:
            return None
        if None in ne[:n] or None in bne[:n]:
            return Crown(False, "a stored quality run of this model or the baseline failed")
        state, j = sequential(ne[:n], bne[:n], self.qr)
        if state == Verdict.MORE or j is None:
            return None
        ok = state == Verdict.PASSED
        return Crown(ok, f"its model {state} over {n} stored real quality run(s): {j.reason}")

    @property
    def source_note(self) -> str:
        if self.store is None:
            return (
                "no quality store: run `make tune` (it keeps runs/quality.db) or pass "
                "--quality-store"
            )
        return f"quality store {self.where}"
