"""The winner a tune stores on its study (user attr "winner", `Store.set_winner`), typed.

The tuner builds it (`cubic.tune.summary`); the report, the analysis and the export read it back
from the stored JSON (`Winner.from_dict`). Why a type with its own `to_dict`: the stored JSON is
the contract with every study already written, so its keys and their order are spelled once,
here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the stored keys before the backend's provenance, in their stored order
HEAD = ("trial", "qps", "qps_spread", "baseline_qps", "speedup", "speedup_spread",
        "confirm_base_qps", "config", "config_key", "searcher", "quality_reason", "confirm_qps",
        "short_config")
TAIL = ("quality", "vs_torchrec_planner", "confirmed")


@dataclass(frozen=True)
class PlannerRef:
    """TorchRec's planner's plan of the baseline (the `reference` trial): its qps (re-measured or
    measured once) and what the winner (else the best measured trial) and the baseline give over
    it."""

    trial: int
    qps: float
    re_measured: bool
    speedup: float | None
    baseline_speedup: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"trial": self.trial, "qps": self.qps, "re_measured": self.re_measured,
                "speedup": self.speedup, "baseline_speedup": self.baseline_speedup}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlannerRef:
        return cls(d["trial"], d["qps"], bool(d.get("re_measured")), d.get("speedup"),
                   d.get("baseline_speedup"))


@dataclass(frozen=True)
class Winner:
    """The fastest confirmed configuration that passed the gate.

    qps: the median of its confirm re-measurements (`qps_spread`: their range); speedup: the median
    ratio of each re-measurement to the baseline's run beside it (`speedup_spread`: their range);
    provenance: what the backend records (a simulated tune's "backend" and "cluster"); quality: the
    evidence behind its quality verdict, where quality runs judged it; confirmed: False only for the
    best measured trial the analysis stands in where no confirm stored a winner (never stored)."""

    trial: int | None  # None only where a partial record names none (export reads what it has)
    qps: float | None
    qps_spread: list[float] | None = None
    baseline_qps: float | None = None
    speedup: float | None = None
    speedup_spread: list[float] | None = None
    confirm_base_qps: list[float | None] = field(default_factory=list)
    config: dict[str, Any] | None = None
    config_key: str | None = None
    searcher: str | None = None
    quality_reason: str | None = None
    confirm_qps: list[float] = field(default_factory=list)
    short_config: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    quality: dict[str, Any] | None = None
    vs_torchrec_planner: PlannerRef | None = None
    confirmed: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the keys of `HEAD`, the provenance, then quality and the planner's
        plan where there are any (and `confirmed` only where False)."""
        out = {k: getattr(self, k) for k in HEAD} | self.provenance
        if self.quality is not None:
            out["quality"] = self.quality
        if self.vs_torchrec_planner is not None:
            out["vs_torchrec_planner"] = self.vs_torchrec_planner.to_dict()
        if not self.confirmed:
            out["confirmed"] = False
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Winner:
        """A stored winner (or the analysis's stand-in); keys it lacks take their defaults."""
        known = {k: d[k] for k in HEAD if d.get(k) is not None}
        ref = d.get("vs_torchrec_planner")
        return cls(**known | {"trial": d.get("trial"), "qps": d.get("qps")},
                   provenance={k: v for k, v in d.items() if k not in HEAD + TAIL},
                   quality=d.get("quality"),
                   vs_torchrec_planner=PlannerRef.from_dict(ref) if ref else None,
                   confirmed=bool(d.get("confirmed", True)))
