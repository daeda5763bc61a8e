"""`cubic tune`: find the fastest configuration of a search space with few real trials."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from cubic_harness.errors import ConfigError


def default_space() -> Path:
    """The GPU space where CUDA is present, the CPU space otherwise."""
    import torch

    from cubic.space.search_space import shipped_space

    return shipped_space("dlrm_gpu.yaml" if torch.cuda.is_available() else "dlrm_cpu.yaml")


def tune(
    space: Path | None = typer.Option(None, "--space", help="Search-space YAML file, or a shipped space's name "
                                      "(dlrm_cpu, dcn_cpu, ...) [default: dlrm_gpu when CUDA is present, else "
                                      "dlrm_cpu]."),
    run_dir: Path | None = typer.Option(None, "--run-dir",
                                        help="Run directory: DIR/study.db + per-trial logs; running again "
                                             "resumes [default: runs/NAME]."),
    storage: str | None = typer.Option(None, "--storage",
                                       help="SQLAlchemy URL of the trial store instead of DIR/study.db "
                                            "(e.g. postgresql://user:PASSWORD@host/db; cubic never prints the "
                                            "password, and PGPASSWORD or ~/.pgpass keep it off the command "
                                            "line)."),
    trials: int | None = typer.Option(None, "--trials", help="Trial budget of the study (total, resumed "
                                      "trials included) [default: the space's budget.trials]."),
    searcher: str = typer.Option("cubic", "--searcher", help="cubic | random | grid | tpe | ds-xgb"),
    address: str | None = typer.Option(None, "--address",
                                       help="Ray cluster (HOST:PORT, ray://HOST:PORT or auto) [default: a "
                                            "local Ray on this machine]."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed of the searcher (0 .. 2^32 - 1)."),
    live: bool | None = typer.Option(None, "--live/--no-live", help="Live table [default: on a terminal]."),
    backend: str = typer.Option("real", "--backend", help="real: training trials on Ray; torchrec: training "
                                "trials in TorchRec on Ray (a space with target: torchrec); sim: the simulator "
                                "(needs --cluster; crowns a numerics change only as real "
                                "quality runs judged it)."),
    cluster: str | None = typer.Option(None, "--cluster", help="Cluster file (clusters/*.yaml) or preset name "
                                       "for --backend sim."),
    framework: str = typer.Option("harness", "--framework", help="--backend sim: whose step to price, cubic's "
                                  "harness or torchrec (the cluster's profile: `cubic calibrate --framework`)."),
    warm_start: list[str] = typer.Option([], "--warm-start", help="Run dir or storage URL of a study of the same "
                                         "space (typically a simulated one) whose trials the searcher learns from "
                                         "first; repeatable (searcher cubic)."),
    quality_store: str | None = typer.Option(None, "--quality-store", help="Where quality runs are kept, reused "
                                             "and added to (table cubic_quality_runs): a run dir, a storage URL, "
                                             "or a .db file (created) [default: this tune's own store; --backend sim: "
                                             "runs/quality.db, else runs/SPACE/study.db, read only]."),
    quality_from: str | None = typer.Option(
        None, "--quality-from", help="--backend sim: take the numerics verdicts from the real "
        "quality runs of this space (a file or a shipped space's name), which trains the same "
        "workload at another size; a change carries as cubic/quality/carried.py CARRIES says "
        "[default: the space's own runs]."),
) -> None:
    """Tune: baseline first, then the searcher's proposals as real trials on Ray, then confirm the top-k."""
    import optuna
    import sqlalchemy
    from rich.console import Console

    from cubic.study.store import redact
    from cubic.tune.view import print_summary

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # --live through a pipe (`| tee log` on a terminal) draws the table with terminal codes, as asked
    console = Console() if sys.stdout.isatty() else Console(width=130, force_terminal=bool(live))
    req = TuneRequest(space=space, run_dir=run_dir, storage=storage, trials=trials, searcher=searcher,
                      address=address, seed=seed, live=live, backend=backend, cluster=cluster, framework=framework,
                      warm_start=tuple(warm_start), quality_store=quality_store,
                      quality_from=quality_from)
    tuner = None
    try:
        tuner = build(req, console)
        summary = tuner.run()
    except ConfigError as e:  # never a storage URL's password, even in a driver's words
        print(f"error: {redact(' '.join(str(e).split()), *req.secrets)}", file=sys.stderr)
        raise typer.Exit(2) from None
    except sqlalchemy.exc.SQLAlchemyError as e:
        # the store failed mid-tune (its server went away): one redacted line, not a driver's traceback
        msg = redact(" ".join(str(getattr(e, "orig", None) or e).split()), *req.secrets)[:300]
        print(f"error: the trial store failed ({type(e).__name__}: {msg}); run the same command again to resume",
              file=sys.stderr)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        raise typer.Exit(130) from None
    finally:
        if tuner is not None:
            tuner.runner.stop()
    print_summary(console, summary)


@dataclass(frozen=True)
class TuneRequest:
    """What `cubic tune` was asked, typed (its options' meanings are the CLI's help)."""

    space: Path | None = None
    run_dir: Path | None = None
    storage: str | None = None
    trials: int | None = None
    searcher: str = "cubic"
    address: str | None = None
    seed: int = 0
    live: bool | None = None
    backend: str = "real"
    cluster: str | None = None
    framework: str = "harness"
    warm_start: tuple[str, ...] = ()
    quality_store: str | None = None
    quality_from: str | None = None

    @property
    def secrets(self) -> tuple[str | None, ...]:
        """The URLs whose passwords an error message must not show."""
        return (self.storage, self.quality_store, *self.warm_start)


def check(req: TuneRequest) -> None:
    """ConfigError (one line) for options that cannot go together, before anything is read or opened."""
    from cubic.search.samplers import SEARCHERS

    if req.searcher not in SEARCHERS:
        raise ConfigError(f"--searcher {req.searcher!r}: choose one of {list(SEARCHERS)}")
    if req.address is not None and not req.address.strip():
        raise ConfigError("--address '': empty; give HOST:PORT, ray://HOST:PORT or auto, or leave it out "
                          "for a local Ray")
    if req.trials is not None and req.trials < 1:
        raise ConfigError(f"--trials {req.trials}: must be >= 1")
    if req.warm_start and req.searcher != "cubic":
        raise ConfigError(f"--warm-start: only the cubic searcher learns from other studies, not {req.searcher}")
    if req.quality_from is not None and req.backend != "sim":
        raise ConfigError("--quality-from: only --backend sim takes its quality verdicts from "
                          f"another space's real runs; --backend {req.backend} judges its own")


def build(req: TuneRequest, console: Any) -> Any:
    """The `Tuner` `req` asks for, with its space, store, runner and quality store opened (its runner started:
    the caller stops it). Bad input is a ConfigError (one line) raised before this tune's store is written."""
    from cubic.cli.trial import sim_cluster_of
    from cubic.execution.runner import RayRunner
    from cubic.space.search_space import load_space
    from cubic.study.store import Store, check_run_dir, open_storage, storage_url
    from cubic.tune import Tuner

    check(req)
    sim_cluster = sim_cluster_of(req.backend, req.cluster, req.framework)
    if sim_cluster is not None and req.address is not None:
        raise ConfigError("--address: simulated trials run in this process, not on Ray; leave it out")
    where = req.space or default_space()
    sp = load_space(where)
    if sim_cluster is not None:
        from cubic_harness.sim.backend import check_holds

        check_holds(sp.baseline, sim_cluster, f"{where}: baseline")
    if req.backend == "torchrec":
        check_torchrec_space(sp, where)
    judged_in = None if req.quality_from is None else quality_source(req.quality_from, sp)
    warm = []  # read (and judged) before this tune's own store is made: bad input writes nothing
    if req.warm_start:
        from cubic.search.warm_start import load_warm_start

        for src in req.warm_start:
            warm += load_warm_start(src, sp)
    qstore = None
    if req.quality_store is not None:  # opened before the study's store: a bad one writes nothing
        from cubic.quality.store import open_quality_store

        qstore = open_quality_store(req.quality_store)
    elif sim_cluster is not None:
        qstore = real_quality_store((judged_in or sp).name)
    run_dir = req.run_dir
    if run_dir is None and req.storage is None:
        run_dir = Path("runs") / (f"{sp.name}-sim-{sim_cluster.name}" if sim_cluster is not None else
                                  f"{sp.name}-torchrec" if req.backend == "torchrec" else sp.name)
    if run_dir is not None:
        check_run_dir(run_dir, holds_store=req.storage is None)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--run-dir {run_dir}: cannot create: {e.strerror}") from None
    url = req.storage or storage_url(run_dir, must_exist=False)
    rdb = open_storage(url, None if req.storage else f"--run-dir {run_dir}")
    sim_label = None if sim_cluster is None else f"sim:{sim_cluster.name}" + (
        "" if req.framework == "harness" else f"+{req.framework}")  # another framework's predictions: own study
    store = Store(sp, rdb, run_dir, backend=sim_label or req.backend,
                  figures=None if sim_cluster is None else sim_cluster.features())
    if sim_cluster is not None:
        from cubic.execution.sim_runner import SimRunner

        runner = SimRunner(sim_cluster)
    else:
        runner = RayRunner(req.address, sp.isolation, req.backend).check()
    try:
        if qstore is None and sim_cluster is None and sp.quality_runs is not None:
            from cubic.quality.store import QualityStore

            qstore = QualityStore(rdb.url)
        return Tuner(sp, store, runner, searcher=req.searcher, budget=req.trials, seed=req.seed, console=console,
                     live=req.live, warm_start=warm, quality_store=qstore, quality_from=judged_in)
    except BaseException:
        runner.stop()
        raise


def quality_source(name: str, sp: Any) -> Any:
    """The space `--quality-from` names, loaded and checked to judge `sp` (the same workload,
    quality runs of its own: `cubic.quality.scaled.check_judges`); ConfigError (one line)
    otherwise."""
    from cubic.quality.scaled import check_judges
    from cubic.space.search_space import load_space

    try:
        src = load_space(name, check_choices=False)
        check_judges(sp, src)
    except ConfigError as e:
        hint = ("; give a space file or a shipped space's name (dlrm_cpu, dcn_cpu, ...)"
                if str(e).endswith("not found") else "")
        raise ConfigError(f"--quality-from {name}: {e}{hint}") from None
    return src


def real_quality_store(space_name: str) -> Any:
    """Where a simulated tune finds the real quality runs of its space when none is named: the store
    `make tune` keeps (runs/quality.db), else a real tune's own store of the space (runs/NAME/study.db);
    None where neither exists (it then crowns no numerics change, and says so)."""
    from cubic.quality.store import QualityStore

    for p in (Path("runs") / "quality.db", Path("runs") / space_name / "study.db"):
        if p.is_file():
            return QualityStore(f"sqlite:///{p.resolve()}")
    return None


def check_torchrec_space(sp: Any, where: Path) -> None:
    """A TorchRec tune's space: `target: torchrec`, and a baseline TorchRec runs as it says."""
    from cubic_harness.torchrec_rules import check_runs_in_torchrec

    if sp.target != "torchrec":
        raise ConfigError(f"--backend torchrec: {where} has target {sp.target!r}; a TorchRec tune needs a space "
                          "with `target: torchrec`, which keeps only the knob values TorchRec runs (e.g. "
                          "search_spaces/dlrm_cpu_torchrec.yaml)")
    try:
        check_runs_in_torchrec(sp.baseline)
    except ConfigError as e:
        raise ConfigError(f"{where}: baseline: {e}") from None
