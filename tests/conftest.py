"""Set-up every test session shares."""

from __future__ import annotations

import os

import pytest

from cubic_harness.trial import rank_context


@pytest.fixture(scope="session", autouse=True)
def rank_fork_server() -> None:
    """Start the ranks' fork server with the session's own environment, before a test changes it: a variable
    a test sets for its own trials would otherwise become the server's, and every later rank be spawned
    (slower, and with a spawned rank's memory) instead of forked."""
    rank_context(dict(os.environ))
