"""`cubic tune --warm-start RUN_DIR_OR_URL`: start a study from another study's trials of the same space.

The usual source is a simulated study (`cubic tune --backend sim`): thousands of predicted trials for
the price of none, from which the proxy learns the landscape's shape before the first real trial. Its
trials enter the searcher as history marked with their fidelity; the proxy never ranks a prediction
against a measurement and learns, from the real trials as they come, where the simulator is wrong
(cubic/search/proxy.py, `Proxy.fit`). A real study can be a source too (then it is plain history).
"""

from __future__ import annotations

from typing import Any

from optuna.trial import TrialState

from cubic.space.search_space import SearchSpace, fingerprint
from cubic.study.store import NOT_RUN, safe_url
from cubic_harness.errors import ConfigError


def load_warm_start(source: str, space: SearchSpace) -> list[tuple[dict[str, Any], float | None, str]]:
    """(params, qps or None for a failed trial, "sim" | "real") of every finished trial of every study of
    `space` in `source` (a run directory or a storage URL); ConfigError naming the source otherwise."""
    from cubic.results.analysis import existing_storage
    from cubic.study.store import storage_url

    try:
        url = storage_url(source)
    except ConfigError as e:  # say which option named it
        raise ConfigError(f"--warm-start {e}") from None
    where = f"--warm-start {safe_url(url) if '://' in source else source}"  # never a password
    storage, studies = existing_storage(url, where)
    fp = fingerprint(space.to_dict())
    same = [s for s in studies if fingerprint(s.user_attrs.get("space") or {}) == fp]
    if not same:
        raise ConfigError(f"{where}: no study of search space {space.name!r} (the same knobs, baseline and "
                          f"workload) in it; it holds {[s.study_name for s in studies]}")
    out = []
    for s in same:
        kind = "sim" if str(s.user_attrs.get("backend", "real")).startswith("sim") else "real"
        for t in storage.get_all_trials(storage.get_study_id_from_name(s.study_name), deepcopy=False):
            if t.state == TrialState.COMPLETE and t.value:
                out.append((t.params, float(t.value), kind))
            elif t.state == TrialState.FAIL and t.params and t.user_attrs.get("status") not in NOT_RUN:
                out.append((t.params, None, kind))
    return out
