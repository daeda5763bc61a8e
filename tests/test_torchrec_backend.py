"""The TorchRec trial backend (`--backend torchrec`): the user's own TorchRec model tuned in TorchRec itself, its
winner exported with the model's factory, bad input refused in one line, a trial that crashes inside TorchRec
recorded with its reason while the tune goes on."""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cubic_harness.data import Batch
from tests.helpers import fixture_cluster_as_local, require

CUBIC = [sys.executable, "-m", "cubic"]

# A model that is not cubic's: an EBC inside a module of its own, one table looked up by two features, and a dense
# part of its own. `picky` crashes inside TorchRec's forward on batches over 256 samples (a user's bug);
# `sequence` holds an EmbeddingCollection, which the backend does not shard; `scored` has a weighted collection
# (an id-score list feature) beside an unweighted one, both fed from one KeyedJaggedTensor, and `scored_plain` is
# the same model with that collection unweighted.
MODELS = textwrap.dedent('''
    import torch
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.modules.embedding_configs import PoolingType

    class Ranker(nn.Module):
        def __init__(self, limit=0):
            super().__init__()
            self.limit = limit
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="users", num_embeddings=4000, embedding_dim=16,
                                   feature_names=["user_id", "friend_id"], pooling=PoolingType.MEAN),
                EmbeddingBagConfig(name="goods", num_embeddings=3000, embedding_dim=16, feature_names=["item_id"])])
            self.tower = nn.Sequential(nn.Linear(5, 16), nn.ReLU())
            self.head = nn.Sequential(nn.Linear(16 * 4, 32), nn.ReLU(), nn.Linear(32, 1))

        def forward(self, dense, kjt):
            if self.limit and dense.shape[0] > self.limit:
                raise RuntimeError(f"ranker head sized for {self.limit} samples, got {dense.shape[0]}")
            pooled = self.ebc(kjt).to_dict()
            x = torch.cat([self.tower(dense)] + [pooled[k] for k in ("user_id", "friend_id", "item_id")], dim=1)
            return self.head(x)

    def ranker():
        return Ranker()

    def picky():
        return Ranker(limit=256)

    def broken():
        raise RuntimeError("no GPU config found")

    class Sessions(nn.Module):
        def __init__(self):
            super().__init__()
            self.ec = EmbeddingCollection(tables=[EmbeddingConfig(name="clicks", num_embeddings=100,
                                                                  embedding_dim=8, feature_names=["click"])])
            self.head = nn.Linear(3, 1)

        def forward(self, dense, kjt):
            return self.head(dense)

    def sequence():
        return Sessions()

    class Scored(nn.Module):
        def __init__(self, weighted):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="goods", num_embeddings=3000, embedding_dim=16, feature_names=["item_id"])])
            self.wbc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="topics", num_embeddings=2000, embedding_dim=16,
                                   feature_names=["topic_score"])], is_weighted=weighted)
            self.tower = nn.Sequential(nn.Linear(5, 16), nn.ReLU())
            self.head = nn.Sequential(nn.Linear(16 * 3, 32), nn.ReLU(), nn.Linear(32, 1))

        def forward(self, dense, kjt):
            a, b = self.ebc(kjt).to_dict(), self.wbc(kjt).to_dict()
            return self.head(torch.cat([self.tower(dense), a["item_id"], b["topic_score"]], dim=1))

    def scored():
        return Scored(weighted=True)

    def scored_plain():
        return Scored(weighted=False)
''')

SPACE = """\
name: ranker_torchrec
target: torchrec
workload: {file: picky.json}
baseline: {world_size: 2, sharding: table_wise, batch_size: 256, kernel: fbgemm, emb_precision: fp32,
           dense_precision: fp32, comm_precision: fp32, pipeline_depth: 0, threads_per_rank: 1}
knobs:
  batch_size: [256, 512]
objective: {metric: qps}
trial: {warmup_steps: 1, measure_steps: 4, windows: 2, timeout_s: 180, repeats: 1}
budget: {trials: 2, confirm_top_k: 0}
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module of TorchRec models that are not cubic's, importable from `tmp_path` (the current folder)."""
    require("torchrec")
    (tmp_path / "usermodels.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cli(*args: str) -> tuple[int, str, list[str]]:
    """The `cubic` app in-process: exit code, stdout, stderr lines."""
    from typer.testing import CliRunner

    from cubic.cli.app import app

    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr.strip().splitlines()


def _workload(entry: str, out: Path) -> Path:
    code, _, err = cli("workload", "from-torchrec", f"usermodels:{entry}", "-o", str(out))
    assert code == 0, err
    return out


def test_a_tables_bag_is_cut_into_one_piece_per_feature() -> None:
    """The harness pools a table's features as one bag; TorchRec looks each feature up apart: sample i's bag of
    table t is cut into consecutive pieces, one per feature, and nothing is lost or reordered."""
    require("torchrec")
    from cubic_harness.torchrec_train import _kjt

    # 2 tables, 3 samples: table 0 bags [10 11 12], [13], [] ; table 1 bags [20], [21 22], [23 24 25 26]
    ids = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26])
    b = Batch(torch.zeros(3, 1), ids, torch.tensor([0, 3, 4, 4, 5, 7, 11]), torch.zeros(3))
    kjt = _kjt(b, [["a", "b"], ["c"]]).to_dict()
    assert kjt["a"].lengths().tolist() == [1, 0, 0] and kjt["a"].values().tolist() == [10]
    assert kjt["b"].lengths().tolist() == [2, 1, 0] and kjt["b"].values().tolist() == [11, 12, 13]
    assert kjt["c"].lengths().tolist() == [1, 2, 4] and kjt["c"].values().tolist() == [20, 21, 22, 23, 24, 25, 26]
    one = _kjt(b, [["a"], ["c"]]).to_dict()  # one feature a table: the bags as they are
    assert one["a"].values().tolist() == [10, 11, 12, 13] and one["c"].lengths().tolist() == [1, 2, 4]
    # scores (weighted tables) are cut with their ids: every weight stays beside its id
    scored = Batch(b.dense, ids, b.offsets, b.labels, scores=ids.float() / 100)
    for cut in (_kjt(scored, [["a", "b"], ["c"]]), _kjt(scored, [["a"], ["c"]])):
        assert torch.equal(cut.weights(), cut.values().float() / 100)
    assert _kjt(b, [["a", "b"], ["c"]]).weights_or_none() is None


def test_cubics_kernel_and_torchrecs_train_pipeline_train_as_the_plain_fbgemm_loop_does() -> None:
    """kernel=native in the TorchRec backend runs cubic's numba kernel inside TorchRec's sharded tables
    (harness/torchrec_kernel.py: table-wise and column-wise shards): the same training as FBGEMM's fused TBE
    with row-wise AdaGrad fused into the backward, step for step. pipeline_depth=1 runs TorchRec's
    TrainPipelineSparseDist, which reorders the input distribution, not the math: the same losses again."""
    require("torchrec")
    from cubic_harness.config import TrialConfig
    from cubic_harness.torchrec_trial import run_torchrec
    from cubic_harness.workload import Workload

    cfg = TrialConfig(workload=Workload.tiny(), world_size=2, batch_size=128, sharding="column_wise", warmup_steps=2,
                      measure_steps=4, windows=1, timeout_s=180)
    fb, nat = run_torchrec(cfg.replace(kernel="fbgemm")), run_torchrec(cfg.replace(kernel="native"))
    assert fb.status == nat.status == "ok", (fb.error, nat.error)
    assert (fb.env["kernel"], nat.env["kernel"]) == ("fbgemm", "native")
    assert nat.losses == pytest.approx(fb.losses, rel=1e-4) and fb.losses[-1] != fb.losses[0]
    piped = run_torchrec(cfg.replace(kernel="fbgemm", pipeline_depth=1))
    assert piped.status == "ok" and piped.losses == pytest.approx(fb.losses, rel=1e-6), piped.error


def test_cubics_kernel_in_torchrec_takes_a_table_of_several_features_and_mean_pooling_as_fbgemm(models: Path) -> None:
    """The user's model has a table looked up by two features and pooled by mean. kernel=native runs it inside
    TorchRec's sharded tables (harness/torchrec_kernel.py `_FeatureLayout`: one slot per feature, every feature's
    gradients of a row summed before the row's update) and trains step for step as FBGEMM's TBE with its
    feature-to-table map does. Column-wise puts a shard of both tables on each rank: one group of a two-feature
    and a one-feature table, the latter padded with an empty slot."""
    from cubic_harness.config import TrialConfig
    from cubic_harness.torchrec_trial import run_torchrec
    from cubic_harness.workload import Workload

    wl, _ = Workload.from_json_file(_workload("ranker", models / "ranker.json"))
    assert [t.feature_names for t in wl.tables] == [["user_id", "friend_id"], ["item_id"]]
    cfg = TrialConfig(workload=wl, world_size=2, batch_size=128, sharding="column_wise", warmup_steps=2,
                      measure_steps=4, windows=1, timeout_s=180)
    fb, nat = run_torchrec(cfg.replace(kernel="fbgemm")), run_torchrec(cfg.replace(kernel="native"))
    assert fb.status == nat.status == "ok", (fb.error, nat.error)
    assert nat.losses == pytest.approx(fb.losses, rel=1e-4) and fb.losses[-1] != fb.losses[0]
    assert {p["name"]: p["kind"] for p in nat.plan} == {"users": "column_wise", "goods": "column_wise"}


def test_a_weighted_feature_trains_weighted_in_torchrec_and_cubics_kernel_weights_it_as_fbgemm(models: Path) -> None:
    """The user's model has a weighted collection (scores per id) beside an unweighted one. The import marks its
    table weighted; the TorchRec trial feeds the ids' scores (`data.id_scores`) as the KeyedJaggedTensor's weights,
    so FBGEMM's TBE pools score-weighted sums: the losses differ from the same model unweighted. kernel=native
    takes the scores as per-sample weights inside TorchRec's sharded tables and trains step for step as FBGEMM.
    A weighted table without the model's factory is refused in one line. The runs plan on the fixture cluster,
    which prices weights by their bytes alone: the weighted table's measured kernel cost (`weighted_cost`) would
    move it to the other rank, and TorchRec initialises a table where it lands, so the models would start apart."""
    from cubic_harness.config import TrialConfig
    from cubic_harness.torchrec_trial import run_torchrec
    from cubic_harness.workload import Workload

    wl, _ = Workload.from_json_file(_workload("scored", models / "scored.json"))
    plain, _ = Workload.from_json_file(_workload("scored_plain", models / "plain.json"))
    assert [t.weighted for t in wl.tables] == [False, True] and not any(t.weighted for t in plain.tables)
    assert "weighted" not in json.loads((models / "plain.json").read_text())["tables"][1]  # the default stays out
    assert wl.collections == plain.collections == 2  # TorchRec distributes and looks up each apart
    cfg = TrialConfig(workload=wl, world_size=2, batch_size=128, sharding="table_wise", warmup_steps=2,
                      measure_steps=4, windows=1, timeout_s=180)
    with fixture_cluster_as_local():
        fb, nat = run_torchrec(cfg.replace(kernel="fbgemm")), run_torchrec(cfg.replace(kernel="native"))
        unweighted = run_torchrec(cfg.replace(workload=plain, kernel="fbgemm"))
    assert fb.status == nat.status == unweighted.status == "ok", (fb.error, nat.error, unweighted.error)
    assert fb.plan == unweighted.plan  # the same placement: the same initial tables
    assert nat.losses == pytest.approx(fb.losses, rel=1e-4) and fb.losses[-1] != fb.losses[0]
    assert unweighted.losses[0] == pytest.approx(fb.losses[0], rel=1e-3)  # same model, same initial loss scale
    assert max(abs(a - b) for a, b in zip(unweighted.losses[1:], fb.losses[1:], strict=True)) > 1e-4
    raw = json.loads((models / "scored.json").read_text())
    (models / "nofactory.json").write_text(json.dumps({**raw, "factory": None, "dense_model": None}))
    code, _, err = cli("trial", "--backend", "torchrec", "--workload", str(models / "nofactory.json"), "--set",
                       "kernel=fbgemm")
    assert code == 2 and len(err) == 1 and "table(s) topics: weighted" in err[0], err
    # its unweighted twin still holds two collections, which TorchRec's DLRM built from a workload has not
    raw = json.loads((models / "plain.json").read_text())
    (models / "nofactory.json").write_text(json.dumps({**raw, "factory": None, "dense_model": None}))
    code, _, err = cli("trial", "--backend", "torchrec", "--workload", str(models / "nofactory.json"), "--set",
                       "kernel=fbgemm")
    assert code == 2 and len(err) == 1 and "collections=2: TorchRec's DLRM built from a workload" in err[0], err


def test_2d_on_cubics_kernel_in_torchrec_merges_its_replicas_as_dmpcollection_merges_fbgemms() -> None:
    """2D in TorchRec (DMPCollection, 2 replicas of a group of 1, sync every 2 steps) with kernel=native: the sync
    averages cubic's kernels' weights and row-wise AdaGrad state over the replica group as DMPCollection averages
    FBGEMM's, so it trains step for step as 2D on FBGEMM does. Unmerged, cubic's replicas train apart from the
    third step on: 1.5e-4 apart at the sixth (measured 2026-11-27), 15x this test's tolerance."""
    require("torchrec")
    from cubic_harness.config import TrialConfig
    from cubic_harness.torchrec_trial import run_torchrec
    from cubic_harness.workload import Workload

    cfg = TrialConfig(workload=Workload.tiny(), world_size=2, sharding_group_size=1, sparse_sync="weight_avg",
                      sparse_sync_interval=2, batch_size=128, sharding="table_wise", warmup_steps=2,
                      measure_steps=4, windows=1, timeout_s=180)
    fb, nat = run_torchrec(cfg.replace(kernel="fbgemm")), run_torchrec(cfg.replace(kernel="native"))
    assert fb.status == nat.status == "ok", (fb.error, nat.error)
    assert (nat.env["model_parallel"], nat.env["kernel"]) == ("CpuDMPCollection", "native")
    assert nat.losses == pytest.approx(fb.losses, rel=1e-5) and fb.losses[-1] != fb.losses[0]


def test_the_feature_layout_gives_each_feature_its_tables_slot_and_averages_by_length() -> None:
    """Three features on two tables (t0: a, b; t1: c), 2 samples: the kernel sees t0's two slots and t1's one slot
    padded with empty bags; each feature's output is its slot's rows in its table's columns, divided by the bag's
    length under mean pooling (an empty bag stays 0)."""
    require("torchrec")
    from cubic_harness.torchrec_kernel import _FeatureLayout

    lay = _FeatureLayout([0, 0, 1], dim_offsets=[0, 2, 5], mean=True)
    assert (lay.slots, lay.rows, lay.identity) == (2, 4, False)
    lengths = torch.tensor([1, 2, 0, 3, 1, 1])  # a: 1, 2 | b: 0, 3 | c: 1, 1
    assert lay.offsets(lengths).tolist() == [0, 1, 3, 3, 6, 7, 8, 8, 8]  # t0 slot0 (a), t0 slot1 (b), t1 (c), pad
    pooled = torch.arange(4 * 5, dtype=torch.float32).view(4, 5)  # [M*B, dims]: rows slot0 b0, b1, slot1 b0, b1
    out = lay.output(pooled, lengths)
    assert out.shape == (2, 2 + 2 + 3)
    assert out[:, 0:2].tolist() == [[0.0, 1.0], [2.5, 3.0]]  # a: slot 0, t0's columns, / (1, 2)
    assert out[:, 2:4].flatten().tolist() == pytest.approx([10.0, 11.0, 5.0, 16 / 3])  # b: slot 1, / (1 if empty, 3)
    assert out[:, 4:7].tolist() == [[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]]  # c: slot 0, t1's columns
    assert _FeatureLayout([0, 1], dim_offsets=[0, 2, 5], mean=False).identity


def test_bad_input_for_the_torchrec_backend_is_one_line_exit_2(models: Path) -> None:
    wl = _workload("ranker", models / "ranker.json")
    for args, says in (
        (["--set", "kernel=triton"], "kernel='triton' does not run in TorchRec on cpu"),
        (["--set", "sharding=row_wise"], "row-wise kinds need CUDA in TorchRec"),
        (["--set", "comm_overlap=forward"], "comm_overlap='forward' does not run in TorchRec"),
        (["--set", "pipeline_depth=2"], "PrefetchTrainPipelineSparseDist prefetches on CUDA streams"),
    ):
        code, _, err = cli("trial", "--backend", "torchrec", "--workload", str(wl), "--set", "kernel=fbgemm", *args)
        assert code == 2 and len(err) == 1 and says in err[0], err
    # (on a CUDA machine: a CPU one stops earlier, at "no CUDA device is available here")
    from cubic_harness.config import TrialConfig
    from cubic_harness.errors import ConfigError
    from cubic_harness.torchrec_trial import check_runs_in_torchrec

    with pytest.raises(ConfigError, match="the TorchRec backend trains on CPU"):
        check_runs_in_torchrec(TrialConfig(device="cuda", kernel="fbgemm"))
    seq = _workload("sequence", models / "sequence.json")
    code, _, err = cli("trial", "--backend", "torchrec", "--workload", str(seq), "--set", "kernel=fbgemm")
    assert code == 2 and len(err) == 1 and "clicks" in err[0] and "EmbeddingCollection" in err[0], err
    # a tune needs a space that keeps only what TorchRec runs
    (models / "harness.yaml").write_text(SPACE.replace("target: torchrec\n", "").replace("picky", "ranker"))
    code, _, err = cli("tune", "--backend", "torchrec", "--space", str(models / "harness.yaml"), "--no-live")
    assert code == 2 and len(err) == 1 and "target: torchrec" in err[0], err
    code, _, err = cli("trial", "--backend", "torchec")
    assert code == 2 and "choose one of ['real', 'sim', 'torchrec']" in err[0], err


def test_a_users_model_trains_in_torchrec_and_a_factory_that_raises_is_one_line_exit_2(models: Path) -> None:
    """`cubic trial --backend torchrec` trains the user's own module (its two features cut from one bag) under
    DistributedModelParallel, its all-to-alls in bf16 (TorchRec's QComms), held-out evaluation included; a workload
    whose factory raises is refused before any rank starts, in one line naming the factory and its error (exit 2)."""
    wl = _workload("ranker", models / "ranker.json")
    code, out, err = cli("trial", "--backend", "torchrec", "--workload", str(wl), "--json", "--set", "kernel=fbgemm",
                         "--set", "sharding=column_wise", "--set", "comm_precision=bf16", "--set", "batch_size=128",
                         "--set", "warmup_steps=1",
                         "--set", "measure_steps=3", "--set", "windows=1", "--set", "eval_samples=2048")
    res = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and res["status"] == "ok", (res["error"], err)
    assert res["env"]["backend"] == "torchrec" and res["env"]["torchrec"] and res["env"]["model_parallel"] == \
        "DistributedModelParallel"
    assert res["qps"] > 0 and 0 < res["ne"] < 2 and 0 < res["extra"]["eval_ne"] < 2 and res["extra"]["eval_samples"] \
        == 2048 and res["peak_mem_mb"] > 0
    assert {p["name"]: p["kind"] for p in res["plan"]} == {"users": "column_wise", "goods": "column_wise"}
    raw = json.loads(wl.read_text())
    (models / "broken.json").write_text(json.dumps({**raw, "factory": "usermodels:broken"}))
    code, _, err = cli("trial", "--backend", "torchrec", "--workload", str(models / "broken.json"), "--set",
                       "kernel=fbgemm")
    assert code == 2 and len(err) == 1, err
    assert "usermodels:broken: the factory raised RuntimeError: no GPU config found" in err[0]


def test_a_torchrec_tune_of_a_users_model_records_a_crash_and_exports_the_factory(models: Path) -> None:
    """The short version of the slow tier's tune: both configurations in TorchRec on Ray (the grid), their ranks
    forked from a fork server that preloaded TorchRec; the one with 512-sample batches crashes inside the model's
    forward and is recorded with its reason while the tune goes on; the export names the user's factory and
    `cubic verify` has nothing to re-run."""
    _workload("picky", models / "picky.json")
    (models / "space.yaml").write_text(SPACE)
    p = subprocess.run([*CUBIC, "tune", "--backend", "torchrec", "--space", "space.yaml", "--run-dir", "run",
                        "--searcher", "grid", "--no-live"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    from cubic.results.analysis import load_study

    df = load_study(models / "run")
    assert df.attrs["backend"] == "torchrec" and df.attrs["study"] == "ranker_torchrec@torchrec"
    assert len(df) == 2 and set(df["env_backend"]) == {"torchrec"}
    crashed = df[df["batch_size"] == 512]
    assert len(crashed) == 1 and set(crashed["status"]) == {"error"}
    assert all("ranker head sized for 256 samples, got 512" in e for e in crashed["reason"])
    assert df[df["batch_size"] == 256]["ok"].all()
    # the tune's process runs TorchRec trials only: its fork server preloads TorchRec and every rank is forked
    assert set(df["env_rank_start"]) == {"forkserver"}
    code, out, err = cli("export", "run", "--format", "torchrec")
    exp = json.loads(out)
    assert code == 0 and exp["factory"] == "usermodels:picky" and exp["model"] is None, err
    assert set(exp["placements"]) == {"users", "goods"}
    code, out, err = cli("verify", "run")
    assert code == 0 and "was tuned in TorchRec" in out and "nothing to verify" in out, (out, err)


LONG_SPACE = """\
name: ranker_torchrec_long
target: torchrec
workload: {file: ranker.json}
baseline: {world_size: 2, sharding: table_wise, batch_size: 256, kernel: fbgemm, emb_precision: fp32,
           dense_precision: fp32, comm_precision: fp32, pipeline_depth: 0, threads_per_rank: 1}
knobs:
  sharding: [table_wise, column_wise]
  batch_size: {type: int, low: 256, high: 4096, log: true}
  emb_precision: [fp32, fp16]
  emb_optimizer: [rowwise_adagrad, sgd]
objective: {metric: qps}
constraints: {quality_tolerance: 0.05}
trial: {warmup_steps: 2, measure_steps: 12, windows: 4, timeout_s: 300, repeats: 3}
budget: {trials: 12, confirm_top_k: 2}
"""


@pytest.mark.slow  # ~6 min: 12 TorchRec trials and the confirm's re-measurements, then 3 re-runs of the export
def test_a_torchrec_tune_of_a_users_model_and_its_exported_winner_reruns_at_its_speed(models: Path) -> None:
    """The long version: the user's model tuned in TorchRec with the cubic searcher and the confirm step; the winner
    exported as a full config and re-run in TorchRec three times runs at the confirmed speed within the noise
    (the re-runs' median inside the confirm's range, widened by 15% for a noisy machine)."""
    _workload("ranker", models / "ranker.json")
    (models / "space.yaml").write_text(LONG_SPACE)
    p = subprocess.run([*CUBIC, "tune", "--backend", "torchrec", "--space", "space.yaml", "--run-dir", "run",
                        "--no-live"], capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    from cubic.results.analysis import load_study

    df = load_study(models / "run")
    win = df.attrs["winner"]
    row = df[df["number"] == win["trial"]].iloc[0]
    assert (df["env_backend"] == "torchrec").all() and len(row["confirm_qps"]) >= 3
    assert cli("export", "run", "--format", "yaml", "-o", "winner.yaml")[0] == 0
    reruns = []
    for _ in range(3):
        code, out, err = cli("trial", "--backend", "torchrec", "--config", "winner.yaml", "--json")
        res = json.loads(out.strip().splitlines()[-1])
        assert code == 0 and res["env"]["backend"] == "torchrec", (res["error"], err)
        reruns.append(res["qps"])
    lo, hi = min(row["confirm_qps"]) / 1.15, max(row["confirm_qps"]) * 1.15
    assert lo <= sorted(reruns)[1] <= hi, (reruns, row["confirm_qps"])


def _with_profile(tmp_path: Path, profile: dict) -> Path:
    import yaml

    from tests.helpers import FIXTURE_CLUSTER

    raw = yaml.safe_load(FIXTURE_CLUSTER.read_text())
    raw["frameworks"] = {"torchrec": profile}
    path = tmp_path / "local_tr.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_simulator_prices_torchrecs_step_by_its_profile(tmp_path: Path) -> None:
    """A cluster's `frameworks.torchrec` replaces the device's step figures (the harness's) where TorchRec's
    differ: `--framework torchrec` prices a step with its fixed cost and its collection's cost per id."""
    from cubic_harness.config import TrialConfig
    from cubic_harness.sim.backend import simulate
    from cubic_harness.sim.cluster import load_cluster
    from cubic_harness.workload import Workload

    c = load_cluster(_with_profile(tmp_path, {"step_overhead_ms": 5.0, "glue_ns_per_id": 17.1}))
    tr = c.for_framework("torchrec")
    assert (tr.device.step_overhead_ms, tr.device.glue_ns_per_id, tr.framework) == (5.0, 17.1, "torchrec")
    assert tr.device.process_mb == c.device.process_mb  # what the profile leaves out stays the device's
    cfg = TrialConfig(workload=Workload.small(), world_size=2, batch_size=1024, kernel="fbgemm")
    h, t = simulate(cfg, c), simulate(cfg, tr)
    assert t.env["framework"] == "torchrec" and h.env["framework"] == "harness"
    assert t.step_ms_p50 - h.step_ms_p50 == pytest.approx(5.0 - c.device.step_overhead_ms)
    # the glue per id: its term grows with the ids a rank looks up
    more = load_cluster(_with_profile(tmp_path, {"step_overhead_ms": 5.0, "glue_ns_per_id": 117.1}))
    ids = cfg.batch_size * sum(cfg.workload.lookups_per_sample())
    grown = simulate(cfg, more.for_framework("torchrec")).step_ms_p50 - t.step_ms_p50
    assert ids * 100 / 1e6 <= grown <= 1.5 * ids * 100 / 1e6  # over the rank's shared speed (<= 1) on a full node
    # each collection of the model beyond the first: `collection_ms`, in TorchRec's step only (the harness looks
    # every table up in one)
    split = load_cluster(_with_profile(tmp_path, {"step_overhead_ms": 5.0, "glue_ns_per_id": 17.1,
                                                  "collection_ms": 3.0}))
    three = cfg.replace(workload=dataclasses.replace(cfg.workload, collections=3))
    assert simulate(cfg, split.for_framework("torchrec")).step_ms_p50 == pytest.approx(t.step_ms_p50)
    assert simulate(three, split.for_framework("torchrec")).step_ms_p50 - t.step_ms_p50 == pytest.approx(2 * 3.0)
    assert simulate(three, split).step_ms_p50 == pytest.approx(h.step_ms_p50)


def test_a_missing_or_bad_framework_profile_is_one_line_exit_2(tmp_path: Path) -> None:
    from tests.helpers import FIXTURE_CLUSTER

    code, _, err = cli("trial", "--backend", "sim", "--cluster", str(FIXTURE_CLUSTER), "--framework", "torchrec")
    assert code == 2 and len(err) == 1 and "has no 'torchrec' framework profile" in err[0] \
        and "cubic calibrate --framework torchrec" in err[0], err
    code, _, err = cli("trial", "--backend", "sim", "--cluster", str(FIXTURE_CLUSTER), "--framework", "hugectr")
    assert code == 2 and "choose one of ['harness', 'torchrec']" in err[0], err
    bad = _with_profile(tmp_path, {"step_overhead_ms": -1.0})
    code, _, err = cli("trial", "--backend", "sim", "--cluster", str(bad), "--framework", "torchrec")
    assert code == 2 and len(err) == 1 and "frameworks.torchrec.step_overhead_ms" in err[0], err
    code, _, err = cli("trial", "--framework", "torchrec")
    assert code == 2 and "--framework goes with --backend sim" in err[0], err
    good = _with_profile(tmp_path, {"step_overhead_ms": 5.0})
    code, out, err = cli("trial", "--backend", "sim", "--cluster", str(good), "--framework", "torchrec", "--json")
    assert code == 0 and json.loads(out)["env"]["framework"] == "torchrec", err


@pytest.mark.slow  # ~1 min: micro-steps in both frameworks
def test_calibrate_framework_torchrec_adds_a_measured_profile_the_simulator_prices(tmp_path: Path) -> None:
    """`cubic calibrate --framework torchrec` measures TorchRec's micro-steps beside the harness's and writes their
    difference over the file's own figures as `frameworks.torchrec`, with what measured it; the file keeps
    loading, and `--framework torchrec` prices with it. Without a calibration to add to: one line, exit 2."""
    import shutil

    import yaml

    from cubic_harness.config import TrialConfig
    from cubic_harness.sim.backend import simulate
    from cubic_harness.sim.cluster import load_cluster
    from tests.helpers import FIXTURE_CLUSTER

    require("torchrec")
    code, _, err = cli("calibrate", "--framework", "torchrec", "-o", str(tmp_path / "none.yaml"))
    assert code == 2 and len(err) == 1 and "no calibration of this machine" in err[0], err
    out = tmp_path / "local.yaml"
    shutil.copy(FIXTURE_CLUSTER, out)
    code, _, err = cli("calibrate", "--framework", "torchrec", "--short", "-o", str(out))
    assert code == 0, err
    raw = yaml.safe_load(out.read_text())
    prof, src = raw["frameworks"]["torchrec"], raw["source"]["frameworks"]["torchrec"]
    base = load_cluster(FIXTURE_CLUSTER)
    assert src["torchrec"] and set(src["bare_step_ms"]) == {"harness", "torchrec", "paired_difference"}
    assert len(src["step_ms"]) == 2 and all(set(x) == {"harness", "torchrec", "paired_difference"}
                                            for x in src["step_ms"])
    fixed = src["bare_step_ms"]["paired_difference"]  # TorchRec's runs minus the harness's, paired
    assert prof["step_overhead_ms"] == pytest.approx(base.device.step_overhead_ms + max(0.0, fixed), abs=2e-3)
    (d1, d2), (n1, n2) = [x["paired_difference"] for x in src["step_ms"]], src["ids_per_rank"]
    assert prof["glue_ns_per_id"] == pytest.approx(max(0.0, base.device.glue_ns_per_id + (d2 - d1) / (n2 - n1) * 1e6),
                                                   abs=0.05 + 2e-3 / (n2 - n1) * 1e6)
    assert prof["glue_ns_per_id"] >= 0 and prof["dist_overhead_ms"] >= 0 and prof["dense_replica_merge"] is True
    # one collection and two, paired: the median difference
    assert prof["collection_ms"] == pytest.approx(max(0.0, statistics.median(src["second_collection_ms"])), abs=2e-3)
    assert prof["process_mb"] > 0 and prof["spawned_process_mb"] > 0  # a forked and a spawned bare rank
    tr = load_cluster(out).for_framework("torchrec")
    res = simulate(TrialConfig(kernel="fbgemm"), tr)
    assert res.status == "ok" and res.env["framework"] == "torchrec"
