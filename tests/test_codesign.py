"""`cubic codesign`: the cluster as knobs of a simulated multi-objective study (time to train,
cost), its front and knee; bad input is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import yaml
from typer.testing import CliRunner

from cubic.codesign.clusters import build_choice
from cubic.codesign.front import Point, knee
from cubic.codesign.objectives import time_to_train_s
from cubic.codesign.study import CodesignStudy
from cubic.space.codesign import TimeToTrain
from cubic.space.search_space import load_space

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "search_spaces" / "mlperf_codesign.yaml"


def small(tmp_path: Path, **codesign) -> Path:
    """The shipped co-design space on 2 nodes x 2 sizes x 2 fabrics, `codesign` keys over it."""
    d = yaml.safe_load(SHIPPED.read_text())
    d["codesign"].update(
        nodes_from=["h100-8", "b200-8"],
        gpus=[8, 16],
        price_per_gpu_hour={"h100-8": 3.0, "b200-8": 5.0},
    )
    d["codesign"].update(codesign)
    p = tmp_path / "space.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_time_to_train_counts_training_and_evaluations() -> None:
    ttt = TimeToTrain(
        samples=1000, global_batch=10, eval_every=250, eval_samples=30, eval_speedup=3.0, fixed_s=5
    )
    assert time_to_train_s(ttt, qps=10.0) == pytest.approx(100 + 4 * 30 / 30 + 5)


def test_a_cluster_choice_is_its_node_at_a_size_on_a_fabric(tmp_path: Path) -> None:
    sec = load_space(SHIPPED).codesign
    ib = build_choice(sec, "h100-8", 64, "ib-sharp")
    roce = build_choice(sec, "h100-8", 64, "roce")
    assert (ib.cluster.nodes, ib.cluster.devices_per_node, ib.ranks_per_node) == (8, 8, 8)
    assert ib.cluster.network.in_network_reduction and not roce.cluster.network.in_network_reduction
    assert roce.cluster.network.bandwidth_gbs == pytest.approx(
        0.87 * ib.cluster.network.bandwidth_gbs
    )
    nvl = build_choice(sec, "gb200-nvl72", 128, "ib-sharp")
    assert (nvl.cluster.nodes, nvl.ranks_per_node) == (2, 72)
    assert (
        ib.figures()["dense_tflops"]
        < build_choice(sec, "b200-8", 64, "roce").figures()["dense_tflops"]
    )


def test_the_knee_is_the_front_point_nearest_the_ideal_one() -> None:
    pts = [
        Point(i, "", "", "", {"time_to_train": t, "cost": c})
        for i, (t, c) in enumerate([(1.0, 10.0), (2.0, 3.0), (5.0, 2.5), (9.0, 1.0)])
    ]
    assert knee(pts, ["time_to_train", "cost"]) == 1
    assert knee([], ["cost"]) is None


@pytest.mark.parametrize("searcher", ["nsga2", "proxy"])
def test_a_study_finds_a_front_over_clusters_and_resumes_without_repricing(
    tmp_path: Path, searcher: str
) -> None:
    sp = load_space(small(tmp_path))
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}")
    cd = CodesignStudy(sp, storage, seed=1, searcher=searcher)
    cd.run(20)
    done = cd.study.get_trials(deepcopy=False)
    assert len(done) == 20
    assert {t.user_attrs["cluster"].split()[0] for t in done} == {"h100-8", "b200-8"}
    priced = [t for t in done if "same_as" not in t.user_attrs]
    keys = [(t.user_attrs["cluster"], t.user_attrs["key"]) for t in priced]
    assert len(keys) == len(set(keys))  # nothing priced twice; a repeat names the trial it repeats
    for t in done:
        if t.state == optuna.trial.TrialState.COMPLETE:
            s = t.user_attrs["scores"]
            assert list(t.values) == [s["time_to_train"], s["cost"]]
            gpus = int(t.params["cluster.gpus"])
            assert t.user_attrs["global_batch"] == 55296 // gpus * gpus
    again = CodesignStudy(sp, storage, seed=2, searcher=searcher)
    assert again.priced == cd.priced
    again.run(24)
    assert len(again.study.get_trials(deepcopy=False)) == 24
    assert again.study.best_trials


def test_the_cli_prints_the_front_and_writes_it(tmp_path: Path) -> None:
    from cubic.cli.app import app

    res = CliRunner().invoke(
        app,
        [
            "codesign",
            "--space",
            str(small(tmp_path)),
            "--trials",
            "12",
            "--run-dir",
            str(tmp_path / "run"),
            "--searcher",
            "random",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "Pareto front" in res.output and "knee" in res.output
    f = json.loads((tmp_path / "run" / "front.json").read_text())
    assert f["points"] and f["knee_trial"] in [p["trial"] for p in f["points"]]
    assert (tmp_path / "run" / "front.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "edit, says",
    [
        (
            {"nodes_from": ["h100-8", "clusters/nope.yaml"], "objectives": ["time_to_train"]},
            "codesign.nodes_from[1]: 'clusters/nope.yaml': clusters/nope.yaml: cluster file "
            "not found",
        ),
        ({"price_per_gpu_hour": {"h100-8": -3.0, "b200-8": 5.0}}, "price_per_gpu_hour.h100-8"),
        ({"price_per_gpu_hour": {"h100-8": "cheap", "b200-8": 5.0}}, "price_per_gpu_hour.h100-8"),
        (
            {"price_per_gpu_hour": {"h100-8": 3.0}},
            "objective cost needs price_per_gpu_hour for every node",
        ),
        ({"time_to_train": None}, "objective time_to_train needs codesign.time_to_train"),
        ({"objectives": ["speed"]}, "codesign.objectives"),
        (
            {"fabrics": {"x": {"from": "no-such-preset"}}},
            "codesign.fabrics.x.from: 'no-such-preset'",
        ),
    ],
)
def test_bad_codesign_input_exits_2_with_one_line(tmp_path: Path, edit: dict, says: str) -> None:
    from cubic.cli.app import app

    res = CliRunner().invoke(
        app,
        [
            "codesign",
            "--space",
            str(small(tmp_path, **edit)),
            "--trials",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
        ],
    )
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and says in lines[0], res.output
    assert "Traceback" not in res.output and not (tmp_path / "run").exists()


def test_a_codesign_space_searches_layout_knobs_only(tmp_path: Path) -> None:
    from cubic_harness.errors import ConfigError

    d = yaml.safe_load(small(tmp_path).read_text())
    d["knobs"]["emb_precision"] = {"choices": ["fp16", "fp32"]}
    (tmp_path / "n.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(
        ConfigError, match="knobs.emb_precision: a space with codesign: searches layout"
    ):
        load_space(tmp_path / "n.yaml")


def test_sites_split_the_nodes_between_data_centers_joined_by_an_interconnect(
    tmp_path: Path,
) -> None:
    """The data-center tier as a knob: 2 sites take the interconnect of a preset that has one; a
    size whose nodes cannot be split evenly is a trial that fails with that reason."""
    sp = load_space(small(tmp_path, sites=[1, 2], interconnect_from="h100-16384-4dc"))
    one = build_choice(sp.codesign, "h100-8", 16, "ib-sharp", 1)
    two = build_choice(sp.codesign, "h100-8", 16, "ib-sharp", 2)
    assert one.cluster.datacenters is None and two.cluster.datacenters.count == 2
    assert two.cluster.datacenters.latency_us == pytest.approx(600.0) and two.label.endswith(
        "2 sites"
    )
    assert "cannot be split evenly" in build_choice(sp.codesign, "h100-8", 8, "ib-sharp", 2).unfit
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}")
    cd = CodesignStudy(sp, storage, seed=0, searcher="random")
    p = {
        **sp.baseline_params(),
        "cluster.node": "h100-8",
        "cluster.gpus": 16,
        "cluster.fabric": "ib-sharp",
    }
    near, far = cd.price({**p, "cluster.sites": 1}), cd.price({**p, "cluster.sites": 2})
    assert (
        far.scores["time_to_train"] > near.scores["time_to_train"]
    )  # the all-to-all crosses sites
    bad = cd.price({**p, "cluster.gpus": 8, "cluster.sites": 2})
    assert bad.status == "error" and "cannot be split evenly" in bad.reason
    cd.run(12)
    assert "cluster.sites" in cd.study.get_trials(deepcopy=False)[0].params


def test_sites_without_an_interconnect_exit_2_with_one_line(tmp_path: Path) -> None:
    from cubic.cli.app import app

    res = CliRunner().invoke(
        app,
        [
            "codesign",
            "--space",
            str(small(tmp_path, sites=[1, 2])),
            "--run-dir",
            str(tmp_path / "run"),
        ],
    )
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "needs codesign.interconnect_from" in lines[0]
