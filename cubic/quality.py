"""Quality from search trials, for free: normalized entropy over the baseline's samples.

The harness keys its data by global sample number and records the global loss of every step, so
the first steps of a trial with a global batch at least the baseline's are exactly the training
a sample-matched re-run would do (training is causal): the mean loss over the steps that cover
the baseline's measured samples, divided by the entropy of the labels there (the baseline's
loss / NE over those same samples), is the NE the confirm's quality gate would see. That lets
the searcher learn, while it searches, which fast configurations the gate will reject.
Search trials with a smaller global batch do not cover the baseline's samples: no estimate (None);
the confirm runs them longer (`covering`) so they do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from harness.config import TrialConfig


def matched_steps(cfg: TrialConfig, base: TrialConfig) -> tuple[int, int]:
    """(first, count) of cfg's steps over the baseline's measured samples: the whole steps inside
    them; where not one step fits inside, the step that holds their start. Either way the window
    never begins after more training than the baseline's did (a later window would flatter cfg)."""
    gb, gb0 = cfg.global_batch, base.global_batch
    start, stop = base.warmup_steps * gb0, (base.warmup_steps + base.measure_steps) * gb0
    first, end = -(-start // gb), stop // gb  # ceil, floor
    return (first, end - first) if end > first else (start // gb, 1)


def covering(cfg: TrialConfig, base: TrialConfig) -> TrialConfig:
    """`cfg` with its own warm-up and measured steps (so its speed is measured like any trial's),
    run longer where its steps end before the baseline's samples do (a smaller global batch), so
    `matched_ne` can read its NE over those samples from its per-step losses."""
    first, count = matched_steps(cfg, base)
    short = first + count - (cfg.warmup_steps + cfg.measure_steps)
    return cfg.replace(measure_steps=cfg.measure_steps + short) if short > 0 else cfg


def matched_ne(losses: Sequence[float], cfg: TrialConfig, base_losses: Sequence[float], base: TrialConfig,
               base_ne: float | None) -> float | None:
    """NE of a trial over the baseline's measured samples, or None where its steps do not cover them."""
    first, count = matched_steps(cfg, base)
    w0, m0 = base.warmup_steps, base.measure_steps
    if first + count > len(losses) or w0 + m0 > len(base_losses) or not base_ne or base_ne <= 0:
        return None
    entropy = (sum(base_losses[w0:w0 + m0]) / m0) / base_ne
    ne = (sum(losses[first:first + count]) / count) / entropy
    return ne if math.isfinite(ne) else None


def within(ne: float, base_ne: float, tolerance: float) -> bool:
    """The quality gate's rule: (NE - NE_baseline) / NE_baseline <= tolerance.

    One-sided: lower NE is better quality, so a configuration may improve it freely and may worsen
    it by at most `tolerance`. (A two-sided gate rejected configurations for training *better*:
    a fresh `make tune` crowned the baseline over a 1.19x faster configuration whose smaller batch
    reached an NE 3.3% lower over the same samples.)"""
    return (ne - base_ne) / base_ne <= tolerance
