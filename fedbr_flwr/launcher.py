"""Run the Flower app through ``flwr run`` on a private, local simulation SuperLink, and always stop
every process that run started (FLOWER.md: the auto-started SuperLink outlives ``flwr run``, and
``flwr run --stream`` exits 0 even when the run failed)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from . import runlock, watchdog
from .config import to_toml
from .errors import ConfigError
from .progress import PROGRESS_FILE, SUMMARY_EVENT, Follower
from .raycluster import ray_environment, requested_address

PROJECT_DIR = Path(__file__).resolve().parent.parent
SUPERLINK_START_TIMEOUT_S = 60
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class RunFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (Linux /proc)."""
    return sorted(watchdog.with_descendants({pid}, watchdog.proc_table()) - {pid})


def process_tree(pid: int) -> list[int]:
    """``pid``, its descendants, and the members of sessions they lead (whose parent may have died first)."""
    return [pid, *sorted(watchdog.with_sessions({pid}, watchdog.proc_table()) - {pid})]


def stop_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM a process and everything it started (also children that left its session, and the members of
    sessions its descendants lead, whose parent may have died first), then SIGKILL whatever is still alive
    after ``grace_s``."""
    pids = process_tree(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace_s
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in dict.fromkeys(pids + process_tree(proc.pid)):  # and whatever started during the grace
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    watchdog.unwatch(proc.pid)


def _alive(pid: int) -> bool:
    return watchdog.proc_stat(pid) is not None  # None: gone, or a zombie


def flower_env(flwr_home: Path, http_port: int | None = None, control_port: int | None = None) -> dict[str, str]:
    """The environment for Flower's commands; the ports are those of the local simulation SuperLink."""
    env = os.environ.copy()
    if http_port is not None:
        env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(http_port)
    if control_port is not None:
        env["FLWR_LOCAL_CONTROL_API_PORT"] = str(control_port)
    env.update(
        {
            "FLWR_HOME": str(flwr_home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
            "RAY_DEDUP_LOGS": "0",
        }
    )
    # Flower starts its helpers by name: this interpreter's bin/ must come first on PATH.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


@contextmanager
def local_superlink(log_dir: Path, ray_address: str | None = None) -> Iterator[dict[str, str]]:
    """A simulation SuperLink on free ports with its own FLWR_HOME; yields the environment in which
    ``flwr`` commands talk to it, and stops it with all its children on exit. Its simulations use a private
    Ray runtime, or join the running cluster at ``ray_address`` (``fedbr_flwr.raycluster``)."""
    flwr_home = watchdog.temp_dir("fedbr-flwr-home-")  # removed also if this process is killed
    http_port, control_port = free_port(), free_port()
    env = {**flower_env(flwr_home, http_port, control_port), **ray_environment(ray_address)}
    log_file = log_dir / "superlink.log"
    command = [
        shutil.which("flower-superlink", path=env["PATH"]) or "flower-superlink",
        "--insecure",
        "--simulation",
        "--isolation",
        "subprocess",
        "--control-api-address",
        f"127.0.0.1:{control_port}",
        "--fleet-api-address",
        f"127.0.0.1:{free_port()}",
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--database",
        str(flwr_home / "state.db"),
        "--disable-runtime-dependency-installation",
        "--log-file",
        str(log_file),
    ]
    try:
        proc = watchdog.spawn(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            wait_healthy(proc, f"http://127.0.0.1:{http_port}/health", log_file)
            yield env
        finally:
            stop_tree(proc)
    finally:
        shutil.rmtree(flwr_home, ignore_errors=True)
        watchdog.unwatch_path(flwr_home)


def wait_healthy(proc: subprocess.Popen, url: str, log_file: Path, verify=True) -> None:
    """Wait until the SuperLink answers ``url`` (its /health endpoint); ``verify``: an SSL context under TLS."""
    import httpx

    deadline = time.time() + SUPERLINK_START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RunFailed(f"flower-superlink exited with code {proc.returncode}; see {log_file}")
        try:
            if httpx.get(url, timeout=0.5, verify=verify).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RunFailed(f"flower-superlink did not become ready in {SUPERLINK_START_TIMEOUT_S} s; see {log_file}")


def federation_config(num_supernodes: int, cpus: float, gpus: float) -> str:
    return f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus} client-resources-num-gpus={gpus}"


def run_flower(
    cfg: dict, num_supernodes: int, out_dir: Path, project_dir: Path = PROJECT_DIR, echo: str = "progress"
) -> dict:
    """``flwr run`` the app with ``cfg`` on a fresh local simulation SuperLink; see ``submit_run``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fed = federation_config(num_supernodes, cfg["client-cpus"], cfg["client-gpus"])
    with runlock.hold(out_dir), local_superlink(out_dir, requested_address(cfg["ray-address"])) as env:
        return submit_run(
            cfg, env, "local", out_dir, project_dir, echo, ["--federation-config", fed], end_at_summary=True
        )


def submit_run(
    cfg: dict,
    env: dict[str, str],
    connection: str,
    out_dir: Path,
    project_dir: Path = PROJECT_DIR,
    echo: str = "progress",
    extra_args: list[str] | None = None,
    end_at_summary: bool = False,
) -> dict:
    """``flwr run`` the app with ``cfg`` on the SuperLink that ``connection`` names in ``env``'s FLWR_HOME;
    wait for it; return the run's final status record from ``flwr ls`` (``end_at_summary``: once the ServerApp
    has written its last event, stop Flower and count the run completed without asking). Raises RunFailed when the run
    did not complete. ``echo``: "progress" (the run's events, followed in ``out_dir/progress.jsonl``, which
    the ServerApp writes: this machine must see the run folder), "all" (Flower's whole log, which also
    reaches a remote submitter) or "none"; the whole log is always in ``out_dir/flower.log`` (appended to
    when the run resumes)."""
    if not (project_dir / "pyproject.toml").is_file():
        raise ConfigError(
            f"no pyproject.toml in {project_dir}: fedbr-run needs the project checkout "
            "installed with `pip install -e .`"
        )
    with runlock.hold(out_dir):  # this process writes run_config.toml and flower.log
        return _submit_run(cfg, env, connection, out_dir, project_dir, echo, extra_args, end_at_summary)


def _submit_run(
    cfg: dict,
    env: dict[str, str],
    connection: str,
    out_dir: Path,
    project_dir: Path,
    echo: str,
    extra_args: list[str] | None,
    end_at_summary: bool,
) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    run_config = out_dir / "run_config.toml"
    run_config.write_text(to_toml(cfg))
    log_path = out_dir / "flower.log"
    with open(log_path, "a" if cfg.get("resume") else "w") as log:
        flwr = shutil.which("flwr", path=env["PATH"]) or "flwr"
        command = [
            flwr,
            "run",
            str(project_dir),
            connection,
            "--run-config",
            str(run_config),
            *(extra_args or []),
            "--stream",
        ]
        proc = watchdog.spawn(
            command, env=env, cwd=out_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        run_id = None
        finished = threading.Event()
        follow: Any = contextlib.nullcontext()
        if echo == "progress" or end_at_summary:

            def mark_finished(event: dict) -> None:
                if event.get("kind") == SUMMARY_EVENT:
                    finished.set()

            write = _print if echo == "progress" else None
            follow = Follower(out_dir / PROGRESS_FILE, write, on_event=mark_finished if end_at_summary else None)
        if end_at_summary:
            threading.Thread(target=stop_when_finished, args=(proc, finished), daemon=True).start()
        try:
            with follow:
                assert proc.stdout is not None  # started with stdout=PIPE
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if echo == "all":
                        _print(ANSI_ESCAPE.sub("", line).rstrip("\n"))
                    match = re.search(r"run (\d+)", line)
                    if run_id is None and match and "start" in line.lower():
                        run_id = int(match.group(1))
                proc.wait()
        finally:
            if proc.poll() is None:
                stop_tree(proc)
            watchdog.unwatch(proc.pid)
    if run_id is None:
        raise RunFailed(f"`flwr run` did not start a run (exit code {proc.returncode}); see {log_path}")
    if finished.is_set():  # the ServerApp wrote its last event: every run file is complete
        return {"run-id": run_id, "status": "finished:completed"}
    status = run_status(run_id, env, connection)
    if status.get("status") != "finished:completed":
        raise RunFailed(f"run {run_id} ended as '{status.get('status')}'{last_error(log_path)}; see {log_path}")
    return status


def stop_when_finished(proc: subprocess.Popen, finished: threading.Event, grace_s: float = 1.0) -> None:
    """Once the ServerApp has written its last event, give Flower ``grace_s`` to stream its last log lines,
    then stop ``flwr run`` instead of waiting for Flower's orderly shut-down of the simulation (seconds of
    Ray shutting down, then ``flwr ls``): the caller stops the SuperLink and everything under it."""
    while not finished.wait(0.5):
        if proc.poll() is not None:  # ended without the event (a failed run): nothing to stop
            return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        stop_tree(proc, grace_s=1.0)


def _print(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def last_error(log_path: Path) -> str:
    """The last line of the Flower log that names an error, to show beside 'the run failed'."""
    lines = [
        ANSI_ESCAPE.sub("", ln).strip()
        for ln in log_path.read_text(errors="replace").splitlines()
        if re.search(r"Error|Exception", ln) and "Traceback" not in ln
    ]
    return f": {lines[-1][:500]}" if lines else ""


def run_status(run_id: int, env: dict[str, str], connection: str = "local") -> dict:
    flwr = shutil.which("flwr", path=env["PATH"]) or "flwr"
    res = subprocess.run(
        [flwr, "ls", connection, "--run-id", str(run_id), "--format", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        data = json.loads(res.stdout)
    except json.JSONDecodeError:
        return {"status": f"unknown ({res.stdout.strip()[:200]} {res.stderr.strip()[:200]})"}
    runs = data.get("runs", [data]) if isinstance(data, dict) else data
    for run in runs:
        if int(run.get("run-id", run.get("run_id", -1))) == run_id:
            return run
    return {"status": f"unknown (no run {run_id} in `flwr ls`)"}
