"""Run the Flower app as a simulation, in one process of its own (``fedbr_flwr.launch.simulation``: Flower's
simulation entry point) or through ``flwr run`` on a private, local simulation SuperLink, and always stop
every process that run started (the SuperLink that `flwr run` starts outlives it, and
``flwr run --stream`` exits 0 even when the run failed)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from ..app.raycluster import log_tail, ray_environment, requested_address
from ..core.config import common, to_toml
from ..core.errors import ConfigError
from ..runfiles import runlock
from ..runfiles.checkpoint import CHECKPOINT_NAME
from ..runfiles.progress import PROGRESS_FILE, SUMMARY_EVENT, Follower, LogFollower, mark_stopped
from . import watchdog
from .protocol import RunPlan, RunReply, RunRequest
from .timelimit import RoundWatch, TimeLimitReached

PROJECT_DIR = Path(__file__).resolve().parents[2]
SUPERLINK_START_TIMEOUT_S = 60
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


Echo = str | Callable[[str], None]  # "progress", "all", "none", or where each progress line goes


class RunFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_tree(proc: subprocess.Popen, grace_s: float = 5.0, first_s: float = 0.0) -> None:
    """SIGTERM a process and everything it started (also children that left its session, and the members of
    sessions its descendants lead, whose parent may have died first), then SIGKILL whatever of them is still
    alive after ``grace_s``, with whatever they started meanwhile, until none is left. ``first_s``: the process
    itself is sent SIGTERM first, and may take that long to end while the processes it started still run."""
    table = watchdog.proc_table()
    pids = [proc.pid, *sorted(watchdog.with_sessions({proc.pid}, table) - {proc.pid})]
    roots = {pid: (table[pid][2], table[pid][1] == pid) for pid in pids if pid in table}  # start time, leader
    if first_s > 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=first_s)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    watchdog.kill_all(roots)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
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


def flower_tool(env: dict[str, str], name: str) -> str:
    """The path of Flower's command ``name`` on ``env``'s PATH (the name alone where it is not found)."""
    return shutil.which(name, path=env["PATH"]) or name


def flags(options: dict[str, str]) -> list[str]:
    """Command-line options, each flag followed by its value."""
    return [part for flag, value in options.items() for part in (flag, value)]


@contextmanager
def local_superlink(log_dir: Path, ray_address: str | None = None) -> Iterator[dict[str, str]]:
    """A simulation SuperLink on free ports with its own FLWR_HOME; yields the environment in which
    ``flwr`` commands talk to it, and stops it with all its children on exit. Its simulations use a private
    Ray runtime, or join the running cluster at ``ray_address`` (``fedbr_flwr.app.raycluster``)."""
    flwr_home = watchdog.temp_dir("fedbr-flwr-home-")  # removed also if this process is killed
    http_port, control_port = free_port(), free_port()
    env = {**flower_env(flwr_home, http_port, control_port), **ray_environment(ray_address)}
    log_file = log_dir / "superlink.log"
    options = {
        "--isolation": "subprocess",
        "--control-api-address": f"127.0.0.1:{control_port}",
        "--fleet-api-address": f"127.0.0.1:{free_port()}",
        "--host": "127.0.0.1",
        "--port": str(http_port),
        "--database": str(flwr_home / "state.db"),
    }
    command = [flower_tool(env, "flower-superlink"), "--insecure", "--simulation", *flags(options)]
    command += ["--disable-runtime-dependency-installation", "--log-file", str(log_file)]
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
        watchdog.remove_temp_dir(flwr_home)


def wait_healthy(proc: subprocess.Popen, url: str, log_file: Path, verify=True) -> None:
    """Wait until the SuperLink answers ``url`` (its /health endpoint); ``verify``: an SSL context under TLS."""
    import httpx

    deadline = time.time() + SUPERLINK_START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RunFailed(f"flower-superlink exited with code {proc.returncode}; see {log_file}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5, verify=verify).is_success:
                return
        time.sleep(0.2)
    raise RunFailed(f"flower-superlink did not become ready in {SUPERLINK_START_TIMEOUT_S} s; see {log_file}")


def federation_config(num_supernodes: int, cpus: float, gpus: float) -> str:
    return f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus} client-resources-num-gpus={gpus}"


def run_flower(
    plan: RunPlan,
    echo: Echo = "progress",
    superlink: bool = False,
    host: "RunHost | None" = None,
    watch: RoundWatch | None = None,
) -> dict:
    """Run the app as ``plan`` says, a Flower simulation of its SuperNodes, and wait for it: in one
    simulation process (``fedbr_flwr.launch.simulation``: Flower's simulation entry point, as ``flwr run`` would start
    it), or with ``superlink``, through ``flwr run`` on a fresh local simulation SuperLink. Returns the run's
    final status record; raises RunFailed when the run did not complete. ``echo``: see ``submit_run``.
    ``host``: a simulation process that runs one run after another (``RunHost``, on the Ray runtime it was
    started for), used instead of a new process (not with ``superlink``). ``watch``: a time limit's
    (``timelimit.RoundWatch``): the run is stopped, with all it started, when the watch says so, and
    TimeLimitReached is raised."""
    try:
        return _run_flower(plan, echo, superlink, host, watch)
    except (TimeLimitReached, KeyboardInterrupt, SystemExit) as exc:
        if host is not None:
            host.close()  # its run is stopped before the stop is written: no event of it comes after
        with contextlib.suppress(OSError):
            mark_stopped(plan.out_dir, stop_cause(exc))
        raise


def how_to_continue(out: Path, resume: str) -> str:
    """The end of a stopped run's last line: the ``resume`` command where the run left a checkpoint, else that
    there is nothing to continue."""
    if (out / CHECKPOINT_NAME).is_file():
        return f"continue with `{resume}`"
    return "no round was checkpointed, so there is nothing to continue: start it again"


def stop_cause(exc: BaseException) -> str:
    if isinstance(exc, TimeLimitReached):
        return "time limit"
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else "SIGTERM"


def _run_flower(plan: RunPlan, echo: Echo, superlink: bool, host: "RunHost | None", watch: RoundWatch | None) -> dict:
    run, out_dir = plan.settings, plan.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    address = requested_address(run.ray_address)
    if superlink:
        fed = federation_config(plan.supernodes, run.client_cpus, run.client_gpus)
        with runlock.hold(out_dir), local_superlink(out_dir, address) as env:
            return submit_run(
                plan.config,
                env,
                "local",
                out_dir,
                echo,
                ["--federation-config", fed],
                end_at_summary=True,
                watch=watch,
            )
    with runlock.hold(out_dir):
        if host is not None and host.address == address:
            return host.run(plan, echo, watch)
        return simulate_run(plan, address, echo, watch)


def simulate_run(plan: RunPlan, address: str | None, echo: Echo, watch: RoundWatch | None = None) -> dict:
    """``run_flower`` in a simulation process of its own (a ``RunHost`` for one run), on a private Ray runtime or
    the cluster at ``address``."""
    with RunHost(address) as host:
        return host.run(plan, echo, watch)


EXIT_GRACE_S = 10.0  # how long a simulation process whose replies have ended may take to exit
TRACKERS_STOP_S = 20.0  # how long a stopped simulation process may take to finish its run's W&B run


class RunHost:
    """The simulation process every simulated run goes to (``python -m fedbr_flwr.launch.simulation``): one run
    (``simulate_run``), or one run after another (fedbr-run's early start, a sweep), on one Ray runtime (private,
    or the cluster at ``address``): a later run finds torch imported, Ray up and the client processes of the run
    before (``fedbr_flwr.app.flower_adapter.keep_actors_between_runs``), so it does not pay
    the process, Ray and import start-up again (docs/benchmarks.md).
    A run that fails ends the process, and so does one that leaves a client call running (a client its round
    timed out on: a thread cannot be stopped); the next run starts a new one, and says why.
    ``with RunHost(...) as host:``; its exit stops the process and all it started, as for a run of its own."""

    def __init__(self, address: str | None = None):
        self.address = address
        self.proc: subprocess.Popen | None = None
        self.replies: queue.Queue[RunReply | None] = queue.Queue()
        # the process takes no more runs: its replies have ended, or it said it ends (a failed run, retired)
        self.no_more_runs = threading.Event()
        self.home: Path | None = None

    def __enter__(self) -> "RunHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None:
            # every run file is complete: no need for Ray's orderly stop; a run stopped in progress has its
            # trackers end first (simulation.stop_on_sigterm)
            stop_tree(self.proc, grace_s=0.5, first_s=TRACKERS_STOP_S)
            self.proc = None
        if self.home is not None:
            watchdog.remove_temp_dir(self.home)
            self.home = None

    def start(self) -> "RunHost":
        """Start the process now, where it is not running: it imports what a run needs (and starts Ray where a
        run will likely use it) while the caller prepares the run."""
        # such a process may not have exited yet: a SIGKILL's stdout closes a moment before the process can be
        # reaped, and one whose run failed may take long to end (or never, where a thread of it hangs)
        if self.proc is not None and self.proc.poll() is None and not self.no_more_runs.is_set():
            return self
        self.close()
        self.home = watchdog.temp_dir("fedbr-flwr-home-")  # Flower writes nothing outside it
        env = {**flower_env(self.home), **ray_environment(self.address)}
        with open(self.home / "host.log", "w") as err:
            self.proc = watchdog.spawn(
                [sys.executable, "-m", "fedbr_flwr.launch.simulation"],
                env=env,
                cwd=self.home,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
        self.follow_replies()
        return self

    def follow_replies(self) -> None:
        """Read the process's replies into ``self.replies`` in a thread of their own, None at its end."""
        self.replies, self.no_more_runs = queue.Queue(), threading.Event()
        reader = threading.Thread(target=self._read_replies, args=(self.proc, self.replies, self.no_more_runs))
        reader.daemon = True
        reader.start()

    @staticmethod
    def _read_replies(proc: subprocess.Popen, replies: queue.Queue, ended: threading.Event) -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                with contextlib.suppress(ValueError):  # a line that is no reply (a library printing on stdout)
                    reply = RunReply.parse(line)
                    if reply.retired or reply.ok is False:  # the process ends after these (simulation.serve)
                        ended.set()
                    replies.put(reply)
        except UnicodeDecodeError:  # bytes that are no text: nothing more can be read, and the waiter is told
            pass
        finally:  # whoever waits must learn the end, whatever ended the reading
            ended.set()
            replies.put(None)  # the process has ended, or nothing more can be read from it

    def run(self, plan: RunPlan, echo: Echo, watch: RoundWatch | None = None) -> dict:
        """One run in this host: the run's output in its folder's flower.log, its progress followed as
        there; returns once the run's last event is written (the host finishes Flower's part meanwhile)."""
        run, out_dir = plan.settings, plan.out_dir
        for _ in range(2):  # the host may have ended after the run before: then once more, in a new one
            self.start()
            request = RunRequest(
                run_config=str(write_run_config(plan.config, out_dir)),
                run_id=secrets.randbits(62),
                supernodes=plan.supernodes,
                cpus=run.client_cpus,
                gpus=run.client_gpus,
                log=str(out_dir / "flower.log"),
                append=run.resume,
                cwd=str(out_dir),
            )
            started, result = self._run_once(request, out_dir, echo, watch)
            if started:
                return result
            if result.get("retired"):
                print(f"fedbr: {result['retired']}: this run starts in a new one", file=sys.stderr, flush=True)
                self.close()
        assert self.home is not None
        raise RunFailed(f"the simulation process ended before the run started: {log_tail(self.home / 'host.log')}")

    def _how_it_ended(self) -> str:
        """How the process ended, once its replies have: it has exited, or is about to; one that still runs
        after ``EXIT_GRACE_S`` (its output closed, a thread of it hanging) is stopped with all it started."""
        assert self.proc is not None
        try:
            return how_it_ended(self.proc.wait(timeout=EXIT_GRACE_S))
        except subprocess.TimeoutExpired:
            self.close()
            return f"stopped answering, and was stopped {EXIT_GRACE_S:g} s later"

    def _run_once(
        self, request: RunRequest, out_dir: Path, echo: Echo, watch: RoundWatch | None = None
    ) -> tuple[bool, dict]:
        assert self.proc is not None and self.proc.stdin is not None
        run_id, finished, started = request.run_id, threading.Event(), False

        log = LogFollower(out_dir / "flower.log", _print_log_line) if echo == "all" else contextlib.nullcontext()
        with log, Follower(out_dir / PROGRESS_FILE, progress_writer(echo), on_event=run_events(finished, watch)):
            with contextlib.suppress(OSError):  # the host has ended; its end is also in the replies
                self.proc.stdin.write(request.line())
                self.proc.stdin.flush()
            reply: RunReply | None = RunReply(run_id)
            while not finished.is_set():
                if watch is not None and watch.at_deadline():
                    break
                with contextlib.suppress(queue.Empty):
                    reply = self.replies.get(timeout=0.1)
                    if reply is None:
                        break
                    if reply.run_id != run_id:
                        continue  # the run before's answer, given after its last event
                    started = started or reply.started
                    if reply.last:
                        break
        if finished.is_set():
            return True, {"run-id": run_id, "status": "finished:completed"}
        if watch is not None and watch.stop.is_set():
            self.close()  # a run cannot be stopped inside the process: it goes, with all it started
            raise TimeLimitReached(watch.saved_round)
        if not started:
            return False, {"retired": reply.retired} if reply and reply.retired else {}
        log_path = out_dir / "flower.log"
        if reply and reply.ok:
            raise RunFailed(f"run {run_id} ended without its last event; see {log_path}")
        if reply is None:
            raise RunFailed(
                f"run {run_id}: the simulation process {self._how_it_ended()}{last_error(log_path)}; see {log_path}; "
                f"continue from the last checkpoint with `fedbr-run --resume {out_dir}`"
            )
        raise RunFailed(
            f"run {run_id} ended as 'finished:failed': {reply.error or last_error(log_path)}; see {log_path}"
        )


def write_run_config(cfg: Mapping[str, Any], out_dir: Path) -> Path:
    path = out_dir / "run_config.toml"
    path.write_text(to_toml(cfg))
    return path


def submit_run(
    cfg: Mapping[str, Any],
    env: dict[str, str],
    connection: str,
    out_dir: Path,
    echo: Echo = "progress",
    extra_args: list[str] | None = None,
    end_at_summary: bool = False,
    watch: RoundWatch | None = None,
) -> dict:
    """``flwr run`` the app with ``cfg`` on the SuperLink that ``connection`` names in ``env``'s FLWR_HOME;
    wait for it; return the run's final status record from ``flwr ls`` (``end_at_summary``: once the ServerApp
    has written its last event, stop Flower and count the run completed without asking). Raises RunFailed when the run
    did not complete. ``echo``: "progress" (the run's events, followed in ``out_dir/progress.jsonl``, which
    the ServerApp writes: this machine must see the run folder; or a function that takes each of those lines),
    "all" (Flower's whole log, which also reaches a remote submitter) or "none"; the whole log is always in
    ``out_dir/flower.log`` (appended to when the run resumes)."""
    if not (PROJECT_DIR / "pyproject.toml").is_file():
        raise ConfigError(
            f"no pyproject.toml in {PROJECT_DIR}: fedbr-run needs the project checkout "
            "installed with `pip install -e .`"
        )
    with runlock.hold(out_dir):  # this process writes run_config.toml and flower.log
        out_dir.mkdir(parents=True, exist_ok=True)
        run_config = write_run_config(cfg, out_dir)
        flwr = flower_tool(env, "flwr")
        command = [flwr, "run", str(PROJECT_DIR), connection, "--run-config", str(run_config), *(extra_args or [])]
        run_id, _, finished = follow_run(
            command + ["--stream"], env, out_dir, echo, end_at_summary, common(cfg).resume, watch=watch
        )
    log_path = out_dir / "flower.log"
    if run_id is None:
        raise RunFailed(f"`flwr run` did not start a run; see {log_path}")
    if finished:  # the ServerApp wrote its last event: every run file is complete
        return {"run-id": run_id, "status": "finished:completed"}
    status = run_status(run_id, env, connection)
    if status.get("status") != "finished:completed":
        raise RunFailed(f"run {run_id} ended as '{status.get('status')}'{last_error(log_path)}; see {log_path}")
    return status


def follow_run(
    command: list[str],
    env: dict[str, str],
    out_dir: Path,
    echo: Echo,
    end_at_summary: bool,
    append: bool,
    watch: RoundWatch | None = None,
) -> tuple[int | None, int | None, bool]:
    """Run ``command`` (which starts a Flower run) with its output in ``out_dir/flower.log`` (``append``: on
    resume) and, per ``echo``, on the console or as the run's progress events; with ``end_at_summary``, stop it
    once the ServerApp has written its last event. Returns the run id it printed, its exit code, and whether
    that last event came (every run file is then complete). ``watch``: stop it when the time limit's watch says
    so, and raise TimeLimitReached (unless the run had ended)."""
    with open(out_dir / "flower.log", "a" if append else "w") as log:
        proc = watchdog.spawn(
            command,
            env=env,
            cwd=out_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        run_id = None
        finished = threading.Event()
        follow: Any = contextlib.nullcontext()
        write = progress_writer(echo)
        if write or end_at_summary or watch is not None:
            on_event = run_events(finished if end_at_summary else None, watch)
            follow = Follower(out_dir / PROGRESS_FILE, write, on_event=on_event)
        if end_at_summary:
            threading.Thread(target=stop_when_finished, args=(proc, finished), daemon=True).start()
        if watch is not None:
            threading.Thread(target=stop_when_watched, args=(proc, finished, watch), daemon=True).start()
        try:
            with follow:
                assert proc.stdout is not None  # started with stdout=PIPE
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if echo == "all":
                        _print_log_line(line)
                    run_id = run_id if run_id is not None else started_run_id(line)
                proc.wait()
        finally:
            if proc.poll() is None:
                stop_tree(proc)
            watchdog.unwatch(proc.pid)
    if watch is not None and watch.stop.is_set() and not finished.is_set():
        raise TimeLimitReached(watch.saved_round)
    return run_id, proc.returncode, finished.is_set()


def started_run_id(line: str) -> int | None:
    """The run id in the line of Flower's log that says a run started, else None."""
    match = re.search(r"run (\d+)", line)
    return int(match.group(1)) if match and "start" in line.lower() else None


def run_events(finished: threading.Event | None, watch: RoundWatch | None) -> Callable[[dict], None]:
    """A progress-event callback (``Follower``'s ``on_event``) that sets ``finished`` (where given) at the run's
    last event, once every run file is complete, and tells the time limit's ``watch`` (where given)."""

    def on_event(event: dict) -> None:
        if finished is not None and event.get("kind") == SUMMARY_EVENT:
            finished.set()
        if watch is not None:
            watch.on_event(event)

    return on_event


def stop_when_watched(proc: subprocess.Popen, finished: threading.Event, watch: RoundWatch) -> None:
    """Stop the process and all it started once the time limit's ``watch`` says so (after a round's checkpoint
    when the next round would not fit, or at the deadline), unless the run has ended by then."""
    while not watch.wait(0.5):
        if proc.poll() is not None or finished.is_set():
            return
    if not finished.is_set():
        stop_tree(proc)


def stop_when_finished(proc: subprocess.Popen, finished: threading.Event, grace_s: float = 1.0) -> None:
    """Once the ServerApp has written its last event, give Flower ``grace_s`` to end by itself (``flwr run``
    ends once the SuperLink marks the run finished; a SuperLink whose run was cut off takes seconds to stop),
    then stop the process and all it started instead of waiting for Flower's orderly shut-down of the
    simulation (seconds of Ray shutting down; under a SuperLink then ``flwr ls``): every run file is
    complete by then."""
    while not finished.wait(0.5):
        if proc.poll() is not None:  # ended without the event (a failed run): nothing to stop
            return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        stop_tree(proc, grace_s=0.5)


def progress_writer(echo: Echo) -> Callable[[str], None] | None:
    """Where ``echo`` sends a run's progress lines (None: nowhere)."""
    return echo if callable(echo) else print_line if echo == "progress" else None


def _print_log_line(line: str) -> None:
    print_line(ANSI_ESCAPE.sub("", line).rstrip("\n"))


def print_line(text: str) -> None:
    """One line on stdout, written whole (runs of a sweep at once print from their own threads)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def how_it_ended(code: int) -> str:
    """A process's exit status in words: a negative code is the signal that killed it (Popen's convention)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = {"SIGSEGV": " (a crash)", "SIGKILL": " (the out-of-memory killer, or kill -9)"}.get(name, "")
    return f"was killed by {name}{hint}"


ERROR_LINE = r"Error|Exception"
EXIT_LINE = r"ERROR|Error|Exception|Errno|Exit Code"  # also Flower's log level and its exit codes


def last_error(log_path: Path, pattern: str = ERROR_LINE) -> str:
    """The last line of the Flower log that names an error (``pattern``), to show beside 'the run failed' (""
    where there is none, or no log: a process that ended before it opened one)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ""
    lines = [
        ANSI_ESCAPE.sub("", ln).strip() for ln in text.splitlines() if re.search(pattern, ln) and "Traceback" not in ln
    ]
    return f": {lines[-1][:500]}" if lines else ""


def run_status(run_id: int, env: dict[str, str], connection: str = "local") -> dict:
    flwr = flower_tool(env, "flwr")
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
