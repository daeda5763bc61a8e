"""The `cubic` command: trial, tune, plan, report, export, verify, calibrate, workload, schema.

Each command lives in its own module beside this one (cubic/cli/*.py); this file only wires them.
Bad input anywhere is one line on stderr and exit code 2.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="cubic: find the fastest DLRM training configuration with few real trials.")

# command name -> (module, function); modules are imported lazily so `cubic --help` is fast.
COMMANDS = {
    "trial": ("cubic.cli.trial", "trial"),
    "tune": ("cubic.cli.tune", "tune"),
    "report": ("cubic.cli.report", "report"),
    "export": ("cubic.cli.export", "export"),
    "verify": ("cubic.cli.verify", "verify"),
    "calibrate": ("cubic.cli.calibrate", "calibrate"),
    "schema": ("cubic.cli.schema", "schema"),
    "plan": ("cubic.cli.plan", "plan"),
    "codesign": ("cubic.cli.codesign", "codesign"),
}

# command groups (a typer app of subcommands each): name -> module holding `app`
GROUPS = {"workload": "cubic.cli.workload"}

for _name, _mod in GROUPS.items():
    app.add_typer(importlib.import_module(_mod).app, name=_name)

for _name, (_mod, _fn) in COMMANDS.items():
    try:
        app.command(_name)(getattr(importlib.import_module(_mod), _fn))
    except ModuleNotFoundError as _e:  # a command still being built: leave it out
        if _e.name != _mod:
            raise


def main() -> None:
    """The `cubic` script: a usage error (a bad option value, a missing argument, an unknown command) is one
    line and exit 2, like every other bad input; typer's own handler would print four."""
    import sys

    try:
        code = app(standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as e:  # typer's usage errors (its click exceptions) derive from this
        ctx = getattr(e, "ctx", None)
        msg = e.format_message() if hasattr(e, "format_message") else str(e)
        print(f"error: {ctx.command_path if ctx else 'cubic'}: {' '.join(msg.split())}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
