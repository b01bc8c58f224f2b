"""The error a user can fix from its message alone (exit code 2 in the commands)."""

from typing import Any


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says how."""


def quoted(value: Any, limit: int = 80) -> str:
    """``value`` as a message quotes it: its repr, cut to ``limit`` characters (a 10 MB value is not
    echoed back whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
