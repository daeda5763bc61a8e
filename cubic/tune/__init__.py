"""`cubic tune`, by role: the loop and its lifecycle (`loop`), quality while searching (`checks`), the
confirm step (`confirm`), the summary (`summary`), what a backend's trials can tell (`policy`), the
pending work's types (`work`), the live terminal view (`view`) and what they all share (`context`).

Above `search`, `results`, `quality`, `study`, `execution` and `space`; only `cli` imports it."""

from cubic.tune.checks import early_reject, paired_diff
from cubic.tune.loop import Tuner

__all__ = ["Tuner", "early_reject", "paired_diff"]
