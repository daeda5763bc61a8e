"""cubic's file formats as JSON Schema (`cubic schema space|cluster|workload`), from the models that load them.

Point an editor at one (for example VS Code's `yaml.schemas`, or a `# yaml-language-server: $schema=FILE`
line at the top of a space) and it completes every key and allowed value and marks what the loader would
refuse, before a tune starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from cubic.space.spec import SpaceFile
from cubic_harness.schema import json_schema
from cubic_harness.sim.cluster import ClusterFile
from cubic_harness.workload import Workload

KINDS = ("space", "cluster", "workload")


def workload_schema() -> dict[str, Any]:
    """The full workload form (what `cubic workload` writes, `Workload.to_dict`), from the dataclasses that
    hold it, plus what only a file says: a preset to start from, profiles shared by index."""
    s = TypeAdapter(Workload).json_schema()
    s["additionalProperties"] = False
    s["required"] = []  # every key has a default (the preset `small`'s shape)
    s["properties"]["preset"] = {"enum": sorted(Workload.presets()),
                                 "description": "start from this preset; the other keys override it"}
    s["properties"]["profiles"] = {"type": "array", "items": {"$ref": "#/$defs/IdProfile"},
                                   "description": "id profiles several tables share: a table names one by index"}
    table = s["$defs"]["TableSpec"]
    table["additionalProperties"] = False
    table["properties"]["profile"] = {"anyOf": [{"$ref": "#/$defs/IdProfile"}, {"type": "integer", "minimum": 0},
                                                {"type": "null"}]}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "cubic workload",
            "description": "A DLRM-style workload: its embedding tables, dense part and ids (cubic workload ...)",
            **{k: v for k, v in s.items() if k not in ("title", "description")}}


def schema(kind: str) -> dict[str, Any]:
    if kind == "space":
        return json_schema(SpaceFile, "cubic search space", SpaceFile.__doc__ or "")
    if kind == "cluster":
        return json_schema(ClusterFile, "cubic cluster", ClusterFile.__doc__ or "")
    if kind == "workload":
        return workload_schema()
    raise ValueError(kind)
