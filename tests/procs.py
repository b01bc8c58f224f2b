"""A command's processes and listening ports, read from /proc (no psutil): to check that a command killed
with SIGKILL leaves nothing behind."""

import os
import signal
import subprocess
import time
from pathlib import Path



def proc_stat(pid: int):
    """(parent pid, session id, start time) of a live process; None if gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else (int(fields[1]), int(fields[3]), int(fields[19]))


def proc_table() -> dict:
    """Every live process: pid -> ``proc_stat``."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (info := proc_stat(int(entry.name))) is not None:
            table[int(entry.name)] = info
    return table


def tree(pid: int) -> dict[int, int]:
    """``pid``, its descendants and every process of its session (when it leads one): pid -> start time."""
    table = proc_table()
    if pid not in table:
        return {}
    out = {pid}
    out |= {p for p, (_, sid, _) in table.items() if sid == pid}
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(p)
    stack = list(out)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return {p: table[p][2] for p in out if p in table}


def alive(pids: dict[int, int]) -> list[int]:
    """Those of ``pids`` (pid -> start time) still alive (a reused pid does not count)."""
    return [p for p, start in pids.items() if (info := proc_stat(p)) is not None and info[2] == start]


def _socket_inodes(pids) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def listening(pids=None) -> set[int]:
    """TCP ports in LISTEN state (of the processes ``pids`` only, when given)."""
    inodes = None if pids is None else _socket_inodes(pids)
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and (inodes is None or fields[9] in inodes):
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (started with start_new_session=True): no cleanup code runs."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def wait_gone(pids: dict[int, int], ports: set[int], timeout_s: float) -> tuple[list[int], set[int]]:
    """Wait up to ``timeout_s`` for ``pids`` to die and ``ports`` to close; what is left of each."""
    deadline = time.time() + timeout_s
    while True:
        left, open_ports = alive(pids), ports & listening()
        if (not left and not open_ports) or time.time() > deadline:
            return left, open_ports
        time.sleep(0.2)


def file_sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path(folder).glob("*.jsonl")}


def stop_all(pids: dict[int, int]) -> None:
    """Test cleanup: SIGKILL whatever of ``pids`` is still alive."""
    for pid in alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
