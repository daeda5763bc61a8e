"""`cubic verify`: the study's baseline and winner trained in TorchRec itself, beside cubic's harness; and the
`target: torchrec` search spaces that only hold what TorchRec runs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from cubic.deploy import export
from cubic.results import analysis
from cubic.space.search_space import load_space
from cubic_harness.config import TrialConfig, TrialResult
from cubic_harness.errors import ConfigError
from cubic_harness.planning import plan_for
from cubic_harness.workload import Workload
from tests.helpers import fixture_cluster, require
from tests.test_analysis import ROOT, cubic_cli, tiny_tune

require("torchrec")

from cubic_harness.torchrec_trial import UnsupportedConfig, plan_for_torchrec, run_torchrec_trial  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tune(tmp_path_factory)


def _export(cfg: TrialConfig) -> dict:
    res = TrialResult(qps=1.0, config=cfg.to_dict(), plan=plan_for(cfg, fixture_cluster()).to_list())
    return export.to_torchrec_dict({"study": "t", "storage": "", "trial": 0, "attrs": {}, "result": res.to_dict(),
                                    "winner": {}, "config": cfg.to_dict(), "confirmed": True})


def _cfg(**kw) -> TrialConfig:
    return TrialConfig(workload=Workload.tiny(), kernel="fbgemm", batch_size=64, warmup_steps=1, measure_steps=4,
                       windows=2, timeout_s=120).replace(**kw).validate()


def test_substitutions_name_what_torchrec_runs_differently() -> None:
    assert plan_for_torchrec(_cfg(), _export(_cfg()))[1] == []  # table-wise fbgemm fp32: runs as measured
    fp16, bf16 = _cfg(allreduce_comm_precision="fp16"), _cfg(allreduce_comm_precision="bf16")
    assert plan_for_torchrec(fp16, _export(fp16))[1] == []
    subs = plan_for_torchrec(bf16, _export(bf16))[1]  # torch's bf16 hook needs NCCL: fp32 ran on gloo
    assert [s.split(":")[0] for s in subs] == ["allreduce_comm_precision=bf16"]
    placements, subs = plan_for_torchrec(dp := _cfg(sharding="data_parallel"), _export(dp))
    assert any(s.startswith("data-parallel tables") for s in subs)
    placements, subs = plan_for_torchrec(rw := _cfg(sharding="row_wise", kernel="native", comm_precision="bf16",
                                                    pipeline_depth=1), _export(rw))
    assert {p["sharding_type"] for p in placements.values()} == {"table_wise"}
    # QComms run on gloo, TrainPipelineSparseDist on CPU: only the row-wise kind is substituted
    assert [s.split(":")[0].split(" ")[0] for s in subs] == ["row-wise"]
    deep = _cfg(pipeline_depth=2)  # PrefetchTrainPipelineSparseDist needs CUDA streams
    assert [s.split(":")[0] for s in plan_for_torchrec(deep, _export(deep))[1]] == ["pipeline_depth=2"]
    # cubic's native kernel runs inside TorchRec's sharded tables (harness/torchrec_kernel.py), 2D included (the
    # trial's DMPCollection merges its replicas)
    k2d = _cfg(world_size=4, sharding_group_size=2, sparse_sync="weight_avg", kernel="native")
    assert plan_for_torchrec(k2d, _export(k2d))[1] == []
    two_d = _cfg(world_size=4, sharding_group_size=2, sparse_sync="grad_allreduce",
                 emb_optimizer="momentum_scaled_rowwise_adagrad")
    assert [s.split(":")[0] for s in plan_for_torchrec(two_d, _export(two_d))[1]] == [
        "sparse_sync=grad_allreduce", "emb_optimizer=momentum_scaled_rowwise_adagrad"]
    one_d = _cfg(emb_optimizer="momentum_scaled_rowwise_adagrad")  # one replica: plain row-wise AdaGrad
    assert plan_for_torchrec(one_d, _export(one_d))[1] == []
    wukong = _cfg(workload=Workload.from_dict({"preset": "tiny", "interaction": "wukong", "wukong_rank": 3}))
    with pytest.raises(UnsupportedConfig, match="no TorchRec model"):
        plan_for_torchrec(wukong, _export(wukong))


def test_a_loaded_export_trains_in_torchrec_with_the_placements_cubic_measured() -> None:
    """DistributedModelParallel built from the export trains steps on 2 gloo ranks, and the plan TorchRec
    applied holds every table where cubic's harness held it (table-wise ranks, column-wise shard widths),
    with the dense all-reduce precision cubic measured."""
    for cfg in (_cfg(), _cfg(sharding="column_wise", allreduce_comm_precision="fp16")):
        exp = _export(cfg)
        r = run_torchrec_trial(cfg, exp)
        assert r["status"] == "ok", r["error"]
        assert r["qps"] > 0 and len(r["window_qps"]) == 2
        # the dense gradients' all-reduce precision reached DDP (TorchRec's DefaultDataParallelWrapper)
        assert r["ddp_hooks"] == ([] if cfg.allreduce_comm_precision == "fp32" else ["fp16_compress_hook"])
        for name, p in exp["placements"].items():
            got = r["placements"][name]
            assert got["sharding_type"] == p["sharding_type"]
            if p["sharding_type"] == "table_wise":
                assert got["ranks"] == [p["rank"]]
            else:
                assert got["ranks"] == p["ranks"] and got["widths"] == p["size_per_rank"]


def test_a_2d_export_trains_in_torchrecs_dmpcollection_and_its_replicas_merge() -> None:
    """A 2D winner (2 sharding groups of 2, strided across the ranks, merging every 2 steps) runs in TorchRec's
    own DMPCollection on gloo: each group holds the placements cubic measured, sync() runs every 2 steps and
    after the last, and afterwards the two replicas of each shard hold the same weights."""
    cfg = _cfg(world_size=4, sharding_group_size=2, sparse_sync="weight_avg", sparse_sync_interval=2,
               sharding="column_wise", group_placement="cross_node")
    exp = _export(cfg)
    assert exp["dmp_collection"]["use_inter_host_allreduce"] is False
    r = run_torchrec_trial(cfg, exp)
    assert r["status"] == "ok", r["error"]
    assert r["model_parallel"] == "CpuDMPCollection" and r["substitutions"] == []
    assert r["sharding_group"] == [0, 2]  # cubic's cross_node group 0 (cubic_harness.sharding.comm.group_ranks)
    assert r["syncs"] == 3  # 5 steps: after steps 2, 4 and the last
    for name, p in exp["placements"].items():
        assert r["placements"][name] == {"sharding_type": "column_wise", "ranks": p["ranks"],
                                         "widths": p["size_per_rank"]}
    c = r["checksums"]  # replicas of position 0 are ranks 0 and 1, of position 1 ranks 2 and 3
    assert c[0] > 0 and c[0] == pytest.approx(c[1], rel=1e-6) and c[2] == pytest.approx(c[3], rel=1e-6)
    assert c[0] != pytest.approx(c[2], rel=1e-6)  # different shards (of similar size: their sums are close)


def test_torchrec_ranks_start_in_the_harness_rank_environment() -> None:
    """Oversubscribed ranks (2 x 2 threads on 2 cores) wait passively in both frameworks: without it TorchRec's
    OpenMP workers spin on each other's cores and the verify compared a 4x-slowed TorchRec with cubic."""
    import os

    from cubic_harness.trial import rank_env

    cfg = _cfg(threads_per_rank=2)
    r = run_torchrec_trial(cfg, _export(cfg))
    assert r["status"] == "ok", r["error"]
    assert r["omp_wait_policy"] == rank_env(cfg).get("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "default"))


def test_cubic_verify_prints_both_speedups_and_the_substitutions(run_dir: Path, capsys) -> None:
    r = cubic_cli("verify", str(run_dir), "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [c["label"] for c in out["configs"]] == ["baseline", "winner"]
    base, win = out["configs"]
    df = analysis.load_study(run_dir)
    assert base["trial"] == analysis.baseline_rows(df)["number"].iloc[0]
    assert win["trial"] == out["trial"] == df.attrs["winner"]["trial"]
    for c in (base, win):  # --repeats 1: one run of each in each framework, its qps the one reported
        assert c["errors"] == [] and len(c["qps_cubic_runs"]) == 1 and len(c["qps_torchrec_runs"]) == 1
        assert c["qps_cubic"] == c["qps_cubic_runs"][0] > 0 and c["qps_torchrec"] == c["qps_torchrec_runs"][0] > 0
    # each speed-up is the winner's qps over the baseline's, in the same framework
    assert win["speedup_cubic"] == pytest.approx(win["qps_cubic"] / base["qps_cubic"], rel=1e-12)
    assert win["speedup_torchrec"] == pytest.approx(win["qps_torchrec"] / base["qps_torchrec"], rel=1e-12)
    assert (out["speedup_cubic"], out["speedup_torchrec"]) == (win["speedup_cubic"], win["speedup_torchrec"])
    assert base["speedup_cubic"] == base["speedup_torchrec"] == 1.0
    # search_spaces/tiny.yaml measures kernel=torch: TorchRec runs it too, through cubic's sharder
    assert not any(s.startswith("kernel=") for s in out["substitutions"])
    from cubic.cli.verify import _print

    _print(out, fidelity=False)  # the human table, from the same result
    shown = " ".join(capsys.readouterr().out.split())
    assert "TorchRec" in shown
    assert f"{win['speedup_cubic']:.2f}x" in shown and f"{win['speedup_torchrec']:.2f}x" in shown


@pytest.mark.slow  # a second tune: ~45 s (`make test-slow`); the substitution itself is tested above
def test_a_data_parallel_winner_is_named_and_fidelity_is_a_number(tmp_path: Path, run_dir: Path) -> None:
    space = (ROOT / "search_spaces" / "tiny.yaml").read_text()
    space = space.replace("sharding: table_wise", "sharding: data_parallel").replace(
        "  sharding: [table_wise, row_wise, column_wise, data_parallel]\n", "")
    (tmp_path / "dp.yaml").write_text(space)
    t = cubic_cli("tune", "--space", str(tmp_path / "dp.yaml"), "--run-dir", str(tmp_path / "run"), "--trials", "2")
    assert t.returncode == 0, t.stderr[-2000:]
    r = cubic_cli("verify", str(tmp_path / "run"), "--repeats", "1", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert any(s.startswith("data-parallel tables: TorchRec all-reduces") for s in out["substitutions"])
    f = cubic_cli("verify", str(run_dir), "--fidelity", "3", "--json")
    assert f.returncode == 0, f.stderr[-2000:]
    fid = json.loads(f.stdout.strip().splitlines()[-1])
    rows = fid["rows"]
    assert fid["configs"] == len(rows) == 3 and fid["skipped"] == []
    # cubic's side is the study's stored qps of each trial; the tau is the rank correlation of the two columns
    df = analysis.load_study(run_dir)
    ok = df[df["ok"]].drop_duplicates("config_key")
    for row in rows:
        assert row["qps_cubic"] == pytest.approx(ok.loc[ok["number"] == row["trial"], "qps"].iloc[0])
        assert row["qps_torchrec"] > 0
    assert {rows[0]["qps_cubic"], rows[-1]["qps_cubic"]} == {ok["qps"].min(), ok["qps"].max()}  # the study's range
    cubic, torchrec = [x["qps_cubic"] for x in rows], [x["qps_torchrec"] for x in rows]
    concordant = sum((cubic[i] - cubic[j]) * (torchrec[i] - torchrec[j]) > 0 for i in range(3) for j in range(i))
    assert fid["kendall_tau"] == pytest.approx((2 * concordant - 3) / 3)  # 3 pairs, no ties: (C - D) / 3
    assert fid["median_qps_ratio_cubic_over_torchrec"] == pytest.approx(
        statistics.median(c / t for c, t in zip(cubic, torchrec, strict=True)))


def test_verify_refuses_a_study_with_nothing_to_verify(tmp_path: Path) -> None:
    r = cubic_cli("verify", str(tmp_path / "nowhere"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.stderr


# ---------------------------------------------------------------------------------------------- target: torchrec
def test_target_torchrec_keeps_only_what_torchrec_runs(tmp_path: Path) -> None:
    text = (ROOT / "search_spaces" / "dlrm_cpu.yaml").read_text()
    text = text.replace("name: dlrm_cpu", "name: t\ntarget: torchrec")
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"baseline.sparse_sync: baseline value 'grad_allreduce' is outside"):
        load_space(tmp_path / "t.yaml")  # TorchRec's 2D merges by averaging only: the baseline must say so
    text = text.replace("sparse_sync: grad_allreduce", "sparse_sync: weight_avg", 1)
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(ConfigError,
                       match=r"quality.layout.comm_overlap: target torchrec: 'forward_backward'"):
        load_space(tmp_path / "t.yaml")  # TorchRec waits on the all-to-all where the model reads it
    text = text.replace(" comm_overlap: forward_backward,", "", 1)
    (tmp_path / "t.yaml").write_text(text)
    s = load_space(tmp_path / "t.yaml")
    assert s.knobs["kernel"].choices == ("fbgemm", "native", "torch")  # cubic's own through its sharder
    assert set(s.knobs["sharding"].choices) == {"table_wise", "column_wise", "size_greedy", "lookup_greedy",
                                                "size_lookup_greedy", "plan", "torchrec_planner"}
    assert s.knobs["comm_precision"].choices == ("fp32", "bf16", "fp16") and s.knobs["pipeline_depth"].choices == (0, 1)
    assert s.knobs["sharding_group_size"].choices == (0, 1)  # 2D runs as DMPCollection, merging by averaging
    assert s.knobs["sparse_sync"].choices == ("weight_avg",) and s.target_dropped["sparse_sync"] == ["grad_allreduce"]
    bad = (ROOT / "search_spaces" / "tiny.yaml").read_text().replace("name: tiny", "name: t\ntarget: torchrec")
    (tmp_path / "bad.yaml").write_text(bad.replace("emb_precision: fp32", "emb_precision: bf16", 1))
    with pytest.raises(ConfigError, match=r"baseline.emb_precision: target torchrec: emb_precision='bf16' cannot"):
        load_space(tmp_path / "bad.yaml")
    (tmp_path / "x.yaml").write_text(bad.replace("target: torchrec", "target: tpu"))
    with pytest.raises(ConfigError, match=r"target: 'tpu' is not allowed; choose one of \['harness', 'torchrec'\]"):
        load_space(tmp_path / "x.yaml")
