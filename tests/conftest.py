"""Set-up every test session shares."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# A developer's own `cubic calibrate` (~/.config/cubic/local.yaml) must not change what the tests price: the suite,
# and every rank and Ray worker it starts, reads its configuration from an empty folder of its own. Set on import,
# before the ranks' fork server copies the environment.
CONFIG_HOME = tempfile.mkdtemp(prefix="cubic-tests-config-")
os.environ["XDG_CONFIG_HOME"] = CONFIG_HOME

from cubic_harness.trial import rank_context  # noqa: E402


def pytest_unconfigure(config: pytest.Config) -> None:
    """The folder goes with the session (each xdist worker, and the controller, made its own)."""
    shutil.rmtree(CONFIG_HOME, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def rank_fork_server() -> None:
    """Start the ranks' fork server with the session's own environment, before a test changes it: a variable
    a test sets for its own trials would otherwise become the server's, and every later rank be spawned
    (slower, and with a spawned rank's memory) instead of forked."""
    rank_context(dict(os.environ))


# `make test` hands whole files to two workers (`--dist loadfile --no-loadscope-reorder`) in collection order. The
# longest files go first, so that the last file a worker takes is short and neither waits long for the other
# (longest-first scheduling). Worker-seconds per file measured with `--durations=0` on 2026-11-27; the order only
# balances the run, so a file missing here runs after these, in its usual place.
LONGEST_FIRST = ("test_tune.py", "test_torchrec_backend.py", "test_tune_faults.py", "test_screen.py",
                 "test_trial.py", "test_postgres.py", "test_verify.py", "test_multinode.py", "test_plan_search.py",
                 "test_sharding.py", "test_sim.py", "test_replica_sync.py", "test_report_export.py",
                 "test_ray_cluster.py", "test_lease.py", "test_record.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: a file's tests keep their order
