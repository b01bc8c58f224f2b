"""A command killed with SIGKILL takes every process it started along (fedbr_flwr/launch/watchdog.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import procs

PARENT = """
import sys, tempfile, time
from fedbr_flwr.launch import watchdog

home = tempfile.mkdtemp(prefix="fedbr-watchdog-test-")
watchdog.watch_path(home)
# a session of its own with a child that left the session and an orphan that stayed in it
watchdog.spawn(["sh", "-c", "setsid sleep 7771 & (sleep 7772 &); sleep 7773"], start_new_session=True)
watchdog.spawn(["sh", "-c", "sleep 7774"])  # in this process's session: only its own tree is killed
done = watchdog.spawn(["sleep", "7775"], start_new_session=True)
done.kill(); done.wait(); watchdog.unwatch(done.pid)  # stopped and unregistered by the command itself
print(home, flush=True)
time.sleep(300)
"""


def sleepers() -> dict[int, int]:
    """The test's `sleep 777x` processes: pid -> start time."""
    out = {}
    for pid, (_, _, start) in procs.proc_table().items():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd[:1] == [b"sleep"] and cmd[1:2] and cmd[1].startswith(b"777"):
            out[pid] = start
    return out


def test_sigkill_of_the_command_kills_what_it_started_and_removes_its_folders(tmp_path):
    bystander = subprocess.Popen(["sleep", "8889"], start_new_session=True)  # not the command's: must survive
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=True,
    )
    started: dict[int, int] = {}
    try:
        home = Path(parent.stdout.readline().strip())
        deadline = time.time() + 10
        while len(started) < 4 and time.time() < deadline:  # 7771-7774 (7775 was stopped)
            started = sleepers()
            time.sleep(0.05)
        assert len(started) == 4 and home.is_dir()
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        left, _ = procs.wait_gone(started, set(), timeout_s=5)
        assert not left
        deadline = time.time() + 5
        while home.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert not home.exists()
        assert bystander.poll() is None
    finally:
        parent.kill()
        procs.stop_all(started)
        bystander.kill()
        bystander.wait()


def test_a_temporary_folder_whose_owner_and_watchdog_both_died_is_removed_by_the_next_command(tmp_path, monkeypatch):
    """kill -9 of the command *and* its watchdog leaves the folder; the next command with that prefix removes
    it, and keeps those of live commands and folders that are not ours."""
    import tempfile

    from fedbr_flwr.launch import watchdog

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale, reused, live, foreign = (tmp_path / f"fedbr-test-{n}" for n in ("stale", "reused", "live", "foreign"))
    for d in (stale, reused, live, foreign):
        d.mkdir()
    me = procs.proc_stat(os.getpid())
    (stale / watchdog.OWNER_FILE).write_text(f"{2**22 + 1} 1\n")  # above any pid_max: no such process
    (reused / watchdog.OWNER_FILE).write_text(f"{os.getpid()} {me[2] - 1}\n")  # its pid now names another process
    (live / watchdog.OWNER_FILE).write_text(f"{os.getpid()} {me[2]}\n")
    made = watchdog.temp_dir("fedbr-test-")
    try:
        assert made.is_dir() and not stale.exists() and not reused.exists() and live.exists() and foreign.exists()
        assert (made / watchdog.OWNER_FILE).read_text().split()[0] == str(os.getpid())
    finally:
        watchdog.unwatch_path(made)


def test_a_process_whose_parent_died_is_still_found_through_the_session_its_ancestor_leads():
    """pid -> (parent, session, start). 10 starts 20, which leads session 20 and started 21 and 22; 21 died,
    so 23 (its child) now has parent 1 but is still in session 20. 30 is someone else's."""
    from fedbr_flwr.launch.watchdog import with_descendants, with_sessions

    table = {
        10: (1, 10, 100),
        20: (10, 20, 101),
        22: (20, 20, 102),
        23: (1, 20, 103),
        30: (1, 30, 104),
        31: (1, 20, 50),  # in a session 20 of before the leader started: a reused session id, not ours
    }
    assert with_descendants({10}, table) == {10, 20, 22}
    assert with_sessions({10}, table) == {10, 20, 22, 23}


def test_the_launcher_stops_flower_once_the_server_app_wrote_its_last_event():
    """Flower's orderly shut-down of a finished simulation takes seconds: the launcher stops it instead."""
    import threading

    from fedbr_flwr.launch.launcher import stop_when_finished

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    finished = threading.Event()
    thread = threading.Thread(target=stop_when_finished, args=(proc, finished, 0.2))
    thread.start()
    try:
        time.sleep(0.5)
        assert proc.poll() is None  # not before the event
        finished.set()
        thread.join(timeout=10)
        assert proc.poll() is not None
    finally:
        if proc.poll() is None:
            proc.kill()


ENDED_MAIN_THREAD = """
import ctypes, fcntl, os, signal, sys, threading, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
signal.signal(signal.SIGTERM, lambda *_: None)  # its main thread, which would run this, is gone: SIGTERM is lost
threading.Thread(target=time.sleep, args=(300,)).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_process_whose_main_thread_ended_is_stopped_with_its_threads_and_its_locks_freed(tmp_path):
    """A process whose main thread ended before the others shows as a zombie while they run on and hold its
    locks (a ServerApp's run-folder lock, for one): stop_tree must not take it for gone."""
    import fcntl

    from fedbr_flwr.launch.launcher import stop_tree
    from fedbr_flwr.launch.watchdog import proc_stat

    lock = tmp_path / "held.lock"
    proc = subprocess.Popen([sys.executable, "-c", ENDED_MAIN_THREAD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.time() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.time() < deadline
            time.sleep(0.01)
        assert proc_stat(proc.pid) is not None  # its main thread is a zombie, the process is not
        stop_tree(proc, grace_s=0.2)
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while the process still holds it
        finally:
            os.close(fd)
        assert proc_stat(proc.pid) is None
    finally:
        proc.kill()
        proc.wait()


ENDS_ON_SIGTERM = """
import os, signal, subprocess, sys, time
child = subprocess.Popen(["sleep", "7776"])

def stop(*_):
    time.sleep(0.3)  # as a W&B run finishing would take, with the processes it needs
    with open(sys.argv[1], "w") as f:
        f.write("child running" if child.poll() is None else "child gone")
    os._exit(143)

signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(300)
"""


def test_a_stopped_process_may_end_first_while_what_it_started_still_runs(tmp_path):
    """stop_tree(first_s=...) sends SIGTERM to the process alone first (the simulation process finishes its
    run's trackers then, with their helper processes alive), and then to all it started; without first_s every
    process is sent SIGTERM at once."""
    from fedbr_flwr.launch.launcher import stop_tree

    for first_s, said in ((5.0, "child running"), (0.0, "child gone")):
        proc = subprocess.Popen(
            [sys.executable, "-c", ENDS_ON_SIGTERM, str(tmp_path / "said")], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout.readline() == "ready\n"
            stop_tree(proc, grace_s=2.0, first_s=first_s)
            assert proc.returncode == 143 and (tmp_path / "said").read_text() == said
            assert not sleepers()
        finally:
            if proc.poll() is None:
                proc.kill()
