"""The simulator backend: one performance model, cluster files, `cubic calibrate`, simulated trials and tunes."""

from __future__ import annotations

import ast
import itertools
import json
import math
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from cubic.cli.app import app
from cubic_harness.config import TrialConfig, TrialResult
from cubic_harness.sim.backend import NO_QUALITY, simulate
from cubic_harness.sim.cluster import (
    cluster_from_dict,
    cluster_mapping,
    load_cluster,
    local_cluster,
    resolve,
    shipped_cluster,
)
from cubic_harness.timers import PHASES
from cubic_harness.trial import env_info
from cubic_harness.workload import Workload
from tests.helpers import FIXTURE_CLUSTER, fixture_cluster, fixture_cluster_as_local

ROOT = Path(__file__).resolve().parent.parent
LOCAL = str(FIXTURE_CLUSTER)  # `--cluster` for the CLI: the tests' own calibrated machine (named `local`)


def local_dict() -> dict:
    return yaml.safe_load(FIXTURE_CLUSTER.read_text())


def cluster(**over) -> object:
    d = local_dict()
    for path, v in over.items():
        node = d
        *head, last = path.split("__")
        for k in head:
            node = node[k]
        node[last] = v
    return cluster_from_dict(d, "test")


def test_simulated_result_has_the_real_backends_schema() -> None:
    cfg = TrialConfig()
    res = simulate(cfg, fixture_cluster())
    assert res.status == "ok" and res.qps > 0 and res.step_ms_p50 > 0 and res.peak_mem_mb > 0
    assert set(res.to_dict()) == set(TrialResult().to_dict())
    real_env = set(env_info(cfg)) | {"placement", "nodes", "rank_nodes", "wall_s", "startup_s"}
    assert real_env <= set(res.env) and res.env["backend"] == "sim" and res.env["cluster"] == "local"
    assert env_info(cfg)["backend"] == "real"
    assert list(res.breakdown_ms) == list(PHASES)  # the phases a real trial times
    assert res.qps == pytest.approx(cfg.global_batch / sum(res.breakdown_ms.values()) * 1e3)
    assert math.isnan(res.ne) and res.losses == [] and res.extra["quality"] == NO_QUALITY
    assert [t["table"] for t in res.plan] == list(range(cfg.workload.num_tables))
    json.loads(res.to_json())  # strict JSON


def test_oom_names_the_rank_and_the_bytes_over() -> None:
    small_gpu = cluster(device__type="gpu", device__memory_gb=0.5)
    res = simulate(TrialConfig(), small_gpu)
    assert res.status == "oom" and "rank " in res.error and "MB over its device's memory" in res.error
    capped = simulate(TrialConfig(mem_cap_mb=400), fixture_cluster())
    assert capped.status == "oom" and "over mem_cap_mb" in capped.error
    too_big = simulate(TrialConfig(world_size=64), fixture_cluster())
    assert too_big.status == "error" and "cluster local has 8" in too_big.error


def test_the_model_prices_what_decides_the_answer() -> None:
    """Each knob moves the prediction the way its bytes, FLOPs and collectives say."""
    c = fixture_cluster()
    base = simulate(TrialConfig(), c)
    comm = base.extra["sim"]["comm_ms"]
    fp16 = simulate(TrialConfig(comm_precision="fp16"), c).extra["sim"]["comm_ms"]
    assert fp16["pooled_a2a"] < comm["pooled_a2a"]  # half the bytes on the wire
    assert simulate(TrialConfig(kernel="torch"), c).breakdown_ms["emb_bwd"] > 3 * base.breakdown_ms["emb_bwd"]
    assert simulate(TrialConfig(dense_precision="bf16"), c).breakdown_ms["dense"] < base.breakdown_ms["dense"]
    k1 = simulate(TrialConfig(sharding_group_size=1, sparse_sync="weight_avg", sparse_sync_interval=1), c)
    k8 = simulate(TrialConfig(sharding_group_size=1, sparse_sync="weight_avg", sparse_sync_interval=8), c)
    assert k8.extra["sim"]["comm_ms"]["replica_sync"] < k1.extra["sim"]["comm_ms"]["replica_sync"]
    assert simulate(TrialConfig(pipeline_depth=1), c).extra["sim"]["comm_ms"]["input_a2a"] < comm["input_a2a"]
    # the step waits for the slowest rank: one rank holding every table is the step's embedding time
    skew = simulate(TrialConfig(world_size=4, sharding="row_wise"), c)
    assert skew.breakdown_ms["emb_fwd"] == pytest.approx(max(skew.extra["sim"]["emb_fwd_ms"]))


def test_all_to_all_across_nodes_runs_on_each_devices_nic() -> None:
    """Two nodes of 4 on a slow network: a 2D group inside a node keeps its all-to-all on the node link,
    a strided one sends most of it through the NICs (and its replica sync stays inside the node)."""
    c = cluster(nodes=2, devices_per_node=4, network__bandwidth_gbs=0.05, device__type="gpu",
                device__memory_gb=80)
    cfg = TrialConfig(world_size=8, sharding_group_size=4, sparse_sync="grad_allreduce", batch_size=4096)
    intra = simulate(cfg.replace(group_placement="intra_node"), c).extra["sim"]["comm_ms"]
    cross = simulate(cfg.replace(group_placement="cross_node"), c).extra["sim"]["comm_ms"]
    assert cross["pooled_a2a"] > 5 * intra["pooled_a2a"]
    assert intra["replica_sync"] > 5 * cross["replica_sync"]


def test_the_planner_and_the_model_do_not_import_each_other() -> None:
    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
        return out

    planner = imports(ROOT / "harness/sharding/planner.py")
    model = imports(ROOT / "harness/sim/perf.py") | imports(ROOT / "harness/sim/collectives.py")
    assert not any(m.startswith("cubic_harness.sim") for m in planner)
    assert "cubic_harness.sharding.planner" not in model
    assert not (ROOT / "harness/cost_model.py").exists()  # one performance model, not two
    # and the simulator never imports the tuner
    for f in (ROOT / "harness/sim").glob("*.py"):
        assert not any(m == "cubic" or m.startswith("cubic.") for m in imports(f)), f


def test_real_trials_and_the_simulator_run_the_same_plan() -> None:
    from cubic_harness.planning import plan_for

    cfg = TrialConfig(world_size=4, sharding="auto")
    with fixture_cluster_as_local() as local:  # what a real trial plans with: this machine's cluster
        assert simulate(cfg, local).plan == plan_for(cfg).to_list()


BAD = [
    ("nodes: [1\n", "not valid YAML"),
    ("- 1\n- 2\n", "(top level): must be a mapping"),
    ({"drop": "network"}, "network: missing"),
    ({"set": ("intra_node", "bandwidth_gbs", -1.0)}, "intra_node.bandwidth_gbs: -1.0 must be > 0"),
    ({"set": (None, "nodes", 0)}, "nodes: 0 must be > 0"),
    ({"set": (None, "devices_per_node", "eight")}, "devices_per_node: 'eight' is not an integer"),
    ({"set": ("device", "type", "tpu")}, "device.type: 'tpu' is not allowed; choose one of ['cpu', 'gpu']"),
    ({"set": (None, "colour", "red")}, "colour: unknown key"),
    # data-center tiers: no links between them, a negative latency, a placement the nodes cannot hold
    ({"set": (None, "datacenters", {"count": 2, "bandwidth_gbs": 0, "latency_ms": 1})},
     "datacenters.bandwidth_gbs: 0 must be > 0"),
    ({"set": (None, "datacenters", {"count": 1, "bandwidth_gbs": 10, "latency_ms": 1})},
     "datacenters.count: 1 must be >= 2"),
    ({"set": (None, "datacenters", {"count": 2, "bandwidth_gbs": 10, "latency_ms": -1})},
     "datacenters.latency_ms: -1 must be >= 0"),
    ({"set": (None, "datacenters", {"count": 3, "bandwidth_gbs": 10, "latency_ms": 1})},
     "datacenters.count=3 does not divide nodes=1"),
    ({"set": (None, "base", "h100-9999")}, "base: 'h100-9999': choose one of ["),
    ({"set": ("device", "weighted_cost", {"native": {"fwd": -1.0, "bwd": 1.2}})},
     "device.weighted_cost.native.fwd: -1.0 must be > 0"),
    ({"set": ("device", "weighted_cost", {"cuda": {"fwd": 1.0, "bwd": 1.2}})}, "device.weighted_cost"),
]


@pytest.mark.parametrize("bad,needle", BAD)
def test_bad_cluster_files_exit_2_with_one_line(tmp_path: Path, bad, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    if isinstance(bad, str):
        path.write_text(bad)
    else:
        d = local_dict()
        if "drop" in bad:
            del d[bad["drop"]]
        else:
            sec, key, val = bad["set"]
            (d[sec] if sec else d)[key] = val
        path.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(app, ["trial", "--backend", "sim", "--cluster", str(path)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and needle in lines[0], r.output


def test_cubic_trial_on_the_simulator_prints_the_predicted_result() -> None:
    r = CliRunner().invoke(app, ["trial", "--backend", "sim", "--cluster", LOCAL, "--set", "batch_size=2048",
                                 "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["env"]["backend"] == "sim" and res["config"]["batch_size"] == 2048 and res["ne"] is None
    r = CliRunner().invoke(app, ["trial", "--cluster", "local"])
    assert r.exit_code == 2 and "--cluster FILE goes with --backend sim" in r.output


def test_cubic_calibrate_short_writes_a_cluster_file_that_loads(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """By default calibrate writes $XDG_CONFIG_HOME/cubic/local.yaml, never a shipped file, and this machine's
    cluster (what real trials plan with, and `--cluster local`) is then that file, before the shipped one."""
    shipped = shipped_cluster("local.yaml")
    before = shipped.read_bytes() if shipped.exists() else None
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("CUBIC_LOCAL_CLUSTER", raising=False)
    r = CliRunner().invoke(app, ["calibrate", "--short"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "config" / "cubic" / "local.yaml"
    c = load_cluster(out)
    assert c.device.type == "cpu" and c.device.mem_bw_gbs > 0 and c.intra_node.bandwidth_gbs > 0
    assert {"native", "torch"} <= set(c.device.embedding) and c.device.dense_gflops["fp32"] > 0
    ov = yaml.safe_load(out.read_text())["source"]["overlap"]  # a collective beside compute, measured
    assert ov["comm_ms"] > 0 and ov["compute_ms"] > 0 and ov["both_ms"] > 0
    assert c.device.overlap_hidden == pytest.approx(ov["hidden"], abs=1e-3) and -1 <= ov["hidden"] <= 1
    w = yaml.safe_load(out.read_text())["source"]["weighted"]  # each backend weighted and not, interleaved
    assert set(c.device.weighted_cost) == set(c.device.embedding) == set(w)
    for b, cost in c.device.weighted_cost.items():  # the file keeps 3 decimals of the ratio: 5e-4 of rounding
        assert cost["fwd"] == pytest.approx(w[b]["fwd_w_ms"] / w[b]["fwd_ms"], rel=2e-3, abs=5e-4)
        assert cost["bwd"] == pytest.approx(w[b]["bwd_w_ms"] / w[b]["bwd_ms"], rel=2e-3, abs=5e-4)
    assert simulate(TrialConfig(), c).status == "ok"
    assert (shipped.read_bytes() if shipped.exists() else None) == before  # the checkout's file untouched
    local_cluster.cache_clear()
    try:
        assert local_cluster() == c and resolve("local") == c  # the new calibration, not the shipped file
        assert c != load_cluster(shipped)  # (measured now: the shipped one is another machine, another day)
    finally:
        local_cluster.cache_clear()
    help_text = " ".join(CliRunner().invoke(app, ["calibrate", "--help"]).output.split())
    assert "cubic/local.yaml" in help_text and "XDG_CONFIG_HOME" in help_text
    bad = CliRunner().invoke(app, ["calibrate", "--short", "-o", str(tmp_path)])  # -o FILE: a directory is not one
    assert bad.exit_code == 2 and bad.output.strip().count("\n") == 0 and "cannot write" in bad.output, bad.output


def test_simulated_tune_stores_reports_and_exports_like_a_real_one(tmp_path: Path) -> None:
    from cubic.results.analysis import load_study

    run = tmp_path / "sim"
    r = CliRunner().invoke(app, ["tune", "--backend", "sim", "--cluster", LOCAL, "--space",
                                 str(ROOT / "search_spaces/dlrm_cpu.yaml"), "--trials", "25", "--run-dir", str(run),
                                 "--no-live"])
    assert r.exit_code == 0, r.output
    df = load_study(run)
    assert df.attrs["study"] == "dlrm_cpu@sim:local"
    assert len(df) >= 25 and (df["env_backend"] == "sim").all()
    r = CliRunner().invoke(app, ["report", str(run), "--top", "3"])
    assert r.exit_code == 0 and (run / "report.html").exists(), r.output
    assert "simulated on local: predicted, not measured" in r.output
    out = tmp_path / "winner.json"
    r = CliRunner().invoke(app, ["export", str(run), "-f", "json", "-o", str(out)])
    assert r.exit_code == 0, r.output
    exp = json.loads(out.read_text())
    assert exp["config"]["workload"]["name"] == Workload.preset("small-zipf").name  # dlrm_cpu.yaml's
    assert exp["provenance"]["backend"] == "sim" and exp["provenance"]["machine"]["cluster"] == "local"
    # the tune said why nothing was quality-gated, and a resumed tune runs no trial twice
    r2 = CliRunner().invoke(app, ["tune", "--backend", "sim", "--cluster", LOCAL, "--space",
                                  str(ROOT / "search_spaces/dlrm_cpu.yaml"), "--trials", "25", "--run-dir", str(run),
                                  "--no-live"])
    assert r2.exit_code == 0 and len(load_study(run)) == len(df)


def test_a_simulated_study_warm_starts_another(tmp_path: Path) -> None:
    """--warm-start: each simulated study in the source enters the next study's searcher as a source
    of its own, named by its cluster and carrying the cluster's figures (the proxy's features)."""
    from cubic.search.warm_start import load_warm_start
    from cubic.space.search_space import load_space

    space = str(ROOT / "search_spaces/dlrm_cpu.yaml")
    first = tmp_path / "first"
    r = CliRunner().invoke(app, ["tune", "--backend", "sim", "--cluster", LOCAL, "--space", space, "--trials", "12",
                                 "--run-dir", str(first), "--no-live"])
    assert r.exit_code == 0, r.output
    d = local_dict()
    d["name"] = "fastlink"
    d["intra_node"]["bandwidth_gbs"] *= 10
    other = tmp_path / "fastlink.yaml"
    other.write_text(yaml.safe_dump(d))
    r = CliRunner().invoke(app, ["tune", "--backend", "sim", "--cluster", str(other), "--space", space, "--trials",
                                 "8", "--run-dir", str(first), "--no-live"])  # a second cluster's study beside
    assert r.exit_code == 0, r.output
    sources = {h[2] for h in load_warm_start(str(first), load_space(space))}
    links = {s.backend: dict(s.figures)["intra_node_gbs"] for s in sources}
    fast = d["intra_node"]["bandwidth_gbs"]
    assert links == {"sim:local": fast / 10, "sim:fastlink": fast}
    r = CliRunner().invoke(app, ["tune", "--backend", "sim", "--cluster", LOCAL, "--space", space, "--trials",
                                 "6", "--run-dir", str(tmp_path / "second"), "--warm-start", str(first), "--no-live"])
    assert r.exit_code == 0, r.output
    assert re.search(r"trials from --warm-start \(sim:local \d+, sim:fastlink \d+\)", " ".join(r.output.split()))
    bad = CliRunner().invoke(app, ["tune", "--backend", "sim", "--cluster", LOCAL, "--space",
                                   str(ROOT / "search_spaces/tiny.yaml"), "--run-dir", str(tmp_path / "t"),
                                   "--warm-start", str(first), "--no-live"])
    assert bad.exit_code == 2 and "no study of search space 'tiny'" in bad.output, bad.output


@pytest.mark.parametrize("name", ["h100-8", "h100-64", "h100-128", "h100-4096", "a100-zionex-128", "a100-80-8",
                                  "h200-8", "b200-8", "gb200-nvl72", "h100-64-roce", "a40-8", "l40-8", "l40s-8",
                                  "h100-pcie-8", "h200-nvl-4"])
def test_cluster_presets_load_and_price_the_full_mlperf_model(name: str) -> None:
    c = load_cluster(shipped_cluster(f"{name}.yaml"))
    wl = Workload.preset("mlperf-dcnv2")
    res = simulate(TrialConfig(workload=wl, world_size=min(c.devices, 64), batch_size=1024, device="cuda",
                               kernel="triton", sharding="column_wise", dense_precision="bf16", ranks_per_node=8), c)
    assert res.status == "ok" and res.qps > 0, res.error


def test_traffic_that_leaves_a_pod_pays_the_oversubscription() -> None:
    """h100-4096: pods of 384 nodes, 7:1 above. An all-to-all over 4,096 ranks sends 1/4 of its bytes out
    of the pod; inside one pod (3,072 ranks) none. Oversubscription is an aggregate ratio: rings pay it
    only when more of them leave a pod at once than its uplinks carry."""
    from cubic_harness.sim import collectives as coll

    c = load_cluster(shipped_cluster("h100-4096.yaml"))
    flat = cluster_from_dict({**cluster_mapping(shipped_cluster("h100-4096.yaml")),
                              "network": {"bandwidth_gbs": 46, "latency_us": 25}}, "flat")
    world = coll.span(list(range(4096)), c)
    assert (world.p, world.q) == (2, 3072)
    one_pod = coll.span(list(range(3072)), c)
    mb = 64 * 2**20
    assert coll.all_to_all(mb, one_pod, c) == pytest.approx(coll.all_to_all(mb, one_pod, flat))
    assert coll.all_to_all(mb, world, c) > 2 * coll.all_to_all(mb, world, flat)
    # a ring leaves each pod on one edge: the 8 rails of one all-reduce fit the uplinks; 1,024 rings side by
    # side (2D positions syncing at once) need 8,192 NICs' worth against a pod's 3,072 / 7: 8192 x 7 / 3072
    assert coll.all_reduce(mb, world, c) == pytest.approx(coll.all_reduce(mb, world, flat))
    many = coll.all_reduce(mb, world, c, concurrent=1024) - coll.all_reduce(mb, world, c)
    nic = mb * 2 / 8 * 511 / 512 / (46 * 1e6)
    assert many == pytest.approx(nic * (8192 * 7 / 3072 - 1))


def test_collective_formulas_match_hand_computed_cases() -> None:
    """h100-4096 (NVLink 370 GB/s, NIC 46 GB/s, 25 us x log2(n) latency), 64 MiB per rank:
    inside a node, 7/8 of the buffer on NVLink; over 2 nodes, 8/16 through each GPU's own NIC while
    7/16 goes over NVLink at the same time; over 3,072 ranks (one pod) 3064/3072 through the NIC; over
    4,096 ranks the 1/4 that leaves the pod counts 7 times."""
    from cubic_harness.sim import collectives as coll

    c = load_cluster(shipped_cluster("h100-4096.yaml"))
    mb = 64 * 2**20

    def ms(nbytes: float, gbs: float) -> float:
        return nbytes / (gbs * 1e6)

    def lat(n: int) -> float:
        return 25 * math.log2(n) / 1e3

    def a2a(n: int) -> float:
        return coll.all_to_all(mb, coll.span(list(range(n)), c), c)

    assert a2a(8) == pytest.approx(ms(mb * 7 / 8, 370) + lat(8))
    assert a2a(16) == pytest.approx(max(ms(mb * 7 / 16, 370), ms(mb * 8 / 16, 46)) + lat(16))
    assert a2a(3072) == pytest.approx(ms(mb * 3064 / 3072, 46) + lat(3072))
    assert a2a(4096) == pytest.approx(ms(mb * (3064 + 1024 * 7) / 4096, 46) + lat(4096))
    # all-reduce over 2 nodes: ring in the node (2 x 7/8), then each of the 8 NICs carries 1/8 (2 x 1/2)
    ar = coll.all_reduce(mb, coll.span(list(range(16)), c), c)
    assert ar == pytest.approx(ms(2 * mb * 7 / 8, 370) + ms(2 * mb / 8 / 2, 46) + 2 * lat(16))


def test_switches_that_reduce_send_an_all_reduces_buffer_once_not_twice() -> None:
    """In-network reduction (SHARP, NVLink SHARP) as a property of a link: over 16 nodes each of a node's 8 NICs
    carries 1/8 of the buffer once instead of a ring's 2 x 15/16 of it, in one latency instead of two; inside
    a node, the buffer once instead of 2 x 7/8."""
    import dataclasses

    from cubic_harness.sim import collectives as coll

    c = load_cluster(shipped_cluster("h100-4096.yaml"))
    sharp = dataclasses.replace(c, network=dataclasses.replace(c.network, in_network_reduction=True))
    nvls = dataclasses.replace(sharp, intra_node=dataclasses.replace(c.intra_node, in_network_reduction=True))
    mb = 64 * 2**20

    def ms(nbytes: float, gbs: float) -> float:
        return nbytes / (gbs * 1e6)

    def lat(n: int) -> float:
        return 25 * math.log2(n) / 1e3

    def ar(n: int, cl) -> float:
        return coll.all_reduce(mb, coll.span(list(range(n)), cl), cl)

    assert ar(128, sharp) == pytest.approx(ms(2 * mb * 7 / 8, 370) + ms(mb / 8, 46) + lat(128))
    assert ar(128, c) == pytest.approx(ms(2 * mb * 7 / 8, 370) + ms(2 * mb / 8 * 15 / 16, 46) + 2 * lat(128))
    assert ar(8, nvls) == pytest.approx(ms(mb, 370) + lat(8))
    assert ar(128, nvls) == pytest.approx(ms(mb, 370) + ms(mb / 8, 46) + lat(128))
    assert ar(8, sharp) == ar(8, c)  # one node: the NICs' switches take no part
    bad = {**yaml.safe_load(shipped_cluster("h100-8.yaml").read_text())}
    bad["network"] = {**bad["network"], "in_network_reduction": "sometimes"}
    with pytest.raises(Exception, match="in_network_reduction"):
        cluster_from_dict(bad, "x.yaml")


def test_a_step_is_a_critical_path_over_compute_and_the_collectives_streams() -> None:
    """Issue 33 item 2 (harness/sim/schedule.py): a collective of a ms beside compute of b >= a ms takes
    b + (1 - h) a, h the device's measured overlap_hidden (1: hidden, 0: as in turn, < 0: worse); one the compute
    waits for adds all of itself; two collectives at once share the rank's links (as long as in turn); a stream
    keeps its order; and the step is always the compute's own work plus every collective's exposed time."""
    import random

    from cubic_harness.sim.schedule import Op, critical_path

    for h in (1.0, 0.8, 0.0, -0.5):
        for a, b in ((4.0, 10.0), (10.0, 4.0)):
            tl = critical_path([Op("c", b), Op("x", a, "g")], h)
            assert tl.step_ms == pytest.approx(max(a, b) + (1 - h) * min(a, b))
            assert tl.exposed_ms["x"] + b == pytest.approx(tl.step_ms) and tl.hidden_ms["x"] == pytest.approx(
                a - tl.exposed_ms["x"])
    waited = critical_path([Op("e", 2), Op("x", 3, "g", ("e",)), Op("d", 1, after=("x",))], 1.0)
    assert waited.step_ms == 6 and waited.exposed_ms == {"x": 3} and waited.end_ms["x"] == 5
    shared = critical_path([Op("x", 4, "g"), Op("y", 4, "w")], 1.0)
    assert shared.step_ms == 8 and shared.exposed_ms == {"x": 4, "y": 4}
    with pytest.raises(ValueError, match="wait for each other"):
        critical_path([Op("a", 1, after=("b",)), Op("b", 1)], 1.0)
    with pytest.raises(ValueError, match="which no op is"):
        critical_path([Op("a", 1, after=("nope",))], 1.0)
    rnd = random.Random(3)
    for _ in range(50):
        ops, names = [], []
        for i in range(12):
            stream = rnd.choice(["compute", "compute", "g", "w"])
            after = tuple(n for n in names if rnd.random() < 0.2)
            ops.append(Op(f"o{i}", rnd.choice([0.0, rnd.uniform(0.1, 5)]), stream, after))
            names.append(f"o{i}")
        h = rnd.uniform(-1, 1)
        tl = critical_path(ops, h)
        work = sum(o.ms for o in ops if o.stream == "compute")
        assert tl.step_ms == pytest.approx(work + sum(tl.exposed_ms.values()))
        assert tl.step_ms >= max(work, max(tl.end_ms.values()) - 1e-9)


def test_comm_overlap_hides_the_pooled_all_to_all_beside_the_bottom_mlp_on_the_critical_path() -> None:
    """The model prices comm_overlap as the harness runs it: the pooled all-to-all launched after the lookup runs
    beside the bottom MLP's forward, which hides h x the shorter of the two (h = 0.8 here), exactly; with
    `forward_backward` its gradients' all-to-all runs beside the bottom MLP's backward as well, where DDP's bucketed
    all-reduce shares the links, so it hides less than another h x min. The hidden time is reported apart, as a
    real trial reports it. DDP's buckets (25 MB each) run beside the backward as it fills them: at h = 1 hidden
    but for their share of the links while the compute waits on the gradients' all-to-all; at h = 0 exposed."""
    import dataclasses

    from cubic_harness.dense_cost import dense_cost
    from cubic_harness.sim.perf import DDP_BUCKET_BYTES, gemm_ms

    c = load_cluster(shipped_cluster("h100-128.yaml"))
    c = dataclasses.replace(c, device=dataclasses.replace(c.device, overlap_hidden=0.8))
    cfg = TrialConfig(workload=Workload.preset("mlperf-dcnv2"), world_size=64, batch_size=2112, device="cuda",
                      kernel="triton", sharding="column_wise", emb_precision="fp16", dense_precision="bf16",
                      comm_precision="fp16", ranks_per_node=8)
    res = {ov: simulate(cfg.replace(comm_overlap=ov), c) for ov in ("none", "forward", "forward_backward")}
    pooled = res["none"].extra["sim"]["comm_ms"]["pooled_a2a"] / 2
    wl = cfg.workload
    dc = dense_cost(wl)
    bf, bb = gemm_ms(dataclasses.replace(dc, gemms=dc.gemms[:len(wl.bottom_mlp)]), cfg.batch_size,
                     c.device.dense_gflops["bf16"], c.device.gemm_half_mflop)
    assert res["forward"].extra["comm_hidden_ms"] == pytest.approx(0.8 * min(pooled, bf))
    assert res["none"].step_ms_p50 - res["forward"].step_ms_p50 == pytest.approx(0.8 * min(pooled, bf))
    more = res["forward"].step_ms_p50 - res["forward_backward"].step_ms_p50
    assert 0 < more < 0.8 * min(pooled, bb) + 1e-9
    assert "comm_hidden_ms" not in res["none"].extra
    assert res["forward_backward"].qps > res["forward"].qps > res["none"].qps
    assert dc.params * 4 > 2 * DDP_BUCKET_BYTES  # several buckets
    ddp = {h: simulate(cfg, dataclasses.replace(c, device=dataclasses.replace(c.device, overlap_hidden=h)))
           for h in (0.0, 1.0)}
    exposed = {h: r.extra["sim"]["comm_ms"]["ddp_allreduce"] for h, r in ddp.items()}
    assert exposed[1.0] < 0.6 * exposed[0.0]  # what stays: its share of the links while the compute waits


def test_the_full_size_mlperf_model_is_for_the_simulator_only() -> None:
    from cubic_harness.errors import ConfigError
    from cubic_harness.trial import check_config

    with pytest.raises(ConfigError, match="for the simulator"):
        check_config(TrialConfig(workload=Workload.preset("mlperf-dcnv2")))


def test_tables_that_do_not_fit_live_in_host_memory_behind_a_cache() -> None:
    """Neo's hierarchy: on 2 A100 40 GB the full MLPerf tables (~100 GB fp32) do not fit; the biggest shards
    move to host memory with the rest of the device as their cache (hit rate from the ids' Zipf law), the
    step pays the misses over PCIe, and without a host link the same config is out of memory."""
    import dataclasses

    from cubic_harness.sim.perf import hit_rate
    from cubic_harness.workload import TableSpec

    c = load_cluster(shipped_cluster("a100-zionex-128.yaml"))
    cfg = TrialConfig(workload=Workload.preset("mlperf-dcnv2"), world_size=2, batch_size=4096, device="cuda",
                      kernel="triton", sharding="table_wise", ranks_per_node=8)
    res = simulate(cfg, c)
    assert res.status == "ok" and res.peak_mem_mb <= c.device.memory_gb * 1024
    moved = [x for shards in res.extra["sim"]["offload"].values() for x in shards]
    assert moved and all(0 < x["hit_rate"] < 1 for x in moved)
    roomy = dataclasses.replace(c, device=dataclasses.replace(c.device, memory_gb=1000.0))
    assert simulate(cfg, roomy).qps > res.qps  # the misses cost time
    no_link = dataclasses.replace(c, device=dataclasses.replace(c.device, host_link_gbs=0.0))
    assert simulate(cfg, no_link).status == "oom"
    uni, zipf = TableSpec("u", 1000, 8), TableSpec("z", 1000, 8, 1, "zipf", 1.05)
    assert hit_rate(100, 1000, uni) == pytest.approx(0.1) and hit_rate(100, 1000, zipf) > 0.5
    # a trial's record lists at most 8 positions' moves; beyond, the one that moved the most rows and a count
    from cubic_harness.sim.backend import OFFLOAD_LISTED, offloaded

    many = {p: [{"table": 0, "rows": 10 + (p == 40), "cache_rows": 1, "hit_rate": 0.5}] for p in range(64)}
    assert offloaded(many) == {"40": many[40], "positions": 64} and len(offloaded(dict(list(many.items())[:8]))) == 8
    assert OFFLOAD_LISTED == 8


def test_a_uvm_cache_trades_device_memory_for_misses_that_the_ids_decide() -> None:
    """`uvm_cache_load_factor`: every shard in host memory behind a device cache of that share of its rows.
    On 8 H100s a smaller cache takes less device memory and misses more, so the step is slower; skewed ids
    miss less than uniform ones at the same cache (uniform: the hit rate is the load factor); at load factor 1
    nothing misses and the step is the device-resident one's. Where the cache cannot run it is refused (a real
    trial also needs kernel=fbgemm: the cache is FBGEMM's; the simulator prices the calibrated kernel's lookups)."""
    from cubic_harness.errors import ConfigError

    c = load_cluster(shipped_cluster("h100-8.yaml"))

    def run(preset: str, lf: float) -> TrialResult:
        cfg = TrialConfig(workload=Workload.preset(preset), world_size=8, batch_size=4096, device="cuda",
                          kernel="triton", sharding="table_wise", ranks_per_node=8, uvm_cache_load_factor=lf)
        res = simulate(cfg.validate(), c)
        assert res.status == "ok", res.error
        return res

    def hits(res: TrialResult) -> list[float]:
        return [x["hit_rate"] for shards in res.extra["sim"]["offload"].values() for x in shards]

    on_device = run("small-zipf", 0.0)
    assert "offload" not in on_device.extra["sim"]
    runs = {lf: run("small-zipf", lf) for lf in (0.01, 0.1, 1.0)}
    qps = [runs[lf].qps for lf in (0.01, 0.1, 1.0)]
    mem = [runs[lf].peak_mem_mb for lf in (0.01, 0.1, 1.0)]
    assert qps[0] < qps[1] < qps[2] == pytest.approx(on_device.qps)
    assert mem[0] < mem[1] < mem[2] <= on_device.peak_mem_mb
    assert all(h == 1.0 for h in hits(runs[1.0]))
    uniform = hits(run("small", 0.1))
    assert uniform and all(h == pytest.approx(0.1, abs=1e-3) for h in uniform)
    assert min(hits(runs[0.1])) > 0.1
    assert TrialConfig(uvm_cache_load_factor=0.0).key() == TrialConfig().key()  # stored keys stay as they were
    r = CliRunner().invoke(app, ["trial", "--backend", "sim", "--cluster", "h100-8", "--set", "device=cuda", "--set",
                                 "kernel=triton", "--set", "world_size=8", "--set", "uvm_cache_load_factor=0.1"])
    assert r.exit_code == 0 and "host memory" in r.output and "device cache hit" in r.output, r.output
    for bad, says in ((dict(uvm_cache_load_factor=0.2), "needs device=cuda"),
                      (dict(device="cuda", kernel="fbgemm", uvm_cache_load_factor=1.5), "must be in [0, 1]"),
                      (dict(device="cuda", kernel="fbgemm", uvm_cache_load_factor=0.2, world_size=4,
                            sharding_group_size=2, sparse_sync="weight_avg"), "the replica merge writes rows")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            TrialConfig(**bad).validate()


def test_the_cache_model_at_hit_rates_0_and_1() -> None:
    """No cache: every lookup of a host-resident shard is a miss, priced at its row bytes over the host
    link, forward and backward alike; a cache as large as the shard serves every lookup (Zipf or not)."""
    from cubic_harness.sim.perf import _Held, _offload, hit_rate
    from cubic_harness.workload import TableSpec

    c = load_cluster(shipped_cluster("a100-zionex-128.yaml"))
    for t in (TableSpec("u", 10_000, 64), TableSpec("z", 10_000, 64, 1, "zipf", 1.05)):
        assert hit_rate(0, t.rows, t) == 0.0 and hit_rate(t.rows, t.rows, t) == 1.0
        shard = _Held(np.array([0]), np.array([t.rows]), np.array([64 * 4 + 4]), np.array([50_000.0]),
                      np.array([64]), [t])
        ms, moved, _ = _offload(shard, 0.0, 1e12, c)
        assert moved[0]["hit_rate"] == 0.0 and moved[0]["cache_rows"] == 0
        assert ms == pytest.approx(50_000 * (64 * 4 + 4) / (c.device.host_link_gbs * 1e6))


def test_zipf_ids_touch_as_few_rows_as_the_harness_draws() -> None:
    """What a 2D merge moves is the rows its replicas touched. For Zipf ids the simulator counts them by the
    harness's own law (`perf.rows_touched`): on the default task's tables, within 3% of the distinct rows in
    the harness's batches (2 replicas, 8 steps of 1,024 samples), where the uniform birthday count is 1.3-5x
    too many. The merge's price follows: the union transport costs its fixed part plus its rows'."""
    from cubic_harness.data import make_batch
    from cubic_harness.sharding.transport import UNION_FIXED, union_cost, union_pays
    from cubic_harness.sim.perf import rows_touched

    wl = Workload.preset("small-zipf")
    batches = [make_batch(wl, 0, s * 1024, 1024) for s in range(16)]  # 2 replicas x 8 steps, all different samples
    T, pool = wl.num_tables, wl.tables[0].pooling
    for i in (0, 3, 7):  # alpha 1.2, 1.0, 0.7
        t = wl.tables[i]
        seen = np.unique(np.concatenate([b.ids.view(T, -1)[i].numpy() for b in batches]))
        draws = 16 * 1024 * pool
        assert rows_touched(t, t.rows, 1.0, draws, False) == pytest.approx(seen.size, rel=0.03)
        assert t.rows * -math.expm1(-draws / t.rows) > 1.25 * seen.size
    assert union_cost(0, 100) == UNION_FIXED and union_pays(40, 100) and not union_pays(50, 100)


def _bench(name: str):
    """A benchmark module (benchmarks/ is scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mlperf_log_rate_is_read_between_evaluations() -> None:
    """The training rate excludes evaluation time: samples of the eval_stop -> next eval_start span (its
    epoch difference x train_samples) over that span's seconds, median over spans."""
    logs = _bench("mlperf_logs")

    def line(key: str, t: int, value=None, epoch: float | None = None) -> str:
        meta = {} if epoch is None else {"epoch_num": epoch}
        return ":::MLLOG " + json.dumps({"key": key, "time_ms": t, "value": value, "metadata": meta})

    text = "\n".join([
        "noise before the log", line("global_batch_size", 0, 1000), line("train_samples", 0, 1_000_000),
        line("eval_start", 1000, epoch=0.05), line("eval_stop", 3000, epoch=0.05),  # the eval's 2 s are not training
        line("eval_start", 8000, epoch=0.10), line("eval_stop", 9000, epoch=0.10),  # 50k samples in 5 s
        line("eval_start", 11500, epoch=0.15), line("eval_stop", 12000, epoch=0.15),  # 50k in 2.5 s
        line("eval_start", 14000, epoch=0.20),  # 50k in 2 s
        line("tracked_stats", 15000, {"throughput": 123.0}),
    ])
    run = logs.parse_log(text)
    assert run["global_batch"] == 1000 and run["spans"] == 3 and run["tracked"] == 123.0
    assert run["rate"] == pytest.approx(20_000.0)  # median of 10k, 20k, 25k samples/s
    with pytest.raises(ValueError, match="no training span"):
        logs.parse_log(line("global_batch_size", 0, 1000))


# What docs/simulator.md claims (benchmarks/data/mlperf_validation.json, "rates"): per round, the 8-GPU fit factor and
# the prediction errors at 64 and 128 GPUs and of the 64 -> 128 ratio, as fractions.
MLPERF_TODAY = {"v3.1": {"fit": 0.957, 64: -0.008, 128: -0.059, "ratio": -0.051},
                "v4.0": {"fit": 0.987, 64: -0.023, 128: -0.094, "ratio": -0.073},
                "v4.1": {"fit": 0.987, 64: -0.044, 128: -0.118, "ratio": -0.078}}
MLPERF_SLACK = 0.03  # 3 points either way: room for a refinement, not for a regression of the model


def test_simulator_predicts_published_mlperf_scaling_from_one_8_gpu_point() -> None:
    """Issue 21's validation as a guard on the performance model: on NVIDIA's DGX H100 DLRM-DCNv2 results
    of rounds v3.1, v4.0 and v4.1, the device rates fitted on each round's 8-GPU point, the 64- and 128-GPU
    predictions and the 64 -> 128 ratio stay within 3 points of the figures docs/simulator.md claims (64 GPUs -1% to
    -4%, 128 GPUs -6% to -12%), so a model 20% off at scale, or needing a 20% different fit, fails. v3.0 is
    left out: its software is the outlier (benchmarks/bench_mlperf.py)."""
    b = _bench("bench_mlperf")
    base = load_cluster(shipped_cluster("h100-128.yaml"))
    meas = b.measured()
    assert sorted(meas) == ["v3.0", "v3.1", "v4.0", "v4.1"]
    got = {}
    for rnd in MLPERF_TODAY:
        res = b.validate(base, meas[rnd], "rates")
        r = res[res["pick"]]
        assert res["pick"] == "column_wise", (rnd, res["pick"])
        got[rnd] = {"fit": r["fit"], 64: r["err"][64], 128: r["err"][128], "ratio": b.ratio_err(r)}
        assert b.verdict(r) == "meets the goals", (rnd, got[rnd])
    for rnd, want in MLPERF_TODAY.items():
        for k, v in want.items():
            assert abs(got[rnd][k] - v) <= MLPERF_SLACK, (rnd, k, f"{got[rnd][k]:+.3f}", f"expected {v:+.3f}")



# The same rounds priced as HugeCTR runs them (bench_mlperf.py's "rates, overlap + SHARP": the all-to-all beside the
# bottom MLP, SHARP on the fabric; the step a critical path on which DDP's buckets share the links with the all-to-all):
# the scaling gap closes from -6..-12% at 128 GPUs to 0..-6%
MLPERF_OVERLAP_SHARP = {"v3.1": {64: +0.032, 128: +0.000, "ratio": -0.031},
                        "v4.0": {64: +0.017, 128: -0.034, "ratio": -0.050},
                        "v4.1": {64: -0.005, 128: -0.060, "ratio": -0.055}}


def test_every_other_mlperf_system_is_predicted_from_its_gpus_preset_without_a_refit() -> None:
    """Every GPU system in the logs is predicted from its GPU's preset and its round's one 8-H100
    fit; today 58 systems, median |error| 5%. The SXM / NVLink-domain presets (A100, H100, H200,
    B200, GB200: 51 systems) stay within 40% (a 4-GPU H100 system measured 23% below its peers);
    B200 and GB200 are within 10% at 8 GPUs (docs/simulator.md, GPU presets against MLPerf). Of the
    PCIe cards' presets (A40, L40, H100 PCIe, H200 NVL: 7 systems; the "L40S" system's logs name
    L40s) all are within 10% once their host's PCIe switches and sockets are priced, but QCT's
    4-GPU H100 PCIe D54U-3U, whose runs throttle (+137% / +188%; -1% / +41% against the rate
    each run opens at). Only the CPU-only submission is not predicted, and it says why; none is
    silently dropped."""
    b = _bench("bench_mlperf")
    base = load_cluster(shipped_cluster("h100-128.yaml"))
    meas = b.measured()
    results = {rnd: b.validate(base, meas[rnd], "rates") for rnd in b.ROUNDS}
    rows = b.all_systems(meas, results)
    fitted = {name for rnd in meas.values() for name in rnd["systems"].values()}
    assert len(rows) == sum(name not in fitted for d in b.logs().values() for name in d["systems"])
    done = [r for r in rows if r.get("err") is not None]
    sxm = {"h100-8", "h200-8", "a100-80-8", "b200-8", "gb200-nvl72"}
    pcie = {"a40-8", "l40-8", "h100-pcie-8", "h200-nvl-4"}
    assert {r["preset"] for r in done} == sxm | pcie
    errs = sorted(abs(r["err"]) for r in done)
    assert len(done) >= 58 and errs[len(errs) // 2] <= 0.08, errs
    h200 = sorted(r["err"] for r in done if r["preset"] == "h200-8")
    assert len(h200) == 14 and statistics.median(h200) <= 0.10, h200
    assert max(abs(r["err"]) for r in done if r["preset"] in sxm) <= 0.45, errs
    cards = [r for r in done if r["preset"] in pcie]
    assert len(cards) == 7, cards
    steady = [(r["system"], r["err"]) for r in cards if r["system"] != "D54U-3U"]
    assert len(steady) == 5 and all(abs(err) <= 0.10 for _, err in steady), steady
    assert [r["why_not"] for r in rows if r.get("err") is None] == [
        "a CPU-only submission (no accelerator): the presets are GPUs"]


def test_overlap_and_in_network_reduction_close_the_mlperf_scaling_gap() -> None:
    """With comm_overlap and SHARP as HugeCTR's submissions run them, 64 and 128 H100 are predicted within 6% on
    v3.1-v4.1 (5 of the 6 within 5%; v4.1's 128 at -6.0%), the 64 -> 128 ratio within 6%, from the one 8-GPU fit
    per round; and each figure stays within 3 points of what the closing note reports."""
    b = _bench("bench_mlperf")
    base = load_cluster(shipped_cluster("h100-128.yaml"))
    meas = b.measured()
    for rnd, want in MLPERF_OVERLAP_SHARP.items():
        res = b.validate(base, meas[rnd], "rates, overlap + SHARP")
        r = res[res["pick"]]
        got = {64: r["err"][64], 128: r["err"][128], "ratio": b.ratio_err(r)}
        assert abs(got["ratio"]) <= 0.065 and max(abs(got[64]), abs(got[128])) <= 0.065, (rnd, got)
        for k, v in want.items():
            assert abs(got[k] - v) <= MLPERF_SLACK, (rnd, k, f"{got[k]:+.3f}", f"expected {v:+.3f}")

def test_a_16_bit_gradient_all_reduce_moves_half_the_bytes() -> None:
    """allreduce_comm_precision prices DDP's dense all-reduce at its wire width: across 8 nodes the all-reduce
    is bandwidth-bound, so fp16 and bf16 halve it (plus the hook's cast, in the optimizer phase); one rank has
    no all-reduce, so nothing changes. (The quality screen judges it: tests/test_screen.py.)"""
    c = load_cluster(shipped_cluster("h100-64.yaml"))
    base = TrialConfig(workload=Workload.preset("mlperf-dcnv2"), world_size=64, batch_size=2112, device="cuda",
                       kernel="triton", sharding="column_wise", dense_precision="bf16", ranks_per_node=8)
    r32, r16 = simulate(base, c), simulate(base.replace(allreduce_comm_precision="fp16"), c)
    ar32, ar16 = r32.extra["sim"]["comm_ms"]["ddp_allreduce"], r16.extra["sim"]["comm_ms"]["ddp_allreduce"]
    assert 0.45 < ar16 / ar32 < 0.6, (ar16, ar32)  # latency terms do not halve
    assert r16.qps > r32.qps and r16.breakdown_ms["optim"] > r32.breakdown_ms["optim"]
    from cubic_harness.sim.backend import features

    f32, f16 = features(base, c), features(base.replace(allreduce_comm_precision="bf16"), c)
    assert f16["allreduce_bytes"] == f32["allreduce_bytes"] / 2
    one = base.replace(world_size=1, batch_size=1024)
    assert simulate(one, c).qps == simulate(one.replace(allreduce_comm_precision="fp16"), c).qps



def test_the_simulator_breaks_a_step_into_the_phases_a_real_trial_times() -> None:
    """A measured and a predicted breakdown mean the same: the 2D weight_avg merge is `sync` in both (it was
    folded into the simulator's `comm`), a grad_allreduce's replica gather is `comm` in both."""
    from cubic_harness.timers import PHASES

    c = resolve("h100-8")
    two_d = dict(world_size=8, sharding_group_size=4, device="cuda", kernel="triton", sharding="row_wise")
    avg = simulate(TrialConfig(**two_d, sparse_sync="weight_avg", sparse_sync_interval=8), c)
    gather = simulate(TrialConfig(**two_d, sparse_sync="grad_allreduce"), c)
    assert list(avg.breakdown_ms) == list(gather.breakdown_ms) == list(PHASES)
    assert avg.breakdown_ms["sync"] > 0 and gather.breakdown_ms["sync"] == 0
    assert sum(avg.breakdown_ms.values()) <= avg.step_ms_p50 * (1 + 1e-9)


def test_traffic_between_data_centers_pays_the_interconnect_and_its_milliseconds() -> None:
    """h100-16384-4dc: 4 sites of 4,096 GPUs (2,048-GPU pods 7:1 above), each GPU's flow to another site at 46
    GB/s, a site's flows together at 1/16 of its NICs', 0.6 ms one way. An all-to-all over all 16,384 ranks
    sends 3/4 of its bytes between sites, all sites' devices at once (x16), plus one one-way latency; an
    all-reduce reduces inside each site, then each of a site's 4,096 ranks its 1/4,096 with its 3 peers (a ring:
    2 x 3/4 of it, 2 log2(4) latencies). A group inside one site pays nothing for the tier."""
    import dataclasses

    from cubic_harness.sim import collectives as coll

    c = resolve("h100-16384-4dc")
    one_site = dataclasses.replace(c, datacenters=None)
    mb = 64 * 2**20

    def ms(nbytes: float, gbs: float) -> float:
        return nbytes / (gbs * 1e6)

    def lat(us: float, n: int) -> float:
        return us * math.log2(n) / 1e3

    world = coll.span(list(range(16384)), c)
    assert (world.d, world.r, world.p, world.q) == (4, 4096, 8, 2048)
    nic = ms(mb * (2040 + 14336 * 7) / 16384, 46)
    dci = ms(mb * 12288 / 16384, 46) * 16
    assert dci > nic
    assert coll.all_to_all(mb, world, c) == pytest.approx(dci + lat(25, 16384) + 0.6)
    site = coll.span(list(range(4096)), c)
    inside = coll.all_reduce(mb, site, c)
    assert coll.all_reduce(mb, world, c) == pytest.approx(
        inside + ms(2 * mb / 4096 * 3 / 4, 46) * 16 + 2 * lat(600, 4))
    assert coll.all_to_all(mb, site, c) == pytest.approx(coll.all_to_all(mb, site, one_site))
    assert inside == pytest.approx(coll.all_reduce(mb, site, one_site))
    # a strided group (one rank per site) crosses on 1 rank's flow per site: under the interconnect's share
    strided = coll.span([0, 4096, 8192, 12288], c)
    assert coll.all_reduce(mb, strided, c) == pytest.approx(ms(2 * mb * 3 / 4, 46) + 2 * lat(600, 4))


def test_placement_decides_what_crosses_between_data_centers() -> None:
    """2D groups of one site's 4,096 GPUs: side by side (`intra_node`) each group stays in a site and only the
    replica sync every k steps crosses; strided (`cross_node`) every group spans the 4 sites and its pooled
    all-to-all crosses every step while the replicas sync inside a site. The tier costs each where it crosses
    and nothing elsewhere."""
    import dataclasses

    c = resolve("h100-16384-4dc")
    one_site = dataclasses.replace(c, datacenters=None)
    wl = Workload.preset("mlperf-dcnv2-x16")
    cfg = TrialConfig(workload=wl, world_size=16384, batch_size=1024, device="cuda", kernel="triton",
                      sharding="column_wise", emb_precision="fp16", dense_precision="bf16", comm_precision="bf16",
                      ranks_per_node=8, sharding_group_size=4096, sparse_sync="weight_avg", sparse_sync_interval=32)

    def comm(cf: TrialConfig, cl) -> dict[str, float]:
        r = simulate(cf, cl)
        assert r.status == "ok", r.error
        return r.extra["sim"]["comm_ms"]

    inside, flat = comm(cfg, c), comm(cfg, one_site)
    assert inside["pooled_a2a"] == pytest.approx(flat["pooled_a2a"])
    # (inside one site the sync already crosses its pods' 7:1 uplinks; between sites, the 16:1 interconnect)
    assert inside["replica_sync"] > 1.1 * flat["replica_sync"]
    strided = cfg.replace(group_placement="cross_node")
    across, flat = comm(strided, c), comm(strided, one_site)
    assert across["pooled_a2a"] > 1.5 * flat["pooled_a2a"]
    assert across["replica_sync"] == pytest.approx(flat["replica_sync"])


def test_a_gpus_pipelined_input_distribution_hides_only_up_to_the_step_beside_it() -> None:
    """Pipelined (pipeline_depth=1), the next batch's ids travel beside this step: a step of `rest` ms with an
    input all-to-all of `raw` ms takes max(rest, raw). At 64 GPUs it hides; full model parallelism over 16,384
    GPUs sends every table's ids to its few column shards' holders, longer than the step: the rest is exposed.
    A framework that reads each rank's ids itself (HugeCTR, `reads_own_ids`) runs none."""
    import dataclasses

    wl = Workload.preset("mlperf-dcnv2-x16")
    for name, world in (("h100-4096", 64), ("h100-16384-4dc", 16384)):
        c = resolve(name)
        cfg = TrialConfig(workload=wl, world_size=world, batch_size=1024, device="cuda", kernel="triton",
                          sharding="column_wise", emb_precision="fp16", dense_precision="bf16",
                          comm_precision="bf16", ranks_per_node=8, pipeline_depth=0)
        plain, piped = simulate(cfg, c), simulate(cfg.replace(pipeline_depth=1), c)
        raw = plain.extra["sim"]["comm_ms"]["input_a2a"]
        rest = plain.step_ms_p50 - raw
        assert raw > 0 and piped.step_ms_p50 == pytest.approx(max(rest, raw))
        assert (raw > rest) == (world == 16384), (name, raw, rest)
        own = dataclasses.replace(c, device=dataclasses.replace(c.device, reads_own_ids=True))
        assert simulate(cfg, own).extra["sim"]["comm_ms"]["input_a2a"] == 0.0


def test_an_unbalanced_all_to_all_waits_on_its_busiest_nic_not_on_everyone_sending_as_much() -> None:
    """Over 4,096 ranks (two pods, 7:1 above): when one rank sends 64 MiB and the mean rank 1 MiB, the
    oversubscribed uplinks carry the mean's traffic; the busiest rank's own NIC carries its 64 MiB at full rate.
    Balanced (mean = busiest), the formula is the oversubscribed one."""
    from cubic_harness.sim import collectives as coll

    c = load_cluster(shipped_cluster("h100-4096.yaml"))
    world = coll.span(list(range(4096)), c)
    mb = 64 * 2**20
    lat = 25 * math.log2(4096) / 1e3
    own_nic = mb * 4088 / 4096 / 46e6
    assert coll.all_to_all(mb, world, c, mb / 64) == pytest.approx(own_nic + lat)
    assert coll.all_to_all(mb, world, c, mb) == pytest.approx(coll.all_to_all(mb, world, c))
    assert coll.all_to_all(mb, world, c) == pytest.approx(mb * (3064 + 1024 * 7) / 4096 / 46e6 + lat)


def test_a_pcie_switchs_gpus_share_its_uplink_in_an_all_to_all_not_in_a_ring() -> None:
    """An 8-GPU PCIe server with a switch of 4 GPUs per socket (l40-8): an all-to-all's bytes to
    the other switch, 4 GPUs x 4/8 of a buffer, cross one 25 GB/s uplink together: 2x the buffer
    at 25 GB/s, slower than each GPU's own 7/8 at 20. A ring all-reduce crosses the uplink as one
    edge of the ring, at 25 above the node's 20: unchanged. Four ranks behind one switch never
    cross it."""
    import dataclasses

    from cubic_harness.sim import collectives as coll

    c = load_cluster(shipped_cluster("l40-8.yaml"))
    flat = dataclasses.replace(c, intra_node=dataclasses.replace(c.intra_node, uplink_devices=0))
    node, half = coll.span(list(range(8)), c), coll.span(list(range(4)), c)
    mb, lat = 64 * 2**20, 25 * 3 / 1e3
    assert coll.all_to_all(mb, node, flat) == pytest.approx(mb * 7 / 8 / 20e6 + lat)
    assert coll.all_to_all(mb, node, c) == pytest.approx(4 * mb * 4 / 8 / 25e6 + lat)
    assert coll.all_reduce(mb, node, c) == coll.all_reduce(mb, node, flat)
    assert coll.all_to_all(mb, half, c) == coll.all_to_all(mb, half, flat)


@pytest.mark.parametrize("devices", [8, 3])
def test_a_switch_that_does_not_divide_the_node_is_one_line(tmp_path: Path, devices: int) -> None:
    from cubic_harness.errors import ConfigError

    path = tmp_path / "c.yaml"
    uplink = {"devices": devices, "bandwidth_gbs": 25}
    mine = {"base": "l40-8", "name": "c", "intra_node": {"uplink": uplink}}
    path.write_text(yaml.safe_dump(mine))
    with pytest.raises(ConfigError) as e:
        load_cluster(path)
    msg = str(e.value)
    assert "\n" not in msg and "devices_per_node=8" in msg
    assert f"intra_node.uplink.devices={devices}" in msg


def test_a_hosts_sockets_carry_an_all_to_all_between_them_and_set_a_rings_pace() -> None:
    """The A40 server's two Ice Lake sockets (a40-8: 4 + 4 GPUs, NCCL's 10 GB/s across them): an
    all-to-all's bytes between sockets, 4 GPUs x 4/8 of a buffer, cross that link together, 2x the
    buffer at 10 GB/s (2.5x its switches' 25 GB/s uplinks); a ring crosses it once each way, so an
    all-reduce runs at 10 instead of the node's 20. Four ranks on one socket never cross it, and a
    node without sockets priced is as before."""
    import dataclasses

    from cubic_harness.sim import collectives as coll

    c = load_cluster(shipped_cluster("a40-8.yaml"))
    flat = dataclasses.replace(c, intra_node=dataclasses.replace(c.intra_node, sockets=0))
    node, half = coll.span(list(range(8)), c), coll.span(list(range(4)), c)
    mb, lat = 64 * 2**20, 25 * 3 / 1e3
    assert coll.all_to_all(mb, node, flat) == pytest.approx(4 * mb * 4 / 8 / 25e6 + lat)
    assert coll.all_to_all(mb, node, c) == pytest.approx(4 * mb * 4 / 8 / 10e6 + lat)
    assert coll.all_reduce(mb, node, flat) == pytest.approx(2 * mb * 7 / 8 / 20e6 + 2 * lat)
    assert coll.all_reduce(mb, node, c) == pytest.approx(2 * mb * 7 / 8 / 10e6 + 2 * lat)
    for f in (coll.all_to_all, coll.all_reduce):
        assert f(mb, half, c) == f(mb, half, flat)
    nvlink = load_cluster(shipped_cluster("h100-8.yaml"))
    assert nvlink.intra_node.sockets == 0


@pytest.mark.parametrize(("count", "uplink"), [(3, None), (2, 8), (4, 4)])
def test_sockets_that_do_not_hold_whole_switches_are_one_line(tmp_path: Path, count: int,
                                                               uplink: int | None) -> None:
    """Three sockets cannot split 8 GPUs evenly; four sockets of 2 GPUs cannot hold a switch
    of 4."""
    from cubic_harness.errors import ConfigError

    path = tmp_path / "c.yaml"
    node: dict = {"sockets": {"count": count, "bandwidth_gbs": 10}}
    if uplink:
        node["uplink"] = {"devices": uplink, "bandwidth_gbs": 25}
    path.write_text(yaml.safe_dump({"base": "a40-8", "name": "c", "intra_node": node}))
    with pytest.raises(ConfigError) as e:
        load_cluster(path)
    msg = str(e.value)
    assert "\n" not in msg and "devices_per_node=8" in msg
    assert (f"intra_node.uplink.devices={uplink}" if uplink == 8
            else f"intra_node.sockets.count={count}") in msg


def test_a_cluster_file_states_only_how_it_differs_from_its_base_preset(tmp_path: Path) -> None:
    """`base: PRESET` merges the file over a shipped preset, nested keys one by one: h100-16384-4dc is h100-4096's
    device and NICs with 4x the nodes, smaller pods and a data-center tier."""
    big, site = resolve("h100-16384-4dc"), resolve("h100-4096")
    assert big.device == site.device and big.intra_node == site.intra_node
    assert (big.nodes, big.network.pod_nodes, big.network.bandwidth_gbs) == (2048, 256, site.network.bandwidth_gbs)
    assert big.datacenters is not None and big.dc_devices == 4096
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"base": "h100-8", "name": "mine", "device": {"memory_gb": 141}}))
    mine = load_cluster(path)
    assert mine.device.memory_gb == 141 and mine.device.mem_bw_gbs == resolve("h100-8").device.mem_bw_gbs


def test_a_weighted_table_sends_a_score_beside_every_id() -> None:
    """With a weighted table every id of the batch carries a 4-byte score (harness/data.py Batch.scores), so the
    input all-to-all moves 12 bytes an id instead of 8 and the step takes longer; the embedding work is the same."""
    import dataclasses

    from cubic_harness.planning import plan_for
    from cubic_harness.sim.perf import estimate

    wl = Workload.small()
    weighted = dataclasses.replace(wl, tables=[dataclasses.replace(wl.tables[0], weighted=True), *wl.tables[1:]])
    cfg = TrialConfig(workload=wl, world_size=8, batch_size=1024, sharding="table_wise", kernel="torch")
    c = fixture_cluster()
    plain, scored = (estimate(x, plan_for(x, c), c) for x in (cfg, cfg.replace(workload=weighted)))
    ids = cfg.batch_size * sum(wl.lookups_per_sample())
    assert scored.features["a2a_bytes"] - plain.features["a2a_bytes"] == pytest.approx(ids * 4)
    assert scored.step_ms > plain.step_ms
    assert scored.per_rank["emb_fwd"] == plain.per_rank["emb_fwd"]


def test_a_weighted_table_costs_the_extra_kernel_work_its_backend_measured() -> None:
    """A weighted table's lookups take the backend's measured `weighted_cost` times as long, per phase (FBGEMM's CPU
    backward computes the scores' gradient too: 3x); a backend without one is priced by its bytes alone."""
    import dataclasses

    from cubic_harness.planning import plan_for
    from cubic_harness.sim.perf import estimate

    wl = Workload.small()
    weighted = dataclasses.replace(wl, tables=[dataclasses.replace(t, weighted=True) for t in wl.tables])
    c = fixture_cluster()
    c = dataclasses.replace(c, device=dataclasses.replace(c.device, weighted_cost={"torch": {"fwd": 1.1, "bwd": 3.0}}))
    for kernel, want in (("torch", (1.1, 3.0)), ("native", (1.0, 1.0))):
        cfg = TrialConfig(workload=wl, world_size=2, batch_size=1024, sharding="table_wise", kernel=kernel)
        plain, scored = (estimate(x, plan_for(x, c), c) for x in (cfg, cfg.replace(workload=weighted)))
        for phase, m in zip(("emb_fwd", "emb_bwd"), want, strict=True):
            assert scored.per_rank[phase] == pytest.approx([m * x for x in plain.per_rank[phase]], rel=1e-9), phase


def test_step_at_prices_a_plans_own_parts_as_the_estimate_and_rises_with_each():
    """`step_at` (the floor under every plan in benchmarks/bench_plan_bound.py) is the estimate's own step
    where no part is replaced, and never falls when a part takes longer."""
    from cubic_harness.planning import plan_for
    from cubic_harness.sim.step import estimate, step_at

    c = load_cluster(shipped_cluster("h100-64.yaml"))
    cfg = TrialConfig(workload=Workload.preset("criteo-mlperf-mini"), world_size=64, ranks_per_node=8,
                      device="cuda", kernel="triton", sharding="table_wise", pipeline_depth=1,
                      comm_overlap="forward_backward")
    plan = plan_for(cfg, c)
    step = estimate(cfg, plan, c).step_ms
    assert step_at(cfg, plan, c) == step
    for part in ("pooled", "emb_bwd", "allreduce"):
        steps = [step_at(cfg, plan, c, **{part: ms}) for ms in (0.0, 0.1, 0.5, 1.0, 2.0, 8.0, 32.0)]
        assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(steps)), (part, steps)
        assert steps[-1] > step > steps[0], (part, steps)
