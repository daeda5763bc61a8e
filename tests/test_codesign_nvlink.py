"""`cubic codesign`'s NVLink domain knob (`nvlink_domains`): a domain of D GPUs is what the
simulator calls a node, on the node's NVLink with its per-GPU figures; absent, the study has no
such parameter; a bad domain is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import yaml
from typer.testing import CliRunner

from cubic.codesign.clusters import NVLINK, build_choice
from cubic.codesign.study import CodesignStudy
from cubic.space.search_space import load_space

SHIPPED = Path(__file__).resolve().parents[1] / "search_spaces" / "mlperf_codesign.yaml"


def space(tmp_path: Path, **codesign: object) -> Path:
    """The shipped co-design space on h100-8 at 8 and 64 GPUs, `codesign` keys over it."""
    d = yaml.safe_load(SHIPPED.read_text())
    d["codesign"].update(nodes_from=["h100-8"], gpus=[8, 64], price_per_gpu_hour={"h100-8": 3.0})
    d["codesign"].update(codesign)
    p = tmp_path / "space.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def study(path: Path, tmp_path: Path) -> CodesignStudy:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}")
    return CodesignStudy(load_space(path), storage, seed=0, searcher="random")


def test_a_domain_is_the_simulators_node_with_the_nodes_per_gpu_figures(tmp_path: Path) -> None:
    sec = load_space(space(tmp_path, nvlink_domains=["node", 64])).codesign
    own = build_choice(sec, "h100-8", 64, "ib-sharp", 1, "node")
    nvl = build_choice(sec, "h100-8", 64, "ib-sharp", 1, 64)
    assert (own.cluster.nodes, own.cluster.devices_per_node, own.label) == (
        8,
        8,
        "h100-8 x64 nvl8 ib-sharp",
    )
    assert (nvl.cluster.nodes, nvl.cluster.devices_per_node, nvl.ranks_per_node) == (1, 64, 64)
    assert nvl.label == "h100-8 x64 nvl64 ib-sharp" and nvl.figures()["nvlink_domain"] == 64
    a, b = own.cluster, nvl.cluster
    assert (b.device, b.intra_node, b.network) == (a.device, a.intra_node, a.network)
    assert b.host_memory_gb / 64 == pytest.approx(a.host_memory_gb / 8)
    # without the key a cluster is labelled (and so keyed in a stored study) as before
    assert build_choice(sec, "h100-8", 64, "ib-sharp").label == "h100-8 x64 ib-sharp"


@pytest.mark.parametrize("sharding, faster", [("column_wise", 1.02), ("row_wise", 2.0)])
def test_a_larger_domain_speeds_an_all_to_all_bound_plan(
    tmp_path: Path, sharding: str, faster: float
) -> None:
    """64 H100s in one NVLink domain: the all-to-all leaves the NICs for NVLink. Column-wise
    tables at this batch are mostly fixed costs; row-wise ones are bound by their exchange."""
    cd = study(space(tmp_path, nvlink_domains=["node", 64]), tmp_path)
    p = {
        **cd.space.baseline_params(),
        "sharding": sharding,
        "cluster.node": "h100-8",
        "cluster.gpus": 64,
        "cluster.fabric": "ib-sharp",
    }
    own, nvl = cd.price({**p, NVLINK: "node"}), cd.price({**p, NVLINK: 64})
    assert own.status == nvl.status == "ok", (own.reason, nvl.reason)
    assert nvl.scores["qps"] > faster * own.scores["qps"]
    assert nvl.scores["time_to_train"] < own.scores["time_to_train"]


def test_the_study_has_the_parameter_only_when_the_section_lists_domains(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = study(space(tmp_path / "a"), tmp_path / "a")
    plain.run(4)
    assert all(NVLINK not in t.params for t in plain.study.get_trials(deepcopy=False))
    cd = study(space(tmp_path / "b", nvlink_domains=["node", 36, 72]), tmp_path / "b")
    cd.run(8)
    done = cd.study.get_trials(deepcopy=False)
    assert all(t.params[NVLINK] in ("node", 36, 72) for t in done)
    for t in done:  # each trial's cluster is its domain's: `node` is h100-8's own 8
        dom = 8 if t.params[NVLINK] == "node" else t.params[NVLINK]
        assert f" nvl{dom} " in t.user_attrs["cluster"]
        assert t.user_attrs["figures"]["nvlink_domain"] == dom


@pytest.mark.parametrize(
    "domains, says",
    [
        ([0], "codesign.nvlink_domains: 0 is not an NVLink domain"),
        ([-8], "codesign.nvlink_domains: -8 is not an NVLink domain"),
        ([36.5], "codesign.nvlink_domains: 36.5 is not an NVLink domain"),
        (["rack"], "codesign.nvlink_domains: 'rack' is not an NVLink domain"),
        ([], "codesign.nvlink_domains: must not be empty"),
        (
            ["node", 4],
            "codesign.nvlink_domains[1]: 4: smaller than h100-8's own NVLink domain (8 GPUs)",
        ),
    ],
)
def test_a_bad_domain_exits_2_with_one_line(tmp_path: Path, domains: list, says: str) -> None:
    from cubic.cli.app import app

    res = CliRunner().invoke(
        app,
        [
            "codesign",
            "--space",
            str(space(tmp_path, nvlink_domains=domains)),
            "--trials",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
        ],
    )
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and says in lines[0], res.output
    assert "Traceback" not in res.output and not (tmp_path / "run").exists()
