"""Errors the harness raises on bad input (the CLI turns them into exit 2 + one line)."""


from pathlib import Path


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
