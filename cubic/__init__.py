"""cubic: a CubicML-style co-design auto-tuner for DLRM training.

An XGBoost proxy learns throughput from finished trials, a searcher uses it to
pick what to run next, and short real trials of the harness give the truth.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas only when a study is loaded: `import cubic` stays light
    import pandas as pd

__version__ = "0.1.0"


def load_study(run_dir_or_storage_url: str | Path, study: str | None = None) -> pd.DataFrame:
    """One row per trial of a study (see cubic.results.analysis.load_study)."""
    from cubic.results.analysis import load_study as _load

    return _load(run_dir_or_storage_url, study)


__all__ = ["__version__", "load_study"]
