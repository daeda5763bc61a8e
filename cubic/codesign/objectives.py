"""What a co-design trial scores: time to train, cost, samples/s and memory headroom, from one
prediction.

Time to train is MLPerf's clock: the samples to the quality target at the step rate predicted, plus
the evaluations on the way (each `eval_samples` at `eval_speedup` times the training rate, every
`eval_every` samples), plus a fixed part. Cost is that time on every GPU of the cluster at the
user's price.
"""

from __future__ import annotations

import math

from cubic.codesign.clusters import ClusterChoice
from cubic.space.codesign import OBJECTIVES, CodesignSection, TimeToTrain
from cubic_harness.config import TrialResult


def time_to_train_s(ttt: TimeToTrain, qps: float) -> float:
    """Seconds to the quality target at `qps` training samples/s (MLPerf's run time)."""
    evals = math.floor(ttt.samples / ttt.eval_every) if ttt.eval_every else 0
    return ttt.samples / qps + evals * ttt.eval_samples / (ttt.eval_speedup * qps) + ttt.fixed_s


def scores(section: CodesignSection, choice: ClusterChoice, res: TrialResult) -> dict[str, float]:
    """Every objective `res` allows (`OBJECTIVES`' units); what it lacks data for is left out."""
    out = {"qps": res.qps}
    mem_mb = choice.cluster.rank_memory_mb(choice.ranks_per_node)
    if res.peak_mem_mb > 0 and mem_mb > 0:
        out["memory_headroom"] = 1.0 - res.peak_mem_mb / mem_mb
    if section.time_to_train is not None and res.qps > 0:
        hours = time_to_train_s(section.time_to_train, res.qps) / 3600
        out["time_to_train"] = hours
        if choice.price_per_gpu_hour is not None:
            out["cost"] = hours * choice.gpus * choice.price_per_gpu_hour
    return out


def values(section: CodesignSection, s: dict[str, float]) -> list[float]:
    """The study's objective values, in the section's order."""
    return [s[o] for o in section.objectives]


def directions(section: CodesignSection) -> list[str]:
    return [OBJECTIVES[o][0] for o in section.objectives]
