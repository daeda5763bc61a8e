"""What `pip install .` installs: cubic's own names only (cubic, cubic_harness, cubic_kernels and the shipped
spaces and clusters as package data), so it works from any directory without the source tree and never claims
a name another distribution uses (the registry's `kernels`, for one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"cubic", "cubic_harness", "cubic_kernels", "cubic_search_spaces", "cubic_clusters"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the sources (no build files in the checkout), installed (not editable,
    no dependencies: this venv has them) into a directory of its own."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    for name in ("cubic", "harness", "kernels", "search_spaces", "clusters"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"),
                    str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("cubic-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(tmp / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return tmp


def _run(installed: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m cubic ARGS` from a directory outside the checkout, the installed copy first on the path."""
    cwd = installed / "elsewhere"
    (cwd / "config").mkdir(parents=True, exist_ok=True)
    # no calibration of this machine in the user's config: `--cluster local` is the shipped clusters/local.yaml
    env = {**{k: v for k, v in os.environ.items() if k != "CUBIC_LOCAL_CLUSTER"},
           "PYTHONPATH": str(installed / "site"), "XDG_CONFIG_HOME": str(cwd / "config")}
    return subprocess.run([sys.executable, "-m", "cubic", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_wheel_installs_cubics_own_names_and_ships_its_spaces_and_clusters(installed: Path) -> None:
    (wheel,) = (installed / "dist").glob("cubic-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    tops = {f.split("/")[0] for f in files if not f.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == NAMES, tops
    assert "cubic_search_spaces/dlrm_cpu.yaml" in files and "cubic_clusters/h100-8.yaml" in files
    assert "cubic_harness/sharding/collection.py" in files and "cubic_kernels/base.py" in files


def test_the_installed_copy_runs_a_trial_and_a_tune_from_another_directory(installed: Path) -> None:
    where = subprocess.run([sys.executable, "-c", "import cubic_harness, cubic_kernels, cubic.space.search_space as s; "
                            "print(cubic_harness.__file__, s.shipped_space('dlrm_cpu.yaml'))"],
                           cwd=installed, env={**os.environ, "PYTHONPATH": str(installed / "site")},
                           capture_output=True, text=True, check=True).stdout
    assert where.count(str(installed / "site")) == 2, where  # not the checkout
    r = _run(installed, "trial", "--backend", "sim", "--cluster", "local", "--json")  # the shipped space, too
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and res["status"] == "ok", (res["error"], r.stderr[-2000:])
    assert res["env"]["cluster"] == "local" and res["config"]["workload"]["name"] == "small-zipf"
    r = _run(installed, "tune", "--backend", "sim", "--cluster", "local", "--trials", "4", "--no-live",
             "--run-dir", "run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (installed / "elsewhere" / "run" / "study.db").is_file() and "winner" in r.stdout


@pytest.mark.slow  # downloads the registry's `kernels` and its dependencies
def test_cubic_imports_beside_the_registrys_kernels_package(installed: Path) -> None:
    site = installed / "site"
    subprocess.run([sys.executable, "-m", "pip", "-q", "install", "--target", str(installed / "other"), "kernels"],
                   check=True, capture_output=True, timeout=600)
    code = ("import kernels, cubic_kernels, cubic_harness.trial; "
            "print(kernels.__file__); print(cubic_kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=installed, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{installed / 'other'}"}).stdout.split()
    assert out[0].startswith(str(installed / "other")) and out[1].startswith(str(site)), out


def test_every_package_of_the_sources_is_one_the_wheel_lists() -> None:
    """setuptools installs only the packages pyproject.toml names: a new group left out of that list would
    run here (editable) and be missing from every installed copy."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    dirs = {"cubic": "cubic", "harness": "cubic_harness", "kernels": "cubic_kernels"}
    found = {".".join([dirs[p.parts[0]], *p.parts[1:]])
             for top in dirs for p in (q.parent.relative_to(ROOT) for q in (ROOT / top).rglob("__init__.py"))}
    assert found <= listed, sorted(found - listed)
