"""Search-space loading: the shipped spaces, canonical configurations, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cubic.space.search_space import fingerprint, load_space
from cubic_harness.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
GOOD = """\
name: t
workload: {preset: tiny}
baseline: {world_size: 2, sharding: table_wise, batch_size: 64, kernel: torch}
knobs:
  sharding: [table_wise, row_wise]
  batch_size: {type: int, low: 64, high: 256, log: true}
  sharding_group_size: {choices: [0, 1], when: sharding_group_size < world_size}
  sparse_sync: {choices: [grad_allreduce, weight_avg], when: sharding_group_size > 0}
trial: {warmup_steps: 1, measure_steps: 3, windows: 1}
budget: {trials: 5}
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", ["dlrm_cpu.yaml", "tiny.yaml"])
def test_shipped_spaces_load(name: str) -> None:
    space = load_space(ROOT / "search_spaces" / name)
    assert space.baseline.validate() is space.baseline
    assert space.tup(space.baseline_params()) in set(space.all_tuples)
    json.dumps(space.to_dict())  # the study's "space" attr must be JSON
    assert space.to_dict()["baseline_config"]["workload"]["name"] == space.workload.name


def test_dlrm_cpu_space_matches_the_brief() -> None:
    space = load_space(ROOT / "search_spaces" / "dlrm_cpu.yaml")
    b = space.baseline
    assert (b.sharding, b.kernel, b.emb_precision, b.dense_precision, b.pipeline_depth, b.batch_size,
            b.world_size) == ("table_wise", "fbgemm", "fp32", "fp32", 0, 1024, 2)
    assert space.workload.name == "small-zipf"  # skewed per-table ids: see test_eval_quality.py
    assert space.knobs["dense_precision"].choices == ("fp32", "bf16")
    assert space.knobs["kernel"].choices == ("fbgemm", "native", "torch")


def test_ranges_conditions_and_canonical_configs(tmp_path: Path) -> None:
    space = load_space(write(tmp_path, GOOD))
    assert space.knobs["batch_size"].choices == (64, 128, 256)
    # sparse_sync means nothing without 2D: both values are one configuration
    a = space.tup({"sharding": "row_wise", "batch_size": 128, "sharding_group_size": 0, "sparse_sync": "weight_avg"})
    b = space.tup({"sharding": "row_wise", "batch_size": 128, "sharding_group_size": 0,
                   "sparse_sync": "grad_allreduce"})
    assert a == b
    c = space.tup({"sharding": "row_wise", "batch_size": 128, "sharding_group_size": 1, "sparse_sync": "weight_avg"})
    assert c != b and space.config(space.params_of(c)).replicas == 2
    # 2 shardings x 3 batches x (plain + 2D x 2 syncs) distinct configurations
    assert space.size() == 2 * 3 * 3
    rng = np.random.default_rng(0)
    seen: set[tuple] = set()
    for _ in range(space.size()):
        t = space.random_tuple(rng, seen)
        assert t is not None and t not in seen and space.valid(space.params_of(t))
        seen.add(t)
    assert space.random_tuple(rng, seen) is None
    assert all(space.tup(space.params_of(n)) == n for n in space.neighbours(b))
    assert sorted(space.differs_in_numerics(space.params_of(c))) == ["batch_size", "sharding_group_size",
                                                                     "sparse_sync"]
    assert space.differs_in_numerics({**space.baseline_params(), "sharding": "row_wise"}) == []


def test_configs_that_cannot_run_are_not_in_the_space(tmp_path: Path) -> None:
    """Static rules the planner would reject at run time (here: 6-wide column shards of 16-wide
    tables) make a configuration invalid in the space, so no searcher spends a trial on it."""
    text = GOOD.replace("[table_wise, row_wise]", "[table_wise, column_wise]\n  column_shard_dim: [0, 6]")
    space = load_space(write(tmp_path, text))
    b = space.baseline_params()
    assert space.valid({**b, "sharding": "column_wise", "column_shard_dim": 0})
    assert not space.valid({**b, "sharding": "column_wise", "column_shard_dim": 6})
    cfgs = [space.config(space.params_of(t)) for t in space.all_tuples]
    assert not any(c.sharding == "column_wise" and c.column_shard_dim == 6 for c in cfgs)
    assert any(c.sharding == "column_wise" for c in cfgs)


def test_global_batch_and_learning_rates_change_numerics(tmp_path: Path) -> None:
    """The quality gate sees the global batch (per-rank batch x ranks) and the learning rates."""
    more = "  world_size: [1, 2]\n  emb_lr: [0.01, 0.05]\ntrial: {"
    space = load_space(write(tmp_path, GOOD.replace("trial: {", more)))
    b = space.baseline_params()
    assert space.differs_in_numerics({**b, "world_size": 1}) == ["world_size"]
    assert space.differs_in_numerics({**b, "world_size": 1, "batch_size": 128}) == []  # 1 x 128 = 2 x 64
    assert space.differs_in_numerics({**b, "emb_lr": 0.05}) == ["emb_lr"]


def test_fingerprint_ignores_budget_and_name(tmp_path: Path) -> None:
    a = load_space(write(tmp_path, GOOD)).to_dict()
    b = load_space(write(tmp_path, GOOD.replace("trials: 5", "trials: 9").replace("name: t", "name: u"))).to_dict()
    c = load_space(write(tmp_path, GOOD.replace("measure_steps: 3", "measure_steps: 4"))).to_dict()
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)


def test_resuming_with_another_space_names_the_first_difference(tmp_path: Path) -> None:
    """A study keeps the space it was made with; opening it with one that measures differently (an
    edited YAML, or a cubic whose configs gained a field) is refused naming what changed."""
    from cubic.study.store import Store, open_storage, storage_url

    rdb = open_storage(storage_url(tmp_path, must_exist=False))
    Store(load_space(write(tmp_path, GOOD)), rdb, tmp_path).record_space()
    Store(load_space(write(tmp_path, GOOD.replace("trials: 5", "trials: 9"))), rdb, tmp_path)  # budget: same study
    with pytest.raises(ConfigError, match=r"first difference: trial\.measure_steps: 3 -> 4\)"):
        Store(load_space(write(tmp_path, GOOD.replace("measure_steps: 3", "measure_steps: 4"))), rdb, tmp_path)


@pytest.mark.parametrize("text, expected", [
    (GOOD.replace("knobs:\n", "knobs:\n  sharding: [a, b\n"), ":6: malformed YAML"),  # where yaml sees the problem
    (GOOD.replace("  sharding: [table_wise, row_wise]", "  shardin: [table_wise]"),
     ":5: knobs.shardin: unknown key; allowed: ['world_size'"),
    (GOOD.replace("[table_wise, row_wise]", "[]"), ":5: knobs.sharding.choices: choices must not be empty"),
    (GOOD.replace("[table_wise, row_wise]", "[row_wise, column_wise]"),
     ":3: baseline.sharding: baseline value 'table_wise' is outside the space"),
    (GOOD.replace("[table_wise, row_wise]", "[table_wise, diagonal]"), "knobs.sharding.choices[1]: 'diagonal'"),
    (GOOD.replace("budget: {trials: 5}", "budget: {trials: 0}"), "budget.trials: 0 must be >= 1"),
    (GOOD.replace("when: sharding_group_size > 0", "when: sharding_group_size >> 0"), "cannot parse"),
    (GOOD + "bogus: 1\n", ":11: bogus: unknown key"),
    (GOOD.replace("[table_wise, row_wise]", "[table_wise, row_wise]\n  batch_size: [64, -128]").replace(
        "  batch_size: {type: int, low: 64, high: 256, log: true}\n", ""),
     "value -128 is in no valid configuration: with the baseline: batch_size=-128 must be >= 1"),
    (GOOD.replace("budget: {trials: 5}", "budget: {trials: .inf}"), "budget.trials: inf is not an integer"),
    (GOOD.replace("budget: {trials: 5}", "budget: {trials: 5, isolation: rack}"),
     "budget.isolation: 'rack' is not allowed; choose one of ['node', 'cores']"),
    (GOOD.replace("high: 256", "high: .inf"), "must be finite numbers with low <= high"),
    (GOOD.replace("when: sharding_group_size > 0", "when: mem_cap_mb > 0"), "unknown name 'mem_cap_mb'"),
    (GOOD.replace("preset: tiny", "preset: huge"), "workload: unknown preset 'huge'"),
])
def test_bad_spaces_fail_with_one_line_naming_file_line_and_key(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_space(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    assert expected in msg, msg


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_space(tmp_path / "nope.yaml")


def test_a_shipped_space_loads_by_name_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no search_spaces/ here: the package's own copy
    assert load_space("tiny").name == load_space("tiny.yaml").name == "tiny"
    with pytest.raises(ConfigError, match="nope.yaml: search space file not found"):
        load_space("nope.yaml")


def test_the_numerics_rule_is_one_table_of_aspects() -> None:
    """Each quality knob changes one aspect of what trains; keys, changed knobs and screen labels all read it."""
    from cubic.space import numerics
    from cubic_harness.config import TrialConfig

    knobs = tuple(numerics.NUMERICS)
    base = TrialConfig(world_size=4, batch_size=64, sharding="row_wise", emb_optimizer="rowwise_adagrad")
    # 4 x 64 trains as 2 x 128: the same global batch, the same key, nothing to judge
    same = base.replace(world_size=2, batch_size=128)
    assert numerics.key(same, knobs) == numerics.key(base, knobs)
    assert numerics.changed_knobs(same, base, knobs) == []
    # column-wise shards keep their own optimizer state, unless the optimizer has none
    col = base.replace(sharding="column_wise")
    assert numerics.changed_knobs(col, base, knobs) == ["sharding"]
    assert numerics.changes(col, base, knobs, knobs) == {("sharding", "column_wise")}
    sgd = base.replace(emb_optimizer="sgd")
    assert numerics.key(sgd.replace(sharding="column_wise"), knobs) == numerics.key(sgd, knobs)
    # replicas that apply one update with the union of their bags take the full model-parallel step
    assert numerics.key(base.replace(sharding_group_size=2), knobs) == numerics.key(base, knobs)
    assert numerics.changed_knobs(base.replace(sharding_group_size=2), base, knobs) == []
    # the world size moves the replicas under a fixed group size: the group-size knob is where it shows
    two_d = base.replace(sharding_group_size=2, sparse_sync="weight_avg")
    wider = two_d.replace(world_size=8, batch_size=32)
    assert numerics.changed_knobs(wider, two_d, knobs) == ["sharding_group_size"]
    assert numerics.changes(wider, two_d, knobs, ["world_size"]) == frozenset()  # not a searched knob's change
    # a knob a space names beyond the table is its own aspect
    assert numerics.changed_knobs(base.replace(kernel="torch"), base, ("kernel",)) == ["kernel"]


def test_comm_overlap_is_a_knob_that_changes_no_numerics(tmp_path: Path) -> None:
    """comm_overlap's whole path from YAML: a space searches it, a configuration carries it, the quality gate
    needs no run for it (the same math in another order), and a value it does not have is one line."""
    text = ("name: ov\nworkload: {preset: tiny}\nbaseline: {world_size: 2, sharding: table_wise, batch_size: 64}\n"
            "knobs:\n  comm_overlap: [none, forward, forward_backward]\n")
    (tmp_path / "s.yaml").write_text(text)
    space = load_space(tmp_path / "s.yaml")
    assert space.config({"comm_overlap": "forward_backward"}).comm_overlap == "forward_backward"
    assert space.numerics_changes({"comm_overlap": "forward_backward"}) == frozenset()
    (tmp_path / "b.yaml").write_text(text.replace("forward_backward]", "sometimes]"))
    with pytest.raises(ConfigError, match=r"comm_overlap.*'sometimes' is not allowed"):
        load_space(tmp_path / "b.yaml")


def test_inert_knobs_change_neither_what_trains_nor_its_price() -> None:
    """`inert_knobs`, the one rule: with one replica the 2D knobs set nothing, and without a
    weight_avg merge the interval spaces nothing; the optimizer always matters. Every value of an
    inert knob prices the same (the simulator reads each knob only where it acts), while the same
    knob matters where it is not inert."""
    from cubic_harness.config import CHOICES, TrialConfig, inert_knobs
    from cubic_harness.sim.backend import simulate
    from cubic_harness.sim.cluster import resolve

    one = TrialConfig(world_size=8, device="cuda", kernel="triton")
    two_d = {"sparse_sync", "sparse_sync_interval", "group_placement"}
    whole = one.replace(sharding_group_size=8, sparse_sync="weight_avg")  # one group of the world
    assert inert_knobs(one) == inert_knobs(whole) == two_d
    gather = one.replace(sharding_group_size=2)
    avg = gather.replace(sparse_sync="weight_avg")
    assert inert_knobs(gather) == {"sparse_sync_interval"} and inert_knobs(avg) == frozenset()
    assert not any("emb_optimizer" in inert_knobs(c.replace(emb_optimizer=o))
                   for c in (one, gather, avg) for o in CHOICES["emb_optimizer"])
    cluster = resolve("h100-8")
    values = {"sparse_sync": CHOICES["sparse_sync"], "group_placement": CHOICES["group_placement"],
              "sparse_sync_interval": (1, 8)}

    def priced(cfg: TrialConfig) -> tuple:
        r = simulate(cfg, cluster)
        assert r.status == "ok", r.error
        return r.qps, r.peak_mem_mb, tuple(sorted(r.breakdown_ms.items()))

    for cfg in (one, gather, avg):
        for k in inert_knobs(cfg):
            assert len({priced(cfg.replace(**{k: v})) for v in values[k]}) == 1, (cfg.replicas, k)
    assert len({priced(avg.replace(sparse_sync_interval=v)) for v in (1, 8)}) == 2


def test_a_space_applies_the_inert_rule_without_a_when(tmp_path: Path) -> None:
    """A space counts configurations that differ only in inert knobs as one whether or not its YAML
    restates the rule in `when:` lines: the same configurations either way."""
    knobs = ("  sparse_sync: {choices: [grad_allreduce, weight_avg]WHEN1}\n"
             "  sparse_sync_interval: {choices: [1, 4]WHEN2}\n"
             "  group_placement: {choices: [intra_node, cross_node]WHEN1}\n")
    sync = "  sparse_sync: {choices: [grad_allreduce, weight_avg], when: sharding_group_size > 0}\n"
    base = GOOD.replace(sync, knobs)
    said = base.replace("WHEN1", ", when: sharding_group_size > 0").replace(
        "WHEN2", ", when: sparse_sync == weight_avg and sharding_group_size > 0")
    (tmp_path / "said.yaml").write_text(said)
    (tmp_path / "bare.yaml").write_text(base.replace("WHEN1", "").replace("WHEN2", ""))
    with_when, without = load_space(tmp_path / "said.yaml"), load_space(tmp_path / "bare.yaml")
    assert not any(kn.when for k, kn in without.knobs.items() if k != "sharding_group_size")
    # per sharding and batch: plain model parallelism once, 2D with grad_allreduce x 2 placements,
    # and weight_avg x 2 placements x 2 intervals
    assert without.size() == with_when.size() == 2 * 3 * (1 + 2 + 4)
    assert without.all_tuples == with_when.all_tuples
    one = {"sharding": "row_wise", "batch_size": 128, "sharding_group_size": 0}
    assert len({without.tup({**one, "sparse_sync": s, "sparse_sync_interval": i,
                             "group_placement": p})
                for s in ("grad_allreduce", "weight_avg") for i in (1, 4)
                for p in ("intra_node", "cross_node")}) == 1
