"""What a tune found, typed (`Summary`): what `cubic tune` prints (`cubic.tune.view.print_summary`).

`cubic.tune.summary` builds it; each type's `to_dict` is its plain-JSON form, with the keys in the
order they always had, and `from_dict` reads that form back (keys it lacks take their defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from cubic.study.winner import PlannerRef, Winner


def _plain(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class BestMeasured:
    """The fastest search measurement (selected for being high: never the winner's evidence)."""

    trial: int
    qps: float | None
    short_config: str
    speedup: float | None

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BestMeasured:
        return cls(d["trial"], d.get("qps"), d.get("short_config", ""), d.get("speedup"))


@dataclass(frozen=True)
class ConfirmedRow:
    """One confirmed configuration: its speed, re-measured, and its quality verdict.
    `same_model_as`: the earlier row whose configuration trains the same model and was judged by
    the same quality runs."""

    trial: int
    short_config: str = ""
    backoff: bool = False
    qps: float | None = None
    confirm_qps: list[float] = field(default_factory=list)
    confirm_speedup: float | None = None
    quality_ok: bool | None = None
    quality_verdict: str | None = None
    quality_eval_diff: float | None = None
    quality_ci: list[float] | None = None
    quality_seeds: int | None = None
    quality_confidence: float | None = None
    quality_reason: str | None = None
    same_model_as: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConfirmedRow:
        return cls(**_known(cls, d) | {"confirm_qps": d.get("confirm_qps") or []})


@dataclass(frozen=True)
class QualityRunCount:
    """The confirm's and checks' quality runs: trained here, or reused from the quality store."""

    ran: int
    reused: int

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True)
class NotCrowned:
    """A simulated configuration faster than the winner that real quality runs did not let it crown."""

    trial: int
    short_config: str
    qps: float | None
    speedup: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True)
class Summary:
    """The tune's outcome: the winner with the evidence behind it, the best measured trial, the
    screen's verdicts (`screen`: `QualityChecks.screen_summary`'s rows) and the confirmed
    configurations."""

    study: str
    storage: str
    best_measured: BestMeasured | None = None
    run_dir: str | None = None
    searcher: str = ""
    budget: int | None = None
    trials: int = 0
    ok: int = 0
    failed: int = 0
    proxy_tau: float | None = None
    winner: Winner | None = None
    torchrec_planner: PlannerRef | None = None
    screen: list[dict[str, Any]] = field(default_factory=list)
    quality_runs: QualityRunCount | None = None
    backoff: list[int] = field(default_factory=list)
    confirmed: list[ConfirmedRow] = field(default_factory=list)
    carried_from: str | None = None  # simulated: where its quality verdicts came from (`screen`: carried)
    not_crowned: list[NotCrowned] = field(default_factory=list)  # simulated: faster than the winner

    def to_dict(self) -> dict[str, Any]:
        """As plain JSON, the nested outcomes each by its own `to_dict`."""
        out = _plain(self)
        for k in ("best_measured", "winner", "torchrec_planner", "quality_runs"):
            out[k] = None if out[k] is None else out[k].to_dict()
        out["confirmed"] = [c.to_dict() for c in self.confirmed]
        out["not_crowned"] = [c.to_dict() for c in self.not_crowned]
        for k in ("carried_from", "not_crowned"):  # a measured tune's summary reads as it always did
            if not out[k]:
                del out[k]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        def opt(key: str, read: Any) -> Any:
            return read(d[key]) if d.get(key) else None

        return cls(**_known(cls, d) | {
            "best_measured": opt("best_measured", BestMeasured.from_dict),
            "winner": opt("winner", Winner.from_dict),
            "torchrec_planner": opt("torchrec_planner", PlannerRef.from_dict),
            "quality_runs": opt("quality_runs", lambda q: QualityRunCount(**q)),
            "screen": d.get("screen") or [], "backoff": d.get("backoff") or [],
            "confirmed": [ConfirmedRow.from_dict(c) for c in d.get("confirmed") or []],
            "not_crowned": [NotCrowned(**c) for c in d.get("not_crowned") or []]})
