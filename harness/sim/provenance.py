"""Which of a cluster's figures were measured and which assumed, and where each came from.

A prediction is only as good as the figures it prices with, and a cluster file composed of this
machine's calibration (`base: local`) and a preset's fabric (`fabric: h100-64`) mixes the two kinds:
the node's rates were measured by `cubic calibrate`, the NICs between nodes are a spec sheet's.
The loader records, per figure group (a top-level key of the file, or one level down where a
group's keys came from different files), the file that stated it and whether that file measured it;
`Cluster.figures` holds it and every simulated prediction carries it (`extra["figures"]`).

A file written by `cubic calibrate` (its `source.command`) is measured except the groups its
`source.assumed` lists; any other file is assumed except the groups its `source.measured` lists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MEASURED, ASSUMED = "measured", "assumed"
# a file's description, not hardware figures
NOT_FIGURES = ("name", "about", "source", "base", "fabric")
# what `cubic calibrate` cannot measure on a machine with one GPU (harness/sim/calibrate.py:
# `_links` writes DGX H100's public NVLink figures): assumed in its file (`source.assumed`)
GPU_CALIBRATION_ASSUMES = ("intra_node", "network")
# a GPU calibration whose file lists nothing under `source.assumed` was written when the framework
# step was a constant too, not measured
GPU_CALIBRATION_ASSUMED_UNLISTED = (*GPU_CALIBRATION_ASSUMES, "device.step_overhead_ms",
                                    "device.process_mb")


def calibrated(raw: dict[str, Any]) -> bool:
    """Whether `cubic calibrate` wrote this mapping (its `source.command`)."""
    src = raw.get("source")
    return isinstance(src, dict) and str(src.get("command", "")).startswith("cubic calibrate")


def _listed(src: Any, key: str) -> set[str]:
    got = src.get(key) if isinstance(src, dict) else None
    return {str(g) for g in got} if isinstance(got, list) else set()


def stated(raw: dict[str, Any], path: Path, preset: bool) -> dict[str, str]:
    """Figure group -> "measured (FILE, cubic calibrate DATE)", "assumed (preset NAME)" or
    "assumed (FILE)" for each figure the mapping itself states: a top-level key, or each key of a
    top-level mapping (run before the mapping is checked: any keys; the checker names bad ones)."""
    src = raw.get("source")
    where = f"preset {path.stem}" if preset else path.name
    if calibrated(raw):
        date = str(src.get("date", ""))[:10]
        measured_as = f"{MEASURED} ({where}, {' '.join(x for x in ('cubic calibrate', date) if x)})"
        dev = raw.get("device")
        gpu = isinstance(dev, dict) and dev.get("type") == "gpu"
        flip = (_listed(src, "assumed") if "assumed" in src
                else set(GPU_CALIBRATION_ASSUMED_UNLISTED) if gpu else set())
        kinds = (measured_as, f"{ASSUMED} ({where}: not measured by cubic calibrate)")
    else:
        flip = _listed(src, "measured")
        kinds = (f"{ASSUMED} ({where})", f"{MEASURED} ({where})")
    out: dict[str, str] = {}
    for key, val in raw.items():
        if key in NOT_FIGURES:
            continue
        groups = [f"{key}.{sub}" for sub in val] if isinstance(val, dict) and val else [str(key)]
        for g in groups:
            out[g] = kinds[1] if g in flip or key in flip else kinds[0]
    return out


def collapse(origins: dict[str, str]) -> dict[str, str]:
    """One entry per top-level key whose groups share one origin, else one per group: `device`,
    not its twenty keys, unless a file overrode some of them."""
    by_top: dict[str, dict[str, str]] = {}
    for g, label in origins.items():
        by_top.setdefault(g.split(".", 1)[0], {})[g] = label
    out: dict[str, str] = {}
    for top, groups in by_top.items():
        labels = set(groups.values())
        out.update({top: labels.pop()} if len(labels) == 1 else groups)
    return out


def split(figures: dict[str, str]) -> dict[str, dict[str, str]]:
    """`Cluster.figures` as a prediction carries it:
    {"measured": {group: source}, "assumed": {group: source}}."""
    out: dict[str, dict[str, str]] = {MEASURED: {}, ASSUMED: {}}
    for g, label in figures.items():
        kind, _, rest = label.partition(" (")
        out.setdefault(kind, {})[g] = rest.removesuffix(")")
    return out


def describe(kinds: dict[str, dict[str, str]]) -> str:
    """A prediction's `extra["figures"]` (or `split(cluster.figures)`) in one line for a person: the
    groups measured and those assumed, each with its source (for `cubic trial --backend sim`)."""
    parts = []
    for kind, groups in kinds.items():
        by_src: dict[str, list[str]] = {}
        for g, src in groups.items():
            by_src.setdefault(src, []).append(g)
        if by_src:
            listed = (f"{', '.join(gs)} ({s})" for s, gs in by_src.items())
            parts.append(f"{kind}: " + "; ".join(listed))
    return " | ".join(parts) or "unknown"
