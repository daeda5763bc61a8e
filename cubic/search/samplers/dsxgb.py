"""DeepSpeed-autotuner-style model-based search (deepspeed/autotuning/tuner/model_based_tuner.py).

As DeepSpeed does: a few random configurations, then an XGBoost `rank:pairwise` cost model
(max_depth 3, eta 0.3, 10 rounds, targets normalised by their max) on the flattened config values
(ordinal knob indices, no derived features), refit after every trial; the next trial is the best
predicted untried configuration, or with probability 0.2 a random one; failed runs score 0; no
repeats or noise model; it stops after 5 trials without a gain.
"""

from __future__ import annotations

import numpy as np
import optuna
import xgboost as xgb
from optuna.trial import FrozenTrial

from cubic.search.samplers.base import Observations, SpaceSampler
from cubic.space.search_space import SearchSpace
from cubic.study.store import NOT_RUN

INIT_NUM = 2
EARLY_STOPPING = 5
XGB_PARAMS = {"max_depth": 3, "gamma": 0.0001, "min_child_weight": 1, "subsample": 1.0, "eta": 0.3,
              "lambda": 1.0, "alpha": 0, "objective": "rank:pairwise", "verbosity": 0, "nthread": 1}
POOL = 20_000  # spaces too large to enumerate are scored on this many random configurations


class DSXGBSearch(SpaceSampler):
    name = "ds-xgb"

    def __init__(self, space: SearchSpace, seed: int = 0, exploration: float = 0.2) -> None:
        super().__init__(space, seed)
        self.exploration = exploration

    def _candidates(self, obs: Observations) -> list[tuple]:
        if self.space.all_tuples is not None:
            return [t for t in self.space.all_tuples if t not in obs.seen]
        out: set[tuple] = set()
        for _ in range(POOL):
            t = self.space.random_tuple(self.rng, obs.seen, tries=20)
            if t is not None:
                out.add(t)
        return sorted(out, key=str)

    def propose(self, study: optuna.Study, trial: FrozenTrial, obs: Observations) -> tuple[tuple | None, dict]:
        finished = obs.ok + obs.failed
        if len(finished) < INIT_NUM or self.rng.random() < self.exploration:
            return self.random_unseen(obs), {"phase": "random"}
        X = self.space.encode(finished)
        y = np.array(obs.qps + [0.0] * len(obs.failed), dtype=np.float32)
        y = y / max(float(y.max()), 1e-9)
        perm = self.rng.permutation(len(y))
        bst = xgb.train({**XGB_PARAMS, "seed": int(self.rng.integers(2**31))},
                        xgb.DMatrix(X[perm], label=y[perm], qid=np.zeros(len(y), dtype=np.int32)))
        cands = self._candidates(obs)
        if not cands:
            return None, {}
        scores = bst.predict(xgb.DMatrix(self.space.encode(cands)))
        return cands[int(np.argmax(scores))], {}

    def should_stop(self, study: optuna.Study) -> bool:
        obs = self.observations(study)
        order = [t.value if t.value is not None else 0.0 for t in study.get_trials(deepcopy=False)
                 if t.state.is_finished() and t.user_attrs.get("status") not in NOT_RUN]
        if order:
            best = int(np.argmax(order))
            if len(order) - 1 - best >= EARLY_STOPPING:
                return True
        return super().should_stop(study) or (self.space.all_tuples is not None
                                              and len(obs.seen) >= len(self.space.all_tuples))
