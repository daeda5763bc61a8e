"""Wheels that let `cubic tune` run on a GPU machine that lacks optuna, ray and xgboost.

The lent GPU machine (Python 3.12, no internet) has torch, triton, pandas, pyarrow and numba but
not the tuner's own stack, and what travels to it is capped at 64 MiB. Ray's wheel alone is 76 MiB,
of which 31 MiB are Java jars and a few more the web dashboard, RLlib, Serve and LLM libraries that
a tune never imports. This script downloads, for CPython 3.12 x86-64, each missing package at the
version pinned here, repacks Ray without those parts, and checks the total fits.

    python benchmarks/gpu_wheels.py [--out .whl] [--python 3.12]

Then on the GPU machine (carry `.whl`):

    pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/*.whl .
    export PYTHONPATH=/tmp/site    # cubic itself too: its harness and kernels install as cubic_harness, cubic_kernels
    bash benchmarks/gpu_suite.sh tune
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from base64 import urlsafe_b64encode
from importlib.metadata import version
from pathlib import Path

# What the GPU image lacks (its package list: ../.library/device/KINDS.md), pinned to the versions
# this project's .venv runs (ray, optuna, xgboost-cpu, sqlalchemy are pinned in pyproject.toml).
MISSING = ["ray", "optuna", "xgboost-cpu", "sqlalchemy", "alembic", "mako", "colorlog",
           "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
           "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"]
# Parts of Ray a tune never loads: the Java worker, the dashboard's web client, and libraries.
RAY_DROP = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/serve/", "ray/llm/")
LIMIT_MB = 60.0  # the 64 MiB transfer also carries the repository (~1 MiB)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]


def download(pkg: str, out: Path, py: str) -> Path:
    spec = f"{pkg}=={version(pkg)}"
    before = set(out.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           py, "--implementation", "cp", "-d", str(out), spec]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd, check=True)
    (new,) = set(out.glob("*.whl")) - before  # the folder starts empty: each download adds one wheel
    return new


def _hash(data: bytes) -> str:
    return "sha256=" + urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def strip_wheel(whl: Path, drop: tuple[str, ...]) -> tuple[int, int]:
    """Rewrite `whl` without the files under `drop` (RECORD updated to match). Returns bytes before/after."""
    before = whl.stat().st_size
    tmp = whl.with_suffix(".tmp")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        kept = [i for i in src.infolist() if not i.filename.startswith(drop)]
        record = next(i for i in kept if i.filename.endswith(".dist-info/RECORD"))
        lines = []
        for i in kept:
            if i is record:
                continue
            data = src.read(i)
            dst.writestr(i, data)
            lines.append(f"{i.filename},{_hash(data)},{len(data)}")
        lines.append(f"{record.filename},,")
        dst.writestr(record, "\n".join(lines) + "\n")
    tmp.replace(whl)
    return before, whl.stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".whl"))
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (KINDS.md)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("*.whl"):  # two versions of one package would stop the install there
        old.unlink()
    total = 0
    for pkg in MISSING:
        w = download(pkg, a.out, a.python)
        if pkg == "ray":
            b, s = strip_wheel(w, RAY_DROP)
            print(f"{w.name}: {b / 2**20:.1f} -> {s / 2**20:.1f} MiB (dropped {', '.join(RAY_DROP)})")
        total += w.stat().st_size
    print(f"{len(MISSING)} wheels in {a.out}: {total / 2**20:.1f} MiB (limit {LIMIT_MB:.0f})")
    if total > LIMIT_MB * 2**20:
        print(f"too large to travel with the repository: {total / 2**20:.1f} MiB > {LIMIT_MB:.0f} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
