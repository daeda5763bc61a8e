"""Errors the harness raises on bad input (the CLI turns them into exit 2 + one line)."""


import os
from pathlib import Path

# The one debug switch: a failing rank prints its traceback, and TorchRec's ranks keep their own stdout and
# stderr (TorchRec's and DDP's warnings, silenced otherwise). It changes no measurement, so it is no knob.
DEBUG_ENV = "CUBIC_DEBUG"


def debugging() -> bool:
    return bool(os.environ.get(DEBUG_ENV))


class ConfigError(ValueError):
    """Bad input: the message is one line naming the file/key/value and what is allowed."""


def write_text(path: Path, text: str, what: str) -> None:
    """Write a user's output file (making its folder), or ConfigError naming it (a directory, no access)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot write the {what}: {e.strerror or e}") from None


def read_text(path: Path, what: str) -> str:
    """A user's file as UTF-8 text, or ConfigError naming it (missing, a directory, unreadable, binary)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory; expected a {what}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {e.start}); expected a {what}") from None
