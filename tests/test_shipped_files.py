"""Every file the repository ships is checked as a user would use it: each search space loads and its baseline
runs (for real on this CPU, or simulated on its cluster), each cluster file loads and prices a trial, and the
space `make tune` runs trains its baseline and a configuration of today's winning family for real;
the knobs' doc lists the values the config allows."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from cubic.space.search_space import load_space
from cubic_harness.config import CHOICES, TrialConfig, inert_knobs
from cubic_harness.errors import ConfigError
from cubic_harness.sim.backend import simulate
from cubic_harness.sim.cluster import load_cluster, resolve
from cubic_harness.trial import run_trial
from cubic_harness.workload import SIMULATED_ONLY

ROOT = Path(__file__).resolve().parent.parent
SPACES = sorted((ROOT / "search_spaces").glob("*.yaml"))
CLUSTERS = sorted((ROOT / "clusters").glob("*.yaml"))
TINY_RUN = {"warmup_steps": 1, "measure_steps": 2, "windows": 1}  # a trial as short as the harness allows


def test_every_shipped_file_is_found() -> None:
    assert {p.name for p in SPACES} >= {"dlrm_cpu.yaml", "dlrm_gpu.yaml", "dlrm_cluster.yaml", "dcn_cpu.yaml",
                                       "wukong_cpu.yaml", "dlrm_cpu_torchrec.yaml", "tiny.yaml"}
    assert {p.name for p in CLUSTERS} >= {"local.yaml", "h100-8.yaml", "h100-4096.yaml", "a100-zionex-128.yaml"}


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.stem)
def test_every_search_space_loads_and_its_baseline_runs(path: Path) -> None:
    """A CPU space's baseline trains for real (at batch 256 and two timed steps: this checks that it runs,
    not how fast; dlrm_cpu's is run whole below); a GPU space's is simulated on H100s; a space of a
    simulated-only workload (thousands of GPUs) is loaded and validated."""
    space = load_space(path)
    base = space.baseline
    assert space.knobs and base.validate()
    for k, kn in space.knobs.items():  # what the loader enforces, said here of every shipped file
        assert set(kn.choices) <= set(CHOICES.get(k, kn.choices)), (k, kn.choices)
    assert all(getattr(base, k) in allowed for k, allowed in CHOICES.items())
    if base.workload.name in SIMULATED_ONLY or path.name == "dlrm_cpu.yaml":
        return
    if base.device == "cuda":  # no GPU here: an H100 node, or 8 of them for a space of 64 GPUs
        res = simulate(base, resolve("h100-8" if base.world_size <= 8 else "h100-64"))
        assert res.status == "ok" and res.qps > 0, res.error
        return
    res = run_trial(base.replace(batch_size=min(base.batch_size, 256), **TINY_RUN))
    assert res.status == "ok", res.error
    assert res.qps > 0 and res.config["sharding"] == base.sharding and len(res.losses) == 3


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
def test_every_cluster_file_loads_and_prices_a_trial(path: Path) -> None:
    c = load_cluster(path)
    assert c.devices >= 1 and c.device.mem_bw_gbs > 0
    device = "cpu" if c.device.type == "cpu" else "cuda"
    cfg = TrialConfig(world_size=min(2, c.devices), device=device, kernel="native" if device == "cpu" else "triton")
    res = simulate(cfg, c)
    assert res.status == "ok" and res.step_ms_p50 > 0, res.error


def test_make_tunes_space_trains_its_baseline_and_a_winner_like_configuration() -> None:
    """dlrm_cpu.yaml (what `make tune` runs): the baseline (FBGEMM, fp32) and today's winning family (native
    kernel, fp16 tables, bf16 dense and comm) both train for real, and their losses fall."""
    space = load_space(ROOT / "search_spaces" / "dlrm_cpu.yaml")
    base = space.baseline.replace(warmup_steps=1, measure_steps=6, windows=2)
    winner_like = base.replace(kernel="native", emb_precision="fp16", dense_precision="bf16", comm_precision="bf16")
    for cfg in (base, winner_like):
        res = run_trial(cfg)
        assert res.status == "ok", res.error
        assert res.loss_last < res.loss_first, (cfg.kernel, res.losses)
        assert {k: res.config[k] for k in ("kernel", "emb_precision", "dense_precision", "comm_precision")} == {
            k: getattr(cfg, k) for k in ("kernel", "emb_precision", "dense_precision", "comm_precision")}
    assert dataclasses.asdict(base.workload) == dataclasses.asdict(space.workload)


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.stem)
def test_every_when_that_restates_the_inert_rule_agrees_with_it(path: Path) -> None:
    """Each space applies `inert_knobs` itself; the shipped files keep the `when:` lines that
    restate it, so studies made with them keep their fingerprint. Such a line must say exactly what
    the rule says on every valid configuration (sampled: the large spaces have up to 400k)."""
    space = load_space(path, check_choices=False)
    rng = np.random.default_rng(0)
    valid = []
    for _ in range(400):
        params = {k: kn.choices[int(rng.integers(len(kn.choices)))]
                  for k, kn in space.knobs.items()}
        cfg = dataclasses.replace(space.baseline, **params)
        try:
            valid.append(cfg.validate(workload=False))
        except ConfigError:
            continue
    ruled = {k for cfg in valid for k in inert_knobs(cfg)
             if k in space.knobs and space.knobs[k].when}
    seen: dict[str, set[bool]] = {k: set() for k in ruled}
    for cfg in valid:
        inert = inert_knobs(cfg)
        for k in ruled:
            holds = all(c.holds(vars(cfg)) for c in space.knobs[k].when)
            assert holds == (k not in inert), (k, " and ".join(map(str, space.knobs[k].when)), cfg)
            seen[k].add(holds)
    assert all(v == {True, False} for v in seen.values()), seen  # both sides of each rule were seen


def test_the_knobs_doc_lists_exactly_the_allowed_values() -> None:
    """docs/knobs.md gives each categorical knob's values as the first words of its bullet: they are
    exactly `CHOICES`', every knob of `CHOICES` has such a bullet, and no bullet lists values of a
    knob outside it."""
    text = (ROOT / "docs" / "knobs.md").read_text()
    bullets = re.findall(r"^- \*\*(.+?)\*\*: (.*(?:\n  .*)*)", text, flags=re.M)
    listed: dict[str, set[str]] = {}
    for head, body in bullets:
        names = re.findall(r"`(\w+)`", head)
        m = re.match(r"(\w+(?:, \w+)+)(?=[.:;]|\s\(|$)", " ".join(body.split()))
        if m is None:
            continue
        assert len(names) == 1, f"{head}: a list of values belongs to one knob's bullet"
        listed[names[0]] = set(m.group(1).split(", "))
    assert listed == {k: {str(v) for v in allowed} for k, allowed in CHOICES.items()}
