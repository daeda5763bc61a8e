"""`cubic tune --warm-start RUN_DIR_OR_URL`: start a study from another study's trials of the same space.

The usual source is a simulated study (`cubic tune --backend sim`): thousands of predicted trials for
the price of none, from which the proxy learns the landscape's shape before the first real trial. Its
trials enter the searcher as history marked with their source (cubic/search/fidelity.py): the proxy
never ranks a prediction against a measurement, nor one cluster's predictions against another's, and
learns, from the real trials as they come, where the simulator is wrong, and from the clusters'
figures how the order moves between clusters (cubic/search/proxy.py, `Proxy.fit`). A real study can
be a source too.
"""

from __future__ import annotations

from typing import Any

from optuna.trial import TrialState

from cubic.search.fidelity import REAL, Fidelity
from cubic.space.search_space import SearchSpace, fingerprint
from cubic.study.store import FIGURES_ATTR, NOT_RUN, safe_url
from cubic_harness.errors import ConfigError


def load_warm_start(source: str, space: SearchSpace) -> list[tuple[dict[str, Any], float | None, Fidelity]]:
    """(params, qps or None for a failed trial, where it came from) of every finished trial of every
    study of `space` in `source` (a run directory or a storage URL); ConfigError naming the source
    otherwise. Each study is a source of its own: measured, or simulated for the cluster it names,
    with the cluster's figures where the study recorded them."""
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
        kind = Fidelity.of(str(s.user_attrs.get("backend", REAL)), _figures(s.user_attrs.get(FIGURES_ATTR)))
        for t in storage.get_all_trials(storage.get_study_id_from_name(s.study_name), deepcopy=False):
            if t.state == TrialState.COMPLETE and t.value:
                out.append((t.params, float(t.value), kind))
            elif t.state == TrialState.FAIL and t.params and t.user_attrs.get("status") not in NOT_RUN:
                out.append((t.params, None, kind))
    return out


def _figures(attr: Any) -> dict[str, float] | None:
    """A study's recorded cluster figures; None where they are missing or not numbers (a study of
    another version: its trials still warm-start, as a source without figures)."""
    if not isinstance(attr, dict):
        return None
    ok = {k: v for k, v in attr.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    return ok if len(ok) == len(attr) else None
