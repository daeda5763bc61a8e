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


# Inside the tuner: each group of cubic/ by role, on a floor; a module imports only its own group and lower floors.
# A circle between groups would make the floors a lie, and a reader could no longer learn one group from the ones
# below it alone (the grouping and why: docs/architecture.md).
FLOORS = {"space": 0, "execution": 0, "study": 1, "quality": 2, "results": 3, "search": 4, "deploy": 4, "tune": 5,
          "codesign": 5, "cli": 6}


def cubic_imports(path: Path) -> set[str]:
    """The cubic groups a module imports anywhere in it (`from cubic import x` counts as group x)."""
    groups: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "cubic" else [node.module]
        groups.update(n.split(".")[1] for n in names if n.startswith("cubic.") and n.count(".") >= 1)
    return groups


def test_every_module_of_the_tuner_is_in_a_group_on_a_floor() -> None:
    top = sorted(p.name for p in (ROOT / "cubic").glob("*.py"))
    assert top == ["__init__.py", "__main__.py"], f"a flat module outside the groups: {top}"
    groups = sorted(p.name for p in (ROOT / "cubic").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert groups == sorted(FLOORS)


def test_a_group_imports_only_its_own_floor_and_below() -> None:
    bad = []
    for group, floor in FLOORS.items():
        for path in sorted((ROOT / "cubic" / group).rglob("*.py")):
            for other in cubic_imports(path) - {group}:
                if FLOORS.get(other, 99) >= floor:
                    bad.append(f"{path.relative_to(ROOT)} (floor {floor}) imports cubic.{other} "
                               f"(floor {FLOORS.get(other)})")
    assert not bad, "\n".join(bad)


def test_the_floor_check_sees_an_upward_import(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from cubic.tune.loop import Tuner\n    from cubic import results\n")
    assert cubic_imports(p) == {"tune", "results"}
