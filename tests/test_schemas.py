"""File formats as typed models (`cubic_harness.schema`): every shipped file loads and validates against the
JSON Schema `cubic schema` exports, and what the schema refuses the loader refuses, in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from cubic.space.schemas import schema
from cubic.space.search_space import load_space
from cubic_harness.errors import ConfigError
from cubic_harness.sim.cluster import load_cluster
from cubic_harness.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
SPACES = sorted((ROOT / "search_spaces").glob("*.yaml"))
CLUSTERS = sorted((ROOT / "clusters").glob("*.yaml"))


def as_editor_sees(path: Path) -> object:
    """The YAML as JSON (mapping keys become strings), which is what an editor checks against a schema."""
    return json.loads(json.dumps(yaml.safe_load(path.read_text())))


def validator(kind: str) -> jsonschema.Draft202012Validator:
    s = schema(kind)
    jsonschema.Draft202012Validator.check_schema(s)
    return jsonschema.Draft202012Validator(s)


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.name)
def test_every_shipped_space_loads_and_matches_its_schema(path: Path) -> None:
    load_space(path)
    errors = list(validator("space").iter_errors(as_editor_sees(path)))
    assert not errors, [e.message for e in errors]


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_every_shipped_cluster_loads_and_matches_its_schema(path: Path) -> None:
    """(A preset written as differences from a `base` preset matches once merged, as the loader checks it.)"""
    from cubic_harness.sim.cluster import cluster_mapping

    load_cluster(path)
    seen = as_editor_sees(path)
    errors = list(validator("cluster").iter_errors(cluster_mapping(path) if "base" in seen else seen))
    assert not errors, [e.message for e in errors]


def test_every_preset_workload_as_written_matches_the_workload_schema() -> None:
    v = validator("workload")
    for name, make in Workload.presets().items():
        errors = list(v.iter_errors(json.loads(json.dumps(make().to_dict()))))
        assert not errors, (name, [e.message for e in errors][:3])
    assert list(v.iter_errors({"preset": "tiny", "tabels": []}))  # a typo an editor marks


@pytest.mark.parametrize("edit, says", [
    (("knobs", "shardin", ["table_wise"]), "knobs.shardin: unknown key; allowed: ['world_size'"),
    (("knobs", "kernel", ["fbgemm", "cuda"]), "knobs.kernel.choices[1]: 'cuda' is not allowed; choose one of"),
    (("budget", "isolation", "rack"), "budget.isolation: 'rack' is not allowed; choose one of ['node', 'cores']"),
    (("quality", "seeds", "two"), "quality.seeds: 'two' is not an integer"),
])
def test_what_the_schema_refuses_the_loader_refuses_in_one_line(tmp_path: Path, edit: tuple, says: str) -> None:
    d = yaml.safe_load((ROOT / "search_spaces" / "tiny.yaml").read_text())
    section, key, value = edit
    d.setdefault(section, {})[key] = value
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(d))
    assert list(validator("space").iter_errors(as_editor_sees(tmp_path / "s.yaml")))
    with pytest.raises(ConfigError) as e:
        load_space(tmp_path / "s.yaml")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{tmp_path / 's.yaml'}:") and says in str(e.value)


def test_cubic_schema_writes_each_format_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    for kind in ("space", "cluster", "workload"):
        r = subprocess.run([sys.executable, "-m", "cubic", "schema", kind, "-o", str(tmp_path / f"{kind}.json")],
                           capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        assert json.loads((tmp_path / f"{kind}.json").read_text())["title"] == f"cubic {kind}".replace(
            "space", "search space")
    r = subprocess.run([sys.executable, "-m", "cubic", "schema", "spaces"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: cubic schema: 'spaces' is not a format; choose one of ['space', 'cluster', 'workload']"]
