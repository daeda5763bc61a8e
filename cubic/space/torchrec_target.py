"""`target: torchrec`: a space narrowed to the knob values TorchRec runs as cubic measures them on
the baseline's device (`cubic_harness.torchrec_rules`), so its winner deploys
as measured."""

from __future__ import annotations

import dataclasses
from typing import Any

from cubic.space.knobs import Knob
from cubic.space.loader import Loader
from cubic_harness.config import TrialConfig, inert_knobs


def restrict_to_torchrec(ld: Loader, knobs: dict[str, Knob], baseline: TrialConfig,
                         base_raw: dict[str, Any]) -> tuple[dict[str, Knob], dict[str, list]]:
    """The knobs without the values TorchRec cannot run, and what was dropped per knob; the baseline
    must be one of them where its value acts. Where every configuration has one replica (CPU: no 2D
    value is left), the knobs inert there (`inert_knobs`) leave the space."""
    from cubic_harness.torchrec_rules import runs_unchanged, torchrec_unsupported

    if baseline.workload.interaction == "wukong":
        raise ld.err("target", "torchrec: interaction 'wukong' has no TorchRec model")
    skip = runs_unchanged(baseline)
    for k in base_raw:
        if k in skip:
            continue  # the same training whatever its value: nothing TorchRec runs differently
        why = torchrec_unsupported(k, getattr(baseline, k), baseline.device)
        if why:
            raise ld.err(f"baseline.{k}", f"target torchrec: {k}={getattr(baseline, k)!r} cannot "
                         f"run as measured ({why})")
    out, dropped = {}, {}
    for k, kn in knobs.items():
        keep = tuple(v for v in kn.choices if not torchrec_unsupported(k, v, baseline.device))
        gone = [v for v in kn.choices if v not in keep]
        if gone:
            dropped[k] = gone
        if not keep:
            why = torchrec_unsupported(k, kn.choices[0], baseline.device)
            raise ld.err(f"knobs.{k}", f"target torchrec: none of {list(kn.choices)} runs in "
                         f"TorchRec on {baseline.device} ({why})")
        out[k] = dataclasses.replace(kn, choices=keep)
    group_sizes = out.get("sharding_group_size")
    if baseline.replicas == 1 and group_sizes is not None and set(group_sizes.choices) <= {0}:
        inert = inert_knobs(baseline)
        for k in [k for k in knobs if k in inert]:
            if out.pop(k, None) is not None:
                dropped[k] = list(knobs[k].choices)
    return out, dropped
