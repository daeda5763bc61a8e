"""Learning rates that follow the global batch: how a space judges a larger batch at the rate a
practitioner would train it with (MLPerf's DLRM-DCNv2 sets a learning rate per global batch).

A space's `lr_scaling` is a rule relative to the baseline's global batch and learning rates: `none`
(every config at the baseline's rates), `linear` (rates x GB / GB_baseline), `sqrt` (x its square root),
or a table `{GLOBAL_BATCH: {emb_lr: X, dense_lr: Y}}` (global batches it does not list keep the
baseline's rates). A learning rate that is itself a knob of the space is the knob's, never scaled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from cubic_harness.config import TrialConfig
from cubic_harness.errors import ConfigError

RULES = ("none", "linear", "sqrt")
LRS = ("emb_lr", "dense_lr")


def parse(value: Any, where: str) -> str | dict[int, dict[str, float]]:
    """The YAML value -> a rule name or a {global batch: {lr: value}} table (ConfigError, one line)."""
    if isinstance(value, str):
        if value not in RULES:
            raise ConfigError(f"{where}: {value!r} is not a rule; allowed: {list(RULES)} or a table "
                              "{GLOBAL_BATCH: {emb_lr: X, dense_lr: Y}}")
        return value
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where}: must be one of {list(RULES)} or a table {{GLOBAL_BATCH: {{emb_lr: X, "
                          "dense_lr: Y}}}")
    table: dict[int, dict[str, float]] = {}
    for gb, lrs in value.items():
        if isinstance(gb, bool) or not isinstance(gb, int) or gb < 1:
            raise ConfigError(f"{where}: key {gb!r} must be a global batch (an integer >= 1)")
        if not isinstance(lrs, dict) or not lrs or set(lrs) - set(LRS):
            raise ConfigError(f"{where}.{gb}: must map some of {list(LRS)} to learning rates")
        for k, v in lrs.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{where}.{gb}.{k}: {v!r} must be a finite number > 0")
        table[gb] = {k: float(v) for k, v in lrs.items()}
    return table


def apply(cfg: TrialConfig, base: TrialConfig, rule: str | dict, knobs: tuple[str, ...] = ()) -> TrialConfig:
    """`cfg` at the learning rates `rule` gives its global batch (knobs listed in `knobs` are left alone)."""
    if rule == "none" or cfg.global_batch == base.global_batch and not isinstance(rule, dict):
        return cfg
    if isinstance(rule, dict):
        new = {k: v for k, v in rule.get(cfg.global_batch, {}).items() if k not in knobs}
    else:
        f = cfg.global_batch / base.global_batch
        f = f if rule == "linear" else math.sqrt(f)
        new = {k: getattr(base, k) * f for k in LRS if k not in knobs}
    return dataclasses.replace(cfg, **new) if new else cfg
