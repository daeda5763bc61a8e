"""`cubic report` on a `cubic codesign` run: the front rebuilt from the study (each point's trial,
cluster, configuration and plan, its time to train, cost and qps), the knee, and the plot of time to
train against cost embedded in the HTML; bad input is one line and exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest
import yaml
from typer.testing import CliRunner

from cubic.cli.app import app
from cubic.codesign.front import FMT

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real co-design study: the shipped space on 2 nodes x 2 sizes x 2 fabrics."""
    tmp = tmp_path_factory.mktemp("codesign_report")
    d = yaml.safe_load((ROOT / "search_spaces" / "mlperf_codesign.yaml").read_text())
    d["codesign"].update(
        nodes_from=["h100-8", "b200-8"],
        gpus=[8, 16],
        price_per_gpu_hour={"h100-8": 3.0, "b200-8": 5.0},
    )
    space = tmp / "space.yaml"
    space.write_text(yaml.safe_dump(d))
    run = tmp / "run"
    args = ["--space", str(space), "--trials", "12", "--searcher", "random", "--seed", "3"]
    r = cli("codesign", *args, "--run-dir", str(run))
    assert r.exit_code == 0, r.output
    return run


def test_report_shows_the_front_the_knee_and_the_plot(run_dir: Path) -> None:
    want = json.loads((run_dir / "front.json").read_text())  # what `cubic codesign` found
    assert want["points"] and want["knee_trial"] is not None
    (run_dir / "front.json").write_text("{}")  # stale or not, the report reads the study
    r = cli("report", str(run_dir))
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    page = (run_dir / "report.html").read_text()
    for p in want["points"]:
        row = [str(p["trial"]), p["cluster"], f"{p['config']} ({p['plan']})"]
        row += [FMT[o](p["scores"][o]) for o in ("time_to_train", "cost", "qps")]
        assert " ".join(row) in text.replace(" knee", ""), (row, r.output)
        for cell in (p["cluster"], p["config"], p["plan"], *row[3:]):
            assert f">{cell}</td>" in page, cell
    k = want["knee_trial"]
    assert f"knee: trial #{k} on " in text
    assert re.search(rf"<tr style=[^>]+><td class=\"l\">{k} knee", page)
    assert f"Knee: trial #{k} on" in page
    img = r'<img alt="time_to_train against cost" src="data:image/png;base64,[A-Za-z0-9+/]{1000,}'
    assert re.search(img, page)
    assert "top 5" not in text.lower()  # not a tune's report


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # a multi-objective store whose values nothing names (not written by `cubic codesign`)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="other", storage=url, directions=["minimize"] * 2)
    study.add_trial(optuna.trial.create_trial(values=[1.0, 2.0]))
    r = cli("report", str(tmp_path))
    assert r.exit_code == 2
    err = r.stderr.strip()
    assert "does not name them" in err and "\n" not in err and "Traceback" not in err
    # a co-design study with nothing priced yet
    empty = tmp_path / "empty"
    empty.mkdir()
    url = f"sqlite:///{empty / 'study.db'}"
    optuna.create_study(study_name="x@codesign", storage=url, directions=["minimize"] * 2)
    r = cli("report", str(empty))
    assert r.exit_code == 2 and "no trials yet; run `cubic codesign` first" in r.stderr.strip()


@pytest.mark.parametrize("command", [["export", "--format", "json"], ["verify"]])
def test_export_and_verify_of_a_codesign_run_are_one_line_exit_2(run_dir: Path, command: list[str]) -> None:
    """A front has no single winner to hand to TorchRec: one line naming the study and what to run."""
    r = cli(command[0], str(run_dir), *command[1:])
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert "is a co-design study" in err and "cubic report" in err
    assert "\n" not in err and "Traceback" not in err
