"""The error a user can fix from its message alone (exit code 2 in the commands)."""

import argparse
from typing import Any, NoReturn


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says how."""


def quoted(value: Any, limit: int = 80) -> str:
    """``value`` as a message quotes it: its repr, cut to ``limit`` characters (a 10 MB value is not
    echoed back whole)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def describe(exc: BaseException) -> str:
    """An exception in one line, ``<type>: <message>``; an empty message (``MemoryError()``) still says what
    happened."""
    text = " ".join(str(exc).split())
    if not text and isinstance(exc, MemoryError):
        text = "out of memory"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class OneLineParser(argparse.ArgumentParser):
    """A command's argument parser whose errors are one line on stderr and exit code 2, like every other
    refusal of the commands (argparse's own print the whole usage first: 3 to 6 lines). Options are spelled in
    full: a command recorded in a report (``--table`` for ``--table-only``) must mean the same when run again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")
