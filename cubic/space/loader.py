"""A search-space YAML file read with each key's line: every error the loader raises is one line,
`FILE:LINE: key: what is allowed` (`cubic_harness.errors.ConfigError`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cubic_harness.errors import ConfigError, read_text


class Lines:
    """Line numbers of YAML keys (1-based), by dotted path, for error messages."""

    def __init__(self, text: str) -> None:
        self.lines: dict[str, int] = {}
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError:
            node = None
        if node is not None:
            self._walk(node, "")

    def _walk(self, node: yaml.Node, prefix: str) -> None:
        self.lines.setdefault(prefix, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                path = f"{prefix}.{k.value}" if prefix else str(k.value)
                self.lines[path] = k.start_mark.line + 1
                self._walk(v, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._walk(v, f"{prefix}[{i}]")

    def at(self, path: str) -> int | None:
        """The line of `path`, or of the nearest enclosing key that has one."""
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path.rsplit(".", 1)[0] if "." in path else ""
        return None


class Loader:
    """One file being loaded: its path and key lines, so any check can raise a one-line error."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.lines = path, Lines(text)

    def err(self, key: str, msg: str) -> ConfigError:
        line = self.lines.at(key)
        loc = f"{self.path}:{line}" if line else str(self.path)
        return ConfigError(f"{loc}: {key}: {msg}" if key else f"{loc}: {msg}")

    def mapping(self, d: Any, key: str) -> dict[str, Any]:
        """A section as a dict ({} where absent); its keys were checked by the file's model
        (`SpaceFile`)."""
        if d is None:
            return {}
        if not isinstance(d, dict):
            raise self.err(key, f"must be a mapping, got {type(d).__name__}")
        return d


def read_space_file(path: Path) -> tuple[Loader, dict[str, Any]]:
    """The file's top-level mapping and its loader; malformed YAML is one line naming where yaml saw
    it."""
    text = read_text(path, "search space file")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{line}: malformed YAML: {problem}") from None
    ld = Loader(path, text)
    raw = ld.mapping(raw, "")
    if not raw:
        raise ld.err("", "empty search space; needs at least 'knobs'")
    return ld, raw


def shipped_space(name: str) -> Path:
    """A space `search_spaces/` ships, from a checkout or the installed package."""
    from cubic_harness.sim.cluster import shipped_file

    return shipped_file("search_spaces", "cubic_search_spaces", name)
