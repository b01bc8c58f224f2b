"""``python -m fedbr_flwr.launch.simulation``: the app's Flower simulation in one process, which runs the runs
asked for on its stdin one after another (``serve``; ``launcher.RunHost`` asks). It is what ``flwr run`` starts
under a SuperLink (``flwr-simulation``): Flower's own simulation entry point with the same ServerApp, ClientApp,
run config and Ray backend, but without the SuperLink, the app bundle and the processes between them, which cost
seconds per run (docs/benchmarks.md). With ``backend = in-process`` the clients run in this process's threads
instead of Ray's processes (``InProcessBackend``).

Flower's public ``run_simulation`` cannot take a run config; its private entry point, which ``flwr-simulation``
itself calls, can (``fedbr_flwr.app.flower_adapter``, with the engine's patches). flwr is pinned (pyproject.toml) and
the end-to-end tests run this path."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

from ..app.flower_adapter import (
    dispatch_messages_promptly,
    keep_actors_between_runs,
    replace_dead_actors,
    run_flower_simulation,
)
from ..core.config import CommonSettings
from ..core.errors import describe
from ..runfiles.tracking import stop_open_trackers
from .protocol import RunReply, RunRequest

SERVER_APP = "fedbr_flwr.app.server_app:app"
CLIENT_APP = "fedbr_flwr.app.client_app:app"
# the run has started (fedbr-bench --startup times the process's start by this line; a sweep's runs name one process)
STARTED = "fedbr simulation: run {} started in process {}"


def ray_init_args(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, Any]:
    """``ray.init`` arguments: those Flower's Ray backend would use (its defaults), at the address the launcher
    set (``fedbr_flwr.app.raycluster``). The workers need this interpreter's module path. A cluster's nodes get it
    as the job's runtime environment, as Flower gives it. A private runtime's workers inherit it from this
    process's environment (``start_ray`` sets it), because with a job runtime environment Ray leaves the
    worker processes it starts with the driver idle and starts the actors in new ones (1 CPU-s wasted)."""
    from ..app.raycluster import PRIVATE

    address = environ.get("RAY_ADDRESS") or PRIVATE
    args: dict[str, Any] = {
        "address": address,
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": True,
    }
    if address != PRIVATE:
        args["runtime_env"] = {"env_vars": {"PYTHONPATH": module_path()}}
    return args


def module_path() -> str:
    return os.pathsep.join(sys.path)


def start_ray() -> None:
    """Start (or join) Ray while another thread imports the ServerApp: on two cores this overlaps the
    seconds Ray's own processes take to come up with the driver's imports. Flower's backend then finds Ray
    initialised and uses it (ray.init wants the main thread)."""
    import ray

    loader = threading.Thread(target=import_server_side)
    loader.start()
    if not ray.is_initialized():
        os.environ["PYTHONPATH"] = module_path()  # as Flower sets it; a private runtime's workers inherit it
        ray.init(**ray_init_args())
    loader.join()


def import_server_side() -> None:
    import flwr.simulation.run_simulation  # noqa: F401

    from ..app import server_app  # noqa: F401


def import_both_sides() -> None:
    """What a run imports, server and client side: ahead, while the command checks the run's configuration."""
    import_server_side()
    from ..app import client_app, node  # noqa: F401
    from ..core.registry import load_all

    load_all()


def run_config_from(path: Path) -> dict[str, Any]:
    """The overrides of a ``--run-config`` file, read as ``flwr run`` reads them."""
    from flwr.common.config import parse_config_args

    return parse_config_args([str(path)])


def run_config_of(request: RunRequest) -> dict[str, Any] | None:
    """The requested run's config, read once for both the choice of Ray and the run; None where it cannot be
    read (the run then reads it again, inside its error handling, and fails saying why)."""
    try:
        return run_config_from(Path(request.run_config))
    except Exception:  # noqa: BLE001 - reported by the run
        return None


def in_process(run_config: dict[str, Any]) -> bool:
    """Whether the run's clients run in this process (``backend = in-process``; fedbr-run resolves ``auto``)."""
    return CommonSettings.from_config(run_config, stored=True).backend == "in-process"


def simulate(
    run_config: dict[str, Any], run_id: int, supernodes: int, cpus: float, gpus: float, clients_here: bool
) -> None:
    """Run the app once through Flower's simulation entry point, as ``flwr-simulation`` does: on Ray, or with the
    clients in this process (``clients_here``: the run config's ``backend``, read once by ``serve``)."""
    dispatch_messages_promptly()
    if clients_here:
        import_both_sides()
    else:
        start_ray()
    from .launcher import PROJECT_DIR

    resources = {"num_cpus": cpus, "num_gpus": gpus}
    run_flower_simulation(run_id, run_config, PROJECT_DIR, supernodes, resources, clients_here, SERVER_APP, CLIENT_APP)


def output_to(log: Path, append: bool) -> None:
    """From now on this process's stdout and stderr (Flower's log, Ray's forwarded worker output, a traceback)
    go to ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def serve(requests: IO[str], replies: IO[str]) -> int:
    """Run the runs asked for on ``requests`` (a ``RunRequest`` a line), one after another in this process, on
    one Ray runtime and one set of client processes (``keep_actors_between_runs``), or with the clients in this
    process (``backend``: in-process); each run's output goes to its ``log``. Answers (a ``RunReply`` a line)
    ``started`` when a run starts and ``ok``, ``error`` when Flower's part of it has ended. A run starts once
    the run before has ended or written its last event, so that it starts while Flower ends the old one (whose
    threads poll for up to a second). After a run that failed, the process ends (exit 1) instead of starting
    another: what a failure leaves behind (in Ray, the actors, threads) is not trusted with the next run. So
    does a process still running a client of the run before (``leftover_clients``): it answers the next
    request ``retired`` (why) and ends."""
    replace_dead_actors()
    keep_actors_between_runs()  # before each run chooses its backend (flower_adapter.choose_backend_per_run)
    # as the process starts (fedbr-run starts it before checking the run's configuration): Ray where a run will
    # likely use it, else only the imports
    if ray_likely():
        start_ray()
    else:
        threading.Thread(target=import_both_sides, daemon=True).start()
    failed = threading.Event()
    runs: list[tuple[threading.Thread, Path]] = []
    for line in lines_until(requests, failed):
        if runs:
            wait_for_last_event(*runs[-1])
        if failed.is_set():
            break
        request = RunRequest.parse(line)
        leftover = leftover_clients()
        if leftover:
            answer(replies, RunReply(request.run_id, retired=leftover))
            break
        run_config = run_config_of(request)
        clients_here = run_config is not None and in_process(run_config)
        if not clients_here:
            start_ray()  # in the main thread: the processes Ray starts end with the thread that started them
        run = threading.Thread(target=run_requested, args=(request, run_config, clients_here, replies, failed))
        runs.append((run, Path(request.cwd)))
        runs[-1][0].start()
    for run, _ in runs:
        run.join()
    return 1 if failed.is_set() else 0


def leftover_clients() -> str:
    """Why this process must not take another run: a client thread of the run before that never returned (a
    round timeout gave up on it; a thread cannot be killed, and it would slow every later run). "" if none."""
    from ..app.inprocess import clients_running

    count = clients_running()
    if not count:
        return ""
    return f"the simulation process still runs {count} client(s) the run before gave up on (never returned)"


def ray_likely(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether a run of this host will likely use Ray (``backend = auto`` picks it on a cluster or a GPU), told
    without importing torch: a wrong guess costs seconds, not correctness."""
    from ..app.raycluster import PRIVATE

    if environ.get("RAY_ADDRESS", PRIVATE) != PRIVATE:
        return True
    if environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def lines_until(stream: IO[str], stop: threading.Event) -> Iterator[str]:
    """The lines of ``stream`` until it ends or ``stop`` is set, whichever comes first."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    while not stop.is_set():
        with contextlib.suppress(queue.Empty):
            line = lines.get(timeout=0.1)
            if line is None:
                return
            yield line


def wait_for_last_event(run: threading.Thread, out_dir: Path) -> None:
    """Until ``run`` has ended or written its last event (then only Flower's end of it goes on)."""
    from ..runfiles.progress import PROGRESS_FILE, SUMMARY_EVENT, read_events

    offset = 0
    while run.is_alive():
        events, offset = read_events(out_dir / PROGRESS_FILE, offset)
        if any(e.get("kind") == SUMMARY_EVENT for e in events):
            return
        run.join(0.05)


def run_requested(
    request: RunRequest,
    run_config: dict[str, Any] | None,
    clients_here: bool,
    replies: IO[str],
    failed: threading.Event,
) -> None:
    """One run of ``serve``."""
    answer(replies, RunReply(request.run_id, started=True))
    output_to(Path(request.log), request.append)
    error = ""
    try:
        os.chdir(request.cwd)
        print(STARTED.format(request.run_id, os.getpid()), flush=True)
        simulate(
            run_config if run_config is not None else run_config_from(Path(request.run_config)),
            request.run_id,
            request.supernodes,
            float(request.cpus),
            float(request.gpus),
            clients_here,
        )
    except BaseException as exc:  # noqa: BLE001 - also Flower's sys.exit: say so, then end
        traceback.print_exc()
        sys.stderr.flush()
        error = describe(exc)
        failed.set()
    answer(replies, RunReply(request.run_id, ok=not error, error=error))


_answering = threading.Lock()


def answer(replies: IO[str], reply: RunReply) -> None:
    with _answering:
        replies.write(reply.line())
        replies.flush()


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv):
        print(f"usage: {(__doc__ or '').split(':', 1)[0].strip('`')}", file=sys.stderr)
        return 2
    replies = os.fdopen(os.dup(1), "w")  # stdout itself goes to each run's log
    os.dup2(2, 1)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    return serve(sys.stdin, replies)


def stop_on_sigterm(*_: Any) -> None:
    """The launcher stops this process (``launcher.RunHost.close``: a time limit, Ctrl-C, SIGTERM, or the end of
    its runs): the trackers of a run in progress end first, so W&B keeps the rounds that ended."""
    stop_open_trackers()
    os._exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
