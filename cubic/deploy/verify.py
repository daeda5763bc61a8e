"""`cubic verify`: is the winner also a winner in TorchRec?

Takes a study's baseline and its winner (or the top N), builds each in TorchRec from its export
(`cubic export --format torchrec`: the tables, the exact placements, the model class, the optimizers)
and trains it there on the same synthetic data in real gloo ranks (harness/torchrec_trial.py),
alternating with cubic's own harness trial of the same configuration, `repeats` times each. It reports
both samples/s, the speed-up over the baseline in each framework, and the substitutions: every knob
TorchRec could not run as cubic measured it on this device, and what ran instead.

`fidelity(n)`: n completed configurations of the study run once each in TorchRec; the Kendall tau
between cubic's measured qps and TorchRec's says how far to trust the harness's ranking on this workload.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from cubic.deploy import export
from cubic.results import analysis
from cubic.study.store import safe_url
from cubic_harness.config import TrialConfig, json_safe
from cubic_harness.errors import ConfigError


def _require_torchrec() -> None:
    from cubic_harness.torchrec_rules import INSTALL_HINT, torchrec_available

    if not torchrec_available():
        raise ConfigError(f"cubic verify needs TorchRec: {INSTALL_HINT}")


def _candidate(df: pd.DataFrame, row: pd.Series, label: str, study: str) -> dict[str, Any]:
    """A study row as verify needs it: its config, plan and TorchRec export (ConfigError if it has none)."""
    from cubic_harness.torchrec_rules import UnsupportedConfig, plan_for_torchrec

    where = f"{study} trial #{int(row['number'])}"
    if not row["config"]:
        raise ConfigError(f"{where}: no config recorded")
    cfg = TrialConfig.from_dict(row["config"], where=where).validate(where)
    rec = {"study": study, "storage": "", "trial": int(row["number"]), "attrs": {},
           "result": {"plan": row["plan"]}, "winner": {"qps": float(row["qps"])}, "config": cfg.to_dict(),
           "confirmed": label == "winner"}
    tr = export.to_torchrec_dict(rec)
    try:
        _, subs = plan_for_torchrec(cfg, tr)
    except UnsupportedConfig as e:
        raise ConfigError(f"{where}: TorchRec cannot load its export: {e}") from None
    return {"label": label, "trial": int(row["number"]), "config": cfg, "export": tr, "substitutions": subs,
            "cubic": [], "torchrec": [], "errors": []}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def verify(run_dir_or_storage_url: str | Path, top: int = 1, repeats: int = 3, study: str | None = None,
           progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Baseline + winner (+ the next top-1 fastest), each in cubic and TorchRec, alternating `repeats` times."""
    from cubic_harness.torchrec_trial import run_torchrec_trial
    from cubic_harness.trial import run_trial

    if top < 1 or repeats < 1:
        raise ConfigError(f"--top {top} and --repeats {repeats} must be >= 1")
    df = analysis.load_study(run_dir_or_storage_url, study)
    analysis.require_completed(df, str(run_dir_or_storage_url))
    name = df.attrs["study"]
    if df.attrs["backend"] == "torchrec":  # its trials ran in TorchRec: the speed-up is TorchRec's already
        return {"study": name, "backend": "torchrec", "configs": [],
                "needs_nothing": f"study {name!r} was tuned in TorchRec (--backend torchrec): its winner's "
                                 "speed-up was measured there, with the same placements the export writes"}
    _require_torchrec()  # after the store: what is wrong with the user's input is said first
    win = int(df.attrs["winner"]["trial"])
    base_rows = analysis.baseline_rows(df)
    base_rows = base_rows[base_rows["ok"]]
    if base_rows.empty:
        raise ConfigError(f"{safe_url(str(run_dir_or_storage_url))}: the baseline of study {name!r} never "
                          "completed: no speed-up to verify")
    picks = [(base_rows.iloc[0], "baseline"), (df[df["number"] == win].iloc[0], "winner")]
    seen = {int(picks[0][0]["number"]), win}
    for _, row in analysis.usable(df).sort_values("qps", ascending=False).iterrows():
        if len(picks) >= top + 1:
            break
        if int(row["number"]) not in seen and row["config_key"] not in {p[0]["config_key"] for p in picks}:
            picks.append((row, f"top {len(picks)}"))
            seen.add(int(row["number"]))
    cands = [_candidate(df, row, label, name) for row, label in picks]
    for rep in range(repeats):
        for c in cands:  # alternate, so drift in the machine's speed hits every configuration alike
            if progress:
                progress(f"repeat {rep + 1}/{repeats}: {c['label']} (trial #{c['trial']}) in cubic, then TorchRec")
            r = run_trial(c["config"])
            (c["cubic"].append(r.qps) if r.status == "ok" else c["errors"].append(f"cubic: {r.status}: {r.error}"))
            t = run_torchrec_trial(c["config"], c["export"])
            (c["torchrec"].append(t["qps"]) if t["status"] == "ok"
             else c["errors"].append(f"torchrec: {t['status']}: {t['error']}"))
    base = cands[0]
    out = []
    for c in cands:
        qc, qt = _median(c["cubic"]), _median(c["torchrec"])
        out.append({"label": c["label"], "trial": c["trial"], "qps_cubic": qc, "qps_cubic_runs": c["cubic"],
                    "qps_torchrec": qt, "qps_torchrec_runs": c["torchrec"],
                    "speedup_cubic": qc / _median(base["cubic"]), "speedup_torchrec": qt / _median(base["torchrec"]),
                    "model_parallel": c["export"]["model_parallel"], "substitutions": c["substitutions"],
                    "errors": c["errors"]})
    return json_safe({"study": name, "repeats": repeats, "configs": out, **{
        k: v for k, v in out[1].items() if k in ("trial", "speedup_cubic", "speedup_torchrec", "substitutions",
                                                 "qps_cubic", "qps_torchrec")}})


def fidelity(run_dir_or_storage_url: str | Path, n: int, study: str | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """n completed configurations (spread over the study's qps range) run once each in TorchRec: Kendall tau
    between cubic's measured qps and TorchRec's."""
    from scipy.stats import kendalltau

    from cubic_harness.torchrec_trial import run_torchrec_trial

    if n < 3:
        raise ConfigError(f"--fidelity {n}: a rank correlation needs at least 3 configurations")
    df = analysis.load_study(run_dir_or_storage_url, study)
    analysis.require_completed(df, str(run_dir_or_storage_url))
    if df.attrs["backend"] != "real":
        raise ConfigError(f"--fidelity: study {df.attrs['study']!r} ran on backend {df.attrs['backend']!r}; "
                          "fidelity compares a study of cubic's harness with TorchRec")
    _require_torchrec()
    ok = df[df["ok"]].drop_duplicates("config_key").sort_values("qps").reset_index(drop=True)
    idx = sorted({round(i * (len(ok) - 1) / max(1, n - 1)) for i in range(n)}) if len(ok) > n else range(len(ok))
    rows, skipped = [], []
    for i in idx:
        row = ok.iloc[i]
        try:
            c = _candidate(df, row, "config", df.attrs["study"])
        except ConfigError as e:
            skipped.append(str(e))
            continue
        if progress:
            progress(f"fidelity {len(rows) + 1}/{len(idx)}: trial #{c['trial']} in TorchRec")
        t = run_torchrec_trial(c["config"], c["export"])
        if t["status"] != "ok":
            skipped.append(f"trial #{c['trial']}: {t['status']}: {t['error']}")
            continue
        rows.append({"trial": c["trial"], "qps_cubic": float(row["qps"]), "qps_torchrec": t["qps"],
                     "substitutions": c["substitutions"]})
    tau = kendalltau([r["qps_cubic"] for r in rows], [r["qps_torchrec"] for r in rows]).statistic \
        if len(rows) >= 3 else math.nan
    ratios = [r["qps_cubic"] / r["qps_torchrec"] for r in rows if r["qps_torchrec"] > 0]
    return json_safe({"study": df.attrs["study"], "configs": len(rows), "kendall_tau": float(tau),
                      "median_qps_ratio_cubic_over_torchrec": _median(ratios), "rows": rows, "skipped": skipped})
