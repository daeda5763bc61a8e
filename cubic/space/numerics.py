"""The numerics rule, once: which knobs change what a run learns, and through what.

Two configurations that agree on every *aspect* below train the same model on the same samples, so one
quality run answers for both; a configuration whose aspect differs from the baseline's must pass the
quality gate. Each knob maps to the aspect it changes:

- most knobs are their own aspect (a precision, an optimizer, a learning rate, the 2D sync rule);
- `batch_size` and `world_size` act only through the global batch they make (2 x 64 trains as 1 x 128);
- `sharding_group_size` acts through the number of replicas it makes (world / group) in 2D, where the
  replicas train apart and merge (`weight_avg`); replicas that apply one update with the union of their
  bags (`grad_allreduce`, harness/sharding/collection.py) take exactly the full model-parallel step, one
  model (the screen measured replicas=2 so at +0.000% on both seeds, bit for bit);
- `sharding` acts only through column-wise shards keeping their own row-wise AdaGrad state (as in
  FBGEMM and TorchRec); every other sharding type, and any sharding under SGD, trains the same model.

`NUMERICS`' keys are also a space's default `quality_knobs`; a space may name others, each its own aspect.
Knobs outside the table (kernels, pipelining, communication overlap, threads, placement) move where and when
the same math runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from cubic_harness.config import TrialConfig


@dataclass(frozen=True)
class Aspect:
    """What trains differently when a knob changes: its name (the quality screen's label) and its value."""

    name: str
    of: Callable[[TrialConfig], Any]


def _own(knob: str) -> Aspect:
    return Aspect(knob, attrgetter(knob))


GLOBAL_BATCH = Aspect("global_batch", attrgetter("global_batch"))
NUMERICS: dict[str, Aspect] = {
    **{k: _own(k) for k in ("emb_precision", "dense_precision", "comm_precision", "allreduce_comm_precision")},
    "batch_size": GLOBAL_BATCH,
    "world_size": GLOBAL_BATCH,
    **{k: _own(k) for k in ("emb_optimizer", "emb_lr", "dense_lr")},
    "sharding": Aspect("sharding", lambda c: "column_wise" if c.sharding == "column_wise"
                       and c.emb_optimizer != "sgd" else "not column_wise"),
    **{k: _own(k) for k in ("sparse_sync", "sparse_sync_interval")},
    "sharding_group_size": Aspect("replicas", lambda c: 1 if c.sparse_sync == "grad_allreduce" else c.replicas),
}

#: Knobs that change where and when the same math runs, not what is trained, unless their aspect says
#: otherwise for a value (column-wise shards keep their own optimizer state): a quality run of a
#: configuration resets them to the baseline's where the aspects stay equal (`SearchSpace.model_params`).
MODEL_NEUTRAL = ("pipeline_depth", "comm_overlap", "threads_per_rank", "sharding")
#: The model-neutral knobs no aspect names: every value of one trains the same model, so a quality
#: layout sets it in every quality run, whether the space searches it or fixes it
#: (`QualityRuns.config`).
ALWAYS_NEUTRAL = tuple(k for k in MODEL_NEUTRAL if k not in NUMERICS)
#: What a space's `quality.layout` may set for its quality runs instead of the baseline's values: the
#: model-neutral knobs and the kernel. Every kernel computes FBGEMM's math (kernels/base.py: the same
#: optimizers, reduced-precision rows rounded to nearest; each checked against float64), so the kernel is
#: neutral too; it is reset only where a layout names it, as a kernel is most of a quality run's speed
#: (on 2 CPU ranks `native` trains the baseline's model 2x as fast as `fbgemm`).
LAYOUT_KNOBS = (*MODEL_NEUTRAL, "kernel")

#: Changes another change may cover: where a configuration makes both, the first may round nothing
#: the second does not round anyway, so a verdict on it alone does not carry to that configuration,
#: whose own quality runs judge it. Pooled embeddings sent in bf16 reach dense math that reads bf16
#: (harness/train.py autocasts the dense arch; the fp8 modes run inside that autocast), and their
#: gradients come back from it in bf16. Whether a model reads them only there (no fp32 op on the
#: pooled values, no 2D replica sync in `comm_precision`) its runs show: bit-equal runs are one
#: model (`cubic.tune.candidates.Candidates.same_model`).
Change = tuple[str, Any]  # (aspect, value): what trains differently, as `changes` names it
COVERS: dict[Change, frozenset[Change]] = {
    ("comm_precision", "bf16"): frozenset(
        ("dense_precision", p) for p in ("bf16", "fp8_auto", "fp8_all")),
}


@dataclass(frozen=True)
class Monotone:
    """An aspect whose cost in eval NE only grows with its value's distance from the baseline's on one
    side (`side`: +1 above it), and why."""

    aspect: Aspect
    side: int
    why: str


#: Where a value the quality screen rules out rules out every value further out on its side without a
#: run of its own (`further_out`). A larger global batch over the same samples at the same learning
#: rates takes fewer steps of the same size, so it cannot learn more (the default space, seed 0, paired:
#: 2x the batch +0.47% eval NE, 4x +3.1%). Not where rates follow the batch or are knobs
#: (`cubic.quality.screen.monotone`): a larger step may then make up for fewer.
MONOTONE: dict[str, Monotone] = {GLOBAL_BATCH.name: Monotone(
    GLOBAL_BATCH, +1, "a larger global batch takes fewer steps over the same samples at the same rates")}


def further_out(change: Change, than: Change, base: TrialConfig) -> bool:
    """Whether `change` lies further from the baseline `base` than `than` does, both on the side of a
    `MONOTONE` aspect where its cost only grows: then `than` ruled out rules `change` out too, and judging
    `than` first may spare `change` its run."""
    (name, value), (other, bound) = change, than
    rule = MONOTONE.get(name)
    if rule is None or name != other:
        return False
    return rule.side * (bound - rule.aspect.of(base)) > 0 and rule.side * (value - bound) > 0


def aspect(knob: str) -> Aspect:
    return NUMERICS.get(knob) or _own(knob)


def key(cfg: TrialConfig, knobs: Iterable[str]) -> tuple:
    """What decides the numerics of `cfg` under the quality knobs `knobs`: equal keys, the same model."""
    return tuple(sorted({(a.name, a.of(cfg)) for a in map(aspect, knobs)}, key=lambda p: p[0]))


def changed_knobs(cfg: TrialConfig, base: TrialConfig, knobs: Iterable[str]) -> list[str]:
    """The quality knobs through which `cfg` trains differently from `base`, in `knobs`' order.

    A knob is named when its aspect differs and the knob itself changed; where an aspect differs and none
    of its knobs changed (the replicas, when the world size moves under a fixed group size), its knobs are
    named, since that is where the change shows in the space."""
    of = {k: aspect(k) for k in knobs}
    moved = {a.name for a in of.values() if a.of(cfg) != a.of(base)}
    own = {k for k, a in of.items() if a.name in moved and getattr(cfg, k) != getattr(base, k)}
    shown = {of[k].name for k in own}
    return [k for k, a in of.items() if k in own or (a.name in moved and a.name not in shown)]


def changes(cfg: TrialConfig, base: TrialConfig, knobs: Iterable[str],
            searched: Iterable[str]) -> frozenset[tuple[str, Any]]:
    """`changed_knobs` that are `searched` (a space's knobs), as what trains differently, one (aspect, value)
    each: ("global_batch", 4096), ("replicas", 2), ("sharding", "column_wise"), ("emb_optimizer", "sgd")."""
    searched = set(searched)
    return frozenset((aspect(k).name, aspect(k).of(cfg)) for k in changed_knobs(cfg, base, knobs) if k in searched)


def blocking(made: frozenset[Change], out: frozenset[Change]) -> frozenset[Change]:
    """The changes of a configuration making `made` that the screen's ruled-out changes `out`
    rule out for it: each one out, unless it also makes a change that may cover it (`COVERS`)."""
    return frozenset(c for c in made & out if not COVERS.get(c, frozenset()) & made)


def covered_where(change: Change) -> str:
    """Where a ruled-out change still may be searched, for a person: "" where nowhere."""
    covers = sorted(f"{n}={v}" for n, v in COVERS.get(change, ()))
    return f"with {' or '.join(covers)}, which may round as it does" if covers else ""
