"""A co-design study: the space's knobs and the cluster's, priced by the simulator, on several
objectives.

The lifecycle, once:

1. The space's `codesign:` section is checked whole (every node and fabric file loads, every
   objective has its data) before the store is written; bad input is one line.
2. An Optuna multi-objective study in the run directory's store (resumed where it stands) asks for
   the next trial: the space's knobs plus `cluster.node`, `cluster.gpus`, `cluster.fabric`
   (and `cluster.sites`, `cluster.nvlink_domain` where the section lists them;
   `cubic.codesign.clusters`). The searcher is Optuna's NSGA-II, or the proxy
   (`cubic.codesign.proxy`), which learns across clusters from their figures.
3. The trial's configuration runs the cluster's GPUs at the section's global batch; the simulator
   prices it with the per-table plan its `sharding` knob names. Its scores
   (`cubic.codesign.objectives`) are told to the study; a configuration that does not fit, or that
   the planner cannot place, is told FAIL with its reason, and the study goes on. A configuration
   already priced on the same cluster is not priced again: it is told the same values and names the
   trial it repeats.
4. The front (`cubic.codesign.front`): the non-dominated trials, the knee, a table and a plot.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cubic.codesign import clusters as cl
from cubic.codesign.clusters import FABRIC, GPUS, NODE, NVLINK, SITES, ClusterChoice
from cubic.codesign.objectives import directions, scores, values
from cubic.search.samplers import distributions
from cubic.space.codesign import CodesignSection
from cubic.space.search_space import SearchSpace
from cubic_harness.config import TrialConfig
from cubic_harness.errors import ConfigError
from cubic_harness.sim.backend import simulate

SEARCHERS = ("nsga2", "random", "proxy")


@dataclass(frozen=True)
class Priced:
    """One trial's outcome as the study keeps it (its user attrs)."""

    status: str
    reason: str
    scores: dict[str, float]
    plan: str

    def attrs(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reason": self.reason,
            "scores": self.scores,
            "plan": self.plan,
        }


def section_of(space: SearchSpace) -> CodesignSection:
    """The space's `codesign:` section, its files checked (ConfigError: one line)."""
    if space.codesign is None:
        raise ConfigError(
            f"{space.path}: no codesign: section (the clusters and objectives a co-design "
            "study chooses among; search_spaces/mlperf_codesign.yaml is one)"
        )
    try:
        cl.check(space.codesign)
    except ConfigError as e:
        raise ConfigError(f"{space.path}: {e}") from None
    return space.codesign


def plan_summary(res_plan: list[dict[str, Any]]) -> str:
    """The per-table plan in a few words: how many tables of each sharding type."""
    kinds = Counter(t.get("kind", "?") for t in res_plan)
    return ", ".join(f"{n} {k}" for k, n in kinds.most_common())


class CodesignStudy:
    """`run(trials)` prices configurations on the clusters until `trials` have finished."""

    def __init__(
        self,
        space: SearchSpace,
        storage: optuna.storages.BaseStorage,
        seed: int = 0,
        searcher: str = "nsga2",
        console: Console | None = None,
        describe: Callable[[dict[str, Any]], str] | None = None,
    ) -> None:
        """`describe`: a configuration's knobs in the words the front prints (`cubic codesign` passes the
        tuner's short form), stored on each trial so `cubic report` can show it without the space."""
        if searcher not in SEARCHERS:
            raise ConfigError(f"--searcher {searcher!r}: choose one of {list(SEARCHERS)}")
        self.space, self.section = space, section_of(space)
        self.choices = cl.choices(self.section)
        self.console = console or Console()
        self.describe = describe
        self.dists = {
            **distributions(space),
            NODE: CategoricalDistribution(list(self.section.nodes_from)),
            GPUS: CategoricalDistribution(list(self.section.gpus)),
            FABRIC: CategoricalDistribution(list(self.section.fabrics)),
            **(
                {SITES: CategoricalDistribution(list(self.section.sites))}
                if self.section.sites != [1]
                else {}
            ),
            **(
                {NVLINK: CategoricalDistribution(list(self.section.nvlink_domains))}
                if self.section.nvlink_domains is not None
                else {}
            ),
        }
        self.searcher = searcher
        self.study = optuna.create_study(
            study_name=f"{space.name}@codesign",
            storage=storage,
            load_if_exists=True,
            directions=directions(self.section),
            sampler=self._sampler(seed),
        )
        # what `cubic report` needs to show the front without the space: the objectives' names
        self.study.set_user_attr("codesign", {"objectives": list(self.section.objectives)})
        self.priced: dict[
            tuple[str, str], int
        ] = {}  # (cluster, config key) -> the trial that priced it
        for t in self.study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)
        ):
            if "key" in t.user_attrs and "same_as" not in t.user_attrs:
                self.priced.setdefault((t.user_attrs["cluster"], t.user_attrs["key"]), t.number)

    def _sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        if self.searcher == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if self.searcher == "proxy":
            from cubic.codesign.proxy import ProxySampler

            return ProxySampler(self, seed=seed)
        return optuna.samplers.NSGAIISampler(seed=seed)

    # ------------------------------------------------------------------ one trial
    def choice(self, params: dict[str, Any]) -> ClusterChoice:
        return self.choices[
            (params[NODE], params[GPUS], params[FABRIC], params.get(SITES, 1), params.get(NVLINK))
        ]

    def config(self, params: dict[str, Any]) -> TrialConfig:
        """params' configuration on its cluster: all its GPUs, the section's global batch."""
        ch = self.choice(params)
        cfg = self.space.config(self.space.canonical({k: params[k] for k in self.space.knobs}))
        ttt = self.section.time_to_train
        bs = max(1, ttt.global_batch // ch.gpus) if ttt else cfg.batch_size
        return cfg.replace(world_size=ch.gpus, ranks_per_node=ch.ranks_per_node, batch_size=bs)

    def price(self, params: dict[str, Any]) -> Priced:
        ch, cfg = self.choice(params), self.config(params)
        if ch.unfit:
            return Priced("error", ch.unfit, {}, "")
        res = simulate(cfg, ch.cluster)
        if res.status != "ok":
            return Priced(res.status, res.error[:300], {}, "")
        s = scores(self.section, ch, res)
        lacking = [o for o in self.section.objectives if o not in s]
        if lacking:
            return Priced("error", f"no data for objective(s) {lacking}", s, plan_summary(res.plan))
        return Priced("ok", "", s, plan_summary(res.plan))

    def step(self) -> optuna.trial.FrozenTrial:
        """Ask for one trial, price it (or name the trial that did), tell the study."""
        t = self.study.ask(self.dists)
        params = t.params
        ch, cfg = self.choice(params), self.config(params)
        key = (ch.label, cfg.key())
        t.set_user_attr("cluster", ch.label)
        t.set_user_attr("key", cfg.key())
        if self.describe is not None:  # as the front shows it
            t.set_user_attr("config", self.describe({k: params[k] for k in self.space.knobs}))
        t.set_user_attr("global_batch", cfg.global_batch)
        t.set_user_attr("figures", ch.figures())
        same = self.priced.get(key)
        if same is not None:
            prev = self.study.get_trials(deepcopy=False)[same]
            t.set_user_attr("same_as", same)
            for k, v in prev.user_attrs.items():
                if k in ("status", "reason", "scores", "plan"):
                    t.set_user_attr(k, v)
            if prev.state == TrialState.COMPLETE:
                return self.study.tell(t, prev.values)
            return self.study.tell(t, state=TrialState.FAIL)
        p = self.price(params)
        for k, v in p.attrs().items():
            t.set_user_attr(k, v)
        self.priced[key] = t.number
        if p.status != "ok":
            return self.study.tell(t, state=TrialState.FAIL)
        return self.study.tell(t, values(self.section, p.scores))

    def finished(self) -> int:
        return len(
            self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
        )

    def run(self, trials: int) -> float:
        """Price until `trials` have finished (resumed ones count); the wall seconds it took."""
        t0, done = time.perf_counter(), self.finished()
        cols = (
            TextColumn("codesign"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
        )
        with Progress(*cols, console=self.console, transient=not self.console.is_terminal) as bar:
            task = bar.add_task("", total=trials, completed=done)
            while done < trials:
                ft = self.step()
                done += 1
                bar.update(
                    task, completed=done, description=f"#{ft.number} {ft.user_attrs['cluster']}"
                )
        return time.perf_counter() - t0


def open_study(
    space: SearchSpace,
    run_dir: Path | None,
    storage: str | None,
    seed: int,
    searcher: str,
    console: Console,
    describe: Callable[[dict[str, Any]], str] | None = None,
) -> CodesignStudy:
    """The study in `storage` (a URL) or RUN_DIR/study.db, checked before anything is written."""
    from cubic.study.store import check_run_dir, open_storage, storage_url

    section_of(space)
    if run_dir is not None:
        check_run_dir(run_dir, holds_store=storage is None)
        run_dir.mkdir(parents=True, exist_ok=True)
    url = storage or storage_url(run_dir, must_exist=False)
    rdb = open_storage(url, None if storage else f"--run-dir {run_dir}")
    return CodesignStudy(space, rdb, seed=seed, searcher=searcher, console=console, describe=describe)
