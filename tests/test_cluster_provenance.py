"""The node you have, the cluster you will have (issue 61 item 4): `base: local` composes a target
cluster of this machine's calibrated node with a preset's fabric, and every figure says whether it
was measured or assumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cubic.cli.app import app
from cubic_harness.config import TrialConfig
from cubic_harness.errors import ConfigError
from cubic_harness.sim.backend import simulate
from cubic_harness.sim.cluster import cluster_from_dict, load_cluster, resolve, shipped_cluster
from cubic_harness.sim.provenance import GPU_CALIBRATION_ASSUMES, describe, split
from cubic_harness.workload import Workload
from tests.helpers import FIXTURE_CLUSTER, fixture_cluster

SHIPPED = shipped_cluster("local.yaml").parent
PRESETS = sorted(p.stem for p in SHIPPED.glob("*.yaml") if p.stem != "local")
MEASURED = "measured (local_cluster.yaml, cubic calibrate 2026-11-24)"


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tests' calibrated machine as this one (`base: local` reads `local_cluster_path()`)."""
    monkeypatch.setenv("CUBIC_LOCAL_CLUSTER", str(FIXTURE_CLUSTER))
    return FIXTURE_CLUSTER


def write(tmp_path: Path, d: dict, name: str = "target.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d))
    return path


def test_base_local_with_a_presets_fabric_is_this_node_on_that_network(
        tmp_path: Path, local: Path) -> None:
    """The node's figures are this machine's measured ones, the fabric's the preset's (assumed);
    the prediction says which is which, and the file is named after itself, not the machine."""
    target = load_cluster(write(tmp_path, {"base": "local", "nodes": 4, "fabric": "h100-64"}))
    node, fabric = fixture_cluster(), resolve("h100-64")
    assert (target.name, target.nodes) == ("target", 4)
    assert target.devices == 4 * node.devices_per_node
    assert target.device == node.device and target.intra_node == node.intra_node
    assert target.host_memory_gb == node.host_memory_gb and target.network == fabric.network
    assert target.source == {}  # the calibration's measurements stay in its own file
    assert target.figures == {
        "devices_per_node": MEASURED, "host_memory_gb": MEASURED, "device": MEASURED,
        "intra_node": MEASURED, "nodes": "assumed (target.yaml)",
        "network": "assumed (preset h100-8)"}  # h100-64's NICs are stated in h100-8
    line = describe(split(target.figures))
    assert ("measured: devices_per_node, host_memory_gb, device, intra_node "
            "(local_cluster.yaml, cubic calibrate 2026-11-24)") in line
    assert "assumed: nodes (target.yaml); network (preset h100-8)" in line


def test_the_fabric_brings_its_data_centers_and_the_file_still_wins(
        tmp_path: Path, local: Path) -> None:
    """`fabric:` takes all that joins the nodes (network and datacenters) in place of the base's;
    keys the file states over it are the file's (assumed: the user's plan), the rest keep the
    preset's origin."""
    path = write(tmp_path, {"base": "local", "name": "four-sites", "nodes": 8,
                            "fabric": "h100-16384-4dc", "network": {"pod_nodes": 2}})
    c, big = load_cluster(path), resolve("h100-16384-4dc")
    assert c.name == "four-sites" and c.network.pod_nodes == 2
    assert c.dc_devices == 2 * c.devices_per_node and c.datacenters == big.datacenters
    assert c.network.bandwidth_gbs == big.network.bandwidth_gbs
    assert c.figures["network.pod_nodes"] == "assumed (target.yaml)"
    assert c.figures["network.bandwidth_gbs"] == "assumed (preset h100-8)"
    assert c.figures["datacenters"] == "assumed (preset h100-16384-4dc)"
    assert c.figures["device"] == MEASURED


@pytest.mark.parametrize("name", PRESETS)
def test_a_shipped_preset_is_all_assumed(name: str) -> None:
    figures = resolve(name).figures
    assert figures and all(v.startswith("assumed (preset ") for v in figures.values()), figures
    assert {"device", "intra_node", "nodes"} <= {g.split(".")[0] for g in figures}


def test_this_machines_calibration_is_all_measured(local: Path) -> None:
    figures = resolve("local").figures
    assert figures and set(figures.values()) == {MEASURED}


def test_a_gpu_calibration_says_what_one_gpu_could_not_measure(tmp_path: Path) -> None:
    """On one GPU `cubic calibrate` writes public NVLink figures: assumed, even in its file (and
    in one written before it listed them under `source.assumed`, when the framework step was a
    constant too); a hand-written file may list what it measured under `source.measured`."""
    d = yaml.safe_load(FIXTURE_CLUSTER.read_text())
    d["device"]["type"] = "gpu"
    figures = load_cluster(write(tmp_path, d, "gpu.yaml")).figures
    assert figures["intra_node"] == "assumed (gpu.yaml: not measured by cubic calibrate)"
    assert figures["network"] == figures["intra_node"]
    assert figures["device.step_overhead_ms"].startswith("assumed")
    assert figures["device.mem_bw_gbs"].startswith("measured (gpu.yaml, cubic calibrate")
    d["source"]["assumed"] = list(GPU_CALIBRATION_ASSUMES)  # as `cubic calibrate` writes it now
    figures = load_cluster(write(tmp_path, d, "gpu.yaml")).figures
    assert figures["intra_node"].startswith("assumed")
    assert figures["device"].startswith("measured")  # its step and memory too: one group
    d["source"] = {"measured": ["device.mem_bw_gbs", "intra_node"]}
    figures = cluster_from_dict(d, "hand.yaml").figures
    assert figures["device.mem_bw_gbs"] == figures["intra_node"] == "measured (hand.yaml)"
    assert figures["device.memory_gb"] == figures["network"] == "assumed (hand.yaml)"


@pytest.mark.parametrize("d,needle", [
    ({"base": "h100-9999"}, "base: 'h100-9999': choose one of ['local', 'a100-80-8'"),
    ({"base": "local", "fabric": "h100-9999"}, "fabric: 'h100-9999': choose one of ['a100-80-8'"),
    ({"base": "local", "fabric": "local"}, "fabric: 'local': choose one of ['a100-80-8'"),
    ({"base": ["local"]}, "base: ['local']: choose one of"),
])
def test_a_bad_base_or_fabric_is_one_line_naming_the_file_and_what_is_allowed(
        tmp_path: Path, local: Path, d: dict, needle: str) -> None:
    path = write(tmp_path, {**d, "nodes": 2})
    with pytest.raises(ConfigError) as e:
        load_cluster(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and needle in msg, msg
    assert str(PRESETS) in msg or str(["local", *PRESETS]) in msg
    r = CliRunner().invoke(app, ["trial", "--backend", "sim", "--cluster", str(path)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert needle in r.output, r.output


def test_base_local_without_a_calibration_broken_or_onto_itself_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, {"base": "local", "nodes": 2})
    monkeypatch.setenv("CUBIC_LOCAL_CLUSTER", str(tmp_path / "absent.yaml"))
    with pytest.raises(ConfigError, match=r"base: 'local': this machine has no calibration "
                                          r".*cubic calibrate"):
        load_cluster(path)
    calibration = yaml.safe_load(FIXTURE_CLUSTER.read_text())
    del calibration["network"]
    broken = write(tmp_path, calibration, "broken.yaml")
    monkeypatch.setenv("CUBIC_LOCAL_CLUSTER", str(broken))  # named as itself
    with pytest.raises(ConfigError, match=r"broken.yaml: network: missing"):
        load_cluster(path)
    monkeypatch.setenv("CUBIC_LOCAL_CLUSTER", str(path))  # this machine's file builds on itself
    with pytest.raises(ConfigError, match=r"^\S+target.yaml: base: 'local': a cluster cannot build "
                                          r"on itself \(target.yaml -> target.yaml\)$"):
        load_cluster(path)


def test_every_prediction_says_which_figures_were_measured(tmp_path: Path, local: Path) -> None:
    """A simulated trial's `extra.figures` names the groups measured and assumed, each with its
    source, ok or failed alike, and the CLI's JSON result carries it."""
    path = write(tmp_path, {"base": "local", "nodes": 4, "fabric": "h100-64"})
    cfg = TrialConfig(workload=Workload.small(), world_size=16, batch_size=1024,
                      sharding="table_wise")
    res = simulate(cfg, load_cluster(path))
    assert res.status == "ok", res.error
    figures = res.extra["figures"]
    assert set(figures["measured"]) == {"devices_per_node", "host_memory_gb", "device",
                                        "intra_node"}
    assert figures["assumed"] == {"nodes": "target.yaml", "network": "preset h100-8"}
    failed = simulate(cfg.replace(world_size=64), load_cluster(path))
    assert failed.status == "error" and failed.extra["figures"] == figures
    assert simulate(cfg.replace(world_size=8), resolve("h100-8")).extra["figures"]["measured"] == {}
    r = CliRunner().invoke(app, ["trial", "--backend", "sim", "--cluster", str(path), "--json",
                                 "--set", "world_size=16"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["extra"]["figures"] == split(load_cluster(path).figures)
