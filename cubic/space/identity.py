"""A space's identity: what its trials measure (workload, knobs, baseline, trial settings), not its
budget or name. Studies with equal fingerprints can share history (warm start); a study refuses a
space that measures differently, naming the first difference."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from cubic_harness.config import RETIRED


def _identity(space_dict: dict[str, Any]) -> dict[str, Any]:
    """What a trial measures (workload, knobs, baseline, trial settings), not the budget or name."""
    d = {k: space_dict.get(k) for k in ("workload", "knobs", "baseline_config", "objective")}
    if isinstance(d["baseline_config"], dict):  # removed fields at their one value, as key()
        d["baseline_config"] = {**RETIRED, **d["baseline_config"]}
    d["trial"] = {k: v for k, v in (space_dict.get("trial") or {}).items() if k != "repeats"}
    if space_dict.get("lr_scaling") not in (None, "none"):  # (absent from older studies: "none")
        d["lr_scaling"] = space_dict["lr_scaling"]
    return json.loads(json.dumps(d, default=str))


def fingerprint(space_dict: dict[str, Any]) -> str:
    """Identity of what a trial measures: studies with equal fingerprints can share history (warm
    start)."""
    text = json.dumps(_identity(space_dict), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def first_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first dotted key where two spaces measure differently (None if they do not), e.g.
    'knobs.comm_precision.when' or 'baseline_config.batch_size: 1024 -> 2048'."""
    def walk(a: Any, b: Any, path: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                if (d := walk(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))) is not None:
                    return d
            return None
        if a == b:
            return None
        short = (lambda v: json.dumps(v)[:40])
        return f"{path}: {short(a)} -> {short(b)}"
    a, b = _identity(old), _identity(new)
    # the YAML's own sections first: the baseline config repeats the trial settings
    for k in ("workload", "knobs", "objective", "trial", "baseline_config"):
        if (d := walk(a.get(k), b.get(k), k)) is not None:
            return d
    return None
