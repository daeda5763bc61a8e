"""Errors the harness raises on bad input (the CLI turns them into exit 2 + one line)."""


class ConfigError(ValueError):
    """Bad input: the message is one line naming the file/key/value and what is allowed."""
