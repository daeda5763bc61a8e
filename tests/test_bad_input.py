"""Bad input that used to end in a traceback or a four-line usage message: one line, exit 2, via the real
`cubic` script (its `main` turns usage errors into one line; the in-process CliRunner would bypass it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CUBIC = shutil.which("cubic", path=str(Path(sys.executable).parent)) or "cubic"


def run(*args: str, cwd: Path | None = None) -> tuple[int, list[str], str]:
    p = subprocess.run([CUBIC, *args], capture_output=True, text=True, cwd=cwd, timeout=120)
    return p.returncode, p.stderr.strip().splitlines(), p.stderr


@pytest.mark.parametrize("args, says", [
    (("tune", "--seed", "-1"), "--seed"),
    (("tune", "--seed", "4294967296"), "less than or equal to 4294967295"),
    (("tune", "--trials", "abc"), "--trials"),
    (("report",), "Missing argument"),
    (("nosuchcommand",), "No such command"),
    (("workload", "profile", "x.csv"), "--workload"),
])
def test_usage_errors_are_one_line(args: tuple[str, ...], says: str) -> None:
    code, lines, err = run(*args)
    assert code == 2 and len(lines) == 1 and says in lines[0] and lines[0].startswith("error: cubic"), err


@pytest.mark.parametrize("text, says", [
    ("objective: {metric: [qps]}\nknobs: {batch_size: {choices: [1024]}}\n", "objective.metric"),
    ("objective: {direction: [max]}\nknobs: {batch_size: {choices: [1024]}}\n", "objective.direction"),
    ("workload: {preset: [tiny]}\nknobs: {batch_size: {choices: [1024]}}\n", "unknown preset ['tiny']"),
    ("workload: {preset: tiny, collections: 0}\nknobs: {batch_size: {choices: [1024]}}\n",
     "collections=0 must be an integer from 1 to the number of tables (6)"),
    ("workload: {preset: tiny, collections: two}\nknobs: {batch_size: {choices: [1024]}}\n", "collections='two'"),
])
def test_space_type_errors_are_one_line(tmp_path: Path, text: str, says: str) -> None:
    (tmp_path / "s.yaml").write_text(text)
    code, lines, err = run("trial", "--space", str(tmp_path / "s.yaml"), "--backend", "sim", "--cluster", "h100-8")
    assert code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in err, err


def test_cluster_file_with_numeric_unknown_keys_is_one_line(tmp_path: Path) -> None:
    import yaml

    from cubic_harness.sim.cluster import shipped_cluster

    d = yaml.safe_load(shipped_cluster("h100-8.yaml").read_text())
    d[7] = "x"  # a number beside the string keys: sorting them for the message raised TypeError
    d["zzz"] = 1
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(d))
    code, lines, err = run("trial", "--backend", "sim", "--cluster", str(tmp_path / "c.yaml"))
    assert code == 2 and len(lines) == 1 and "unknown key" in lines[0] and "Traceback" not in err, err


def test_verify_fidelity_table_with_too_few_configurations_prints(capsys: pytest.CaptureFixture) -> None:
    """Fewer than 3 configurations ran in TorchRec: no tau, said so (formatting None raised before)."""
    from cubic.cli.verify import _print

    _print({"study": "s", "configs": 1, "rows": [{"trial": 1, "qps_cubic": 10.0, "qps_torchrec": 20.0,
                                                  "substitutions": []}],
            "kendall_tau": None, "median_qps_ratio_cubic_over_torchrec": 0.5, "skipped": ["trial #2: error"]}, True)
    out = capsys.readouterr().out
    assert "Kendall tau n/a" in " ".join(out.split()) and "0.50" in out


@pytest.mark.parametrize("knob, says", [
    ("uvm_cache_load_factor=0.1", "uvm_cache_load_factor=0.1 needs device=cuda"),
    ("uvm_cache_load_factor=2", "uvm_cache_load_factor=2.0 must be in [0, 1]"),
])
def test_a_knob_value_that_cannot_run_is_one_line(knob: str, says: str) -> None:
    code, lines, err = run("trial", "--set", knob)
    assert code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in err, err


def test_a_cluster_name_that_is_no_preset_names_the_presets() -> None:
    """A mistyped preset used to read "clusters/h100.yaml: cluster file not found", a path the user
    never gave, with no word of what the names are."""
    code, lines, err = run("trial", "--backend", "sim", "--cluster", "h100")
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: h100: no such cluster file or preset; presets: local, ")
    assert "h100-8" in lines[0] and "gb200-nvl72" in lines[0]


@pytest.mark.parametrize("value", ["nope", "row_wise"])
def test_cubic_plan_refuses_a_sharding_it_would_replace(value: str) -> None:
    """`cubic plan` plans every table itself: `--set sharding=...` was replaced without a word (even
    a value that is no sharding type), and the plan printed as if it had been heard."""
    code, lines, err = run("plan", "--space", "tiny", "--cluster", "h100-8",
                           "--set", f"sharding={value}")
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: --set sharding:") and "--vs" in lines[0]
