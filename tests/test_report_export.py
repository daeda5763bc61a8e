"""`cubic report` and `cubic export` end to end on a real tiny tune, plus their bad-input behaviour."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import statistics
from pathlib import Path

import optuna
import pytest
import yaml

from cubic.deploy import export
from cubic.results import analysis
from cubic_harness.config import SHARDING_TYPES, TrialConfig, TrialResult
from cubic_harness.planning import plan_for
from cubic_harness.workload import Workload
from tests.helpers import fixture_cluster, require
from tests.test_analysis import cubic_cli, tiny_tune


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tune(tmp_path_factory)


@pytest.fixture(scope="module")
def failed_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store in the tuner's schema whose trials all failed (real harness failures: a plan over the
    memory cap is refused before any process starts)."""
    from cubic_harness.trial import run_trial

    run = tmp_path_factory.mktemp("failed_only")
    study = optuna.create_study(study_name="tiny", storage=f"sqlite:///{run / 'study.db'}",
                                direction="maximize")
    dist = {"sharding": optuna.distributions.CategoricalDistribution(list(SHARDING_TYPES))}
    for i, sharding in enumerate(("table_wise", "row_wise")):
        cfg = TrialConfig(workload=Workload.tiny(), kernel="torch", sharding=sharding, mem_cap_mb=0.01)
        res = run_trial(cfg)
        assert res.status == "oom", res
        attrs = {"result": res.to_dict(), "status": res.status, "error": res.error, "qps": 0.0,
                 "phase": "baseline" if i == 0 else "warmup", "searcher": "cubic", "config": cfg.to_dict(),
                 "config_key": cfg.key()}
        study.add_trial(optuna.trial.create_trial(params={"sharding": sharding}, distributions=dist,
                                                  user_attrs=attrs, state=optuna.trial.TrialState.FAIL))
    return run


def one_line_error(r) -> str:
    code = getattr(r, "returncode", getattr(r, "exit_code", None))
    assert code == 2, (code, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------------- report
def test_report_writes_self_contained_html(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r" / "report.html"
    r = cubic_cli("report", str(run_dir), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "speed-up" in r.stdout and "winner: trial #" in r.stdout
    html = out.read_text()
    assert html.count('src="data:image/png;base64,') >= 5
    srcs = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']*)', html, flags=re.I)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs), [s[:40] for s in srcs]
    assert not re.search(r"https?://|file:", html.replace("sqlite:///", ""))
    assert "<script" not in html.lower()
    # the default output lands in the run directory (in-process: the same typer app, no startup cost)
    from typer.testing import CliRunner

    from cubic.cli.app import app

    r = CliRunner().invoke(app, ["report", str(run_dir), "--top", "2"])
    assert r.exit_code == 0, r.stderr
    assert (run_dir / "report.html").exists() and "top 2" in r.stdout


# ---------------------------------------------------------------------------------------------- export
def test_export_yaml_then_cubic_trial_reproduces_the_winner(run_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / "winner.yaml"
    r = cubic_cli("export", str(run_dir), "--format", "yaml", "-o", str(f))
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(f.read_text())
    df = analysis.load_study(run_dir)
    assert cfg == df.attrs["winner"]["config"]
    assert TrialConfig.from_dict(cfg).to_dict() == cfg  # the full config, nothing defaulted
    r = cubic_cli("trial", "--config", str(f), "--json", timeout=300)
    assert r.returncode == 0, f"cubic trial --config failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    res = _last_json(r.stdout)
    assert res["status"] == "ok", res.get("error")
    assert res["config"] == cfg


def _last_json(text: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(next(line for line in reversed(text.splitlines()) if line.startswith("{")))


def test_export_json_has_metrics_spread_speedup_provenance(run_dir: Path) -> None:
    r = cubic_cli("export", str(run_dir), "--format", "json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    win = analysis.load_study(run_dir).attrs["winner"]
    assert d["config"] == win["config"] and d["qps"] == pytest.approx(win["qps"])
    assert d["metrics"]["qps"] > 0 and set(analysis.BREAKDOWN_KEYS) <= set(d["metrics"]["breakdown_ms"])
    # the spread is the min and max of the runs behind the reported qps (the confirm's re-measurements of a
    # confirmed winner, else its measurement windows), and that qps is their median
    confirmed = d["provenance"]["confirmed"]
    runs = d["spread"]["confirm_qps"] if confirmed else d["spread"]["window_qps"]
    assert runs and d["spread"]["qps_min_max"] == pytest.approx([min(runs), max(runs)])
    assert d["qps"] == pytest.approx(statistics.median(runs))
    lo, hi = d["spread"]["qps_min_max"]
    assert lo <= d["qps"] <= hi
    # the speed-up is that qps over the baseline trial's, measured the same way, from the stored numbers
    base = analysis.baseline_rows(analysis.load_study(run_dir)).iloc[0]
    base_qps = base["confirm_qps_median"] if confirmed and not math.isnan(base["confirm_qps_median"]) else base["qps"]
    assert d["baseline_qps"] == pytest.approx(base_qps)
    row = analysis.load_study(run_dir).set_index("number").loc[d["provenance"]["trial"]]
    paired = row["confirm_paired_speedup"] if confirmed else math.nan  # (TrialRecord.confirm_speedup)
    assert d["speedup"] == pytest.approx(d["qps"] / base_qps if math.isnan(paired) else paired)
    prov = d["provenance"]
    assert prov["study"] == "tiny" and prov["trial"] == win["trial"]
    assert prov["versions"]["trial"]["torch"] and prov["versions"]["export"]["cubic"]
    assert prov["machine"]["hostname"] and prov["machine"]["world_size"] == d["config"]["world_size"]


def test_one_speed_up_everywhere_the_winner_is_shown(run_dir: Path) -> None:
    """The banner, the top table (HTML and terminal), the breakdown's label, the frame the notebook reads and
    the export all give the winner the same speed-up: the median ratio of its re-measurements to the baseline's
    run right before each."""
    from cubic.results import plots, report

    df = analysis.load_study(run_dir)
    s = analysis.summary(df)
    assert s["confirmed"] and df.attrs["baseline_remeasured"]  # tiny.yaml confirms: both were re-measured
    base = analysis.baseline_rows(df).iloc[0]
    assert df.attrs["baseline_qps"] == pytest.approx(base["confirm_qps_median"])
    shown = f"{s['speedup']:.2f}x"
    row = df[df["is_winner"]].iloc[0]
    assert row["speedup_remeasured"] and row["speedup"] == pytest.approx(s["speedup"])
    # the median ratio of its re-measurements to the baseline's run just before each, which shares its spell
    assert len(row["confirm_base_qps"]) == len(row["confirm_qps"]) and set(row["confirm_base_qps"]) <= set(
        base["confirm_qps"])
    assert row["speedup"] == pytest.approx(statistics.median(
        q / b for q, b in zip(row["confirm_qps"], row["confirm_base_qps"], strict=True)))
    heads, _, rows = report.top_cells(df, 5, list(report.HEADS))
    cells = dict(rows)[int(row["number"])]
    assert cells[heads.index("speed-up")] == shown and "in-run NE (est.)" in heads
    html = report.render_html(df)
    assert f"<b>{shown}</b> the baseline" in html and f"<td>{shown}</td>" in html
    labels = [t.get_text() for t in plots.breakdown(df).axes[0].get_yticklabels()]
    assert any(lbl.startswith(f"#{int(row['number'])} ") and lbl.endswith(f"x{s['speedup']:.2f}") for lbl in labels)
    r = cubic_cli("export", str(run_dir), "--format", "json")
    assert f"{json.loads(r.stdout)['speedup']:.2f}x" == shown


def test_export_torchrec_from_the_tune(run_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / "tr.json"
    r = cubic_cli("export", str(run_dir), "--format", "torchrec", "-o", str(f))
    assert r.returncode == 0, r.stderr
    d = json.loads(f.read_text())
    winner = analysis.load_study(run_dir).attrs["winner"]
    df = analysis.load_study(run_dir)
    plan = df.loc[df.number == winner["trial"], "plan"].iloc[0] if "plan" in df else None
    _check_torchrec_dict(d, TrialConfig.from_dict(winner["config"]), plan)


def _check_torchrec_dict(d: dict, cfg: TrialConfig, plan: list | None = None) -> None:
    """Structure of the torchrec export against the config it came from (and its plan, if given)."""
    names = [t.name for t in cfg.workload.tables]
    assert [t["name"] for t in d["tables"]] == names
    assert set(d["parameter_constraints"]) == set(names)
    assert d["world_size"] == cfg.world_size and d["sharding_group_size"] == cfg.group_size
    two_d = cfg.group_size < cfg.world_size
    assert d["model_parallel"] == ("DMPCollection" if two_d else "DistributedModelParallel")
    expect = {0: "TrainPipelineBase", 1: "TrainPipelineSparseDist",
              2: "PrefetchTrainPipelineSparseDist" if cfg.device == "cuda" else "TrainPipelineSparseDist"}
    assert d["train_pipeline"]["class"] == expect[cfg.pipeline_depth]
    prec = cfg.comm_precision.upper()
    assert d["qcomms_config"] == {"forward_precision": prec, "backward_precision": prec}
    assert d["ddp"] == {"allreduce_comm_precision": cfg.allreduce_comm_precision}
    for t in d["tables"]:
        assert t["data_type"] == cfg.emb_precision.upper()
    for c in d["parameter_constraints"].values():  # the harness pools in fp32 whatever the dense precision
        assert c["output_dtype"] == "FP32"
    for tp in plan or []:
        c = d["parameter_constraints"][tp["name"]]
        assert c["sharding_types"] == [tp["kind"]]
        uvm = cfg.uvm_cache_load_factor > 0 and tp["kind"] != "data_parallel"
        assert c["compute_kernels"] == ["dense" if tp["kind"] == "data_parallel"
                                        else "fused_uvm_caching" if uvm else "fused"]
        assert c.get("cache_params") == ({"load_factor": cfg.uvm_cache_load_factor} if uvm else None)
    dp = any(tp["kind"] == "data_parallel" for tp in plan or [])
    assert dp == any(n.startswith("data-parallel tables") for n in d["notes"])
    dmp = d["dmp_collection"]
    assert (dmp is not None) == two_d
    if two_d:  # DMPCollection(use_inter_host_allreduce=True) keeps a sharding group's ranks contiguous
        assert dmp["use_inter_host_allreduce"] == (cfg.group_placement == "intra_node")
        assert dmp["sync_interval_batches"] == cfg.sparse_sync_interval
        assert d["train_pipeline"]["dmp_collection_sync_interval_batches"] == cfg.sparse_sync_interval
    scaled = any("momentum-scaled" in n for n in d["notes"])
    assert scaled == (cfg.emb_optimizer == "momentum_scaled_rowwise_adagrad" and two_d
                      and cfg.sparse_sync == "weight_avg")  # the harness scales only under weight averaging


# configs covering every sharding type, a planner, 2D and each pipeline depth / comm precision
TORCHREC_CASES = [
    dict(sharding="table_wise", pipeline_depth=0, comm_precision="fp32"),
    dict(sharding="row_wise", pipeline_depth=1, comm_precision="bf16", emb_precision="fp16"),
    dict(sharding="column_wise", pipeline_depth=2, comm_precision="fp16", allreduce_comm_precision="fp16"),
    dict(sharding="table_row_wise", world_size=4, ranks_per_node=2),
    dict(sharding="data_parallel"),
    dict(sharding="size_lookup_greedy", world_size=4, sharding_group_size=2, sparse_sync="weight_avg"),
    dict(sharding="auto", world_size=4),
    dict(sharding="table_wise", pipeline_depth=2, device="cuda", dense_precision="bf16"),
    dict(sharding="column_wise", device="cuda", kernel="fbgemm", uvm_cache_load_factor=0.25),
    dict(sharding="table_wise", world_size=4, sharding_group_size=2, sparse_sync="grad_allreduce",
         emb_optimizer="momentum_scaled_rowwise_adagrad"),
    dict(sharding="table_wise", world_size=4, sharding_group_size=2, sparse_sync="weight_avg",
         emb_optimizer="momentum_scaled_rowwise_adagrad"),
    dict(sharding="column_wise", world_size=4, sharding_group_size=2, sparse_sync="weight_avg",
         sparse_sync_interval=8, group_placement="cross_node"),
]


def _rec(cfg: TrialConfig) -> dict:
    """A winner record as export.winner_record builds it, with the harness's real plan for cfg."""
    res = TrialResult(qps=1000.0, config=cfg.to_dict(), plan=plan_for(cfg, fixture_cluster()).to_list())
    return {"study": "t", "storage": "sqlite://", "trial": 3, "attrs": {}, "result": res.to_dict(),
            "winner": {"trial": 3, "qps": 1000.0, "speedup": 1.5}, "config": cfg.to_dict(),
            "baseline_qps": 666.0, "baseline_trial": 0, "confirmed": True}


def _id(k: dict) -> str:
    return "-".join(f"{v}" for v in k.values())


@pytest.mark.parametrize("knobs", TORCHREC_CASES, ids=_id)
def test_torchrec_export_matches_the_plan(knobs: dict) -> None:
    cfg = TrialConfig(workload=Workload.tiny(), kernel="torch").replace(**knobs).validate()
    rec = _rec(cfg)
    d = export.to_torchrec_dict(rec)
    json.dumps(d, allow_nan=False)
    _check_torchrec_dict(d, cfg, rec["result"]["plan"])


def test_torchrec_export_keeps_the_models_pooling_and_weighted_features() -> None:
    """An imported model's mean-pooled table is exported as MEAN and its weighted one marked `is_weighted`
    (TorchRec needs both to rebuild the model the plan shards); a plain table stays SUM and unmarked."""
    import dataclasses

    wl = Workload.tiny()
    wl = dataclasses.replace(wl, tables=[dataclasses.replace(wl.tables[0], pooling_type="mean"),
                                         dataclasses.replace(wl.tables[1], weighted=True), *wl.tables[2:]])
    tables = export.to_torchrec_dict(_rec(TrialConfig(workload=wl, kernel="torch").validate()))["tables"]
    assert [(t["pooling"], t.get("is_weighted", False)) for t in tables[:3]] == [
        ("MEAN", False), ("SUM", True), ("SUM", False)]


@pytest.mark.parametrize("knobs", TORCHREC_CASES, ids=_id)
def test_torchrec_export_is_accepted_by_torchrec(knobs: dict) -> None:
    """Feed the export to TorchRec itself: ParameterConstraints, its planner, construct_module_sharding_plan,
    QCommsConfig and the named train pipeline (skipped without torchrec, failed under CI; docs/torchrec.md: its env)."""
    require("torchrec")
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed import train_pipeline
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import CacheParams
    from torchrec.types import DataType

    cfg = TrialConfig(workload=Workload.tiny(), kernel="torch").replace(**knobs).validate()
    d = export.to_torchrec_dict(_rec(cfg))
    ebc = EmbeddingBagCollection(device=torch.device("meta"), tables=[
        EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"],
                           embedding_dim=t["embedding_dim"], feature_names=t["feature_names"],
                           data_type=DataType[t["data_type"]])
        for t in d["tables"]])
    cons = {name: ParameterConstraints(**{**c, "output_dtype": DataType[c["output_dtype"]],
                                          **({"cache_params": CacheParams(**c["cache_params"])}
                                             if "cache_params" in c else {})})  # (as docs/torchrec.md loads it)
            for name, c in d["parameter_constraints"].items()}
    # TorchRec plans row-wise kinds and the UVM cache only for CUDA; the constraint check is the same on either
    needs_cuda = any(c.sharding_types[0] in ("row_wise", "table_row_wise") or c.cache_params for c in cons.values())
    topo = Topology(world_size=d["sharding_group_size"], compute_device="cuda" if needs_cuda else "cpu",
                    local_world_size=min(d["ranks_per_node"], d["sharding_group_size"]))
    planner = EmbeddingShardingPlanner(topology=topo, constraints=cons)
    plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    got = plan.get_plan_for_module("")
    for name, c in cons.items():
        assert got[name].sharding_type == c.sharding_types[0], name
        assert got[name].compute_kernel == c.compute_kernels[0], name
        if c.cache_params:  # the planner keeps the load factor cubic ran for the kernel it sizes the cache by
            assert got[name].cache_params.load_factor == cfg.uvm_cache_load_factor, name

    gens = {}
    for name, p in d["placements"].items():
        kind = p["sharding_type"]
        ck = {"compute_kernel": p["compute_kernel"]} if "compute_kernel" in p else {}
        gens[name] = {"table_wise": lambda p=p, ck=ck: sp.table_wise(rank=p["rank"], **ck),
                      "row_wise": lambda p=p, ck=ck: sp.row_wise(**ck),
                      "column_wise": lambda p=p, ck=ck: sp.column_wise(ranks=p["ranks"],
                                                                       size_per_rank=p["size_per_rank"], **ck),
                      "table_row_wise": lambda p=p: sp.table_row_wise(host_index=p["host_index"]),
                      "data_parallel": lambda p=p: sp.data_parallel()}[kind]()
    exact = sp.construct_module_sharding_plan(
        ebc, gens, local_size=min(d["ranks_per_node"], d["sharding_group_size"]),
        world_size=d["sharding_group_size"], device_type="cuda" if needs_cuda else "cpu")
    for name, p in d["placements"].items():
        ps = exact[name]
        assert ps.sharding_type == p["sharding_type"]
        assert ps.compute_kernel == p.get("compute_kernel", ps.compute_kernel)
        if p["sharding_type"] == "table_wise":
            assert ps.ranks == [p["rank"]]
        if p["sharding_type"] == "column_wise":
            assert ps.ranks == p["ranks"]
            assert [m.shard_sizes[1] for m in ps.sharding_spec.shards] == p["size_per_rank"]

    q = d["qcomms_config"]
    QCommsConfig(forward_precision=CommType[q["forward_precision"]],
                 backward_precision=CommType[q["backward_precision"]])
    ar = d["ddp"]["allreduce_comm_precision"]  # as docs/torchrec.md's loader passes it
    DefaultDataParallelWrapper(allreduce_comm_precision=None if ar == "fp32" else ar)
    assert hasattr(train_pipeline, d["train_pipeline"]["class"])


FAMILY_WORKLOADS = {
    "dot": {"preset": "tiny"},
    "dcn": {"preset": "tiny", "interaction": "dcn", "dcn_layers": 2, "dcn_rank": 12},
    "dcn_full": {"preset": "tiny", "interaction": "dcn", "dcn_layers": 2, "dcn_rank": 0},
    "wukong": {"preset": "tiny", "interaction": "wukong", "wukong_layers": 1, "wukong_rank": 3, "wukong_mlp": [8]},
}


@pytest.mark.parametrize("fam", FAMILY_WORKLOADS)
def test_torchrec_export_names_the_model_of_the_family(fam: str) -> None:
    wl = Workload.from_dict(FAMILY_WORKLOADS[fam])
    d = export.to_torchrec_dict(_rec(TrialConfig(workload=wl, kernel="torch").validate()))
    m = d["model"]
    if fam == "wukong":
        assert m is None and any("no TorchRec model" in n for n in d["notes"])
        assert d["dense"]["wukong_rank"] == 3 and "dcn_rank" not in d["dense"]
        return
    assert m["dense_in_features"] == wl.dense_features and m["over_arch_layer_sizes"] == wl.top_mlp
    if fam == "dot":
        assert m["class"] == "torchrec.models.dlrm.DLRM"
        return
    assert m["class"] == "torchrec.models.dlrm.DLRM_DCN" and m["dcn_num_layers"] == 2
    assert m["dcn_low_rank_dim"] == (12 if fam == "dcn" else wl.num_features * wl.dim)
    assert any("full-rank" in n for n in d["notes"]) == (fam == "dcn_full")


def test_dcn_export_builds_torchrec_dlrm_dcn_with_the_harness_parameters() -> None:
    """TorchRec's own DLRM_DCN from the export: it trains a step, and its dense part has exactly the
    harness's parameter count (the same bottom MLP, cross layers and top MLP)."""
    require("torchrec")
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models import dlrm

    from cubic_harness.dense_cost import dense_cost

    wl = Workload.from_dict(FAMILY_WORKLOADS["dcn"])
    d = export.to_torchrec_dict(_rec(TrialConfig(workload=wl, kernel="torch").validate()))
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=t["name"], num_embeddings=t["num_embeddings"], embedding_dim=t["embedding_dim"],
                           feature_names=t["feature_names"]) for t in d["tables"]])
    m = d["model"]
    model = getattr(dlrm, m["class"].rsplit(".", 1)[1])(ebc, **{k: v for k, v in m.items() if k != "class"})
    emb_params = sum(p.numel() for p in ebc.parameters())
    assert sum(p.numel() for p in model.parameters()) - emb_params == dense_cost(wl).params
    B, keys = 4, [f for t in d["tables"] for f in t["feature_names"]]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.zeros(len(keys) * B, dtype=torch.long),
                                              lengths=torch.ones(len(keys) * B, dtype=torch.long))
    loss = model(torch.rand(B, wl.dense_features), kjt).sum()
    loss.backward()
    assert torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_exit_2_with_one_line(tmp_path: Path, run_dir: Path, failed_only: Path) -> None:
    from typer.testing import CliRunner

    from cubic.cli.app import app

    def cli(*args: str):  # in-process: the same typer app as the `cubic` script, without the startup cost
        return CliRunner().invoke(app, list(args))

    for cmd in (["report"], ["export", "--format", "json"]):
        err = one_line_error(cli(*cmd, str(tmp_path / "missing")))
        assert "no such run directory" in err
        err = one_line_error(cli(*cmd, str(tmp_path)))
        assert "no study" in err
        err = one_line_error(cli(*cmd, str(failed_only)))
        assert "no completed trial" in err
    err = one_line_error(cli("export", str(run_dir), "--format", "xml"))
    assert "'xml'" in err and "yaml" in err and "torchrec" in err
    assert not (tmp_path / "study.db").exists()
    for cmd in (["report", str(run_dir), "-o"], ["export", str(run_dir), "-o"]):  # a directory as output
        assert "cannot write" in one_line_error(cli(*cmd, str(tmp_path)))
    other = tmp_path / "other.db"  # a database that is not a trial store is read, never written
    with sqlite3.connect(other) as con:
        con.execute("create table x (a)")
    assert "not a cubic/Optuna trial store" in one_line_error(cli("report", str(other)))
    with sqlite3.connect(other) as con:
        assert con.execute("select name from sqlite_master").fetchall() == [("x",)]
    # and the real process prints the same single line, no traceback
    err = one_line_error(cubic_cli("export", str(failed_only), "--format", "torchrec"))
    assert "no completed trial" in err
