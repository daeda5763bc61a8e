"""What a study's trials can tell, decided once from its backend (not tested in every step).

A measured trial trains a model: it has losses (the in-run NE estimate), can be re-measured (the machine
is noisy, the first measurement was picked for being high) and its numerics can be judged by held-out
quality runs; that holds whether cubic's harness or TorchRec trains it. A simulated trial
(`cubic.execution.sim_runner`) predicts speed and memory and trains nothing: the same prediction again says
nothing new, and it judges no quality itself: it crowns a numerics change only as real quality runs of the
same space, or of one of the same workload at another size (`cubic.quality.scaled`), judged it
(`cubic.quality.carried`), and a real tune of its winner judges the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cubic.quality.carried import Carried
from cubic.space.quality_runs import QualityRuns
from cubic.space.search_space import SearchSpace


@dataclass(frozen=True)
class Policy:
    estimates_quality: bool  # in-run NE over the baseline's samples, from each trial's losses
    quality_runs: QualityRuns | None  # held-out runs for the screen, the checks and the gate (None: none)
    judges_quality: bool  # the confirm's gate judges numerics changes (else: passes them, saying why)
    repeats: int  # confirm re-measurements per configuration
    checks_memory: bool  # refuse a configuration the memory model says will not fit, before it starts
    provenance: dict[str, Any] = field(default_factory=dict)  # what the winner records about the backend
    # simulated: the real quality runs' verdicts it crowns by (None: measured trials judge their own)
    carried: Carried | None = None

    @classmethod
    def measured(cls, space: SearchSpace, backend: str = "real") -> Policy:
        """Trials that train, in cubic's harness or in TorchRec (`backend`): the memory model prices the
        harness's ranks, so only its trials are refused before they start."""
        return cls(estimates_quality=True, quality_runs=space.quality_runs, judges_quality=True,
                   repeats=space.repeats, checks_memory=backend == "real",
                   provenance={} if backend == "real" else {"backend": backend})

    @classmethod
    def simulated(cls, cluster: str, carried: Carried | None) -> Policy:
        """Predicted trials: speed and memory only; numerics crowned only as real runs judged them."""
        return cls(estimates_quality=False, quality_runs=None, judges_quality=False, repeats=1,
                   checks_memory=False, provenance={"backend": "sim", "cluster": cluster},
                   carried=carried)
