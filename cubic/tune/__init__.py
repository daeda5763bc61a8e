"""`cubic tune`, by role: the loop and its lifecycle (`loop`), quality while searching (`checks`), the
confirm step (`confirm`), the summary (`summary`), what a backend's trials can tell (`policy`), the
pending work's types (`work`) and what they all share (`context`)."""

from cubic.tune.checks import early_reject, paired_diff
from cubic.tune.loop import Tuner

__all__ = ["Tuner", "early_reject", "paired_diff"]
