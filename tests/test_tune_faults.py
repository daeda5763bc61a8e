"""A tune that meets failures: a rank that crashes, runs out of memory or hangs becomes a failed trial and the
study completes; a tuner killed mid-trial resumes losing nothing and running nothing twice.

(Apart from tests/test_tune.py so the two long files run side by side on `make test`'s two workers.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from optuna.trial import TrialState

from cubic_harness.scratch import abandoned
from tests.test_tune import FAST, ROOT, cubic_tune, load, space_file

# Rank 1 crashes / allocates past the cap / hangs / is killed (SIGKILL, as the OOM killer does) at four batch
# sizes (the test hook, cubic_harness.faults, set in the tuner's environment and handed to its Ray workers);
# batch 1048576 is predicted at ~8.9 GB a rank, over the cap, and never launched. Grid search visits each once
# after the baseline.
FAULTS = """\
name: faults
workload: {preset: tiny}
baseline: {world_size: 2, sharding: table_wise, batch_size: 32, kernel: torch}
knobs:
  batch_size: [32, 40, 48, 56, 64, 1048576]
constraints: {mem_cap_mb: 1500}
trial: {warmup_steps: 1, measure_steps: 2, windows: 1, timeout_s: 30, repeats: 1}
budget: {trials: 6, confirm_top_k: 0}
"""




def test_sigkill_mid_trial_then_resume_loses_nothing_and_runs_nothing_twice(tmp_path: Path) -> None:
    """The tuner is killed while a trial runs. Which trial runs is fixed, not caught by timing: grid order
    (#0 the baseline, #1 fp16 tables, then pipeline_depth=1) with the pipelined configurations hanging (the
    fault hook, in the killed tuner's environment only), so #0 and #1 complete and #2 stays running until
    the kill, however fast trials are. The resumed tune runs without the hook."""
    space = space_file(tmp_path, FAST.replace("confirm_top_k: 1", "confirm_top_k: 0"))
    run = tmp_path / "run"
    searcher = ("--searcher", "grid")
    cmd = [sys.executable, "-m", "cubic", "tune", "--no-live", "--space", str(space), "--run-dir", str(run), *searcher]
    log = open(tmp_path / "tune.log", "w")  # noqa: SIM115 - closed below; the tuner writes to it
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "CUBIC_INJECT_FAULT": "pipeline_depth=1:hang"})
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            time.sleep(0.3)
            if proc.poll() is not None:  # this reader must never break the tuner (store.rdb_storage)
                pytest.fail(f"the tuner exited {proc.returncode}: {(tmp_path / 'tune.log').read_text()[-2000:]}")
            if not (run / "study.db").exists():
                continue
            try:
                trials = load(run, "fast").get_trials()
            except Exception:  # the study is being created
                continue
            states = [t.state for t in trials]
            if states.count(TrialState.COMPLETE) >= 2 and TrialState.RUNNING in states:
                proc.send_signal(signal.SIGKILL)  # the tuner dies mid-trial
                proc.wait()
                break
        else:
            pytest.fail("the tuner never had 2 completed trials and one running: "
                        + (tmp_path / "tune.log").read_text()[-2000:])
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
        try:  # the Ray processes the killed tuner left in its process group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    before = {t.number: (t.value, t.user_attrs["config_key"])
              for t in load(run, "fast").get_trials() if t.state == TrialState.COMPLETE}
    running = [t for t in load(run, "fast").get_trials() if t.state == TrialState.RUNNING]
    assert len(before) >= 2 and running
    left = abandoned()  # the killed tuner's workers' folder (harness/scratch.py), among any others
    assert left

    r = cubic_tune("--space", str(space), "--run-dir", str(run), *searcher)
    assert r.returncode == 0, r.stdout + r.stderr
    trials = load(run, "fast").get_trials()
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    keys = [t.user_attrs["config_key"] for t in done]
    assert len(done) == 5, [(t.number, t.state, t.user_attrs.get("status")) for t in trials]
    assert len(set(keys)) == len(keys)
    for n, (value, key) in before.items():  # nothing completed was lost or changed
        assert trials[n].state == TrialState.COMPLETE and trials[n].value == value
        assert trials[n].user_attrs["config_key"] == key
    for t in running:  # what was running is failed as interrupted and its configuration ran again
        after = trials[t.number].user_attrs
        assert trials[t.number].state == TrialState.FAIL
        assert after["status"] == "interrupted" == after["error"]
        # killed between ask and start, the store derives the key from the params; killed while the
        # sampler was still choosing them (ask creates the trial first), no configuration existed
        assert after.get("config_key") in keys if t.params else "config_key" not in after
    assert "resumed" in r.stdout
    assert not [p for p in left if p.exists()]  # the next tune removed what the killed one left




def test_crash_oom_timeout_kill_and_predicted_oom_become_failed_trials_and_the_study_completes(
        tmp_path: Path) -> None:
    """Through `cubic tune` on Ray: each failure is a failed trial with its reason, and the tune goes on."""
    run = tmp_path / "run"
    r = cubic_tune("--space", str(space_file(tmp_path, FAULTS)), "--run-dir", str(run), "--searcher", "grid",
                   env={"CUBIC_INJECT_FAULT": "batch_size=40:crash,batch_size=48:oom,batch_size=56:hang,"
                                              "batch_size=64:kill"})
    assert r.returncode == 0, r.stdout + r.stderr
    fault = {32: "none", 40: "crash", 48: "oom", 56: "hang", 64: "kill", 1048576: "predicted"}
    trials = {fault[t.params["batch_size"]]: t for t in load(run, "faults").get_trials()}
    assert set(trials) == set(fault.values())
    assert trials["none"].state == TrialState.COMPLETE
    for kind, status, why in (("crash", "error", ""), ("oom", "oom", ""), ("hang", "timeout", ""),
                               ("kill", "oom", "rank 1 killed by signal 9 (likely the OOM killer) without a report"),
                               ("predicted", "oom", "not launched: predicted peak memory")):
        t = trials[kind]
        assert t.state == TrialState.FAIL, kind
        assert t.user_attrs["status"] == status, (kind, t.user_attrs["error"])
        assert t.user_attrs["error"] and "\n" not in t.user_attrs["error"] and why in t.user_attrs["error"]
        assert t.user_attrs["result"]["status"] == status
    assert trials["predicted"].user_attrs["result"]["env"]["launched"] is False  # refused before any rank ran
    assert all(trials[f].user_attrs["result"]["env"].get("launched", True) for f in fault.values()
               if f not in ("predicted", "none"))
    assert "5 failed" in r.stdout


# ---------------------------------------------------------------------- bad input: exit 2, one line
