"""A simulated space at another size takes its numerics verdicts from the real quality runs of a
space that trains the same workload here (`cubic.quality.scaled`, `cubic tune --quality-from`): a
change carries as `CARRIES` says, and the runs are real rows of a real quality store, as a real tune
keeps them (`tests/test_carried.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from cubic.cli.tune import TuneRequest, build
from cubic.quality.carried import CarriedVerdicts
from cubic.quality.scaled import ScaledVerdicts
from cubic.quality.store import QualityStore
from cubic.space.search_space import load_space
from tests.test_carried import BASE_NE, SPACE, keep


def space_at(tmp: Path, name: str, baseline: dict[str, Any], **top: Any) -> Path:
    """The default space's workload and knobs at another baseline size, only simulated (no
    quality: section)."""
    raw = yaml.safe_load(SPACE.read_text())
    raw.pop("quality")
    raw["baseline"].update(baseline)
    raw.update(name=name, **top)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture()
def judged_a(tmp_path: Path):
    """Space A (dlrm_cpu, 2 ranks x 1,024): SGD tables failed alone, fp16 tables and 2x the global
    batch (4,096) passed alone, in real quality runs kept in a quality store."""
    a = load_space(SPACE, check_choices=False)
    store = QualityStore(f"sqlite:///{tmp_path / 'quality.db'}")
    base = a.baseline_params()
    keep(store, a, base, list(BASE_NE))
    keep(store, a, {**base, "emb_optimizer": "sgd"}, [0.52])
    keep(store, a, {**base, "emb_precision": "fp16"}, [0.50002])
    keep(store, a, {**base, "batch_size": 2048}, [0.50005])
    yield a, store, tmp_path
    store.close()


def scaled(judged_a, world: int, batch: int) -> tuple[ScaledVerdicts, dict[str, Any]]:
    """Space B, the same workload at `world` ranks x `batch` judged by A's runs; B's baseline."""
    a, store, tmp = judged_a
    b = load_space(space_at(tmp, f"b{world}x{batch}", {"world_size": world, "batch_size": batch}),
                   check_choices=False)
    return ScaledVerdicts(b, CarriedVerdicts(a, store, "q")), b.baseline_params()


def test_a_precision_judged_in_a_carries_to_another_world_size(judged_a) -> None:
    sv, base = scaled(judged_a, 8, 1024)  # 8 ranks: global batch 8,192, not A's 2,048
    fp16 = sv.crown({**base, "emb_precision": "fp16"})
    assert fp16.ok and "passed alone in real quality runs of space dlrm_cpu" in fp16.reason
    rows = {r["change"]: r for r in (v.to_row() for v in sv.changes())}
    assert rows["emb_precision=fp16"]["verdict"] == "passes (carried from space dlrm_cpu)"
    assert rows["emb_precision=fp16"]["judged_in"] == "dlrm_cpu"
    # without the mapping, B (no quality runs of its own) finds nothing to carry
    alone = CarriedVerdicts(sv.space, sv.source.store)
    assert not alone.crown({**base, "emb_precision": "fp16"}).ok


def test_a_global_batch_judged_in_a_carries_only_at_the_size_it_was_judged(judged_a) -> None:
    sv, base = scaled(judged_a, 8, 1024)
    for batch in (512, 2048):  # global batch 4,096 (the value A judged, from A's 2,048) and 16,384
        c = sv.crown({**base, "batch_size": batch})
        assert not c.ok and "not judged at this size" in c.reason, c.reason
        assert "global_batch=2048" in c.reason and "global_batch=8192" in c.reason
    row = next(v.to_row() for v in sv.changes() if v.change == ("global_batch", 4096))
    assert row["ok"] is None and row["verdict"] == "not carried from space dlrm_cpu"
    assert "not judged at this size" in row["reason"] and "only the value judged" in row["reason"]
    same, base4 = scaled(judged_a, 4, 512)  # 4 ranks x 512: A's global batch, so A's verdict is B's
    c = same.crown({**base4, "batch_size": 1024})
    assert c.ok and "global_batch=4096" in c.reason


def test_a_change_ruled_out_in_a_keeps_bs_configuration_uncrowned(judged_a) -> None:
    sv, base = scaled(judged_a, 8, 1024)
    c = sv.crown({**base, "emb_optimizer": "sgd", "emb_precision": "fp16"})
    assert not c.ok
    assert c.reason == "ruled out by real quality runs of space dlrm_cpu: emb_optimizer=sgd"
    assert not sv.crown({**base, "dense_precision": "bf16"}).ok  # never judged in A
    assert sv.crown({**base, "pipeline_depth": 2}).ok  # layout only


def test_a_stack_whose_model_a_judged_whole_takes_that_verdict(judged_a) -> None:
    """Changes that each passed alone in A are crowned together in B, unless A's real runs judged
    their stack whole: then that verdict decides."""
    a, store, _ = judged_a
    sv, base = scaled(judged_a, 8, 1024)
    stack = {**base, "emb_precision": "fp16", "batch_size": 1024, "comm_precision": "bf16"}
    keep(store, a, {**a.baseline_params(), "comm_precision": "bf16"}, [0.50001])
    assert sv.crown(stack).ok  # each passed alone, not judged together
    both = {**a.baseline_params(), "emb_precision": "fp16", "comm_precision": "bf16"}
    keep(store, a, both, [x * 1.01 for x in BASE_NE])  # the stack fails whole in A: +1%
    c = ScaledVerdicts(sv.space, CarriedVerdicts(a, store, "q")).crown(stack)
    assert not c.ok and c.reason.startswith("in space dlrm_cpu: its model failed"), c.reason


def tune_b(tmp: Path, space: Path, *extra: str) -> Any:
    from cubic.cli.app import app

    args = ["tune", "--space", str(space), "--backend", "sim", "--cluster", "local",
            "--run-dir", str(tmp / "run"), "--trials", "2", *extra]
    return CliRunner().invoke(app, args)


@pytest.mark.parametrize("make_a, says", [
    (lambda tmp: "no_such_space", "--quality-from no_such_space: no_such_space: search space "
     "file not found; give a space file or a shipped space's name"),
    (lambda tmp: str(space_at(tmp, "a_unjudged", {})), "quality: missing"),
])
def test_a_bad_source_space_is_refused_with_one_line(tmp_path: Path, make_a, says: str) -> None:
    b = space_at(tmp_path, "b8", {"world_size": 8})
    res = tune_b(tmp_path, b, "--quality-from", make_a(tmp_path))
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and says in lines[0], res.output
    assert not (tmp_path / "run").exists()


def test_a_space_of_another_workload_is_refused_with_one_line(tmp_path: Path) -> None:
    b = space_at(tmp_path, "b8", {"world_size": 8}, workload={"preset": "small"})
    res = tune_b(tmp_path, b, "--quality-from", "dlrm_cpu")
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith("error: --quality-from dlrm_cpu: ") and "workload." in lines[0]
    assert "same workload" in lines[0] and not (tmp_path / "run").exists()
    res = tune_b(tmp_path, b, "--quality-from", "dlrm_cpu", "--backend", "real")
    assert res.exit_code == 2 and "only --backend sim" in res.output


def test_a_simulated_tune_at_another_size_crowns_only_what_as_runs_passed(judged_a) -> None:
    a, _, tmp = judged_a
    req = TuneRequest(space=space_at(tmp, "b8", {"world_size": 8}), run_dir=tmp / "run",
                      backend="sim", cluster="local", trials=16, live=False,
                      quality_store=str(tmp / "quality.db"), quality_from="dlrm_cpu")
    tuner = build(req, Console(record=True, width=200))
    try:
        s = tuner.run()
    finally:
        tuner.runner.stop()
    assert s.carried_from and s.carried_from.startswith("space dlrm_cpu, quality store")
    rows = {r["change"]: r for r in s.screen}
    assert rows["emb_precision=fp16"]["ok"] is True and rows["emb_optimizer=sgd"]["ok"] is False
    assert "not judged at this size" in rows["global_batch=16384"]["reason"]
    assert s.winner is not None
    win = next(t for t in tuner.store.records() if t.number == s.winner.trial)
    made = {f"{n}={v}" for n, v in tuner.space.numerics_changes(win.params)}
    assert made <= {"emb_precision=fp16"}
