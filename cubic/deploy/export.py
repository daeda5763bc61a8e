"""`cubic export`: the winning configuration in the form production needs.

- yaml: the full TrialConfig; `cubic trial --config FILE` runs it again as it is.
- json: the config plus metrics, spread, speed-up and provenance (study, trial, versions, machine).
- torchrec: plain JSON a TorchRec job turns into ParameterConstraints / a sharding plan, DMP or
  DMPCollection (2D), a train pipeline and a QCommsConfig (names checked against torchrec 1.8).
Plain data only (yaml.safe_dump / json), so loading an export never executes anything.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from cubic.results import analysis
from cubic.results.plan_why import plan_why
from cubic.study import record
from cubic.study.store import storage_url
from cubic.study.winner import Winner
from cubic_harness.config import TORCHREC_TYPES, TrialConfig, json_safe
from cubic_harness.errors import ConfigError, write_text
from cubic_harness.torchrec_job import placement_of, torchrec_job

FORMATS = ("yaml", "json", "torchrec")
METRICS = ("qps", "qps_cv", "step_ms_p50", "step_ms_p90", "peak_mem_mb", "loss_first", "loss_last", "ne")

# TorchRec names (torchrec 1.8): the train pipeline that keeps `pipeline_depth` batches' input
# distribution in flight; TrainPipelineBase only overlaps the host-to-device copy.
TRAIN_PIPELINES = {0: "TrainPipelineBase", 1: "TrainPipelineSparseDist", 2: "PrefetchTrainPipelineSparseDist"}
EMB_OPTIMIZERS = {"rowwise_adagrad": "torchrec.optim.RowWiseAdagrad",
                  "momentum_scaled_rowwise_adagrad": "torchrec.optim.RowWiseAdagrad",
                  "sgd": "torch.optim.SGD"}


def winner_record(run_dir_or_storage_url: str | Path, study: str | None = None) -> dict[str, Any]:
    """Everything an export needs about the winner: its trial's attrs, the winner summary and the study."""
    st, storage = analysis.open_store(run_dir_or_storage_url, study)
    recs = record.load(storage.engine, st.study_name, st.get_trials(deepcopy=False))
    df = analysis.study_frame(st, storage, analysis.safe_url(storage_url(run_dir_or_storage_url)), records=recs)
    analysis.require_completed(df, str(run_dir_or_storage_url))
    stored = df.attrs["winner"]
    win = Winner.from_dict(stored)
    rec = next(r for r in recs if r.number == win.trial)
    trial = rec.trial
    ua = dict(trial.user_attrs) | rec.findings()
    result = dict(ua.get("result") or {})
    cfg = win.config or ua.get("config") or result.get("config")
    if not cfg:
        raise ConfigError(f"{analysis.safe_url(str(run_dir_or_storage_url))}: winning trial #{trial.number} has no "
                          "config recorded")
    where = f"{df.attrs['study']} trial #{trial.number}"
    cfg = TrialConfig.from_dict(cfg, where=where).validate(where).to_dict()
    base_trial = int(analysis.baseline_rows(df)["number"].iloc[0]) if len(df) else None
    base = next((r for r in recs if r.number == base_trial), None)
    base_plan = ((dict(base.trial.user_attrs) | base.findings()).get("result") or {}).get("plan") if base else None
    return {"study": df.attrs["study"], "storage": df.attrs["storage"], "trial": trial.number, "attrs": ua,
            "result": result, "winner": stored, "config": cfg, "baseline_qps": df.attrs.get("baseline_qps"),
            "baseline_trial": base_trial, "baseline_plan": base_plan or [],
            "confirmed": win.confirmed, "frame": df}


def plan_changes(rec: dict[str, Any]) -> list[dict[str, str]]:
    """The tables the winner lays out differently from the baseline (kind, shards, ranks), table by table."""
    from cubic_harness.sharding.plan import ShardingPlan, plan_diff

    win, base = rec["result"].get("plan") or [], rec.get("baseline_plan") or []
    if not win or len(win) != len(base):
        return []
    dims = [t["dim"] for t in rec["config"]["workload"]["tables"]]
    g = rec["config"].get("sharding_group_size") or rec["config"]["world_size"]
    plans = [ShardingPlan.from_list(p, g, rec["config"]["world_size"], dims) for p in (base, win)]
    return [{"table": c.table, "baseline": c.before, "winner": c.after} for c in plan_diff(*plans)]


# ---------------------------------------------------------------------------------------------- yaml
def to_yaml(rec: dict[str, Any]) -> str:
    """The full TrialConfig as YAML, with a comment header saying where it came from."""
    w = Winner.from_dict(rec["winner"])
    sp, ref = w.speedup, w.vs_torchrec_planner
    head = [f"# cubic export: study {rec['study']!r}, trial #{rec['trial']}"
            f" ({'confirmed winner' if rec['confirmed'] else 'best measured trial, not confirmed'})",
            f"# qps {w.qps if w.qps is not None else float('nan'):.1f}"
            + (f", {sp:.3f}x the baseline" if sp and sp == sp else "")
            + (f", {ref.speedup:.3f}x TorchRec's planner's plan of it (trial #{ref.trial})"
               if ref and ref.speedup else ""),
            "# run it again: cubic trial --config THIS_FILE"]
    return "\n".join(head) + "\n" + yaml.safe_dump(rec["config"], sort_keys=False, default_flow_style=None)


# ---------------------------------------------------------------------------------------------- json
def _versions(env: dict[str, Any]) -> dict[str, Any]:
    from importlib import metadata

    def ver(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"trial": {k: env.get(k) for k in ("torch", "fbgemm") if k in env},
            "export": {"cubic": ver("cubic"), "optuna": ver("optuna"), "python": platform.python_version()}}


def to_json_dict(rec: dict[str, Any]) -> dict[str, Any]:
    """Config + metrics + spread + speed-up + provenance: enough to trust and to reproduce the number."""
    res, ua, w = rec["result"], rec["attrs"], Winner.from_dict(rec["winner"])
    window = [float(x) for x in res.get("window_qps") or []]
    confirm = [float(x) for x in ua.get("confirm_qps") or []]
    spread = w.qps_spread or ([min(confirm), max(confirm)] if confirm else
                              [min(window), max(window)] if window else None)
    env = res.get("env") or {}
    out = {
        "format": "cubic-winner/1",
        "config": rec["config"],
        "metrics": {**{m: res.get(m, ua.get(m)) for m in METRICS},
                    "breakdown_ms": res.get("breakdown_ms") or {}},
        "qps": w.qps,
        "spread": {"qps_min_max": spread, "window_qps": window, "confirm_qps": confirm},
        "speedup": w.speedup,
        "baseline_qps": w.baseline_qps if w.baseline_qps is not None else rec["baseline_qps"],
        # TorchRec's planner's plan of the baseline, where the tune ran it
        "vs_torchrec_planner": w.vs_torchrec_planner.to_dict() if w.vs_torchrec_planner else None,
        "quality": {k: ua.get(k) for k in ("quality_ok", "quality_reason", "confirm_ne", "quality_eval_ne",
                                           "quality_eval_auc", "quality_eval_diff", "quality_se", "quality_noise",
                                           "quality_resolved", "quality_ci", "quality_verdict")},
        "sharding_plan": res.get("plan") or [],
        "plan_changes": plan_changes(rec),  # what the winner's plan changes from the baseline's, per table
        # the baseline's and the winner's modelled step by phase and rank, and the critical rank of each
        "plan_why": ({k: v for k, v in why.items() if k != "changed"} if (why := plan_why(rec["frame"]))
                     else None),
        "provenance": {
            "study": rec["study"], "storage": analysis.safe_url(rec["storage"]), "trial": rec["trial"],
            # "sim": a prediction (env.cluster says for which cluster), not a measurement
            "backend": env.get("backend", "real"),
            "baseline_trial": rec["baseline_trial"], "confirmed": rec["confirmed"],
            "phase": ua.get("phase"), "searcher": ua.get("searcher"), "config_key": ua.get("config_key"),
            "versions": _versions(env), "machine": env,
            "exported_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "exported_on": platform.node(),
        },
    }
    return json_safe(out)


# ---------------------------------------------------------------------------------------------- torchrec
def train_pipeline_for(depth: int, device: str) -> str:
    """TorchRec's pipeline for cubic's pipeline_depth. PrefetchTrainPipelineSparseDist's prefetch stage runs
    on CUDA streams only (on CPU its forward asserts, checked with torchrec 1.8), so depth 2 on CPU maps to
    TrainPipelineSparseDist, the deepest synchronous pipeline that runs there."""
    if depth == 2 and device != "cuda":
        return TRAIN_PIPELINES[1]
    return TRAIN_PIPELINES[depth]


def _plan_by_name(rec: dict[str, Any], wl: Any) -> dict[str, dict[str, Any]]:
    """The winner's recorded plan keyed by table name (the harness names tables by "name" and
    indexes them by "table")."""
    plan = {}
    for p in rec["result"].get("plan") or []:
        t = p.get("table")
        plan[p.get("name") or (t if isinstance(t, str) else wl.tables[t].name)] = p
    return plan


def _table(i: int, t: Any, wl: Any, dtype: str) -> dict[str, Any]:
    """One `EmbeddingBagConfig`'s fields; an imported model keeps its own feature names, and each
    feature's pooling factor is its mean bag."""
    features = t.features or [f"f{i}"]
    return {"name": t.name, "num_embeddings": t.rows, "embedding_dim": t.dim,
            "feature_names": features, "pooling": t.pooling_type.upper(), "data_type": dtype,
            "mean_pooling_factor": (t.pooling if not wl.profiled
                                    else round(t.lookups(wl.profiled) / len(features), 4)),
            "id_distribution": t.id_dist if not wl.profiled else wl.id_source,
            **({"is_weighted": True} if t.weighted else {})}  # its collection's, in TorchRec


def _constraint(t: Any, wl: Any, cfg: TrialConfig,
                tp: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A table's `ParameterConstraints` and its exact placement (None: no recorded plan).

    cubic's kernels pool in fp32 whatever the dense precision (bf16 autocast lives inside the MLPs,
    and the all-to-all carries comm_precision: qcomms_config), so the output dtype is FP32; BF16
    would halve traffic unmeasured. TorchRec 1.8 trains model-parallel tables only with FBGEMM's
    fused TBE (behind a UVM cache its fused_uvm_caching kernel, with the load factor cubic ran) and
    data-parallel ones dense."""
    n_features = len(t.features) or 1
    per_feature = t.lookups(wl.profiled) / n_features
    c: dict[str, Any] = {"pooling_factors": [float(max(per_feature, 1))] * n_features,
                         "output_dtype": "FP32"}
    if tp is None:
        return c, None
    kind = tp["kind"]
    uvm = cfg.uvm_cache_load_factor > 0 and kind != "data_parallel"
    c["sharding_types"] = [kind]
    c["compute_kernels"] = ["dense" if kind == "data_parallel" else
                            "fused_uvm_caching" if uvm else "fused"]
    if uvm:
        c["cache_params"] = {"load_factor": cfg.uvm_cache_load_factor}  # torchrec's CacheParams
    pl = placement_of(tp, kind, cfg.group_size, cfg.ranks_per_node)
    if uvm:  # sharding_plan's generators take it (the load factor: the constraint's cache_params)
        pl["compute_kernel"] = "fused_uvm_caching"
    if kind == "column_wise" and pl.get("size_per_rank"):
        c["min_partition"] = min(pl["size_per_rank"])
    return c, pl


def _overlap_note(cfg: TrialConfig) -> str:
    backward = (" and its gradients' beside the bottom's backward"
                if cfg.comm_overlap == "forward_backward" else "")
    return (f"comm_overlap={cfg.comm_overlap}: cubic ran the pooled all-to-all beside the bottom "
            f"MLP{backward}; TorchRec's sharded modules return that all-to-all as a LazyAwaitable, "
            "waited on where the embeddings are first used, so the forward overlap needs the model "
            "to compute its dense part before it reads them; TorchRec has no setting for the "
            "backward's")


def _pipeline_note(cfg: TrialConfig) -> str:
    why = (" that runs on CPU (PrefetchTrainPipelineSparseDist needs CUDA)"
           if cfg.device != "cuda" else "")
    return ("pipeline_depth=2 keeps two batches' input distribution in flight; TorchRec has no "
            f"exact equivalent: {train_pipeline_for(2, cfg.device)} is the nearest{why}")


def _two_d_weight_avg(cfg: TrialConfig) -> bool:
    return cfg.replicas > 1 and cfg.sparse_sync == "weight_avg"


#: What a TorchRec job runs differently from what cubic measured: (when, the note), in the order
#: the export lists them.
DIFFERENCES: tuple[tuple[Callable[[TrialConfig], bool], Callable[[TrialConfig], str]], ...] = (
    (lambda cfg: cfg.replicas > 1 and cfg.sparse_sync != "weight_avg",
     lambda cfg: "DMPCollection syncs replicas by weight averaging; cubic measured sparse_sync="
                 f"{cfg.sparse_sync} (gradient all-reduce), which TorchRec does not offer for 2D"),
    (lambda cfg: cfg.pipeline_depth == 2, _pipeline_note),
    (lambda cfg: cfg.comm_overlap != "none", _overlap_note),
    (lambda cfg: cfg.kernel != "fbgemm",
     lambda cfg: f"cubic measured kernel={cfg.kernel}; a stock EmbeddingBagCollectionSharder runs "
                 "FBGEMM's fused TBE; on CPU, sharders=[cubic_harness.torchrec_kernel."
                 f"cubic_sharder({cfg.kernel!r})] runs cubic's kernel inside TorchRec's sharded "
                 "tables (one replica)"),
    (lambda cfg: (cfg.emb_optimizer == "momentum_scaled_rowwise_adagrad"
                  and _two_d_weight_avg(cfg)),
     lambda cfg: "momentum-scaled row-wise AdaGrad: DMPCollection.sync() averages replica weights "
                 "and state (plain row-wise AdaGrad's rule); cubic merged the replicas' summed step "
                 "instead (harness/sharding/replica_sync.py), which needs DMPCollection's "
                 "custom_all_reduce to reproduce"),
)


def _placement_notes(cfg: TrialConfig, placements: dict[str, dict[str, Any]]) -> list[str]:
    notes = []
    dp = [name for name, p in placements.items() if p["sharding_type"] == "data_parallel"]
    if dp:
        notes.append(f"data-parallel tables ({', '.join(dp)}): cubic synced them by all-gathering "
                     "ids and pooled gradients into one fused row-wise update; TorchRec's 'dense' "
                     "kernel all-reduces each whole table's gradient and uses the dense optimizer: "
                     "slower for big tables and other optimizer numerics, so measure before keeping "
                     "them data-parallel")
    if cfg.device == "cpu" and any(p["sharding_type"] in ("row_wise", "table_row_wise")
                                   for p in placements.values()):
        notes.append("TorchRec runs row_wise / table_row_wise only on CUDA; cubic's harness ran "
                     "them on CPU")
    return notes


def _training(cfg: TrialConfig, wl: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The export's keys that say how the job trains: pipeline, comms, optimizers, dense part."""
    two_d = cfg.replicas > 1
    sync = {"dmp_collection_sync_interval_batches": cfg.sparse_sync_interval} if two_d else {}
    return {
        "train_pipeline": {"class": train_pipeline_for(cfg.pipeline_depth, cfg.device),
                           "module": "torchrec.distributed.train_pipeline",
                           "pipeline_depth": cfg.pipeline_depth, **sync},
        "qcomms_config": {"forward_precision": TORCHREC_TYPES[cfg.comm_precision],  # CommType
                          "backward_precision": TORCHREC_TYPES[cfg.comm_precision]},
        # DistributedModelParallel(data_parallel_wrapper=DefaultDataParallelWrapper(
        #     allreduce_comm_precision=...))
        "ddp": job["ddp"],
        "embedding_optimizer": {"class": EMB_OPTIMIZERS[cfg.emb_optimizer], "lr": cfg.emb_lr,
                                "name": cfg.emb_optimizer},
        "dense": {"optimizer": "torch.optim.Adagrad", "lr": cfg.dense_lr,
                  "precision": cfg.dense_precision, "dense_features": wl.dense_features,
                  "bottom_mlp": wl.bottom_mlp, "top_mlp": wl.top_mlp,
                  "interaction": wl.interaction,
                  **{k: getattr(wl, k) for k in wl.interaction_keys()}},
    }


def to_torchrec_dict(rec: dict[str, Any]) -> dict[str, Any]:
    """What a TorchRec training job needs from the winner, as plain JSON (see docs/torchrec.md for
    the loader)."""
    cfg = TrialConfig.from_dict(rec["config"])
    wl = cfg.workload
    plan = _plan_by_name(rec, wl)
    notes: list[str] = []
    if not plan:
        notes.append("the winning trial recorded no sharding plan: sharding_types left to "
                     "TorchRec's planner")
    dtype = TORCHREC_TYPES[cfg.emb_precision]
    tables = [_table(i, t, wl, dtype) for i, t in enumerate(wl.tables)]
    constraints, placements = {}, {}
    for t in wl.tables:
        constraints[t.name], pl = _constraint(t, wl, cfg, plan.get(t.name))
        if pl is not None:
            placements[t.name] = pl
    notes += [note(cfg) for applies, note in DIFFERENCES if applies(cfg)]
    notes += _placement_notes(cfg, placements)
    job = torchrec_job(cfg, list(plan.values()), notes)
    w = Winner.from_dict(rec["winner"])
    out = {
        "format": "cubic-torchrec/1",
        "source": {"study": rec["study"], "trial": rec["trial"], "qps": w.qps,
                   "speedup": w.speedup, "confirmed": rec["confirmed"]},
        "world_size": cfg.world_size,
        "sharding_group_size": cfg.group_size,
        "replicas": cfg.replicas,
        "model_parallel": "DMPCollection" if cfg.replicas > 1 else "DistributedModelParallel",
        "sparse_sync": cfg.sparse_sync,
        # DMPCollection(use_inter_host_allreduce=True) keeps a sharding group's ranks contiguous
        "dmp_collection": job["dmp_collection"],
        "ranks_per_node": cfg.ranks_per_node,
        "batch_size_per_rank": cfg.batch_size,
        "device": cfg.device,
        "tables": tables,
        "parameter_constraints": constraints,
        "placements": placements,
        **_training(cfg, wl, job),
        "model": job["model"],
        "factory": job["factory"],  # the user's own model (MODULE:FACTORY), built instead of "model"
        "notes": notes,
    }
    return json_safe(out)


# ---------------------------------------------------------------------------------------------- entry
def export_text(run_dir_or_storage_url: str | Path, fmt: str, study: str | None = None) -> str:
    """The export as text; ConfigError (one line) on an unknown format, no study or no completed trial."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not supported; choose one of {list(FORMATS)}")
    rec = winner_record(run_dir_or_storage_url, study)
    if fmt == "yaml":
        return to_yaml(rec)
    data = to_json_dict(rec) if fmt == "json" else to_torchrec_dict(rec)
    return json.dumps(data, indent=2, allow_nan=False) + "\n"


def write_export(run_dir_or_storage_url: str | Path, fmt: str, out: str | Path | None,
                 study: str | None = None) -> str:
    """Write to `out` (or stdout when None); returns the text."""
    text = export_text(run_dir_or_storage_url, fmt, study)
    if out is None:
        sys.stdout.write(text)
    else:
        write_text(Path(out), text, "export")
    return text
