"""`cubic tune`: find the fastest configuration of a search space with few real trials."""

from __future__ import annotations

import sys
from pathlib import Path

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
                                "(needs --cluster; no quality gate)."),
    cluster: str | None = typer.Option(None, "--cluster", help="Cluster file (clusters/*.yaml) or preset name "
                                       "for --backend sim."),
    framework: str = typer.Option("harness", "--framework", help="--backend sim: whose step to price, cubic's "
                                  "harness or torchrec (the cluster's profile: `cubic calibrate --framework`)."),
    warm_start: list[str] = typer.Option([], "--warm-start", help="Run dir or storage URL of a study of the same "
                                         "space (typically a simulated one) whose trials the searcher learns from "
                                         "first; repeatable (searcher cubic)."),
    quality_store: str | None = typer.Option(None, "--quality-store", help="Where quality runs are kept, reused "
                                             "and added to (table cubic_quality_runs): a run dir, a storage URL, "
                                             "or a .db file (created) [default: this tune's own store]."),
) -> None:
    """Tune: baseline first, then the searcher's proposals as real trials on Ray, then confirm the top-k."""
    import optuna
    import sqlalchemy
    from rich.console import Console

    from cubic.execution.runner import RayRunner
    from cubic.search.samplers import SEARCHERS
    from cubic.space.search_space import load_space
    from cubic.study.store import Store, check_run_dir, open_storage, redact, storage_url
    from cubic.tune import Tuner
    from cubic.tune.view import print_summary

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # --live through a pipe (`| tee log` on a terminal) draws the table with terminal codes, as asked
    console = Console() if sys.stdout.isatty() else Console(width=130, force_terminal=bool(live))
    runner = None
    try:
        if searcher not in SEARCHERS:
            raise ConfigError(f"--searcher {searcher!r}: choose one of {list(SEARCHERS)}")
        if address is not None and not address.strip():
            raise ConfigError("--address '': empty; give HOST:PORT, ray://HOST:PORT or auto, or leave it out "
                              "for a local Ray")
        if trials is not None and trials < 1:
            raise ConfigError(f"--trials {trials}: must be >= 1")
        from cubic.cli.trial import sim_cluster_of

        sim_cluster = sim_cluster_of(backend, cluster, framework)
        if sim_cluster is not None and address is not None:
            raise ConfigError("--address: simulated trials run in this process, not on Ray; leave it out")
        sp = load_space(space or default_space())
        if sim_cluster is not None:
            from cubic_harness.sim.backend import check_holds

            check_holds(sp.baseline, sim_cluster, f"{space or default_space()}: baseline")
        if backend == "torchrec":
            from cubic_harness.torchrec_trial import check_runs_in_torchrec

            if sp.target != "torchrec":
                raise ConfigError(f"--backend torchrec: {space or default_space()} has target {sp.target!r}; a "
                                  "TorchRec tune needs a space with `target: torchrec`, which keeps only the knob "
                                  "values TorchRec runs (e.g. search_spaces/dlrm_cpu_torchrec.yaml)")
            try:
                check_runs_in_torchrec(sp.baseline)
            except ConfigError as e:
                raise ConfigError(f"{space}: baseline: {e}") from None
        warm = []  # read (and judged) before this tune's own store is made: bad input writes nothing
        if warm_start:
            from cubic.search.warm_start import load_warm_start

            if searcher != "cubic":
                raise ConfigError(f"--warm-start: only the cubic searcher learns from other studies, not {searcher}")
            for src in warm_start:
                warm += load_warm_start(src, sp)
        qstore = None
        if quality_store is not None and sim_cluster is not None:
            raise ConfigError("--quality-store: a simulated tune runs no quality runs; leave it out")
        if quality_store is not None:  # opened before the study's store: a bad one writes nothing
            from cubic.quality.store import open_quality_store

            qstore = open_quality_store(quality_store)
        if run_dir is None and storage is None:
            run_dir = Path("runs") / (f"{sp.name}-sim-{sim_cluster.name}" if sim_cluster is not None else
                                      f"{sp.name}-torchrec" if backend == "torchrec" else sp.name)
        if run_dir is not None:
            check_run_dir(run_dir, holds_store=storage is None)
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"--run-dir {run_dir}: cannot create: {e.strerror}") from None
        url = storage or storage_url(run_dir, must_exist=False)
        rdb = open_storage(url, None if storage else f"--run-dir {run_dir}")
        sim_label = None if sim_cluster is None else f"sim:{sim_cluster.name}" + (
            "" if framework == "harness" else f"+{framework}")  # predictions of another framework: their own study
        store = Store(sp, rdb, run_dir, backend=sim_label or backend)
        if sim_cluster is not None:
            from cubic.execution.sim_runner import SimRunner

            runner = SimRunner(sim_cluster)
        else:
            runner = RayRunner(address, sp.isolation, backend).check()
        if qstore is None and sim_cluster is None and sp.quality_runs is not None:
            from cubic.quality.store import QualityStore

            qstore = QualityStore(rdb.url)
        tuner = Tuner(sp, store, runner, searcher=searcher, budget=trials, seed=seed, console=console, live=live,
                      warm_start=warm, quality_store=qstore)
        summary = tuner.run()
    except ConfigError as e:  # never a storage URL's password, even in a driver's words
        print(f"error: {redact(' '.join(str(e).split()), storage, quality_store, *warm_start)}", file=sys.stderr)
        raise typer.Exit(2) from None
    except sqlalchemy.exc.SQLAlchemyError as e:
        # the store failed mid-tune (its server went away): one redacted line, not a driver's traceback
        msg = redact(" ".join(str(getattr(e, "orig", None) or e).split()), storage, quality_store, *warm_start)[:300]
        print(f"error: the trial store failed ({type(e).__name__}: {msg}); run the same command again to resume",
              file=sys.stderr)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        raise typer.Exit(130) from None
    finally:
        if runner is not None:
            runner.stop()
    print_summary(console, summary)
