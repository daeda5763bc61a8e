"""A space's `quality:` section as the tuner uses it: the budget, seeds and confidence of held-out quality runs.

It lives with the space, below the quality rules that use it (`cubic/quality/rules.py`), because a space is
loaded before any quality run exists and the loader builds it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cubic.space.numerics import ALWAYS_NEUTRAL
from cubic_harness.config import TrialConfig

UPFRONT, ON_DEMAND, OFF = "upfront", "on_demand", "off"
#: When the quality screen judges each numerics change alone: every change before the search (`upfront`);
#: only the changes of an incumbent that outlasted the next trials, while searching (`on_demand`: a change
#: no fast configuration carries costs no run); never (`off`). A space's `screen: true|false` is
#: upfront|off.
SCREENS = (UPFRONT, ON_DEMAND, OFF)


@dataclass(frozen=True)
class QualityRuns:
    """A space's `quality:` section: how the confirm step judges a numerics-changing candidate.

    The baseline and the candidate each train `samples` samples of one non-repeating stream, then are
    evaluated on `eval_samples` held-out samples (eval NE and AUC), once per seed 0..seeds-1 (the seed
    sets the data, the teacher and the initialisation; candidate and baseline are paired by seed).
    The baseline's seed-to-seed spread is the noise floor.

    The confirm's verdict is sequential (`sequential`): after the first `seeds` pairs, one more paired seed
    at a time until the `confidence` interval of the mean paired difference lies wholly on one side of the
    tolerance, or `max_seeds` pairs are spent (or can no longer be expected to pass: `rules.pass_chance`)
    and the verdict is "not resolved". Why not a fixed count: a
    standard error from two pairs is itself a guess (a winner passed at +0.083% +- 0.010% on seeds 0-1 and
    came out at +0.108% +- 0.051% on seeds 2-5), and a fixed count large enough for every candidate would
    be paid by the many that are clear after two."""

    samples: int = 1 << 20
    eval_samples: int = 1 << 16
    seeds: int = 3
    tolerance: float = 0.001
    screen: str = UPFRONT  # when each numerics change is judged alone (SCREENS; cubic/quality/screen.py)
    confidence: float = 0.9  # two-sided, of the mean paired difference; the verdict needs it on one side
    max_seeds: int = 6  # the sequential verdict's seed budget per candidate (and the baseline)
    # the model-neutral knobs' values every quality run takes instead of the baseline's
    # (`numerics.LAYOUT_KNOBS`, `SearchSpace.model_params`): the fastest way to train the same model
    layout: dict[str, Any] = dataclasses.field(default_factory=dict)

    def config(self, cfg: TrialConfig, seed: int) -> TrialConfig:
        """`cfg` as a quality run: the layout's settings that never change the model
        (`numerics.ALWAYS_NEUTRAL`: a fixed setting of the space too), the budget's steps on a
        stream that does not repeat within it, one window (its speed is not the point), held-out
        evaluation, this seed, and time for all of it."""
        cfg = cfg.replace(**{k: v for k, v in self.layout.items() if k in ALWAYS_NEUTRAL})
        wl = cfg.workload
        if wl.sample_cycle < self.samples:
            wl = dataclasses.replace(wl, sample_cycle=1 << max(self.samples - 1, 1).bit_length())
        steps = max(2, self.samples // cfg.global_batch)
        return cfg.replace(workload=wl, warmup_steps=1, measure_steps=steps - 1, windows=1,
                           eval_samples=self.eval_samples, seed=seed,
                           timeout_s=max(cfg.timeout_s, cfg.timeout_s * steps / max(1, cfg.warmup_steps
                                                                                    + cfg.measure_steps)))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
