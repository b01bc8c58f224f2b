"""One live run per run folder.

Two processes hold a lock (``fcntl.flock``) in the run folder for as long as they live: the command that
started the run (``fedbr-run``, ``fedbr-deploy local|run``: ``.fedbr-run.lock``) and the ServerApp process
that writes the run files (``.fedbr-writer.lock``). Each lock file names the pid holding it. A command that
would write into a folder (a new run, ``--overwrite``, ``--resume``) checks both first and stops with a
ConfigError naming the folder and the pid. The kernel releases a lock when its process dies, so a lock left
by a dead process never blocks.
"""

from __future__ import annotations

import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..core.errors import ConfigError

LOCK_FILES = {"launcher": ".fedbr-run.lock", "writer": ".fedbr-writer.lock"}  # a run folder's
ROLES = {"launcher": "the command that started it", "writer": "its ServerApp, which writes the run files"}
SWEEP_LOCK = ".fedbr-sweep.lock"  # a sweep's --out: one sweep at a time writes its runs there

_held: dict[Path, list] = {}  # lock file -> [fd, depth]: this process's locks (re-entrant)
_guard = threading.Lock()


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _busy(path: Path) -> bool:
    """Whether another process holds the lock ``path`` (the check takes and drops it at once)."""
    if path in _held or not path.exists():
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _error(out_dir: Path, role: str, path: Path) -> ConfigError:
    if role == "sweep":
        return ConfigError(
            f"{out_dir} is in use by another fedbr-sweep: pid {_holder(path)} holds {path}. Wait for that sweep "
            "to end (running this one again then continues it), or pick another --out"
        )
    return ConfigError(
        f"{out_dir} is in use by a live run: pid {_holder(path)} ({ROLES[role]}) holds {path}. "
        "Wait for that run to end or stop that process, or pick another output-dir"
    )


def check_free(out_dir: Path) -> None:
    """ConfigError if a process other than this one holds a lock of the run folder ``out_dir``."""
    out_dir = Path(out_dir).expanduser().resolve()
    with _guard:
        for role, name in LOCK_FILES.items():
            if _busy(out_dir / name):
                raise _error(out_dir, role, out_dir / name)


@contextmanager
def hold(out_dir: Path, role: str = "launcher") -> Iterator[None]:
    """Hold the run folder's ``role`` lock while the block runs; ConfigError if another process holds it
    (or, for the launcher, the writer's: a ServerApp left writing). Re-entrant within a process. Role "sweep":
    a sweep's output folder, which its runs' folders are in."""
    out_dir = Path(out_dir).expanduser().resolve()
    path = out_dir / (SWEEP_LOCK if role == "sweep" else LOCK_FILES[role])
    with _guard:
        if path in _held:
            _held[path][1] += 1
        else:
            if role == "launcher" and _busy(out_dir / LOCK_FILES["writer"]):  # an orphaned ServerApp
                raise _error(out_dir, "writer", out_dir / LOCK_FILES["writer"])
            out_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # O_CLOEXEC by default: children do not hold it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _error(out_dir, role, path) from None
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            _held[path] = [fd, 1]
    try:
        yield
    finally:
        with _guard:
            _held[path][1] -= 1
            if _held[path][1] == 0:
                os.close(_held.pop(path)[0])  # closing the only descriptor releases the lock
