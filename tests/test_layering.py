"""The import contract: kernels/ -> harness/ -> cubic/ (installed as cubic_kernels, cubic_harness, cubic), each
layer importing only the ones below it.

Why it is a test: the kernels are reusable without the harness (a backend is the contract in
`kernels/base.py`), and the harness runs a trial without the tuner (`cubic trial`, TorchRec's verify,
a Ray worker that imports only what a trial needs). Imports inside functions count too: a lazy import
is still a dependency, only a later one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the names it must not import: the layers above it, and the bare folder names, which are not
# installed (the distribution installs them as cubic_harness and cubic_kernels: no clash with other packages)
BARE = ("harness", "kernels")
FORBIDDEN = {"kernels": ("cubic_harness", "cubic", *BARE), "harness": ("cubic", *BARE), "cubic": BARE,
             "tests": BARE, "benchmarks": BARE}


def imported_roots(source: str, filename: str = "<src>") -> set[str]:
    """Top-level package names a module imports anywhere in it (relative imports stay in the package)."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def violations(layer: str) -> list[str]:
    out = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        bad = imported_roots(path.read_text(), str(path)) & set(FORBIDDEN[layer])
        out += [f"{path.relative_to(ROOT)} imports {b}" for b in sorted(bad)]
    return out


def test_the_contract_sees_top_level_and_lazy_imports() -> None:
    src = ("import os\nfrom cubic_harness.config import TrialConfig\ndef f():\n    import cubic.tune\n"
           "    from . import x\n")
    assert imported_roots(src) == {"os", "cubic_harness", "cubic"}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_lower_layer_imports_nothing_above_it(layer: str) -> None:
    assert (ROOT / layer).is_dir()
    assert not violations(layer), "\n".join(violations(layer))


def test_the_kernels_a_config_names_are_the_kernels_the_registry_has() -> None:
    """`kernels/` cannot import the harness, so the registry and the config's allowed kernels are two lists:
    this keeps them one fact (a new backend must be allowed where it is configured, and vice versa)."""
    from cubic_harness.config import CHOICES
    from cubic_harness.sim.cluster import KERNELS
    from cubic_kernels import BACKENDS

    assert set(CHOICES["kernel"]) == set(BACKENDS) == set(KERNELS)
