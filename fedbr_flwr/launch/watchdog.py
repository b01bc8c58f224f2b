"""Processes started by ``fedbr-run`` / ``fedbr-deploy`` die with the command that started them, even when
that command is killed with SIGKILL (which no ``finally`` survives).

The first child a command starts is a small watchdog (``python -I fedbr_flwr/launch/watchdog.py``) in its own
session, reading a pipe whose only writer is the command. The command tells it, line by line, which
children it started (``add PID``) and which temporary folders it made (``path DIR``), and what it stopped
or removed itself (``del PID``, ``unpath DIR``). When the command dies, however it dies, the kernel closes
the pipe; the watchdog reads end-of-file, SIGKILLs every child still registered with all it started (its
descendants, and every process of its session: Flower's SuperLink, SuperExec, ServerApp, Ray's workers),
removes the folders, and exits. It runs in a session of its own, so killing the command's process group
does not kill the watchdog too. Linux only (/proc); elsewhere nothing is watched.

Only the standard library here: the watchdog starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

OWNER_FILE = ".fedbr-owner"  # in a temporary folder: "pid start-time" of the process that made it

# ---------------------------------------------------------------- /proc


def proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, session id, start time in clock ticks) of a live process; None if gone or a zombie. A main
    thread that ended before the others shows as a zombie while they run on, holding the process's files and
    locks: such a process is live."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    if fields is None or (fields[0] in ("Z", "X") and not _other_threads_run(pid)):
        return None
    # after the command name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice threads itrealvalue starttime
    return int(fields[1]), int(fields[3]), int(fields[19])


def _other_threads_run(pid: int) -> bool:
    """Whether a thread of process ``pid`` other than its main one has not ended."""
    try:
        threads = [tid for tid in os.listdir(f"/proc/{pid}/task") if tid != str(pid)]
    except OSError:
        return False
    stats = (_stat_fields(f"/proc/{pid}/task/{tid}/stat") for tid in threads)
    return any(fields[0] not in ("Z", "X") for fields in stats if fields is not None)


def _stat_fields(path: str) -> list[str] | None:
    """The fields after the command name of a /proc ``stat`` file (state first); None if it cannot be read."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split() or None
    except (OSError, IndexError):
        return None


def proc_table() -> dict[int, tuple[int, int, int]]:
    """Every live (not zombie) process: pid -> ``proc_stat``."""
    table: dict[int, tuple[int, int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for name in entries:
        if name.isdigit() and (info := proc_stat(int(name))) is not None:
            table[int(name)] = info
    return table


def doomed(roots: dict[int, tuple[int, bool]], table: dict[int, tuple[int, int, int]]) -> set[int]:
    """The registered processes still alive (same start time: not a reused pid), everything they started,
    and, for those that lead a session of their own, every process in that session (also the ones whose
    parent already died)."""
    out = {pid for pid, (start, _) in roots.items() if pid in table and table[pid][2] == start}
    sessions = {pid: start for pid, (start, leader) in roots.items() if leader}
    for pid, (_, sid, start) in table.items():
        if sid in sessions and start >= sessions[sid]:
            out.add(pid)
    out = with_sessions(out, table)
    out.discard(os.getpid())
    return out


def with_sessions(pids: set[int], table: dict[int, tuple[int, int, int]]) -> set[int]:
    """``pids``, their descendants, and every process of a session that one of them leads, with its
    descendants, until nothing is added: a process whose parent died (Ray's workers after their raylet, for
    one) still counts through its session."""
    out = with_descendants(pids, table)
    while True:
        leaders = {pid: table[pid][2] for pid in out if pid in table and table[pid][1] == pid}
        members = {pid for pid, (_, sid, start) in table.items() if sid in leaders and start >= leaders[sid]}
        grown = with_descendants(out | members, table)
        if grown == out:
            return out
        out = grown


def with_descendants(pids: set[int], table: dict[int, tuple[int, int, int]]) -> set[int]:
    """``pids`` and every process of ``table`` descending from one of them."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out = set(pids)
    stack = list(out)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def kill_all(roots: dict[int, tuple[int, bool]], timeout_s: float = 10.0) -> int:
    """SIGKILL ``doomed(roots)`` until none is left (a process may start another meanwhile); returns how many."""
    killed: set[int] = set()
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        pids = doomed(roots, proc_table())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.05)
    return len(killed)


# ---------------------------------------------------------------- the watchdog process


def serve(stream, parent: int) -> None:
    roots: dict[int, tuple[int, bool]] = {}
    paths: list[str] = []
    for line in stream:
        verb, _, arg = line.strip().partition(" ")
        if verb == "add" and arg.isdigit():
            info = proc_stat(int(arg))
            if info is not None:
                roots[int(arg)] = (info[2], info[1] == int(arg))
        elif verb == "del" and arg.isdigit():
            roots.pop(int(arg), None)
        elif verb == "path" and arg:
            paths.append(arg)
        elif verb == "unpath" and arg in paths:
            paths.remove(arg)
    # end of file: the command is gone (or is exiting after stopping everything it registered)
    killed = kill_all(roots)
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    if killed:
        print(
            f"fedbr watchdog: the command (pid {parent}) ended without stopping its processes; killed "
            f"{killed} left behind",
            file=sys.stderr,
            flush=True,
        )


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # only the pipe's end stops it
    serve(sys.stdin, int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid())


# ---------------------------------------------------------------- the command's side

_lock = threading.Lock()
_pipe: int | None = None
_watchdog: subprocess.Popen | None = None
_registered: dict[str, None] = {}  # the "add"/"path" lines in force: told again to a new watchdog


def _send(line: str, start: bool = True) -> None:
    global _pipe, _watchdog
    if not sys.platform.startswith("linux"):
        return
    with _lock:
        verb, _, arg = line.partition(" ")
        if verb in ("add", "path"):
            _registered[line] = None
        else:
            _registered.pop(f"{'add' if verb == 'del' else 'path'} {arg}", None)
        if _pipe is not None and (_watchdog is None or _watchdog.poll() is not None):
            os.close(_pipe)
            _pipe = None
        if _pipe is None:
            if not start:
                return
            read, write = os.pipe()  # not inherited by the other children (PEP 446)
            try:
                # -I: this file alone, standard library only (no PYTHONPATH, no sitecustomize)
                _watchdog = subprocess.Popen(
                    [sys.executable, "-I", str(Path(__file__).resolve()), str(os.getpid())],
                    stdin=read,
                    stdout=subprocess.DEVNULL,
                    cwd="/",
                    start_new_session=True,
                )
            finally:
                os.close(read)
            _pipe = write
            line = "\n".join(_registered) if verb in ("add", "path") else line  # a new one: all in force
        try:
            os.write(_pipe, (line + "\n").encode())
        except OSError:  # the watchdog died: start another on the next call
            os.close(_pipe)
            _pipe = None


def _forked_child() -> None:
    """A forked child (multiprocessing) must not keep its parent's watchdog waiting: drop the pipe."""
    global _pipe, _lock
    _lock = threading.Lock()
    if _pipe is not None:
        with contextlib.suppress(OSError):
            os.close(_pipe)
        _pipe = None
    _registered.clear()


os.register_at_fork(after_in_child=_forked_child)


def watch(pid: int) -> None:
    """Kill ``pid`` and everything it starts if this process dies without calling ``unwatch``."""
    _send(f"add {pid}")


def unwatch(pid: int) -> None:
    _send(f"del {pid}", start=False)


def watch_path(path: Path | str) -> None:
    """Remove the folder ``path`` if this process dies without calling ``unwatch_path``."""
    _send(f"path {Path(path).resolve()}")


def unwatch_path(path: Path | str) -> None:
    _send(f"unpath {Path(path).resolve()}", start=False)


def temp_dir(prefix: str) -> Path:
    """A new temporary folder that the watchdog removes if this process dies without removing it. Should the
    watchdog have died too, the next command that makes a folder with this prefix removes it (its owner
    file names a process that is gone)."""
    remove_stale(prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    info = proc_stat(os.getpid())
    (path / OWNER_FILE).write_text(f"{os.getpid()} {info[2] if info else 0}\n")
    watch_path(path)
    return path


def remove_temp_dir(path: Path) -> None:
    """Remove a folder made by ``temp_dir`` and stop watching it."""
    shutil.rmtree(path, ignore_errors=True)
    unwatch_path(path)


def remove_stale(prefix: str) -> None:
    """Remove the temporary folders ``prefix*`` whose owner process is gone."""
    for path in Path(tempfile.gettempdir()).glob(prefix + "*"):
        try:
            pid, start = (int(x) for x in (path / OWNER_FILE).read_text().split())
        except (OSError, ValueError):
            continue  # not ours, or its owner is writing the file right now
        info = proc_stat(pid)
        if info is None or info[2] != start:
            shutil.rmtree(path, ignore_errors=True)


def spawn(command: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` whose process (with all it starts) dies when this one dies."""
    proc = subprocess.Popen(command, **popen_kwargs)
    watch(proc.pid)
    return proc


if __name__ == "__main__":
    main()
