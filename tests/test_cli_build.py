"""`cubic tune` builds its tuner through `cubic.cli.tune.build(TuneRequest)`: a tune can be built and run
without the CLI, and bad input is refused before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from cubic.cli.tune import TuneRequest, build
from cubic_harness.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "search_spaces" / "tiny.yaml"


def test_a_tune_is_built_from_a_typed_request_and_runs() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        req = TuneRequest(space=TINY, run_dir=Path(d) / "run", backend="sim", cluster="local", trials=3,
                          live=False)
        tuner = build(req, Console(record=True, width=160))
        try:
            summary = tuner.run()
        finally:
            tuner.runner.stop()
        assert summary.study.endswith("@sim:local") and summary.trials == 3
        assert (Path(d) / "run" / "study.db").exists()


@pytest.mark.parametrize("req,says", [
    (TuneRequest(space=TINY, searcher="nope"), "--searcher 'nope': choose one of"),
    (TuneRequest(space=TINY, trials=0), "--trials 0: must be >= 1"),
    (TuneRequest(space=TINY, warm_start=("runs/x",), searcher="random"), "--warm-start: only the cubic searcher"),
    (TuneRequest(space=TINY, backend="sim", cluster="local", quality_store="/no/such/dir/q.db"),
     "--quality-store /no/such/dir/q.db: no such directory"),
])
def test_bad_requests_are_refused_before_anything_is_written(tmp_path: Path, req: TuneRequest, says: str) -> None:
    import dataclasses

    req = dataclasses.replace(req, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        build(req, Console())
    assert not (tmp_path / "run").exists()
