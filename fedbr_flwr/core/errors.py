"""The error a user can fix from its message alone (exit code 2 in the commands)."""

import argparse
import functools
import os
import select
import sys
from typing import Any, Callable, NoReturn, TypeVar

Command = TypeVar("Command", bound=Callable[..., int])


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says how."""


def quoted(value: Any, limit: int = 80) -> str:
    """``value`` as a message quotes it: its repr, cut to ``limit`` characters (a 10 MB value is not
    echoed back whole)."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python prints (sys.get_int_max_str_digits), or a list of one
        text = f"<{type(value).__name__} too large to print>"
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
        required = "the following arguments are required: "
        if message.startswith(required):  # argparse's intermixed parsing also names the optional positionals
            optional = {a.dest for a in self._actions if not a.option_strings and a.nargs in ("*", "?")}
            message = required + ", ".join(n for n in message[len(required) :].split(", ") if n not in optional)
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def quiet_when_its_reader_leaves(main: Command) -> Command:
    """A command whose output's reader went away (``fedbr-sweep x.yaml --dry-run | head -1``) stops without a
    traceback, with a shell's exit code for SIGPIPE, 141; its further output goes nowhere. A broken pipe of
    anything but standard output still raises."""

    @functools.wraps(main)
    def command(*args: Any, **kwargs: Any) -> int:
        try:
            return main(*args, **kwargs)
        except BrokenPipeError:
            if not reader_gone(sys.stdout):
                raise
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else Python's flush at exit complains
            return 141

    return command  # type: ignore[return-value]


def reader_gone(stream: Any) -> bool:
    """Whether ``stream`` is a pipe that nobody reads any more (poll reports an error on its write end)."""
    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's captured stream)
        return False
