"""A command's processes and listening ports, read from /proc (no psutil): to check that a command killed
with SIGKILL leaves nothing behind."""

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from fedbr_flwr.launch.watchdog import proc_stat, proc_table, with_descendants

FIRST_ROUND = "[fedbr] round 1/"
FLOWER_COMMANDS = (
    b"flower-superlink",
    b"flwr-simulation",
    b"flower-superexec",
    b"fedbr_flwr.launch.simulation",
    b"raylet",
)


def flower_processes() -> set[int]:
    """Flower processes started from a test (they inherit pytest's PYTEST_CURRENT_TEST), so that runs
    of the user's own going on beside the tests do not count; under pytest-xdist, from this worker's
    tests only (they inherit its PYTEST_XDIST_WORKER)."""
    mark = b"PYTEST_CURRENT_TEST="
    if os.environ.get("PYTEST_XDIST_WORKER"):
        mark = b"\0PYTEST_XDIST_WORKER=" + os.environ["PYTEST_XDIST_WORKER"].encode() + b"\0"
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                if not any(name in cmd for name in FLOWER_COMMANDS):
                    continue
                if mark in b"\0" + (entry / "environ").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def tree(pid: int) -> dict[int, int]:
    """``pid``, its descendants and every process of its session (when it leads one): pid -> start time."""
    table = proc_table()
    if pid not in table:
        return {}
    out = with_descendants({pid} | {p for p, (_, sid, _) in table.items() if sid == pid}, table)
    return {p: table[p][2] for p in out if p in table}


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid``."""
    return sorted(with_descendants({pid}, proc_table()) - {pid})


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


def as_at_a_terminal() -> None:
    """In the child, before it runs: Ctrl-C's signal as a terminal's foreground job has it, handled by default and
    not blocked. An ignored or blocked SIGINT is inherited, and the whole e2e suite once ran the Ctrl-C tests with
    one (they passed alone and in every subset), so this tests fedbr-run, not what the tests before left behind."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextmanager
def command_at_first_round(command: list[str]):
    """Start ``command`` in a session of its own and read its output up to its first round line; yields
    (the process, the lines it printed, its processes: pid -> start time). Whatever is left of them is
    killed on exit, also when the test fails."""
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=as_at_a_terminal,
    )
    snapshot: dict[int, int] = {}
    try:
        printed = []
        for line in proc.stdout:
            printed.append(line)
            if FIRST_ROUND in line:
                break
        assert printed and FIRST_ROUND in printed[-1], "".join(printed[-30:])
        snapshot.update(tree(proc.pid))
        yield proc, printed, snapshot
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_all(snapshot)


def kill_and_check_nothing_is_left(
    proc: subprocess.Popen, snapshot: dict[int, int], ports: set[int], out: Path
) -> None:
    """SIGKILL the command's process group: within seconds none of its processes lives, none of its ports
    listens, and its run folder stops growing (nothing trains on into it)."""
    kill_group(proc)
    left, still_open = wait_gone(snapshot, ports, timeout_s=10)
    assert not left and not still_open, (left, still_open)
    sizes = file_sizes(out)
    time.sleep(2)
    assert file_sizes(out) == sizes
