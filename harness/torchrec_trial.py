"""One configuration trained by TorchRec itself: a trial backend (`--backend torchrec`) and the
production check behind `cubic verify`; the entry points and the launch of their gloo ranks.

A TorchRec job (`torchrec_job`: the tables, each table's exact placement from cubic's plan, the
model, 2D's DMPCollection settings, DDP's all-reduce precision; `cubic export --format torchrec`
writes the same keys) is trained in real gloo ranks (`torchrec_train`): the user's own model (the
workload's `factory`, MODULE:FACTORY), or TorchRec's DLRM / DLRM_DCN built from the workload, under
DistributedModelParallel (DMPCollection for 2D), on cubic's own batches (harness/data.py: the same
samples and ids, synthetic, profiled or replayed, as the harness trial). Warm-up steps are excluded;
samples/s is the median of the measured windows, as in harness trials.

Two callers, two policies for what TorchRec cannot run here (`torchrec_rules`): the backend
(`run_torchrec`) refuses it (ConfigError: bad input, or a failed trial with the reason), since its
result must be of the config it was given; verify (`run_torchrec_trial`) substitutes and names every
substitution (`substitutions`).

2D runs TorchRec's own DMPCollection (its sharding/replica DeviceMesh, ShardingEnv2D, sync()).
TorchRec (1.8.0 through 1.9.2) opens DMPCollection.__init__ with `assert device.type in ("cuda",
"mtia")`, but nothing after it is CUDA-specific (DeviceMesh takes the device type, sync() is an
all-reduce over the replica group); so 2D ranks start with PYTHONOPTIMIZE=1 (`_start`), which skips
that assert, and average through `custom_all_reduce` (a gloo SUM, then / replicas: gloo has no
ReduceOp.AVG, which sync() would ask for). Its plan remap also writes CUDA-style shard placements
("cpu:1") that CPU tensors ("cpu") never match; `torchrec_train.CpuDMPCollection` writes them back
without the index. Its sync() also averages cubic's kernels (harness/torchrec_kernel.py), whose
tensors DMPCollection does not find: the same tensors (weights, row-wise AdaGrad state), averaged
the same way over the same replica group, grouped by dtype as DMPCollection groups FBGEMM's.

The support rules and the job are re-exported here for the callers that import them from this
module.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from cubic_harness import torchrec_compat as compat
from cubic_harness.config import TrialConfig, TrialResult, ranks_spawned
from cubic_harness.errors import ConfigError, debugging
from cubic_harness.torchrec_job import placement_of, torchrec_job, torchrec_model
from cubic_harness.torchrec_rules import (
    INSTALL_HINT,
    INSTEAD,
    UnsupportedConfig,
    check_runs_in_torchrec,
    plan_for_torchrec,
    runs_unchanged,
    torchrec_available,
    torchrec_kinds,
    torchrec_unsupported,
)
from cubic_harness.trial import (
    TORCHREC_PRELOAD,
    _environ,
    adopt_trial_env,
    check_config,
    env_info,
    rank_context,
    rank_env,
    summarize,
)

__all__ = ["INSTALL_HINT", "INSTEAD", "runs_unchanged", "UnsupportedConfig", "check_runs_in_torchrec",
           "package_version", "placement_of", "plan_for_torchrec", "run_torchrec",
           "run_torchrec_trial", "torchrec_available", "torchrec_job", "torchrec_kinds",
           "torchrec_model", "torchrec_unsupported"]


def run_torchrec(cfg: TrialConfig, cwd: str | None = None) -> TrialResult:
    """The TorchRec trial backend: `cfg` trained in TorchRec, as a TrialResult like the harness's
    (qps over windows, step times, peak RSS, losses and NE, held-out NE with eval_samples; no
    phase breakdown: TorchRec's step is one call). The ranks import the workload's MODULE:FACTORY
    from the folder `cwd` (default: this process's). Never raises for a failing trial."""
    env = {**env_info(cfg), "backend": "torchrec", "torchrec": package_version("torchrec")}
    try:
        cfg.validate("config")
        check_runs_in_torchrec(cfg, cwd)
        check_config(cfg)
        from cubic_harness.planning import plan_for

        plan = plan_for(cfg, allowed=torchrec_kinds(cfg.device))
        rowwise = [t.name for t in plan.tables
                   if torchrec_unsupported("sharding", t.kind, cfg.device)]
        if rowwise:
            raise ConfigError(f"sharding={cfg.sharding} planned {', '.join(rowwise)} row-wise: "
                              f"{torchrec_unsupported('sharding', 'row_wise', cfg.device)}")
        job = torchrec_job(cfg, plan.to_list(), [])
    except ConfigError as e:
        from cubic_harness.sharding.planner import PlanError

        status = "oom" if isinstance(e, PlanError) and "mem_cap" in str(e) else "error"
        return TrialResult.failed(status, str(e), cfg, env=env)
    t0, started_at = time.perf_counter(), time.time()
    env.update(placement="local", nodes=1, rank_nodes=[platform.node()] * cfg.world_size,
               rank_start=_start(cfg)[0].get_start_method())
    status, error, got = _launch(cfg, job, job["placements"], cwd)
    env["wall_s"] = round(time.perf_counter() - t0, 2)
    if status != "ok":
        return TrialResult.failed(status, error, cfg, env=env)
    r0 = got[0]
    env["startup_s"] = round(r0["first_step_at"] - started_at, 2)
    env.update(model_parallel=r0["model_parallel"], kernel=r0["kernel"])
    res = summarize(cfg, {**r0, "plan_json": plan.to_json()}, env)
    if res.status == "ok":  # what TorchRec applied, per table: the plan as its sharded modules hold
        res.extra["placements"] = {name: {**p, "shards": r0["placed"][name]}
                                   for name, p in r0["placements"].items()}
    return res


def package_version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def run_torchrec_trial(cfg: TrialConfig, export: dict[str, Any]) -> dict[str, Any]:
    """Verify's run: `cfg` from its export, with substitutions, on `cfg.world_size` gloo ranks:
    {status, error, qps, window_qps, substitutions, placements (the plan TorchRec applied:
    sharding type, ranks, shard widths per table)}."""
    placements, subs = plan_for_torchrec(cfg, export)
    out: dict[str, Any] = {"status": "error", "error": "no rank reported", "qps": 0.0,
                           "window_qps": [], "substitutions": subs}
    try:
        compat.check()
    except ConfigError as e:
        out["error"] = str(e)
        return out
    status, error, got = _launch(cfg, export, placements)
    if status != "ok":
        out.update(status=status, error=error)
        return out
    r0 = got[0]
    out.update(status="ok", error="", **{k: r0[k] for k in (
        "qps", "window_qps", "placements", "omp_wait_policy", "model_parallel", "kernel", "syncs",
        "sharding_group", "ddp_hooks")}, checksums={r: g["checksum"] for r, g in got.items()})
    return out


def _start(cfg: TrialConfig) -> tuple[Any, dict[str, str]]:
    """How the ranks start and the environment variables they add to this process's: the harness's
    rank environment (oversubscribed: PASSIVE), forked from a fork server that preloaded TorchRec
    where `trial.rank_context` allows it. 2D on CPU is always spawned (`config.ranks_spawned`): its
    ranks run with PYTHONOPTIMIZE=1 (DMPCollection's CUDA-only assert, module docstring)."""
    extra = rank_env(cfg)
    if ranks_spawned(cfg, "torchrec"):
        return mp.get_context("spawn"), {**extra, "PYTHONOPTIMIZE": "1"}
    return rank_context({**os.environ, **extra}, TORCHREC_PRELOAD), extra


def _launch(cfg: TrialConfig, job: dict[str, Any], placements: dict[str, dict],
            cwd: str | None = None) -> tuple[str, str, dict[int, dict]]:
    """Start `cfg.world_size` ranks training `job` (in the folder `cwd`) and wait: (status, one-line
    error, {rank: output})."""
    ctx, extra = _start(cfg)
    q = ctx.Queue()
    # the parent owns the rendezvous on an OS-chosen port, as harness/trial.py does (no port to
    # race for)
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=cfg.timeout_s),
                          wait_for_workers=False)
    env = {**os.environ, **extra}
    args = (cfg.to_dict(), job, placements, store.port, q, cwd or os.getcwd(), env)
    procs = [ctx.Process(target=_rank, args=(r, *args), daemon=True) for r in range(cfg.world_size)]
    with _environ(extra):  # a spawned rank inherits it; a forked one installs `env` first
        for p in procs:
            p.start()
    try:
        got: dict[int, dict] = {}
        while len(got) < len(procs):
            g = q.get(timeout=cfg.timeout_s)
            if g.get("error"):  # the first rank to fail says why; the others would only hang on it
                return g.get("status", "error"), f"rank {g['rank']}: {g['error']}", got
            got[g["rank"]] = g
        return "ok", "", got
    except Exception as e:  # a queue timeout: a hung or dead rank
        return ("timeout", f"TorchRec ranks did not report within {cfg.timeout_s:.0f} s "
                f"({type(e).__name__})", {})
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def _rank(rank: int, cfg_dict: dict, job: dict, placements: dict, port: int, q: Any, cwd: str,
          env: dict[str, str]) -> None:
    """One rank's process: the trial's environment, then `train_rank`'s report, or the error it
    raised, on `q`."""
    adopt_trial_env(env)
    if not debugging():  # TorchRec's and DDP's warnings; errors come back via q
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    try:
        os.chdir(cwd)  # MODULE:FACTORY is imported from the folder the trial was started in
        from cubic_harness.torchrec_train import train_rank  # TorchRec: imported in the ranks only

        cfg = TrialConfig.from_dict(cfg_dict)
        q.put({"rank": rank, **train_rank(cfg, job, placements, rank, port)})
    except Exception as e:  # reported, never a hang
        status = "oom" if isinstance(e, MemoryError) else "error"
        q.put({"rank": rank, "status": status,
               "error": " ".join(f"{type(e).__name__}: {e}".split())[:300]})
