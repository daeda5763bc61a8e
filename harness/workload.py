"""Workload spec: the model being trained (tables, dense features, MLPs, interaction).

A workload is the part of a trial the tuner does not change. Presets:
`tiny` (tests), `small` (the TorchRec anchor's workload-small.json), `small-zipf` (its tables with
skewed per-table ids and a teacher that weighs embeddings as much as dense features: the default CPU space's),
`criteo-mlperf-mini` (MLPerf DLRM-DCNv2 tables and multi-hot sizes, rows capped, dot interaction),
`mlperf-dcnv2-mini` (the same tables with MLPerf's DCN-v2 cross network) and `wukong-mini`
(Wukong's interaction stack in the public re-implementation's shape, scaled to this machine).

The interaction is the model family: `dot` (DLRM), `dcn` (DCN-v2 low-rank cross layers, MLPerf's
DLRM-DCNv2) or `wukong` (stacked FM blocks + linear compression blocks). Its own keys (`dcn_*`,
`wukong_*`) only apply to it and only appear in `to_dict` for it, so a dot workload's dict (and every
stored config key made from one) is what it was before the families existed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cubic_harness.errors import ConfigError, read_text
from cubic_harness.ids import IdProfile

ID_DISTRIBUTIONS = ("uniform", "zipf")
#: Where a trial's ids come from: each table's `id_dist` and fixed `pooling` (synthetic), the tables'
#: profiles of a data sample (bag lengths and skew drawn like the sample's), or the sample itself replayed.
ID_SOURCES = ("synthetic", "profile", "trace")
#: Distinct samples of the synthetic stream by default; training cycles over them (harness/data.py).
SAMPLE_CYCLE = 1 << 16
INTERACTIONS = ("dot", "dcn", "wukong")
TEACHER_EMB_SCALE = 3.0
#: Keys of one interaction only (defaults as in the dataclass); rejected for the others when set.
FAMILY_KEYS = {
    "dcn": ("dcn_layers", "dcn_rank"),
    "wukong": ("wukong_layers", "wukong_fm_embs", "wukong_lcb_embs", "wukong_rank", "wukong_mlp"),
}

# MLPerf DLRM-DCNv2 (Criteo 1TB multi-hot) table rows and multi-hot sizes.
MLPERF_ROWS = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]
MLPERF_POOLING = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
MLPERF_ROW_CAP = 200_000  # fits this 24 GiB / 2-core machine with room for 4 ranks
#: presets too large for a real trial here: `--backend sim` only
SIMULATED_ONLY = ("mlperf-dcnv2", "mlperf-dcnv2-x16", "dlrm-datasets-2021", "dlrm-datasets-2022")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # YAML/JSON true is not the number 1


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class TableSpec:
    """One embedding table: rows x dim, `pooling` ids per bag, and how ids are drawn."""

    name: str
    rows: int
    dim: int
    pooling: int = 1
    id_dist: str = "uniform"
    zipf_alpha: float = 1.05
    # TorchRec's feature names that look up this table (several features may share one table: each brings
    # its own bag per sample, which the harness concatenates into one); empty = the table's own name.
    features: list[str] = field(default_factory=list)
    # As the user's model declares the table (`from-torchrec`): its pooling (sum, mean, or none for a
    # sequence EmbeddingCollection) and its data type. The harness pools by sum in the emb_precision knob
    # (mean and none cost the same lookups); kept so the export and a reader see the user's model.
    pooling_type: str = "sum"
    data_type: str = "fp32"
    # A weighted feature's table (TorchRec's `is_weighted` collection: each id comes with a score, the bag is
    # the score-weighted sum). Both backends train it weighted: on the data's own scores when it replays a
    # trace that has them (`DataSample.scores`), else on `data.id_scores`; the simulator prices the score the
    # ids carry and the kernels' extra work (`sim/perf.py`).
    weighted: bool = False
    # The table's ids in a sample of the user's data (`cubic workload profile`); used when the workload's
    # id_source is profile. Left out of `to_dict` when absent, with `features`, so older keys stay.
    profile: IdProfile | None = None
    # The plan's constraints on this table, as TorchRec's ParameterConstraints offer them: the sharding kinds it
    # may take and the group positions its shards may live on (empty: any). `sharding: plan` plans within them;
    # any other plan that breaks one is refused (harness/sharding/planner.py `check_constraints`).
    sharding_types: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    # Tables with the same label live whole (table-wise) on one rank together: features a model reads side by
    # side, or tables an operator wants on one host. Empty: no such constraint.
    together: str = ""

    @property
    def bytes_fp32(self) -> int:
        return self.rows * self.dim * 4

    def lookups(self, profiled: bool) -> float:
        """Mean ids one sample looks up here: the fixed `pooling`, or where ids follow the data sample
        (`Workload.profiled`) the sample's mean bag length times the features (each brings its own bag)."""
        return self.profile.bag_mean * len(self.feature_names) if profiled and self.profile else float(self.pooling)

    @property
    def feature_names(self) -> list[str]:
        return self.features or [self.name]

    def to_dict(self, profile_ref: int | None = None) -> dict[str, Any]:
        """`profile_ref`: the index of this table's profile in the workload's shared `profiles` list."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in TABLE_EXTRAS}
        for k, default in TABLE_EXTRAS.items():
            v = getattr(self, k)
            if v != default:
                d[k] = list(v) if k in ("features", "sharding_types", "ranks") else (
                    profile_ref if profile_ref is not None else v.to_dict()) if k == "profile" else v
        return d


#: TableSpec keys added for imported models, left out of `to_dict` at these defaults (stored keys stay).
TABLE_EXTRAS: dict[str, Any] = {"features": [], "pooling_type": "sum", "data_type": "fp32", "weighted": False,
                                "profile": None, "sharding_types": [], "ranks": [], "together": ""}
POOLING_TYPES = ("sum", "mean", "none")


@dataclass(frozen=True)
class DataSample:
    """Where a workload's profile came from: the data file, its format, how many rows were read, how raw
    ids became rows, and the replayable trace of those rows (an npz beside the workload file)."""

    source: str
    format: str
    sample_rows: int
    hashing: str = "modulo"  # modulo (integer ids mod rows), hex-modulo (Criteo), hash64 (strings), "+"-joined
    trace: str = ""  # path of the trace (absolute once loaded); empty: no replay possible
    trace_sha256: str = ""  # the trace's content: two traces at one path are different workloads
    scores: tuple[str, ...] = ()  # weighted tables whose scores the data had (in the trace);
    #   the other weighted tables' are synthetic (`data.id_scores`)
    multi_hot: tuple[tuple[str, str], ...] = ()  # (feature, separator) of each text column split into ids

    @classmethod
    def from_dict(cls, d: Any, where: str) -> DataSample:
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(d, dict) or set(d) - set(names) or not {"source", "format", "sample_rows"} <= set(d):
            raise ConfigError(f"{where}: data must be a mapping with source, format, sample_rows (allowed: {names})")
        scores = d.get("scores", ())
        if not isinstance(scores, list | tuple) or not all(isinstance(x, str) for x in scores):
            raise ConfigError(f"{where}: data.scores must be a list of table names, got {scores!r}")
        multi = d.get("multi_hot", ())
        if not isinstance(multi, list | tuple) or not all(
                isinstance(x, list | tuple) and len(x) == 2 and all(isinstance(y, str) for y in x) for x in multi):
            raise ConfigError(f"{where}: data.multi_hot must be a list of [feature, separator] pairs, got {multi!r}")
        return cls(**{**d, "scores": tuple(scores), "multi_hot": tuple(tuple(x) for x in multi)})


@dataclass(frozen=True)
class DenseModel:
    """A dense part cubic does not know by name (not DLRM / DCN / Wukong): its size and cost per sample,
    measured on the user's module, so the simulator prices it and a harness trial runs a stand-in of the
    same FLOPs."""

    params: int
    flops_per_sample: int
    module: str = ""  # the user's class, for the reader

    @classmethod
    def from_dict(cls, d: Any, where: str) -> DenseModel:
        if not isinstance(d, dict) or not {"params", "flops_per_sample"} <= set(d) or set(d) - {
                "params", "flops_per_sample", "module"}:
            raise ConfigError(f"{where}: dense_model must be a mapping of params, flops_per_sample (and module)")
        if not all(_is_int(d[k]) and d[k] >= 0 for k in ("params", "flops_per_sample")):
            raise ConfigError(f"{where}: dense_model params and flops_per_sample must be integers >= 0")
        return cls(**d)


@dataclass
class Workload:
    name: str = "custom"
    tables: list[TableSpec] = field(default_factory=list)
    dense_features: int = 13
    bottom_mlp: list[int] = field(default_factory=lambda: [256, 128, 64])
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])
    interaction: str = "dot"
    # Distinct samples before the stream repeats. Trials pre-generate their batches, so this bounds
    # that cost; but a trial that cycles many times memorises its labels, and then NE compares how
    # fast configurations memorise, not how well they learn: raise it for large batches (GPU).
    sample_cycle: int = SAMPLE_CYCLE
    # The labelling teacher's weight on the embeddings (harness/data.py): logit = dense part (std ~1) +
    # sum over tables of the looked-up rows' mean weight x this / sqrt(tables). At the default the dense
    # features dominate (embedding part std ~0.4 on `small`); `small-zipf` balances them. Left out of
    # `to_dict` at its default, so every stored config key made before it existed stays what it was.
    teacher_emb_scale: float = TEACHER_EMB_SCALE
    # DCN-v2 (interaction: dcn): cross layers x_{l+1} = x_0 * (U_l (V_l x_l) + b_l) + x_l over the
    # concatenated bottom output and pooled embeddings; rank 0 = full rank (x_0 * (W_l x_l + b_l) + x_l).
    dcn_layers: int = 3
    dcn_rank: int = 512
    # Wukong (interaction: wukong): layers of an FM block (n_F = wukong_fm_embs outputs, low-rank FM of
    # rank wukong_rank, then LayerNorm and an MLP of widths wukong_mlp) beside a linear compression block
    # (n_L = wukong_lcb_embs outputs), with a residual and LayerNorm.
    wukong_layers: int = 3
    wukong_fm_embs: int = 16
    wukong_lcb_embs: int = 16
    wukong_rank: int = 24
    wukong_mlp: list[int] = field(default_factory=lambda: [512, 512])
    # The user's own model and data (`cubic workload from-torchrec` / `profile`): all left out of `to_dict`
    # at their defaults, so every stored key of a preset is what it was.
    id_source: str = "synthetic"
    data: DataSample | None = None
    dense_model: DenseModel | None = None
    factory: str = ""  # MODULE:FACTORY the workload was imported from
    # The embedding collections the user's model holds (TorchRec: each EmbeddingBagCollection, and a weighted
    # feature needs one of its own). The harness looks every table up in one; TorchRec distributes and looks
    # up each apart, which its framework profile prices per collection beyond the first (`sim/perf.py`).
    collections: int = 1

    # ------------------------------------------------------------------ presets
    @classmethod
    def small(cls) -> Workload:
        return cls.from_anchor_dict(ANCHOR_SMALL)[0]

    @classmethod
    def small_zipf(cls) -> Workload:
        """`small`'s tables (8 x 200k rows x dim 64, pooling 20) with ids drawn as production traffic draws
        them, skewed and per table (Zipf alpha 1.2 down to 0.7: 9% to 34% of a batch's ids distinct), and a
        teacher whose embedding part weighs as much as its dense part (std ~1 each), so that how a
        configuration trains the tables (optimizer, learning rate, precision) shows in eval NE."""
        alphas = (1.2, 1.1, 1.05, 1.0, 0.95, 0.9, 0.8, 0.7)
        wl = cls.small()
        return dataclasses.replace(wl, name="small-zipf", teacher_emb_scale=8.0, tables=[
            dataclasses.replace(t, id_dist="zipf", zipf_alpha=a) for t, a in zip(wl.tables, alphas, strict=True)])

    @classmethod
    def tiny(cls) -> Workload:
        """A few small tables of unequal sizes and pooling: for fast correctness tests."""
        rows, pool = [4000, 300, 50, 2000, 12, 800], [4, 2, 1, 3, 1, 5]
        tables = [TableSpec(f"t{i}", r, 16, p) for i, (r, p) in enumerate(zip(rows, pool, strict=True))]
        return cls("tiny", tables, 8, [32, 16], [32, 16, 1])

    @classmethod
    def criteo_mlperf_mini(cls) -> Workload:
        tables = [
            TableSpec(f"t{i}", min(r, MLPERF_ROW_CAP), 128, p, "zipf", 1.05)
            for i, (r, p) in enumerate(zip(MLPERF_ROWS, MLPERF_POOLING, strict=True))
        ]
        return cls("criteo-mlperf-mini", tables, 13, [512, 256, 128], [1024, 1024, 512, 256, 1])

    @classmethod
    def mlperf_dcnv2_mini(cls) -> Workload:
        """MLPerf's DLRM-DCNv2 (26 tables, multi-hot, dim 128, bottom 512-256-128, DCN-v2 3 layers,
        top 1024-1024-512-256-1) with rows capped and the cross layers' rank cut from 512 to 128: at
        rank 512 the cross net alone is 64 GFLOP a 1024-sample step, ~1 s on one core of this machine."""
        return dataclasses.replace(cls.criteo_mlperf_mini(), name="mlperf-dcnv2-mini", interaction="dcn",
                                   dcn_layers=3, dcn_rank=128)

    @classmethod
    def mlperf_dcnv2(cls) -> Workload:
        """MLPerf Training's DLRM-DCNv2 at full size: the 26 tables with the published rows (four of 40M),
        multi-hot sizes, dim 128, DCN-v2 3 layers of rank 512 over the 3,456-wide concatenation, bottom
        512-256-128, top 1024-1024-512-256-1. For the simulator only (~100 GB of fp32 tables): a real
        trial refuses it (SIMULATED_ONLY)."""
        tables = [TableSpec(f"t{i}", r, 128, p, "zipf", 1.05)
                  for i, (r, p) in enumerate(zip(MLPERF_ROWS, MLPERF_POOLING, strict=True))]
        return cls("mlperf-dcnv2", tables, 13, [512, 256, 128], [1024, 1024, 512, 256, 1], "dcn",
                   dcn_layers=3, dcn_rank=512)

    @classmethod
    def mlperf_dcnv2_x16(cls) -> Workload:
        """MLPerf's DLRM-DCNv2 with every table 16x longer: 1.7 TB of fp32 tables, the size class of the 2D
        sparse parallelism paper's model, where sharding decisions at 1,000+ GPUs matter (MLPerf's own
        ~100 GB is 25 MB a GPU at 4,096). Simulated only."""
        wl = cls.mlperf_dcnv2()
        return dataclasses.replace(wl, name="mlperf-dcnv2-x16",
                                   tables=[dataclasses.replace(t, rows=t.rows * 16) for t in wl.tables])

    @classmethod
    def wukong_mini(cls) -> Workload:
        """Wukong in the public re-implementation's shape (3 layers, dim 128, n_F = n_L = 16, FM rank 24,
        FM MLP 2 x 512) over 8 Zipf tables of 100k rows, pooling 8: the dense stack, not the tables, is
        what this preset is for."""
        tables = [TableSpec(f"t{i}", 100_000, 128, 8, "zipf", 1.05) for i in range(8)]
        return cls("wukong-mini", tables, 13, [256, 128], [512, 256, 1], "wukong", wukong_layers=3,
                   wukong_fm_embs=16, wukong_lcb_embs=16, wukong_rank=24, wukong_mlp=[512, 512])

    @classmethod
    def dlrm_datasets(cls, year: int) -> Workload:
        """Meta's published embedding traces (facebookresearch/dlrm_datasets, 856 tables at batch 65,536 in
        2021, 788 at 131,072 in 2022): every table's ids repeat within a batch as the published reuse
        histograms say (harness/dlrm_datasets.py). Simulated only."""
        from cubic_harness.dlrm_datasets import workload_dict

        return cls.from_dict(workload_dict(year), where=f"preset dlrm-datasets-{year}")

    @classmethod
    def small_meta(cls) -> Workload:
        """`small-zipf`'s model and teacher with every table's ids drawn as Meta's 2022 production traces repeat
        them (the `dlrm-datasets-2022` profile, bags of 13-14): the default task on real traffic's reuse, small
        enough to train here. Its 149k distinct rows a batch of 131,072 touches fit the 200k rows."""
        from cubic_harness.dlrm_datasets import workload_dict

        prod = workload_dict(2022)
        d = cls.small_zipf().to_dict()
        tables = [{k: v for k, v in t.items() if k not in ("id_dist", "zipf_alpha", "pooling")}
                  | {"pooling": prod["tables"][0]["pooling"], "profile": 0} for t in d["tables"]]
        return cls.from_dict(d | {"name": "small-meta", "tables": tables, "profiles": prod["profiles"],
                                  "id_source": "profile", "data": prod["data"]}, where="preset small-meta")

    @classmethod
    def presets(cls) -> dict[str, Callable[[], Workload]]:
        """The named workloads (`workload: NAME` / `preset: NAME`), each made when asked for."""
        return {"small": cls.small, "small-zipf": cls.small_zipf, "small-meta": cls.small_meta, "tiny": cls.tiny,
                "criteo-mlperf-mini": cls.criteo_mlperf_mini,
                "mlperf-dcnv2-mini": cls.mlperf_dcnv2_mini, "wukong-mini": cls.wukong_mini,
                "mlperf-dcnv2": cls.mlperf_dcnv2, "mlperf-dcnv2-x16": cls.mlperf_dcnv2_x16,
                "dlrm-datasets-2021": lambda: cls.dlrm_datasets(2021),
                "dlrm-datasets-2022": lambda: cls.dlrm_datasets(2022)}

    @classmethod
    def preset(cls, name: str, where: str = "workload") -> Workload:
        presets = cls.presets()
        if not isinstance(name, str) or name not in presets:
            raise ConfigError(f"{where}: unknown preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()

    # ------------------------------------------------------------------ derived
    def together(self) -> dict[str, list[int]]:
        """Each `together` label's tables, by index (`TableSpec.together`)."""
        groups: dict[str, list[int]] = {}
        for i, t in enumerate(self.tables):
            if t.together:
                groups.setdefault(t.together, []).append(i)
        return groups

    def constrained(self) -> list[TableSpec]:
        """The tables with plan constraints (`sharding_types`, `ranks`): a config checks them against its group."""
        return [t for t in self.tables if t.sharding_types or t.ranks or t.together]

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    @property
    def dim(self) -> int:
        return self.tables[0].dim

    @property
    def num_features(self) -> int:
        """Feature vectors the interaction sees: the bottom MLP's output and one per table."""
        return self.num_tables + 1

    @property
    def profiled(self) -> bool:
        """Ids follow the tables' profiles of a data sample (drawn like it, or the sample replayed)."""
        return self.id_source != "synthetic"

    @property
    def weighted(self) -> bool:
        """Some table is weighted, so every id of a batch carries a 4-byte score (harness/data.py `Batch.scores`)."""
        return any(t.weighted for t in self.tables)

    def ids_record(self) -> dict[str, Any]:
        """Which ids a trial trained on (its result's env records this): the source, and the data behind it."""
        rec: dict[str, Any] = {"id_source": self.id_source}
        if self.profiled and self.data:
            rec.update(data=self.data.source, sample_rows=self.data.sample_rows)
            if self.id_source == "trace":
                rec["trace_sha256"] = self.data.trace_sha256[:16]
        return rec

    def lookups_per_sample(self) -> list[float]:
        """Mean ids one sample looks up in each table (TableSpec.lookups)."""
        return [t.lookups(self.profiled) for t in self.tables]

    def validate(self, where: str = "workload") -> Workload:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"{where}: name={self.name!r} must be a non-empty string")
        if not self.tables:
            raise ConfigError(f"{where}: tables must not be empty")
        if not _is_int(self.collections) or not 1 <= self.collections <= len(self.tables):
            raise ConfigError(f"{where}: collections={self.collections!r} must be an integer from 1 to the number "
                              f"of tables ({len(self.tables)})")
        if not _is_num(self.teacher_emb_scale) or self.teacher_emb_scale < 0:
            raise ConfigError(f"{where}: teacher_emb_scale={self.teacher_emb_scale!r} must be a number >= 0")
        names = collections.Counter(t.name for t in self.tables)
        for t in self.tables:
            if not isinstance(t.name, str) or not t.name:
                raise ConfigError(f"{where}: table names must be non-empty strings (got {t.name!r})")
            if names[t.name] > 1:
                raise ConfigError(f"{where}: table name {t.name!r} appears {names[t.name]} times; "
                                  "names must be unique")
            if not all(_is_int(v) for v in (t.rows, t.dim, t.pooling)):
                raise ConfigError(f"{where}: table {t.name!r} rows, dim and pooling must be integers "
                                  f"(got {t.rows!r}, {t.dim!r}, {t.pooling!r})")
            if not _is_num(t.zipf_alpha) or t.zipf_alpha <= 0:
                raise ConfigError(f"{where}: table {t.name!r} zipf_alpha={t.zipf_alpha!r} must be a number > 0")
            if t.rows < 1 or t.dim < 1 or t.pooling < 0:
                raise ConfigError(f"{where}: table {t.name!r} needs rows>=1, dim>=1, pooling>=0")
            if t.id_dist not in ID_DISTRIBUTIONS:
                raise ConfigError(f"{where}: table {t.name!r} id_dist={t.id_dist!r}; "
                                  f"choose one of {list(ID_DISTRIBUTIONS)}")
            if t.pooling_type not in POOLING_TYPES:
                raise ConfigError(f"{where}: table {t.name!r} pooling_type={t.pooling_type!r}; "
                                  f"choose one of {list(POOLING_TYPES)}")
            if not isinstance(t.weighted, bool):
                raise ConfigError(f"{where}: table {t.name!r} weighted={t.weighted!r} must be true or false")
            if t.weighted and t.pooling_type != "sum":
                raise ConfigError(f"{where}: table {t.name!r} is weighted and pooled by {t.pooling_type}; "
                                  "weighted features pool by sum")
            if not isinstance(t.features, list) or not all(isinstance(f, str) and f for f in t.features):
                raise ConfigError(f"{where}: table {t.name!r} features must be a list of feature names")
            if not isinstance(t.sharding_types, list) or not all(isinstance(k, str) for k in t.sharding_types):
                raise ConfigError(f"{where}: table {t.name!r} sharding_types must be a list of sharding kinds")
            if not isinstance(t.ranks, list) or not all(_is_int(r) and r >= 0 for r in t.ranks):
                raise ConfigError(f"{where}: table {t.name!r} ranks must be a list of group positions (>= 0)")
            if not isinstance(t.together, str):
                raise ConfigError(f"{where}: table {t.name!r} together={t.together!r} must be a label (text) that "
                                  "the tables kept on one rank share")
            if t.together and t.sharding_types and "table_wise" not in t.sharding_types:
                raise ConfigError(f"{where}: table {t.name!r} together={t.together!r} keeps it whole on one rank "
                                  f"(table-wise), which its sharding_types {t.sharding_types} leave out")
        feats = collections.Counter(f for t in self.tables for f in t.feature_names)
        dup = next((f for f, n in feats.items() if n > 1), None)
        if dup is not None:
            raise ConfigError(f"{where}: feature {dup!r} looks up more than one table; a feature feeds one table")
        if self.id_source not in ID_SOURCES:
            raise ConfigError(f"{where}: id_source={self.id_source!r}; choose one of {list(ID_SOURCES)}")
        if self.id_source == "profile" and not all(t.profile for t in self.tables):
            miss = next(t.name for t in self.tables if not t.profile)
            raise ConfigError(f"{where}: id_source=profile but table {miss!r} has no profile; "
                              "run `cubic workload profile DATA --workload FILE` first")
        if self.id_source == "trace" and not (self.data and self.data.trace):
            raise ConfigError(f"{where}: id_source=trace needs a data trace; run `cubic workload profile "
                              "DATA --workload FILE` (it writes the trace beside the workload)")
        odd = [n for n in (self.data.scores if self.data else ()) if n not in {t.name for t in self.tables
                                                                                if t.weighted}]
        if odd:
            raise ConfigError(f"{where}: data.scores names {odd[0]!r}, not a weighted table of this workload "
                              f"(weighted: {[t.name for t in self.tables if t.weighted]})")
        if not isinstance(self.sample_cycle, int) or self.sample_cycle < 1:
            raise ConfigError(f"{where}: sample_cycle={self.sample_cycle!r} must be a positive integer")
        if len({t.dim for t in self.tables}) != 1:
            raise ConfigError(f"{where}: interaction {self.interaction!r} needs one embedding dim for all tables "
                              f"(got {sorted({t.dim for t in self.tables})})")
        if not _is_int(self.dense_features) or self.dense_features < 0:
            raise ConfigError(f"{where}: dense_features={self.dense_features!r} must be an integer >= 0")
        for key in ("bottom_mlp", "top_mlp"):
            mlp = getattr(self, key)
            if not isinstance(mlp, list) or not all(_is_int(x) and x > 0 for x in mlp):
                raise ConfigError(f"{where}: {key} must be a list of positive integers (got {mlp!r})")
        if self.interaction not in INTERACTIONS:
            raise ConfigError(f"{where}: interaction={self.interaction!r}; choose one of {list(INTERACTIONS)}")
        self._validate_family(where)
        if not self.bottom_mlp or self.bottom_mlp[-1] != self.dim:
            raise ConfigError(f"{where}: bottom_mlp must end in the embedding dim {self.dim} "
                              f"(got {self.bottom_mlp})")
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ConfigError(f"{where}: top_mlp must end in 1 (got {self.top_mlp})")
        return self

    def _validate_family(self, where: str) -> None:
        """The interaction's own keys: integers in range, and no other family's key set away from its default."""
        defaults = Workload()
        for fam, keys in FAMILY_KEYS.items():
            for k in keys:
                v = getattr(self, k)
                if k == "wukong_mlp":
                    if not isinstance(v, list) or not all(_is_int(x) and x > 0 for x in v):
                        raise ConfigError(f"{where}: wukong_mlp must be a list of positive integers (got {v!r})")
                elif not _is_int(v):
                    raise ConfigError(f"{where}: {k}={v!r} must be an integer")
                if fam != self.interaction and v != getattr(defaults, k):
                    raise ConfigError(f"{where}: {k} applies to interaction {fam!r} only "
                                      f"(this workload's interaction is {self.interaction!r})")
        width = self.num_features * self.dim
        if self.interaction == "dcn":
            if self.dcn_layers < 1:
                raise ConfigError(f"{where}: dcn_layers={self.dcn_layers} must be >= 1")
            if not 0 <= self.dcn_rank <= width:
                raise ConfigError(f"{where}: dcn_rank={self.dcn_rank} must be 0 (full rank) or 1..{width}, the "
                                  f"cross network's input width ({self.num_features} features x dim {self.dim})")
        if self.interaction == "wukong":
            for k in ("wukong_layers", "wukong_fm_embs", "wukong_lcb_embs", "wukong_rank"):
                if getattr(self, k) < 1:
                    raise ConfigError(f"{where}: {k}={getattr(self, k)} must be >= 1")

    def interaction_keys(self) -> tuple[str, ...]:
        """This workload's family keys (what `to_dict` writes beside the common ones)."""
        return FAMILY_KEYS.get(self.interaction, ())

    # ------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        """Common keys plus the interaction's own; other families' keys and the user-model keys at their
        defaults are left out (so a preset's dict, and every stored key made from one, stays)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        # a profile object several tables share is written once (`profiles`) and named by its index: 856 equal
        # tables of a published trace are one profile, not 856 copies in every stored config
        shared = {id(t.profile): t.profile for t in self.tables if t.profile is not None}
        if len(shared) < sum(t.profile is not None for t in self.tables):
            ref = {k: i for i, k in enumerate(shared)}
            d["tables"] = [t.to_dict(ref.get(id(t.profile))) for t in self.tables]
            d["profiles"] = [p.to_dict() for p in shared.values()]
        else:
            d["tables"] = [t.to_dict() for t in self.tables]
        d["bottom_mlp"], d["top_mlp"], d["wukong_mlp"] = list(self.bottom_mlp), list(self.top_mlp), list(
            self.wukong_mlp)
        for k, default in USER_MODEL_DEFAULTS.items():
            if d[k] == default:
                d.pop(k)
            elif k in ("data", "dense_model"):
                d[k] = dataclasses.asdict(d[k])
        if d["teacher_emb_scale"] == TEACHER_EMB_SCALE:
            d.pop("teacher_emb_scale")
        mine = set(self.interaction_keys())
        for keys in FAMILY_KEYS.values():
            for k in keys:
                if k not in mine:
                    d.pop(k)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "workload") -> Workload:
        """Full form (`tables: [{name, rows, dim, ...}]`), `preset: NAME` (+ overrides),
        or the anchor's compact form (`tables: 8, rows: ..., pooling: ...`)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: must be a mapping, got {type(d).__name__}")
        d = dict(d)
        if "preset" in d:
            base = cls.preset(d.pop("preset"), where).to_dict()
            if d.get("interaction", base["interaction"]) != base["interaction"]:  # another family: its own keys
                for k in FAMILY_KEYS.get(base["interaction"], ()):
                    base.pop(k)
            base.update(d)
            d = base
        if isinstance(d.get("tables"), int):
            return cls.from_anchor_dict(d, where)[0]
        if not isinstance(d.get("tables", []), list):
            raise ConfigError(f"{where}: tables={d['tables']!r} must be a list of tables "
                              "({name, rows, dim, pooling, ...}) or, in the anchor format, a count")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - {"profiles"}, key=str)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed: {sorted(known)}")
        shared = d.pop("profiles", [])
        if not isinstance(shared, list):
            raise ConfigError(f"{where}: profiles must be a list of profiles (tables name one by its index)")
        shared = [IdProfile.from_dict(p, f"{where}: profiles[{i}]") for i, p in enumerate(shared)]
        tables = []
        tfields = {f.name for f in dataclasses.fields(TableSpec)}
        for i, t in enumerate(d.pop("tables", [])):
            if isinstance(t, TableSpec):
                tables.append(t)
                continue
            if not isinstance(t, dict):
                raise ConfigError(f"{where}: tables[{i}] must be a mapping of {sorted(tfields)}")
            bad = sorted(set(t) - tfields, key=str)
            if bad:
                raise ConfigError(f"{where}: tables[{i}] unknown key {bad[0]!r}; allowed: {sorted(tfields)}")
            t = dict(t)
            if _is_int(t.get("profile")):
                if not 0 <= t["profile"] < len(shared):
                    raise ConfigError(f"{where}: tables[{i}] profile={t['profile']} names no entry of profiles "
                                      f"(it has {len(shared)})")
                t["profile"] = shared[t["profile"]]
            elif t.get("profile") is not None:
                t["profile"] = IdProfile.from_dict(t["profile"], f"{where}: tables[{i}]")
            try:
                tables.append(TableSpec(**{"name": f"t{i}", **t}))
            except TypeError as e:
                raise ConfigError(f"{where}: tables[{i}]: {e}") from None
        if d.get("data") is not None and not isinstance(d["data"], DataSample):
            d["data"] = DataSample.from_dict(d["data"], where)
        if d.get("dense_model") is not None and not isinstance(d["dense_model"], DenseModel):
            d["dense_model"] = DenseModel.from_dict(d["dense_model"], where)
        try:
            return cls(tables=tables, **d).validate(where)
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def from_anchor_dict(cls, w: dict[str, Any], where: str = "workload") -> tuple[Workload, dict[str, Any]]:
        """The anchor JSON format -> (workload, trial knobs it fixes)."""
        required = ["tables", "rows", "dim", "pooling", "dense", "bottom_mlp", "top_mlp"]
        for k in required:
            if k not in w:
                raise ConfigError(f"{where}: missing key {k!r} (required: {required})")
        family = {k for keys in FAMILY_KEYS.values() for k in keys}
        allowed = set(required) | family | {"interaction", "local_batch", "world", "threads_per_rank",
                                            "warmup_steps", "timed_steps", "emb_dtype", "id_dist", "zipf_alpha",
                                            "name"}
        unknown = sorted(set(w) - allowed, key=str)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed: {sorted(allowed)}")
        n = w["tables"]
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"{where}: tables={n!r} must be a positive integer")

        def per_table(key: str) -> list[int]:
            v = w[key]
            v = v if isinstance(v, list) else [v] * n
            if len(v) != n or not all(_is_int(x) and x >= 0 for x in v):
                raise ConfigError(f"{where}: {key} must be a non-negative int or a list of {n} ints")
            return v

        rows, pool = per_table("rows"), per_table("pooling")
        tables = [TableSpec(f"t{i}", rows[i], w["dim"], pool[i], w.get("id_dist", "uniform"),
                            w.get("zipf_alpha", 1.05)) for i in range(n)]
        for key in ("bottom_mlp", "top_mlp"):
            if not isinstance(w[key], list) or not all(isinstance(x, int) and x > 0 for x in w[key]):
                raise ConfigError(f"{where}: {key} must be a list of positive ints")
        wl = cls(w.get("name", "custom"), tables, w["dense"], list(w["bottom_mlp"]), list(w["top_mlp"]),
                 w.get("interaction", "dot"), **{k: w[k] for k in sorted(family & set(w))}).validate(where)
        knobs = {}
        for src, dst in (("local_batch", "batch_size"), ("world", "world_size"),
                         ("threads_per_rank", "threads_per_rank"), ("warmup_steps", "warmup_steps"),
                         ("timed_steps", "measure_steps"), ("emb_dtype", "emb_precision")):
            if src in w:
                knobs[dst] = w[src]
        return wl, knobs

    @classmethod
    def from_json_file(cls, path: str | Path) -> tuple[Workload, dict[str, Any]]:
        """A workload JSON file: the anchor format (-> the trial knobs it fixes too) or the full form."""
        path = Path(path)
        try:
            w = json.loads(read_text(path, "workload file"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if isinstance(w, dict) and isinstance(w.get("tables"), int):
            return cls.from_anchor_dict(w, where=str(path))
        if isinstance(w, dict) and isinstance(w.get("data"), dict) and w["data"].get("trace"):
            # the trace lies beside the workload file: resolve it here, where the file's folder is known
            w = {**w, "data": {**w["data"], "trace": str((path.parent / w["data"]["trace"]).resolve())}}
        return cls.from_dict(w, where=str(path)), {}


#: The user-model keys and their defaults (left out of `to_dict` there).
USER_MODEL_DEFAULTS: dict[str, Any] = {"id_source": "synthetic", "data": None, "dense_model": None, "factory": "",
                                       "collections": 1}

# The anchor's workload-small.json, embedded so the preset needs no file outside the package.
ANCHOR_SMALL: dict[str, Any] = {
    "name": "small", "tables": 8, "rows": 200000, "dim": 64, "pooling": 20, "dense": 13,
    "bottom_mlp": [256, 128, 64], "top_mlp": [512, 256, 1], "interaction": "dot",
}
