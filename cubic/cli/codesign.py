"""`cubic codesign`: the cluster as knobs of a simulated study; the front of time and cost."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from cubic_harness.errors import ConfigError


def codesign(
    space: Path = typer.Option(
        ...,
        "--space",
        help="Search-space YAML with a codesign: section, or a shipped "
        "space's name (mlperf_codesign).",
    ),
    trials: int = typer.Option(
        200, "--trials", min=1, help="Trials of the study in all (resumed ones count)."
    ),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="DIR/study.db, front.json, front.png; running "
        "again resumes [default: runs/NAME-codesign].",
    ),
    storage: str | None = typer.Option(
        None,
        "--storage",
        help="SQLAlchemy URL of the store instead of "
        "DIR/study.db (cubic never prints its password).",
    ),
    seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed of the searcher."),
    searcher: str = typer.Option(
        "proxy",
        "--searcher",
        help="proxy (learns across clusters from their "
        "figures) | nsga2 (Optuna's NSGA-II) | random",
    ),
) -> None:
    """Price the space's configurations on every cluster its codesign: lists; print the front."""
    import optuna
    from rich.console import Console

    from cubic.codesign.front import plot_front, print_front, write_front
    from cubic.codesign.study import open_study
    from cubic.space.search_space import load_space
    from cubic.study.store import redact

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = Console() if sys.stdout.isatty() else Console(width=150)
    try:
        sp = load_space(space)
        rd = run_dir if run_dir is not None or storage else Path("runs") / f"{sp.name}-codesign"
        from cubic.tune.view import short_config

        study = open_study(sp, rd, storage, seed, searcher, console,
                           describe=lambda knobs: short_config(sp, knobs))
        wall = study.run(trials)
    except ConfigError as e:
        print(f"error: {redact(' '.join(str(e).split()), storage)}", file=sys.stderr)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        raise typer.Exit(130) from None
    f = study_front(study, wall)
    print_front(console, f)
    if rd is not None:
        out = [write_front(f, rd / "front.json"), plot_front(study.study, f, rd / "front.png")]
        console.print("wrote " + ", ".join(str(p) for p in out if p is not None))


def study_front(study: Any, wall_s: float | None = None) -> Any:
    """The study's front, each configuration in the few words a tune's summary uses."""
    from cubic.codesign.front import front
    from cubic.tune.view import short_config

    sp = study.space
    return front(study.study, study.section.objectives,
                 lambda p: short_config(sp, {k: p[k] for k in sp.knobs}), wall_s)
