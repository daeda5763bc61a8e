"""Where a trial's throughput came from: measured, or predicted by the simulator for one cluster.

A searcher learns from trials of several sources at once (`cubic tune --warm-start`): its own
study's, and earlier studies' that were measured or simulated, each simulated study for the cluster
it priced. A throughput is comparable only with those of its own source (the simulator's scale is
not the machine's, and an H100 cluster's order of configurations is not an A100's), so the proxy
ranks each source apart; what sets sources apart, the simulator or the cluster's figures, it reads
as features, so it learns how the order moves between them (cubic/search/proxy.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

REAL = "real"


@dataclass(frozen=True)
class Fidelity:
    """A source of throughputs: a study's backend ("real", "sim:CLUSTER") and, for a simulated one,
    its cluster's figures (`Cluster.features`); none where the study did not record them."""

    backend: str = REAL
    figures: tuple[tuple[str, float], ...] = ()  # (name, value), sorted: a source is hashable

    @classmethod
    def of(cls, backend: str, figures: Mapping[str, float] | None = None) -> Fidelity:
        return cls(backend, tuple(sorted((str(k), float(v)) for k, v in (figures or {}).items())))

    @property
    def simulated(self) -> bool:
        return self.backend.startswith("sim")


MEASURED = Fidelity()
