"""The user's own model and data: a workload imported from TorchRec, ids drawn like a profiled sample or
replayed from it, the simulator pricing the profiled statistics, and the dlrm_datasets preset."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from cubic_harness.config import TrialConfig
from cubic_harness.data import make_batch
from cubic_harness.errors import ConfigError
from cubic_harness.ids import draw_ranks, expected_distinct, hit_rate, profile_ids, rows_of_ranks
from cubic_harness.workload import Workload

CUBIC = [sys.executable, "-m", "cubic"]


def cli(*args: str) -> tuple[int, list[str]]:
    """The `cubic` app in-process (the end-to-end test runs the real script once): exit code, stderr lines."""
    from typer.testing import CliRunner

    from cubic.cli.app import app

    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stderr.strip().splitlines()

MODELS = textwrap.dedent('''
    import torch
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.embedding_configs import DataType, PoolingType
    from torchrec.models.dlrm import DLRM_DCN

    def dcn():
        ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"tab{i}", num_embeddings=r, embedding_dim=32, feature_names=[f"feat{i}"],
                               data_type=DataType.FP16 if i == 1 else DataType.FP32)
            for i, r in enumerate([1000, 4_000_000_000, 300])])
        return DLRM_DCN(ebc, dense_in_features=7, dense_arch_layer_sizes=[64, 32], over_arch_layer_sizes=[128, 64, 1],
                        dcn_num_layers=2, dcn_low_rank_dim=16)

    class Ranker(nn.Module):
        """An EBC inside a module of its own: a user tower over 5 dense inputs and a head over the pooled rows."""

        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="users", num_embeddings=10_000, embedding_dim=16,
                                   feature_names=["user_id", "friend_id"], pooling=PoolingType.MEAN),
                EmbeddingBagConfig(name="goods", num_embeddings=5_000, embedding_dim=16, feature_names=["item_id"])])
            self.tower = nn.Sequential(nn.Linear(5, 16), nn.ReLU())
            self.head = nn.Sequential(nn.Linear(16 * 4, 200), nn.ReLU(), nn.Linear(200, 1))

        def forward(self, dense, kjt):
            pooled = self.ebc(kjt).to_dict()
            x = torch.cat([self.tower(dense)] + [pooled[k] for k in ("user_id", "friend_id", "item_id")], dim=1)
            return self.head(x)

    def ranker():
        return Ranker()

    class DictRanker(Ranker):
        """The same model, its forward taking one dict (a batch as many pipelines hand it over)."""

        def forward(self, batch):
            return super().forward(batch["dense"], batch["sparse"])

    def dict_ranker():
        return DictRanker()

    def dict_inputs(dense, kjt):
        return ({"dense": dense, "sparse": kjt},)

    def bad_inputs(dense, kjt):
        return dense

    class OneDense(nn.Module):
        """One dense input, scaled before the head: the first Linear is not the dense input's."""

        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="catalog", num_embeddings=1000, embedding_dim=16, feature_names=["item"])])
            self.head = nn.Sequential(nn.Linear(17, 8), nn.ReLU(), nn.Linear(8, 1))
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, dense, kjt):
            return self.head(torch.cat([dense * self.scale, self.ebc(kjt).values()], dim=1))

    def one_dense():
        return OneDense()

    def broken():
        raise RuntimeError("no GPU config found")

    def not_a_model():
        return 42

    def no_tables():
        return nn.Linear(4, 1)
''')


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of TorchRec models that are not cubic's, importable from the current folder."""
    name = f"usermodels_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    return name


def test_import_dlrm_dcn_reads_tables_and_dense_arch(models: str) -> None:
    from cubic_harness.torchrec_import import import_workload

    wl = import_workload(f"{models}:dcn")  # a 4e9-row table: built on meta, it costs nothing
    assert [(t.name, t.rows, t.dim, t.features, t.data_type) for t in wl.tables] == [
        ("tab0", 1000, 32, ["feat0"], "fp32"), ("tab1", 4_000_000_000, 32, ["feat1"], "fp16"),
        ("tab2", 300, 32, ["feat2"], "fp32")]
    assert (wl.dense_features, wl.bottom_mlp, wl.top_mlp) == (7, [64, 32], [128, 64, 1])
    assert (wl.interaction, wl.dcn_layers, wl.dcn_rank, wl.dense_model) == ("dcn", 2, 16, None)


def test_import_custom_module_measures_its_dense_part(models: str) -> None:
    import torch

    from cubic_harness.dense_cost import dense_cost
    from cubic_harness.torchrec_import import import_workload

    wl = import_workload(f"{models}:ranker")
    assert [(t.name, t.rows, t.dim, t.features, t.pooling_type) for t in wl.tables] == [
        ("users", 10_000, 16, ["user_id", "friend_id"], "mean"), ("goods", 5_000, 16, ["item_id"], "sum")]
    mod = sys.modules[models].Ranker()
    dense_params = sum(p.numel() for n, p in mod.named_parameters() if not n.startswith("ebc."))
    assert wl.dense_model.params == dense_params
    assert wl.dense_model.flops_per_sample == 2 * (5 * 16 + 64 * 200 + 200 * 1)  # the GEMMs' 2mkn per sample
    assert wl.dense_features == 5
    stand_in = dense_cost(wl).flops_fwd
    assert abs(stand_in - wl.dense_model.flops_per_sample) / wl.dense_model.flops_per_sample < 0.01
    assert wl.dense_model.module == f"{models}.Ranker" and isinstance(mod, torch.nn.Module)


def test_a_forward_it_cannot_call_names_the_fix_and_the_fix_imports_it(models: str, tmp_path: Path) -> None:
    """One dense input where the first Linear takes 17: the failure names --dense-features (and why it tried
    17), and --dense-features 1 imports it. A forward taking a dict: the failure names --example-inputs, and
    a FUNCTION(dense, kjt) returning the dict imports it with the same FLOPs as the plain forward."""
    from cubic_harness.torchrec_import import import_workload

    code, lines = cli("workload", "from-torchrec", f"{models}:one_dense", "-o", str(tmp_path / "a.json"))
    assert code == 2 and len(lines) == 1, lines
    assert "--dense-features N (17 is the first Linear's width)" in lines[0] and "--example-inputs" in lines[0]
    wl = import_workload(f"{models}:one_dense", dense_features=1)
    assert wl.dense_features == 1 and wl.dense_model.flops_per_sample == 2 * (17 * 8 + 8 * 1)
    code, lines = cli("workload", "from-torchrec", f"{models}:dict_ranker", "-o", str(tmp_path / "b.json"))
    assert code == 2 and len(lines) == 1 and "--example-inputs MODULE:FUNCTION" in lines[0], lines
    code, lines = cli("workload", "from-torchrec", f"{models}:dict_ranker", "--example-inputs",
                      f"{models}:dict_inputs", "-o", str(tmp_path / "b.json"))
    assert code == 0, lines
    got, plain = json.loads((tmp_path / "b.json").read_text()), import_workload(f"{models}:ranker")
    assert got["dense_model"]["flops_per_sample"] == plain.dense_model.flops_per_sample
    code, lines = cli("workload", "from-torchrec", f"{models}:dict_ranker", "--example-inputs", f"{models}:bad_inputs")
    assert code == 2 and len(lines) == 1 and "expected the forward's arguments" in lines[0], lines


@pytest.mark.parametrize("entry, says", [
    (":broken", "the factory raised RuntimeError: no GPU config found"),
    (":not_a_model", "returned int, expected a torch.nn.Module"),
    (":no_tables", "holds no EmbeddingBagCollection"),
    (":missing", "has no callable 'missing'"),
    ("nosuchmodule_xyz:f", "cannot import 'nosuchmodule_xyz'"),
    ("nocolon", "expected MODULE:FACTORY"),
])
def test_bad_factory_is_one_line_exit_2_and_writes_nothing(models: str, tmp_path: Path, entry: str,
                                                          says: str) -> None:
    entry = models + entry if entry.startswith(":") else entry
    out = tmp_path / "wl.json"
    code, lines = cli("workload", "from-torchrec", entry, "-o", str(out))
    assert code == 2 and len(lines) == 1 and says in lines[0], lines
    assert not out.exists()


def _skewed_profile(rows: int, n: int = 40_000, hot_low_rows: bool = False) -> tuple:
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 7, n)
    ranks = rng.zipf(1.3, lengths.sum()) - 1
    perm = np.arange(rows) if hot_low_rows else rng.permutation(rows)  # hot ids on the first rows, or spread
    ids = perm[ranks % rows]
    return lengths, ids, profile_ids(lengths, ids, rows, (128,))


def test_profiled_ids_behave_like_the_sample() -> None:
    """Drawn ids repeat, concentrate and bag as the sample did (not as uniform ids with a fixed pooling)."""
    rows = 50_000
    lengths, ids, p = _skewed_profile(rows)
    assert p.distinct == np.unique(ids).size and p.lookups == ids.size and p.bag_max == lengths.max()
    wl = Workload("u", [dataclasses.replace(Workload.tiny().tables[0], rows=rows, profile=p)], 8, [32, 16],
                  [16, 1], id_source="profile").validate()
    wl.tables[0].dim = 16
    b = make_batch(wl, 0, 0, 4096)
    lens = np.diff(b.offsets.numpy())
    assert abs(lens.mean() - lengths.mean()) < 0.1 and lens.max() <= lengths.max() and (lens == 0).any()
    drawn = profile_ids(lens, b.ids.numpy(), rows, (128,))
    # the same hottest rows take the same share (a top-1% share would move with the sample's size)
    assert abs(np.isin(b.ids.numpy(), p.hot_rows[:100]).mean() - hit_rate(p, 100)) < 0.03
    assert abs(drawn.reuse[128] - p.reuse[128]) / p.reuse[128] < 0.1
    # the simulator's dedup: expected distinct among a batch's draws matches the measured reuse
    per_batch = 128 * lengths.mean()
    assert abs(expected_distinct(p, per_batch) - per_batch / p.reuse[128]) / (per_batch / p.reuse[128]) < 0.1
    # the cache's hit rate is the sample's hottest rows' share
    counts = np.sort(np.unique(ids, return_counts=True)[1])[::-1]
    assert abs(hit_rate(p, 100) - counts[:100].sum() / ids.size) < 0.02
    # and a rank keeps its row: the same rank twice is the same row
    r = draw_ranks(p, np.array([0.5, 0.5, 0.999]))
    assert rows_of_ranks(p, r, rows)[0] == rows_of_ranks(p, r, rows)[1]


def test_simulator_prices_the_shard_holding_the_hot_rows() -> None:
    """Row-wise on 2 ranks: each rank's lookups are the sample's share of lookups on its half of the rows
    (hot ids on the first rows: rank 0 is the busy one); synthetic ids of the same table spread evenly."""
    from cubic_harness.sim.backend import simulate
    from cubic_harness.sim.cluster import resolve

    rows = 50_000
    for hot_low in (True, False):
        _, ids, p = _skewed_profile(rows, hot_low_rows=hot_low)
        low = (ids < rows // 2).mean()  # the sample's lookups on rank 0's rows
        base = Workload.tiny()
        wl = dataclasses.replace(base, tables=[dataclasses.replace(t, rows=rows, profile=p) for t in base.tables],
                                 id_source="profile")
        ratio = {}
        for wl_ in (wl, dataclasses.replace(wl, id_source="synthetic")):
            cfg = TrialConfig(workload=wl_, world_size=2, sharding="row_wise", device="cuda", kernel="triton")
            res = simulate(cfg, resolve("h100-8"))
            assert res.status == "ok", res.error
            fwd = res.extra["sim"]["emb_fwd_ms"]
            ratio[wl_.id_source] = fwd[0] / fwd[1]
        assert abs(ratio["synthetic"] - 1) < 0.01
        # forward time = lookups + a pooled write per bag (even on both ranks): the ratio lies between 1 and
        # the lookups' own ratio, on the same side
        lookups_ratio = low / (1 - low)
        assert min(1, lookups_ratio) - 0.01 < ratio["profile"] < max(1, lookups_ratio) + 0.01
        assert (ratio["profile"] > 1.5) == hot_low


def _sample_csv(path: Path, n: int = 3000) -> pd.DataFrame:
    """A data sample as a user has it: one column per feature, a multi-hot one as '|'-joined ids."""
    rng = np.random.default_rng(7)
    df = pd.DataFrame({
        "user_id": rng.zipf(1.4, n) % 20_000, "friend_id": rng.integers(0, 20_000, n),
        "item_id": ["|".join(map(str, rng.zipf(1.2, k) % 9_000)) for k in rng.integers(0, 5, n)],
        "label": rng.integers(0, 2, n)})
    df.to_csv(path, index=False)
    return df


def test_from_model_and_data_to_a_trial_on_profiled_and_replayed_ids(models: str, tmp_path: Path) -> None:
    """docs/workloads.md's path: import the model, profile a sample, then real trials on ids drawn like the sample
    and on the sample replayed; each trial's result says which ids it trained on."""
    from cubic_harness.trial import run_trial

    wl_file = tmp_path / "ranker.json"
    assert subprocess.run([*CUBIC, "workload", "from-torchrec", f"{models}:ranker", "-o", str(wl_file)],
                          capture_output=True, text=True).returncode == 0
    df = _sample_csv(tmp_path / "sample.csv")
    p = subprocess.run([*CUBIC, "workload", "profile", str(tmp_path / "sample.csv"), "--workload", str(wl_file),
                        "--batch-sizes", "256"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    raw = json.loads(wl_file.read_text())
    assert raw["id_source"] == "profile" and raw["data"]["sample_rows"] == len(df)
    assert (tmp_path / raw["data"]["trace"]).exists()
    wl, _ = Workload.from_json_file(wl_file)
    users, goods = wl.tables
    # pandas' own counts: distinct rows (ids mod rows) and bag lengths
    assert users.profile.distinct == pd.concat([df.user_id, df.friend_id]).mod(10_000).nunique()
    item_lens = df.item_id.fillna("").astype(str).map(lambda s: len(s.split("|")) if s else 0)
    assert goods.profile.bag_mean == pytest.approx(item_lens.mean())
    assert users.lookups(True) == pytest.approx(2.0)  # two one-hot features share the table
    # trace replay: sample g's bag is the data's row g, hashed
    tr = dataclasses.replace(wl, id_source="trace")
    b = make_batch(tr, 0, 0, 4)
    first = [int(x) % 5_000 for x in str(df.item_id[0]).split("|")] if item_lens[0] else []
    off = b.offsets.numpy()
    assert b.ids.numpy()[off[4]:off[5]].tolist() == first  # table 1 (goods), sample 0
    assert b.ids.numpy()[off[0]:off[1]].tolist() == [df.user_id[0] % 10_000, df.friend_id[0] % 10_000]
    for source in ("profile", "trace"):
        cfg = TrialConfig(workload=dataclasses.replace(wl, id_source=source), world_size=2, batch_size=64,
                          warmup_steps=1, measure_steps=3, kernel="native", sharding="row_wise", timeout_s=120)
        res = run_trial(cfg)
        assert res.status == "ok", res.error
        assert res.env["ids"]["id_source"] == source and res.env["ids"]["data"] == "sample.csv"
        # the ranks trained on the user's ids: every step's loss a finite number, near the label entropy
        assert len(res.losses) == 4 and all(0 < x < 2 for x in res.losses), res.losses


def test_bad_data_is_one_line_exit_2_and_leaves_the_workload(models: str, tmp_path: Path) -> None:
    wl_file = tmp_path / "ranker.json"
    assert cli("workload", "from-torchrec", f"{models}:ranker", "-o", str(wl_file))[0] == 0
    before = wl_file.read_text()
    pd.DataFrame({"user_id": [1, 2], "item_id": ["1|2", "3"]}).to_csv(tmp_path / "nofriend.csv", index=False)
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "bin.csv").write_bytes(bytes(range(256)) * 4)
    for data, says in (("nofriend.csv", "friend_id"), ("empty.csv", "empty.csv"), ("bin.csv", "bin.csv"),
                       ("missing.parquet", "missing.parquet")):
        code, lines = cli("workload", "profile", str(tmp_path / data), "--workload", str(wl_file))
        assert code == 2 and len(lines) == 1 and says in lines[0], lines
        assert wl_file.read_text() == before and not list(tmp_path.glob("*.trace.npz"))


def test_space_reads_a_workload_file_with_overrides(models: str, tmp_path: Path) -> None:
    from cubic.space.search_space import load_space

    wl_file = tmp_path / "ranker.json"
    assert cli("workload", "from-torchrec", f"{models}:ranker", "-o", str(wl_file))[0] == 0
    (tmp_path / "space.yaml").write_text("workload: {file: ranker.json, id_source: synthetic}\n"
                                         "knobs: {batch_size: {choices: [1024, 128]}}\n")
    assert load_space(tmp_path / "space.yaml").workload.tables[0].features == ["user_id", "friend_id"]
    (tmp_path / "bad.yaml").write_text("workload: {file: ranker.json, id_source: trace}\nknobs: {}\n")
    with pytest.raises(ConfigError, match="id_source=trace needs a data trace"):
        load_space(tmp_path / "bad.yaml")


@pytest.mark.parametrize("year, rows_tv, lookups_tv", [(2021, 0.13, 0.06), (2022, 0.10, 0.03)])
def test_dlrm_datasets_preset_reproduces_the_published_reuse(year: int, rows_tv: float, lookups_tv: float) -> None:
    """The preset's drawn batches against Meta's published reuse histograms (total variation distance), and a
    real draw of one table's batch against the analytic expectation the distance is computed on."""
    from cubic_harness.dlrm_datasets import BIN_LO, LOCALITY, batch_histograms, fitted_profile, histogram_distance

    p, raw, fitted = fitted_profile(year)
    assert fitted["rows_tv"] <= rows_tv and fitted["lookups_tv"] <= lookups_tv
    assert fitted["rows_tv"] + fitted["lookups_tv"] < raw["rows_tv"] + raw["lookups_tv"]
    assert histogram_distance(year, p) == fitted
    n = round(LOCALITY[year]["indices"] / LOCALITY[year]["tables"])
    counts = np.unique(draw_ranks(p, np.random.default_rng(0).random(n)), return_counts=True)[1]
    drawn = np.bincount(np.searchsorted(np.array(BIN_LO[1:]), counts, side="left"), minlength=len(BIN_LO))
    expect_rows, _ = batch_histograms(p, n)
    assert 0.5 * np.abs(drawn / drawn.sum() - expect_rows).sum() < 0.03
    wl = Workload.preset(f"dlrm-datasets-{year}")
    assert wl.num_tables == LOCALITY[year]["tables"] and wl.id_source == "profile"
    # the tables share one profile, written once: a stored config stays small and reads back the same
    d = wl.to_dict()
    assert len(d["profiles"]) == 1 and len(json.dumps(d)) < 200_000 and Workload.from_dict(d).to_dict() == d


def test_small_meta_trains_the_default_model_on_production_reuse() -> None:
    """`small-meta`: small-zipf's model and teacher, its tables' ids drawn from the 2022 production profile (the
    hottest row takes 3.8% of a table's lookups, bags of 13-14), each table its own draw; a real trial trains it."""
    from cubic_harness.dlrm_datasets import workload_dict
    from cubic_harness.trial import run_trial

    wl, zipf = Workload.preset("small-meta"), Workload.preset("small-zipf")
    assert wl.id_source == "profile" and wl.teacher_emb_scale == zipf.teacher_emb_scale
    assert (wl.bottom_mlp, wl.top_mlp, [t.rows for t in wl.tables]) == (
        zipf.bottom_mlp, zipf.top_mlp, [t.rows for t in zipf.tables])
    hottest = workload_dict(2022)["profiles"][0]["rank_cdf"][0][1]
    b = make_batch(wl, 0, 0, 8192)
    per_table = b.ids.split([int(b.offsets[(i + 1) * 8192] - b.offsets[i * 8192]) for i in range(wl.num_tables)])
    for ids in per_table:
        assert 13 <= ids.numel() / 8192 <= 14
        assert abs(torch.bincount(ids).max().item() / ids.numel() - hottest) < 0.01
    assert not torch.equal(per_table[0][:100], per_table[1][:100])
    res = run_trial(TrialConfig(workload=wl, world_size=2, batch_size=256, warmup_steps=1, measure_steps=2,
                                windows=1))
    assert res.status == "ok", res.error


def test_input_buffers_grow_with_the_tables_a_rank_holds() -> None:
    """A rank receives the group's ids for the tables it holds, not for every table: 856 tables on 256 H100s
    fit, and the rank holding more tables needs more memory."""
    from cubic_harness.sim.backend import simulate
    from cubic_harness.sim.cluster import resolve

    wl = Workload.preset("dlrm-datasets-2021")
    res = simulate(TrialConfig(workload=wl, world_size=256, batch_size=4096, sharding="table_wise", device="cuda",
                               kernel="triton", emb_precision="fp16"), resolve("h100-4096"))
    assert res.status == "ok", res.error
    held = [sum(s["rank"] == p for t in res.plan for s in t["shards"]) for p in range(256)]
    mem = res.extra["sim"]["mem_mb"]
    assert mem[held.index(max(held))] > mem[held.index(min(held))]
