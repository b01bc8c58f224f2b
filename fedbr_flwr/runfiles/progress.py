"""A run's progress as structured events: one JSON line per event in ``<run>/progress.jsonl``
(``kind``, ``round`` where it applies, ``message`` for people, ``time``), also written to Flower's log.
``fedbr-run``, ``fedbr-sweep`` and ``fedbr-deploy local`` print progress by following this file;
scripts may follow it too (``read_events``)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

from . import jsonsafe
from .checkpoint import CHECKPOINT_NAME

SUMMARY_EVENT = "summary"  # the last event of a run that ended normally (run files complete)
STOPPED_EVENT = "stopped"  # the last event of a run its command stopped on purpose (time limit, Ctrl-C, SIGTERM)
PROGRESS_FILE = "progress.jsonl"
LEVELS = {"warning": logging.WARNING, "error": logging.ERROR}  # every other kind is logged as INFO
log = logging.getLogger("flwr")


class Progress:
    """The writing side, in the ServerApp. A resumed run appends to the file of the run it continues."""

    def __init__(self, out_dir: Path, resumed: bool = False):
        self.path = Path(out_dir) / PROGRESS_FILE
        if not resumed:
            self.path.write_text("")

    def emit(self, kind: str, message: str, **fields: Any) -> None:
        append_event(self.path, kind, message, **fields)
        log.log(LEVELS.get(kind, logging.INFO), "[fedbr] %s", message)


def append_event(path: Path, kind: str, message: str, **fields: Any) -> None:
    event = {"kind": kind, **fields, "message": message, "time": round(time.time(), 3)}
    with open(path, "ab+") as f:
        f.write((end_cut_line(f) + jsonsafe.dumps(event) + "\n").encode())


def end_cut_line(f: BinaryIO) -> str:
    """A newline where the file's last line was cut short (a run killed as it wrote an event): the next event
    would join it, and readers would skip both as one line that is not JSON."""
    if f.seek(0, os.SEEK_END) == 0:
        return ""
    f.seek(-1, os.SEEK_END)
    return "" if f.read(1) == b"\n" else "\n"


def mark_stopped(out_dir: Path, how: str) -> None:
    """Say in the run's events that its command stopped it on purpose (``how``), once its processes are down:
    the report then tells such a run, which continues from its checkpoint or starts again, from one that
    crashed. A run stopped in its start-up gets the file here (its start empties it); one stopped after its
    summary, as it shut down, had ended and gets nothing."""
    if last_event_kind(out_dir) == SUMMARY_EVENT:
        return
    then = "continue it from its last checkpoint" if (Path(out_dir) / CHECKPOINT_NAME).exists() else "start it again"
    append_event(Path(out_dir) / PROGRESS_FILE, STOPPED_EVENT, f"run stopped ({how}); {then}")


def stopped_on_purpose(out_dir: Path) -> bool:
    """Whether the run's last event says its command stopped it (``mark_stopped``)."""
    return last_event_kind(out_dir) == STOPPED_EVENT


def last_event_kind(out_dir: Path) -> str | None:
    events, _ = read_events(Path(out_dir) / PROGRESS_FILE)
    return events[-1].get("kind") if events else None


def read_events(path: Path, start: int = 0) -> tuple[list[dict], int]:
    """The complete events written after byte ``start`` (a line a crash cut short is skipped), and the
    offset to read on from."""
    events = []
    lines, offset = read_lines(path, start)
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [e for e in events if isinstance(e, dict) and "message" in e], offset


def read_lines(path: Path, start: int = 0) -> tuple[list[str], int]:
    """The complete lines written after byte ``start`` (one not yet ended is left for the next read), and the
    offset to read on from."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return [], start
    complete = data[: data.rfind(b"\n") + 1]
    return complete.decode(errors="replace").splitlines(), start + len(complete)


class Follower:
    """Prints each new event's message while a run goes on (``with Follower(path, print): ...``); only
    events written after it started count, so a resumed run's older ones are not printed again."""

    def __init__(
        self,
        path: Path,
        write: Callable[[str], None] | None,
        poll_s: float = 0.1,
        on_event: Callable[[dict], None] | None = None,
    ):
        """``write``: where each event's message goes (None: nowhere); ``on_event``: called with each event."""
        self.path, self.write, self.poll_s, self.on_event = Path(path), write, poll_s, on_event
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Follower":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._drain()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._drain()

    def _drain(self) -> None:
        self._restart_with_file()
        events, self.offset = read_events(self.path, self.offset)
        for event in events:
            if self.write is not None:
                self.write(f"[fedbr] {event['message']}")
            if self.on_event is not None:
                self.on_event(event)

    def _restart_with_file(self) -> None:
        if self.path.exists() and self.path.stat().st_size < self.offset:  # a new run started the file again
            self.offset = 0


class LogFollower(Follower):
    """Prints each new line of a log while a run goes on: ``--verbose`` for a run whose simulation process
    writes its flower.log itself (``launcher.RunHost``)."""

    def _drain(self) -> None:
        self._restart_with_file()
        lines, self.offset = read_lines(self.path, self.offset)
        for line in lines:
            if self.write is not None:
                self.write(line)
