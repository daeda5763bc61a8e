"""Read a tuning study into pandas, and the small computations the notebook, report and export share.

The trial store (an Optuna study on RDB storage) is the single source of truth;
everything here only reads it. Importing this module stays cheap (no torch) so
`cubic.load_study` can be used in a notebook that never trains anything.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd
import sqlalchemy

from cubic.quality.rules import paired_mean
from cubic.quality.screen import Screened
from cubic.study import record
from cubic.study.record import TrialRecord
from cubic.study.store import NOT_RUN, rdb_storage, redact, safe_url, storage_url
from cubic.study.winner import Winner
from cubic_harness.errors import ConfigError

BREAKDOWN_KEYS = ("emb_fwd", "emb_bwd", "comm", "sync", "dense", "optim")
SCALAR_METRICS = (
    "qps", "qps_cv", "step_ms_p50", "step_ms_p90", "peak_mem_mb", "loss_first", "loss_last", "ne",
)
# Columns of every load_study frame that are not knobs (so a knob named like one can never shadow it).
_META = (
    "number", "state", "status", "reason", "value", "phase", "searcher", "predicted_qps", "predicted_std",
    "config_key", "datetime_start", "datetime_complete", "duration_s",
)


# ---------------------------------------------------------------------------------------------- storage
def existing_storage(url: str, where: str) -> tuple[Any, list]:
    """(storage, its studies) of a trial store that exists; ConfigError naming `where` otherwise."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        # look before Optuna opens it: RDBStorage creates its tables in any database it is given
        engine = sqlalchemy.create_engine(url)
        try:
            is_store = sqlalchemy.inspect(engine).has_table("studies")
        finally:
            engine.dispose()
        if not is_store:
            raise ConfigError(f"{where}: not a cubic/Optuna trial store (no 'studies' table)")
        storage = rdb_storage(url, skip_compatibility_check=False)
        return storage, storage.get_all_studies()
    except ConfigError:
        raise
    except Exception as e:  # not a database, not an Optuna schema, server unreachable
        # the driver's own words (SQLAlchemy's wrapper adds the SQL and a link: noise on one line)
        msg = redact(" ".join(str(getattr(e, "orig", None) or e).split()), url)[:200]
        raise ConfigError(f"{where}: cannot read the trial store ({type(e).__name__}: {msg})") from None


def open_study(run_dir_or_storage_url: str | Path, study: str | None = None) -> optuna.Study:
    """Open an existing study; with study=None the storage's only study (the name is the space's name)."""
    return open_store(run_dir_or_storage_url, study)[0]


def open_store(run_dir_or_storage_url: str | Path, study: str | None = None) -> tuple[optuna.Study, Any]:
    """(the study, its storage): `open_study`, and the storage that also holds cubic's records of it."""
    url = storage_url(run_dir_or_storage_url)
    where = safe_url(url)
    storage, studies = existing_storage(url, where)
    names = [s.study_name for s in studies]
    if not names:
        raise ConfigError(f"{where}: the trial store holds no study; run `cubic tune` first")
    if study is None:
        if len(names) > 1:
            raise ConfigError(f"{where}: {len(names)} studies in this store; choose one with --study: "
                              f"{names}")
        study = names[0]
    elif study not in names:
        raise ConfigError(f"{where}: no study named {study!r}; the store has {names}")
    return optuna.load_study(study_name=study, storage=storage), storage


def one_objective(st: optuna.Study, where: str) -> optuna.Study:
    """`st`, or ConfigError where it is a co-design study: several objectives have a front, not one winner
    to rank, export or verify (`cubic report` shows its front). `where`: the store as it may be shown."""
    if len(st.directions) > 1:
        raise ConfigError(f"{where}: study {st.study_name!r} is a co-design study "
                          f"({len(st.directions)} objectives: a front, not one winner); `cubic report` shows "
                          "its front, and `cubic trial --backend sim --cluster FILE` prices one of its points")
    return st


def records(run_dir_or_storage_url: str | Path, study: str | None = None) -> list[TrialRecord]:
    """Every trial of a stored study as its `TrialRecord` (Optuna's trial and cubic's findings)."""
    st, storage = open_store(run_dir_or_storage_url, study)
    one_objective(st, safe_url(storage_url(run_dir_or_storage_url)))
    return record.load(storage.engine, st.study_name, st.get_trials(deepcopy=False))


# ---------------------------------------------------------------------------------------------- frame
def _num(v: Any) -> float:
    """A metric as float (None / missing / junk -> NaN) so columns stay numeric."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _knob_names(study: optuna.Study, trials: list[optuna.trial.FrozenTrial]) -> list[str]:
    """The space's knobs in its own order when the space says so, else every param seen."""
    names: list[str] = []
    knobs = (study.user_attrs.get("space") or {}).get("knobs")
    if isinstance(knobs, dict):
        names = [str(k) for k in knobs]
    elif isinstance(knobs, list):
        names = [str(k["name"]) for k in knobs if isinstance(k, dict) and "name" in k]
    for t in trials:
        names += [p for p in t.params if p not in names]
    return [n for n in names if n not in _META]


def _status(t: optuna.trial.FrozenTrial, res: dict[str, Any]) -> str:
    st = t.user_attrs.get("status") or res.get("status")
    if st:
        return str(st)
    return {"COMPLETE": "ok", "FAIL": "error", "RUNNING": "running", "WAITING": "waiting",
            "PRUNED": "pruned"}.get(t.state.name, t.state.name.lower())


def _row(r: TrialRecord, knobs: list[str]) -> dict[str, Any]:
    t, ua = r.trial, r.run
    res = ua.get("result") or {}
    cfg = ua.get("config") or res.get("config") or {}
    row: dict[str, Any] = {
        "number": t.number,
        "state": t.state.name,
        "status": _status(t, res),
        "reason": str(ua.get("error") or res.get("error") or ua.get("fail_reason") or ""),
        "value": _num(t.value) if t.values else math.nan,
        "phase": ua.get("phase", ""),
        "searcher": ua.get("searcher", ""),
        "predicted_qps": _num(ua.get("predicted_qps")),
        "predicted_std": _num(ua.get("predicted_std")),
        "config_key": ua.get("config_key", ""),
        "datetime_start": t.datetime_start,
        "datetime_complete": t.datetime_complete,
    }
    for k in knobs:  # the param; a trial that was enqueued without it (the baseline) has it in its config
        row[k] = t.params.get(k, cfg.get(k))
    for m in SCALAR_METRICS:
        row[m] = _num(ua.get(m, res.get(m)))
    bd = res.get("breakdown_ms") or {}
    for k in dict.fromkeys([*BREAKDOWN_KEYS, *bd]):
        row[f"bd_{k}"] = _num(bd.get(k))
    row["window_qps"] = list(res.get("window_qps") or [])
    row["losses"] = list(res.get("losses") or [])
    for k, v in (res.get("env") or {}).items():
        if isinstance(v, str | int | float | bool) or v is None:
            row[f"env_{k}"] = v
        elif isinstance(v, list) and all(isinstance(x, str) for x in v):  # rank_nodes: where each rank ran
            row[f"env_{k}"] = ",".join(v)
        elif isinstance(v, dict) and k == "env_overrides":  # settings a measurement took from the environment
            row[f"env_{k}"] = ",".join(f"{a}={b}" for a, b in sorted(v.items()))
    for k, v in (res.get("extra") or {}).items():
        if isinstance(v, str | int | float):
            row[f"extra_{k}"] = v
    confirm = [_num(x) for x in r.confirm_qps]
    row["confirm_qps"] = confirm
    row["confirm_qps_median"] = float(np.median(confirm)) if confirm else math.nan
    row["confirm_base_qps"] = [_num(x) for x in r.confirm_base_qps]  # the baseline's run beside each
    row["confirm_paired_speedup"] = _num(r.confirm_speedup(None))  # their median ratio (NaN: no pair)
    cne = [_num(x) for x in r.confirm_ne]
    row["confirm_ne"] = cne
    row["confirm_ne_median"] = float(np.median(cne)) if cne else math.nan
    row["quality_ok"] = r.quality_ok
    row["quality_reason"] = r.quality_reason or ""
    row["quality_verdict"] = r.quality_verdict  # passed | failed | not resolved (cubic.quality.rules.sequential)
    row["quality_ci"] = r.quality_ci
    row["ne_matched"] = _num(r.ne_matched)  # NE over the baseline's samples (cubic.quality.rules)
    row["quality_est_ok"] = r.quality_est_ok
    row["quality_heldout_ok"] = r.quality_heldout_ok  # a held-out check while searching (cubic.tune)
    row["quality_runs_of"] = r.quality_runs_of  # whose quality runs it shares (the same model)
    row["quality_screened_out"] = r.quality_screened_out  # its changes the quality screen failed
    # quality runs (a space's `quality:` section): held-out eval NE/AUC per seed, and the gate's numbers
    row["quality_eval_ne"] = [_num(x) for x in r.quality_eval_ne]
    row["quality_eval_auc"] = [_num(x) for x in r.quality_eval_auc]
    for k in ("quality_eval_diff", "quality_se", "quality_noise"):
        row[k] = _num(getattr(r, k))
    row["config"] = cfg
    row["plan"] = res.get("plan") or []
    return row


def load_study(run_dir_or_storage_url: str | Path, study: str | None = None) -> pd.DataFrame:
    """One row per trial: knobs, every TrialResult metric (breakdown as `bd_*`), status/reason, timing,
    searcher, phase and the proxy's prediction at proposal time.

    Also `ok` (a usable measurement), `speedup` (the one speed-up shown everywhere: where the confirm
    re-measured the trial, its median ratio to the baseline's run beside each re-measurement
    (`TrialRecord.confirm_speedup`), else its re-measured median, else its search qps, over the baseline's
    re-measured median when there is one; `speedup_remeasured` says which), `confirm_speedup` and `is_winner`.
    `df.attrs` carries
    study, storage, knobs, baseline_qps, winner (the confirmed one, or the best ok trial) and space.
    """
    st, storage = open_store(run_dir_or_storage_url, study)
    return study_frame(st, storage, safe_url(storage_url(run_dir_or_storage_url)))


def study_frame(st: optuna.Study, storage: Any, label: str = "",
                records: list[TrialRecord] | None = None) -> pd.DataFrame:
    """load_study for an already opened study and its storage; `label`: the storage as it may be shown;
    `records`: the study's records where the caller has read them already (export reads the store once)."""
    one_objective(st, label or st.study_name)
    trials = st.get_trials(deepcopy=False)
    knobs = _knob_names(st, trials)
    recs = records if records is not None else record.load(storage.engine, st.study_name, trials)
    df = pd.DataFrame([_row(r, knobs) for r in recs])
    if df.empty:  # a study with no trial yet: every column a row has (the summaries below read them)
        blank = record.build(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))
        df = pd.DataFrame(columns=list(_row(blank, knobs)))
    df = df.sort_values("number", kind="stable").reset_index(drop=True)
    df["datetime_start"] = pd.to_datetime(df["datetime_start"])
    df["datetime_complete"] = pd.to_datetime(df["datetime_complete"])
    df["duration_s"] = (df["datetime_complete"] - df["datetime_start"]).dt.total_seconds()
    df["ok"] = (df["state"] == "COMPLETE") & (df["status"] == "ok") & (df["qps"] > 0)
    df.attrs.update(study=st.study_name, storage=safe_url(label), knobs=knobs, space=st.user_attrs.get("space") or {},
                    backend=st.user_attrs.get("backend", "real"))  # real, torchrec or sim:CLUSTER
    # One speed-up everywhere (banner, tables, plots, notebook, export): over the baseline's re-measured
    # median when the confirm re-measured it, since its first measurement may have run on a busy machine;
    # a re-measured configuration by its own median, any other by its one search measurement.
    base_conf = baseline_rows(df)["confirm_qps_median"].dropna()
    remeasured = bool(len(base_conf))
    base = float(base_conf.iloc[0]) if remeasured else baseline_qps(df, st.user_attrs.get("winner"))
    df["speedup_remeasured"] = df["confirm_qps_median"].notna() & remeasured
    own = df["confirm_qps_median"].where(df["speedup_remeasured"], df["qps"])
    paired = df["confirm_paired_speedup"].where(df["speedup_remeasured"])
    df["speedup"] = paired.fillna(own / base) if base else paired
    df["confirm_speedup"] = paired.fillna(df["confirm_qps_median"] / base) if remeasured else math.nan
    df.attrs["baseline_qps"] = base
    df.attrs["baseline_remeasured"] = remeasured
    win = winner_info(df, st.user_attrs.get("winner"))
    df["is_winner"] = df["number"] == (win["trial"] if win else -1)
    df.attrs["winner"] = win
    df.attrs["quality_screen"] = st.user_attrs.get("quality_screen") or []
    return df


def screen_table(df: pd.DataFrame) -> pd.DataFrame:
    """The quality screen (cubic/quality/screen.py): each numerics change alone, its held-out eval NE difference
    from the baseline (mean over the seeds it ran, paired) and its verdict; empty if no screen ran."""
    base = baseline_rows(df)
    bne = list(base["quality_eval_ne"].iloc[0]) if len(base) and "quality_eval_ne" in base else []
    out = []
    for s in map(Screened.from_dict, df.attrs.get("quality_screen") or []):
        diff = paired_mean(s.eval_ne, bne)
        out.append({"change": s.label, "seeds": len(s.eval_ne), "eval_ne_diff": math.nan if diff is None else diff,
                    "verdict": s.verdict, "reason": s.reason})
    return pd.DataFrame(out, columns=["change", "seeds", "eval_ne_diff", "verdict", "reason"])


def verdict_table(df: pd.DataFrame) -> pd.DataFrame:
    """The confirm's quality verdicts, fastest re-measurement first: passed, failed, or not resolved (the
    sequential verdict's seed budget spent with its interval straddling the tolerance; never crowned)."""
    cols = ["number", "confirm_qps_median", "quality_verdict", "seeds", "eval_ne_diff", "interval", "reason"]
    if "quality_verdict" not in df:
        return pd.DataFrame(columns=cols)
    rows = df[df["quality_verdict"].notna()].sort_values("confirm_qps_median", ascending=False)
    out = [{"number": r.number, "confirm_qps_median": r.confirm_qps_median, "quality_verdict": r.quality_verdict,
            "seeds": len(r.quality_eval_ne), "eval_ne_diff": r.quality_eval_diff,
            "interval": (f"{r.quality_ci[0]:+.3%}..{r.quality_ci[1]:+.3%}" if isinstance(r.quality_ci, list)
                         else ""), "reason": r.quality_reason} for r in rows.itertuples()]
    return pd.DataFrame(out, columns=cols)


# ---------------------------------------------------------------------------------------------- helpers
def baseline_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The baseline trial(s): phase 'baseline', else trial 0 (the tuner always runs the baseline first)."""
    rows = df[df["phase"] == "baseline"]
    return rows if len(rows) else df[df["number"] == 0]


def baseline_qps(df: pd.DataFrame, winner: dict[str, Any] | None = None) -> float | None:
    """The baseline's throughput, the denominator of every speed-up; None when it never measured."""
    rows = baseline_rows(df)
    rows = rows[rows["state"].eq("COMPLETE") & (rows["qps"] > 0)] if len(rows) else rows
    if len(rows):
        return float(rows["qps"].iloc[0])
    if winner and _num(winner.get("baseline_qps")) > 0:
        return float(winner["baseline_qps"])
    return None


def usable(df: pd.DataFrame) -> pd.DataFrame:
    """Trials with a real measurement, minus those that failed the quality gate (or whose own
    NE over the baseline's samples already fails it, or a held-out check rejected)."""
    out = df[df["ok"]]
    if "quality_ok" in out:
        out = out[out["quality_ok"].ne(False)]
    if "quality_est_ok" in out:  # a held-out check's verdict overrides the in-run estimate
        held = out["quality_heldout_ok"] if "quality_heldout_ok" in out else pd.Series(None, index=out.index)
        out = out[held.where(held.notna(), out["quality_est_ok"]).ne(False)]
    return out


def winner_info(df: pd.DataFrame, stored: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The confirmed winner the tuner stored, else the best usable trial by qps (None if nothing ran)."""
    if stored and "trial" in stored and (df["number"] == stored["trial"]).any():
        return dict(stored)
    ok = usable(df)
    if ok.empty:
        return None
    best = ok.loc[ok["qps"].idxmax()]
    base = df.attrs.get("baseline_qps") or baseline_qps(df)
    return {"trial": int(best["number"]), "qps": float(best["qps"]),
            "qps_spread": [float(min(best["window_qps"] or [best["qps"]])),
                           float(max(best["window_qps"] or [best["qps"]]))],
            "speedup": float(best["qps"]) / base if base else math.nan,
            "baseline_qps": base, "config": best["config"], "confirmed": False}


def best_so_far(df: pd.DataFrame) -> pd.DataFrame:
    """number, qps (NaN for failed trials), best_qps (running max): is the search still improving?"""
    out = df[["number", "phase", "status"]].copy()
    out["qps"] = df["qps"].where(df["ok"])
    out["best_qps"] = out["qps"].cummax().ffill()
    return out.reset_index(drop=True)


def varying_knobs(df: pd.DataFrame) -> list[str]:
    """Knobs that took more than one value: the only ones worth a column or a plot."""
    out = []
    for k in df.attrs.get("knobs", []):
        if k in df and df[k].astype(str).nunique(dropna=True) > 1:
            out.append(k)
    return out


def _groups(col: pd.Series, max_levels: int = 6) -> pd.Series:
    """Categorical knobs as they are; numeric knobs with many values cut into quartiles."""
    num = pd.to_numeric(col, errors="coerce")
    if num.notna().all() and num.nunique() > max_levels:
        return pd.qcut(num.rank(method="first"), 4, labels=False).astype(str)
    return col.astype(str)


def knob_importance(df: pd.DataFrame, knobs: list[str] | None = None) -> pd.Series:
    """Share of the variance of log(qps) each knob explains on its own (eta squared), normalised to 1.

    A variance decomposition needs no extra library and stays defined for tiny studies: with fewer
    than 3 usable trials, or no variance, it returns zeros rather than failing.
    """
    knobs = varying_knobs(df) if knobs is None else knobs
    ok = usable(df)
    scores = dict.fromkeys(knobs, 0.0)
    if len(ok) >= 3 and knobs:
        y = np.log(ok["qps"].astype(float))
        total = float(((y - y.mean()) ** 2).sum())
        if total > 0:
            for k in knobs:
                g = _groups(ok[k])
                means = y.groupby(g).transform("mean")
                scores[k] = float(((means - y.mean()) ** 2).sum()) / total
    s = pd.Series(scores, name="importance", dtype=float)
    if s.sum() > 0:
        s = s / s.sum()
    return s.sort_values(ascending=False)


def top_k(df: pd.DataFrame, k: int = 5) -> pd.DataFrame:
    """The k fastest usable trials with what makes them differ, for tables in the notebook and report.

    The winner first, then the configurations the confirm re-measured above those measured once, whatever
    their first figure: a search measurement was selected for being high, and the confirm is what crowns
    (one it spared after a pair or two, as unable to win, may show a higher figure than the winner's
    median). One quality signal: the held-out verdict where the study ran quality runs, else the in-run
    NE estimate."""
    ok = usable(df)
    remeasured = ok["confirm_qps_median"].notna() if "confirm_qps_median" in ok else False
    win = ok["is_winner"] if "is_winner" in ok else False
    ok = (ok.assign(_win=win, _re=remeasured)
          .sort_values(["_win", "_re", "speedup", "qps"], ascending=False).head(k))
    held = "quality_eval_diff" in df and df["quality_eval_diff"].notna().any()  # held-out runs judged some
    cols = ["number", "phase", "qps", "confirm_qps_median", "speedup", "qps_cv", "peak_mem_mb", "quality_verdict",
            "quality_eval_diff", *([] if held else ["ne"]), *varying_knobs(df)]
    cols = [c for c in cols if c in ok and not (c.startswith(("confirm_", "quality_")) and ok[c].isna().all())]
    return ok[cols].reset_index(drop=True)


def require_completed(df: pd.DataFrame, where: str) -> None:
    """Raise ConfigError (one line) when the study has nothing to report or export. `where`: the run
    directory or storage URL the user gave (its password is never printed)."""
    where = safe_url(where)
    name = df.attrs.get("study")
    if df.empty:
        raise ConfigError(f"{where}: study {name!r} has no trials yet; run `cubic tune` first")
    if not usable(df).empty:
        return
    bad = df[~df["ok"]]
    why = next((r for r in bad["reason"] if r), "")
    why = f"; first failure: {why[:160]}" if why else ""
    raise ConfigError(f"{where}: study {name!r} has no completed trial ({len(df)} trials, none measured "
                      f"successfully{why})")


def failed(df: pd.DataFrame) -> pd.DataFrame:
    """Finished trials that did not give a measurement, with why (queued/running ones are not failures)."""
    done = ~df["ok"] & ~df["state"].isin(["RUNNING", "WAITING"])
    return df.loc[done, ["number", "state", "status", "reason", "phase", *varying_knobs(df)]]


def summary(df: pd.DataFrame) -> dict[str, Any]:
    """Headline numbers: counts, baseline, winner and its speed-up."""
    w = Winner.from_dict(df.attrs["winner"]) if df.attrs.get("winner") else None
    ran = ~df["status"].isin(NOT_RUN)  # proposals refused or re-queued spent no budget: as the tune counts
    return {"study": df.attrs.get("study"), "storage": df.attrs.get("storage"), "trials": int(ran.sum()),
            "ok": int(df["ok"].sum()), "failed": int(failed(df)["number"].isin(df.loc[ran, "number"]).sum()),
            "not_run": int((~ran).sum()),
            "baseline_qps": df.attrs.get("baseline_qps"),
            "winner_trial": w.trial if w else None, "winner_qps": w.qps if w else None,
            "speedup": w.speedup if w else None,
            "winner_baseline_qps": (w.baseline_qps or df.attrs.get("baseline_qps")) if w else None,
            "confirmed": w is not None and w.confirmed,
            # TorchRec's planner's plan of the baseline (`cubic.tune.summary.reference`), where the tune ran it
            "vs_torchrec_planner": (w.vs_torchrec_planner.to_dict()
                                    if w and w.vs_torchrec_planner else None)}
