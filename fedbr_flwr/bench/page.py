"""``fedbr-bench --report PAGE``: what a bench command prints, written as one section of a markdown page with
the command, commit, machine, date and wall time that produced it, as ``fedbr-sweep --report`` writes a
results section. The same command on the same machine replaces its section; the rest of the page stays."""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, TextIO

from ..commands.report import check_report_page, describe_machine, short_commit, write_section
from ..runfiles.run_io import git_commit, host_facts

TOOL = "fedbr-bench"
NOT_MEASURED = ("--report", "--json")  # options that name where figures go, not what is measured


def bench_command(argv: list[str]) -> str:
    """The command as a user would type it again, without the options that only say where figures go."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in NOT_MEASURED:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in NOT_MEASURED)):
            kept.append(arg)
    return shlex.join([TOOL, *kept])


def this_machine() -> str:
    return describe_machine(host_facts())


def section_key(command: str, machine: str) -> str:
    """One section per command and machine: run again on the same machine, a command replaces its figures."""
    return "bench-" + hashlib.sha256(json.dumps([command, machine]).encode()).hexdigest()[:10]


def check_page(page: Path, argv: list[str]) -> None:
    """ConfigError before anything is measured where the section could not be written afterwards."""
    check_report_page(page, section_key(bench_command(argv), this_machine()), TOOL)


def bench_section(command: str, printed: str, wall_s: float, machine: str, commit: str, day: str) -> str:
    return "\n".join(
        [
            f"### `{command}`",
            "",
            f"- commit: {short_commit(commit) if commit else 'unknown'}; machine: {machine}; date: {day}; "
            f"wall time {wall_s / 60:.1f} min",
            "",
            printed.strip(),
        ]
    )


def write_bench_report(page: Path, argv: list[str], printed: str, wall_s: float) -> None:
    command, machine = bench_command(argv), this_machine()
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    section = bench_section(command, printed, wall_s, machine, git_commit(), day)
    key = section_key(command, machine)
    page.parent.mkdir(parents=True, exist_ok=True)  # checked before the run, as fedbr-sweep's page
    write_section(page, key, section, TOOL, new_page="# Benchmark\n")


class _Tee(io.StringIO):
    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(text)
        return super().write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextmanager
def printed_and_kept() -> Iterator[io.StringIO]:
    """What the block prints still goes to stdout, and is also kept (the text of the section)."""
    tee, before = _Tee(sys.stdout), sys.stdout
    sys.stdout = tee
    try:
        yield tee
    finally:
        sys.stdout = before
