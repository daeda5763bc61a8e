"""Quality: the search trials' free estimate, and the confirm step's quality runs.

Quality from search trials, for free: normalized entropy over the baseline's samples.

The harness keys its data by global sample number and records the global loss of every step, so
the first steps of a trial with a global batch at least the baseline's are exactly the training
a sample-matched re-run would do (training is causal): the mean loss over the steps that cover
the baseline's measured samples, divided by the entropy of the labels there (the baseline's
loss / NE over those same samples), is the NE the confirm's quality gate would see. That lets
the searcher learn, while it searches, which fast configurations the gate will reject.
Search trials with a smaller global batch do not cover the baseline's samples: no estimate (None);
the confirm runs them longer (`covering`) so they do.

That estimate is the searcher's early signal only: over a few thousand samples right after warm-up it
is mostly noise (NE near 1, seed-to-seed spread of several percent). A space with a `quality:` section
judges confirmed candidates by quality runs instead (`QualityRuns`, `judge`): real learning over a
budget of samples, held-out eval NE, paired by seed, against a measured noise floor.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from cubic.space.quality_runs import QualityRuns
from cubic_harness.config import TrialConfig


def matched_steps(cfg: TrialConfig, base: TrialConfig) -> tuple[int, int]:
    """(first, count) of cfg's steps over the baseline's measured samples: the whole steps inside
    them; where not one step fits inside, the step that holds their start. Either way the window
    never begins after more training than the baseline's did (a later window would flatter cfg)."""
    gb, gb0 = cfg.global_batch, base.global_batch
    start, stop = base.warmup_steps * gb0, (base.warmup_steps + base.measure_steps) * gb0
    first, end = -(-start // gb), stop // gb  # ceil, floor
    return (first, end - first) if end > first else (start // gb, 1)


def covering(cfg: TrialConfig, base: TrialConfig) -> TrialConfig:
    """`cfg` with its own warm-up and measured steps (so its speed is measured like any trial's),
    run longer where its steps end before the baseline's samples do (a smaller global batch), so
    `matched_ne` can read its NE over those samples from its per-step losses."""
    first, count = matched_steps(cfg, base)
    short = first + count - (cfg.warmup_steps + cfg.measure_steps)
    return cfg.replace(measure_steps=cfg.measure_steps + short) if short > 0 else cfg


def matched_ne(losses: Sequence[float], cfg: TrialConfig, base_losses: Sequence[float], base: TrialConfig,
               base_ne: float | None) -> float | None:
    """NE of a trial over the baseline's measured samples, or None where its steps do not cover them."""
    first, count = matched_steps(cfg, base)
    w0, m0 = base.warmup_steps, base.measure_steps
    if first + count > len(losses) or w0 + m0 > len(base_losses) or not base_ne or base_ne <= 0:
        return None
    entropy = (sum(base_losses[w0:w0 + m0]) / m0) / base_ne
    ne = (sum(losses[first:first + count]) / count) / entropy
    return ne if math.isfinite(ne) else None


class Verdict(StrEnum):
    """A quality verdict on held-out runs paired by seed. Stored as its text ("passed", ...), which is what a
    study's records hold, so a StrEnum reads back equal."""

    PASSED = "passed"  # the interval wholly within the tolerance
    FAILED = "failed"  # wholly past it (or a run failed, or far past it early)
    UNDECIDED = "undecided"  # `judge`: the interval straddles the tolerance
    MORE = "more"  # `sequential`: another paired seed is wanted
    NOT_RESOLVED = "not resolved"  # `sequential`: undecided at the seed budget, or with no chance left to pass
    # the confirm's, not the model's: it cannot beat the baseline or one that passed, so no (further) quality
    # run decided it (`cubic.tune.candidates.Candidates.cannot_win`)
    SLOWER = "slower"


def within(ne: float, base_ne: float, tolerance: float) -> bool:
    """The quality gate's rule: (NE - NE_baseline) / NE_baseline <= tolerance.

    One-sided: lower NE is better quality, so a configuration may improve it freely and may worsen
    it by at most `tolerance`. (A two-sided gate rejected configurations for training *better*:
    a fresh `make tune` crowned the baseline over a 1.19x faster configuration whose smaller batch
    reached an NE 3.3% lower over the same samples.)"""
    return (ne - base_ne) / base_ne <= tolerance


# ------------------------------------------------------------------------------------------- quality runs
#: Quality runs equal bit for bit before a model is taken for another's. One: a run equal to the last
#: bit in eval NE and AUC took every one of its ~500 steps the same way, so the knob that differs
#: rounded nothing there; whether it rounds is decided by the math that reads its values (bf16
#: communication into bf16 dense math), not by the seed's data. A second would cost each such pair
#: one more quality run.
IDENTICAL_SEEDS = 1


def same_runs(ne: Sequence[float | None], auc: Sequence[float | None],
              other_ne: Sequence[float | None], other_auc: Sequence[float | None]) -> bool:
    """Whether runs (eval NE and AUC by seed), at least `IDENTICAL_SEEDS` of them and none failed,
    equal the other's first ones bit for bit: from then on one model."""
    n = len(ne)
    return (n >= IDENTICAL_SEEDS and None not in [*ne, *auc]
            and list(other_ne[:n]) == list(ne) and list(other_auc[:n]) == list(auc))


EARLY_REJECT = 3.0  # x the tolerance: a candidate this far behind after its first seeds skips the rest


def paired_mean(cand_ne: Sequence[float | None], base_ne: Sequence[float | None]) -> float | None:
    """Mean relative eval-NE difference of a candidate from the baseline over the seeds both have run
    (paired by seed); None if none, or if a run among them failed (None or not finite)."""
    n = min(len(cand_ne), len(base_ne))
    pairs = list(zip(cand_ne[:n], base_ne[:n], strict=True))
    if n == 0 or any(c is None or b is None or not math.isfinite(c) or not math.isfinite(b) for c, b in pairs):
        return None
    return statistics.mean((c - b) / b for c, b in pairs)  # type: ignore[operator]


def noise_floor(base_ne: Sequence[float]) -> float | None:
    """The baseline's seed-to-seed spread of eval NE: sample standard deviation / mean (None below 2)."""
    if len(base_ne) < 2:
        return None
    return statistics.stdev(base_ne) / statistics.mean(base_ne)


@dataclass(frozen=True)
class Judgement:
    """The gate on quality runs paired by seed (`judge`).

    ok: the point estimate within the tolerance; diff: mean relative eval NE difference, over
    `diffs`; se: its standard error over the seeds (how precisely the runs measured it); ci: its
    `confidence` interval, Student's t over n-1 degrees of freedom; verdict: PASSED (the interval
    wholly within the tolerance), FAILED (wholly past it), else UNDECIDED; resolved: the verdict is
    not UNDECIDED; noise: the baseline's seed-to-seed spread; pass_chance: `sequential`'s futility
    figure, where it computed one.

    `ok` is what the screen and the checks while searching steer by; the confirm's verdict is
    `verdict`, sequentially (`sequential`)."""

    ok: bool
    diff: float
    diffs: list[float]
    se: float | None
    ci: list[float] | None
    confidence: float
    verdict: Verdict
    resolved: bool
    noise: float | None
    reason: str
    pass_chance: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Its plain-JSON form (`pass_chance` only where computed)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "pass_chance"}
        return out if self.pass_chance is None else {**out, "pass_chance": self.pass_chance}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Judgement:
        return cls(**{**d, "verdict": Verdict(d["verdict"])})


def judge(cand_ne: Sequence[float], base_ne: Sequence[float], tolerance: float,
          confidence: float = QualityRuns.confidence) -> Judgement:
    """The gate on quality runs paired by seed (`Judgement` says what each figure is).

    Why two noise figures: a seed changes the data and the teacher too, so the baseline's seed-to-seed
    spread is mostly how hard each seed's task is, and pairing by seed cancels that; what is left, the
    spread of the paired differences, is what decides whether the runs can see the tolerance."""
    diffs = [(c - b) / b for c, b in zip(cand_ne, base_ne, strict=True)]
    d = statistics.mean(diffs)
    from scipy.stats import t as student_t  # (imported here: half a second every `cubic` start otherwise)

    n = len(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else None
    half = None if se is None else float(student_t.ppf(0.5 + confidence / 2, n - 1)) * se
    ci = None if half is None else [d - half, d + half]
    verdict = (Verdict.UNDECIDED if ci is None else Verdict.PASSED if ci[1] <= tolerance else
               Verdict.FAILED if ci[0] > tolerance else Verdict.UNDECIDED)
    noise = noise_floor(base_ne)
    ok = d <= tolerance
    spread = f" (per seed {min(diffs):+.3%}..{max(diffs):+.3%})" if n > 1 else ""
    floor = ("one seed: no noise measured" if ci is None else
             f"{confidence:.0%} interval {ci[0]:+.3%}..{ci[1]:+.3%} (paired s.e. {se:.3%})")
    if noise is not None:
        floor += f"; baseline seed-to-seed sd {noise:.3%}"
    reason = (f"eval NE {d:+.3%} vs baseline over {n} paired seed(s){spread} "
              f"{'<=' if ok else '>'} {tolerance:.2%}; {floor}")
    return Judgement(ok=ok, diff=d, diffs=diffs, se=se, ci=ci, confidence=confidence,
                     verdict=verdict, resolved=verdict != Verdict.UNDECIDED, noise=noise,
                     reason=reason)


MORE, NOT_RESOLVED = Verdict.MORE, Verdict.NOT_RESOLVED  # the names the tuner's modules import
FUTILE = 0.05  # below this chance to pass within the seed budget, a candidate's seeds stop (`pass_chance`)
FUTILE_FROM = 3  # pairs before that rule applies: a spread measured on two pairs is itself a guess


def pass_chance(diffs: Sequence[float], tolerance: float, confidence: float, max_seeds: int) -> float:
    """The chance that the interval over `max_seeds` pairs will lie wholly within the tolerance, were the
    pairs still to come drawn around the mean and spread of `diffs` (conditional power under the current
    trend). With n pairs of mean d and spread s, the final mean is normal around d with sd s*sqrt(N-n)/N,
    and it passes where it ends at least the final half-width, t(N-1) * s / sqrt(N), below the tolerance.

    Why: `make tune`'s fastest stacks sit at the tolerance (+0.09% against 0.10%) and spent the whole
    budget of six seeds, and their baseline pairs, to end "not resolved"; a candidate that did pass at six
    seeds had a chance of 0.17 or more at every earlier look."""
    from scipy.stats import norm
    from scipy.stats import t as student_t

    n, n_max = len(diffs), max_seeds  # n < n_max: `sequential` asks only while seeds are left
    d, s = statistics.mean(diffs), statistics.stdev(diffs)
    if s == 0:  # every pair alike: no spread to move the mean
        return float(d <= tolerance)
    half = float(student_t.ppf(0.5 + confidence / 2, n_max - 1)) * s / math.sqrt(n_max)
    return float(norm.cdf((tolerance - half - d) / (s * math.sqrt(n_max - n) / n_max)))


def sequential(cand_ne: Sequence[float | None], base_ne: Sequence[float | None],
               qr: QualityRuns) -> tuple[Verdict, Judgement | None]:
    """The confirm's quality verdict from the paired seeds run so far: ("passed" | "failed", judgement) once
    the interval clears the tolerance on one side; (MORE, judgement or None) while fewer than `qr.seeds`
    pairs ran, or the interval straddles the tolerance and fewer than `qr.max_seeds` did; (NOT_RESOLVED,
    judgement) when the seed budget is spent undecided, or earlier (from `FUTILE_FROM` pairs) when its chance
    to pass within the budget is below `FUTILE` (`pass_chance`, in the judgement's `pass_chance`).
    A failed run (None) is the caller's to rule on."""
    n = min(len(cand_ne), len(base_ne))
    if n < qr.seeds:
        return MORE, None
    j = judge(cand_ne[:n], base_ne[:n], qr.tolerance, qr.confidence)  # type: ignore[arg-type]
    if j.resolved:
        return j.verdict, j
    if n >= qr.max_seeds:
        return NOT_RESOLVED, j
    if n >= FUTILE_FROM:
        p = pass_chance(j.diffs, qr.tolerance, qr.confidence, qr.max_seeds)
        j = replace(j, pass_chance=p)
        if p < FUTILE:
            return NOT_RESOLVED, j
    return MORE, j
