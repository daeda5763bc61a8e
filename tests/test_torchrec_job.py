"""The TorchRec job and its support rules are plain data: `cubic export --format torchrec` builds
the job (`cubic_harness.torchrec_job`) and reads the rules (`cubic_harness.torchrec_rules`)
without importing torch or TorchRec, and the TorchRec trial module still offers every name its
callers import from it."""

from __future__ import annotations

import json
import subprocess
import sys

from cubic_harness.config import TrialConfig, TrialResult
from cubic_harness.planning import plan_for
from cubic_harness.workload import Workload
from tests.helpers import fixture_cluster

NO_TORCH = "assert not {'torch', 'torchrec', 'fbgemm_gpu'} & set(sys.modules), sorted(sys.modules)"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_the_export_and_the_torchrec_rules_imports_no_torch() -> None:
    r = _run("import sys, cubic.deploy.export, cubic_harness.torchrec_job, "
             "cubic_harness.torchrec_rules; " + NO_TORCH)
    assert r.returncode == 0, r.stderr


def test_a_torchrec_export_is_built_without_torch() -> None:
    """The whole torchrec export of a 2D column-wise winner (its job: placements, model,
    DMPCollection)."""
    cfg = TrialConfig(workload=Workload.tiny(), kernel="torch", sharding="column_wise",
                      world_size=4, sharding_group_size=2, sparse_sync="weight_avg").validate()
    plan = plan_for(cfg, fixture_cluster()).to_list()
    res = TrialResult(qps=1000.0, config=cfg.to_dict(), plan=plan)
    rec = {"study": "t", "storage": "sqlite://", "trial": 3, "attrs": {}, "result": res.to_dict(),
           "winner": {"trial": 3, "qps": 1000.0, "speedup": 1.5}, "config": cfg.to_dict(),
           "baseline_qps": 666.0, "baseline_trial": 0, "confirmed": True}
    r = _run("import json, sys\nfrom cubic.deploy import export\n"
             f"d = export.to_torchrec_dict(json.loads({json.dumps(json.dumps(rec))}))\n"
             "assert d['placements'] and d['dmp_collection']['sharding_group_size'] == 2\n"
             + NO_TORCH)
    assert r.returncode == 0, r.stderr


def test_the_trial_module_reexports_the_rules_and_the_job() -> None:
    from cubic_harness import torchrec_job, torchrec_rules, torchrec_trial

    for name in torchrec_trial.__all__:
        assert hasattr(torchrec_trial, name), name
    assert torchrec_trial.torchrec_job is torchrec_job.torchrec_job
    assert torchrec_trial.placement_of is torchrec_job.placement_of
    for name in ("torchrec_unsupported", "torchrec_kinds", "plan_for_torchrec",
                 "check_runs_in_torchrec", "INSTEAD", "runs_unchanged", "UnsupportedConfig",
                 "INSTALL_HINT", "torchrec_available"):
        assert getattr(torchrec_trial, name) is getattr(torchrec_rules, name), name
