"""Broken input of every shape, fed to the commands that read each file format: a wrong type at every key of a
valid file, the file cut in half, binary bytes, an empty file. A wrong type, a cut or binary file must end as
one line on stderr with exit 2 (never read as something else); a value of the key's own type (7 for a count,
"text" for a name) or None (the default) may also end as a trial's result (exit 0, or 1 for a trial that
failed, e.g. out of memory, printed as a result). Never a traceback, never another exit code."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from cubic.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
WRONG = (["x"], {"k": 1}, "text", 7, None, -1.5)  # a value of every YAML/JSON type but the right one


def _paths(d: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key path of a nested mapping (lists' entries too, by index), depth-first."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        yield (*prefix, k)
        if isinstance(v, dict | list) and len(prefix) < 2:
            yield from _paths(v, (*prefix, k))


def _set(d: Any, path: tuple, value: Any) -> Any:
    out = copy.deepcopy(d)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _get(d: Any, path: tuple) -> Any:
    for k in path:
        d = d[k]
    return d


def _same_kind(orig: Any, value: Any) -> bool:
    """`value` is of the type the key holds (a number for a number, a string for a string) or None (the key
    left to its default): the only mutations a command may take as given."""
    def num(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)
    return value is None or (num(orig) and num(value)) or (isinstance(orig, str) and isinstance(value, str))


def _broken(text: str, load: Any, dump: Any) -> Iterator[tuple[str, str | bytes, bool]]:
    """(label, content, whether it may be read as given): a wrong type must be refused."""
    doc = load(text)
    for path in _paths(doc):
        for value in WRONG:
            yield (f"{'.'.join(map(str, path))}={value!r}", dump(_set(doc, path, value)),
                   _same_kind(_get(doc, path), value))
    yield "truncated", text[: len(text) // 2], False
    yield "binary", bytes(range(256)) * 8, False
    yield "empty", "", False


def _check(tmp_path: Path, name: str, content: str | bytes, argv: list[str], may_run: bool) -> None:
    f = tmp_path / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    r = CliRunner().invoke(app, argv)
    lines = r.stderr.strip().splitlines()
    assert isinstance(r.exception, SystemExit | None) and "Traceback" not in r.stderr, (argv, r.exception)
    assert r.exit_code in ((0, 1, 2) if may_run else (2,)), (argv, r.exit_code, r.stderr[-500:])
    if r.exit_code == 1:  # a failed trial is a result, printed with its reason
        assert "trial" in r.stdout and ("error" in r.stdout or "oom" in r.stdout), r.stdout[-500:]
    if r.exit_code == 2:
        assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr


SIM = ["--backend", "sim", "--cluster", "h100-8"]
TINY = ["--space", str(ROOT / "search_spaces" / "tiny.yaml")]  # a small space: the default one takes seconds
CASES = {
    "space": (ROOT / "search_spaces" / "tiny.yaml", "s.yaml", ["trial", "--space", "{f}", *SIM]),
    "cluster": (ROOT / "clusters" / "h100-8.yaml", "c.yaml", ["trial", *TINY, "--backend", "sim", "--cluster",
                                                             "{f}"]),
    "workload": (None, "w.json", ["trial", *TINY, "--workload", "{f}", *SIM]),
    "config": (None, "cfg.yaml", ["trial", "--config", "{f}", *SIM]),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_every_broken_file_is_a_result_or_one_line(tmp_path: Path, kind: str) -> None:
    src, name, argv = CASES[kind]
    if kind == "workload":
        from cubic_harness.workload import Workload

        text, load, dump = json.dumps(Workload.tiny().to_dict()), json.loads, json.dumps
    elif kind == "config":
        from cubic_harness.config import TrialConfig

        cfg = TrialConfig(device="cuda", kernel="triton", world_size=2).to_dict()
        text, load, dump = yaml.safe_dump(cfg), yaml.safe_load, yaml.safe_dump
    else:
        text, load, dump = src.read_text(), yaml.safe_load, yaml.safe_dump
    argv = [a.replace("{f}", str(tmp_path / name)) for a in argv]
    cases = list(_broken(text, load, dump))
    assert len(cases) > 20
    assert any(not may_run for *_, may_run in cases) and any(may_run for *_, may_run in cases)
    for label, content, may_run in cases:
        try:
            _check(tmp_path, name, content, argv, may_run)
        except AssertionError as e:
            raise AssertionError(f"{kind} {label}: {e}") from None
