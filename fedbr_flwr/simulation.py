"""``python -m fedbr_flwr.simulation RUN_CONFIG RUN_ID NUM_SUPERNODES CPUS GPUS``: the app's Flower simulation in one
process (``--serve``: one run after another, each asked for on stdin: ``serve``). It is what ``flwr run`` starts
under a SuperLink (``flwr-simulation``): Flower's own simulation entry point with the same ServerApp, ClientApp, run
config and Ray backend, but without the SuperLink, the app bundle and the processes between them, which cost seconds
per run (docs/benchmarks.md). With ``backend = in-process`` the clients run in this process's threads instead of Ray's
processes (``InProcessBackend``).

Flower's public ``run_simulation`` cannot take a run config; its private ``_run_simulation``, which
``flwr-simulation`` itself calls, can. flwr is pinned (pyproject.toml) and the end-to-end tests run this path."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any, Iterator, Sequence

from .errors import describe

SERVER_APP = "fedbr_flwr.server_app:app"
CLIENT_APP = "fedbr_flwr.client_app:app"
# the run has started (fedbr-bench --startup times the process's start by this line; a sweep's runs name one process)
STARTED = "fedbr simulation: run {} started in process {}"


def ray_init_args(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, Any]:
    """``ray.init`` arguments: those Flower's Ray backend would use (its defaults), at the address the launcher
    set (``fedbr_flwr.raycluster``). The workers need this interpreter's module path. A cluster's nodes get it
    as the job's runtime environment, as Flower gives it. A private runtime's workers inherit it from this
    process's environment (``start_ray`` sets it), because with a job runtime environment Ray leaves the
    worker processes it starts with the driver idle and starts the actors in new ones (1 CPU-s wasted)."""
    from .raycluster import PRIVATE

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

    from . import server_app  # noqa: F401


def import_both_sides() -> None:
    """What a run imports, server and client side: ahead, while the command checks the run's configuration."""
    import_server_side()
    from . import client_app, node  # noqa: F401
    from .registry import load_all

    load_all()


def choose_backend_per_run() -> None:
    """Flower's simulation engine builds each run's backend as ``raybackend.RayBackend(backend_config)``: make
    that give an ``InProcessBackend`` where the run's backend config asks for one (``IN_PROCESS``), else the Ray
    backend it is (with ``keep_actors_between_runs``: the one that keeps its actors)."""
    from flwr.server.superlink.fleet.vce.backend import raybackend

    from .inprocess import IN_PROCESS, InProcessBackend

    if getattr(raybackend.RayBackend, "chooses_per_run", False):
        return

    class PerRun(raybackend.RayBackend):  # type: ignore[misc,valid-type]
        chooses_per_run = True

        def __new__(cls, backend_config: dict[str, Any]) -> Any:
            if backend_config.get(IN_PROCESS, {}).get("on"):
                return InProcessBackend(backend_config)
            return super().__new__(cls)

    raybackend.RayBackend = PerRun  # type: ignore[misc]


def run_config_from(path: Path) -> dict[str, Any]:
    """The overrides of a ``--run-config`` file, read as ``flwr run`` reads them."""
    from flwr.common.config import parse_config_args

    return parse_config_args([str(path)])


def in_process(run_config: dict[str, Any]) -> bool:
    """Whether the run's clients run in this process (``backend = in-process``; fedbr-run resolves ``auto``)."""
    return run_config.get("backend") == "in-process"


def simulate(run_config: dict[str, Any], run_id: int, supernodes: int, cpus: float, gpus: float) -> None:
    """Run the app once through Flower's simulation entry point, as ``flwr-simulation`` does: on Ray, or with the
    clients in this process (``in_process``)."""
    choose_backend_per_run()
    dispatch_messages_promptly()
    clients_here = in_process(run_config)
    if clients_here:
        import_both_sides()
    else:
        start_ray()
    from flwr.app import Context, RecordDict
    from flwr.common.config import get_fused_config_from_dir
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.run import Run
    from flwr.supercore.telemetry import EventType

    from .inprocess import IN_PROCESS
    from .launcher import PROJECT_DIR

    run = Run.create_empty(run_id=run_id)
    run.override_config = run_config
    run.primary_task_id = run_id
    run.federation_id = NOOP_FEDERATION_ID
    fused = get_fused_config_from_dir(PROJECT_DIR, run.override_config)
    context = Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=fused)
    _run_simulation(
        num_supernodes=supernodes,
        exit_event=EventType.FLWR_SIMULATION_RUN_LEAVE,
        server_app_attr=SERVER_APP,
        client_app_attr=CLIENT_APP,
        backend_name="ray",
        backend_config={
            "client_resources": {"num_cpus": cpus, "num_gpus": gpus},
            "init_args": {},
            IN_PROCESS: {"on": clients_here},
        },
        app_dir=str(PROJECT_DIR),
        run=run,
        server_app_context=context,
        is_app=True,
    )


FLOWER_POLL_S = 0.1  # how often Flower's simulation engine looks for new messages; now also a wait's upper bound


class StoreSignal:
    """Wakes whoever waits on a LinkState method storing a message (``store_message_ins``: instructions for the
    clients; ``store_message_res``: their replies). Flower's simulation looks for both by polling: the engine every
    0.1 s for instructions, the ServerApp's in-memory grid every ``pull_interval`` for replies, which added about
    0.06 s to every round (docs/benchmarks.md). Installed once per state object, over its bound method."""

    def __init__(self, state: Any, method: str) -> None:
        self.changed = threading.Condition()
        self.count = 0
        store = getattr(state, method)

        def store_and_wake(message: Any) -> Any:
            stored = store(message)
            with self.changed:
                self.count += 1
                self.changed.notify_all()
            return stored

        setattr(state, method, store_and_wake)

    @classmethod
    def on(cls, state: Any, method: str) -> StoreSignal:
        signals = state.__dict__.setdefault("fedbr_store_signals", {})
        with _signal_lock:
            if method not in signals:
                signals[method] = cls(state, method)
            return signals[method]

    def seen(self) -> int:
        with self.changed:
            return self.count

    def wait_after(self, seen: int, timeout_s: float) -> None:
        """Return once a message was stored after ``seen`` (a ``seen()`` value), or after ``timeout_s``."""
        with self.changed:
            self.changed.wait_for(lambda: self.count != seen, timeout=timeout_s)


_signal_lock = threading.Lock()


def dispatch_messages_promptly() -> None:
    """Flower's simulation engine hands the clients their messages from a thread that looks into the LinkState
    every 0.1 s; here it looks again as soon as the ServerApp stores one (and at least every 0.1 s, so that it
    still sees its stop event), in the same order: one message per node per look. Patched over Flower's
    module-level function, which the engine looks up when it starts a run."""
    from flwr.server.superlink.fleet.vce import vce_api

    if getattr(vce_api.add_messages_to_queue, "prompt", False):
        return

    def add_messages_to_queue(state: Any, queue: Any, nodes_mapping: Any, f_stop: threading.Event) -> None:
        arrived = StoreSignal.on(state, "store_message_ins")
        while not f_stop.is_set():
            seen = arrived.seen()
            for node_id in nodes_mapping.keys():
                for message in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(message)
            arrived.wait_after(seen, FLOWER_POLL_S)

    add_messages_to_queue.prompt = True  # type: ignore[attr-defined]
    vce_api.add_messages_to_queue = add_messages_to_queue


def receive_replies_promptly(grid: Any) -> None:
    """The in-memory grid's ``send_and_receive`` (what Flower's compatibility loop calls once per client and
    message) pulls the replies every ``pull_interval``; here it pulls again as soon as a reply is stored. A grid
    without a LinkState of its own (a deployment's, over gRPC) is left as it is."""
    state = getattr(grid, "state", None)
    if state is None or not hasattr(state, "store_message_res"):
        return
    replied = StoreSignal.on(state, "store_message_res")

    def send_and_receive(messages: Any, *, timeout: float | None = None) -> list[Any]:
        waiting = set(grid.push_messages(messages))
        end = None if timeout is None else time.monotonic() + timeout
        replies: list[Any] = []
        while True:
            seen = replied.seen()
            pulled = list(grid.pull_messages(waiting))
            replies.extend(pulled)
            waiting.difference_update(m.metadata.reply_to_message_id for m in pulled)
            left = FLOWER_POLL_S if end is None else min(FLOWER_POLL_S, end - time.monotonic())
            if not waiting or left <= 0:
                return replies
            replied.wait_after(seen, left)

    grid.send_and_receive = send_and_receive


def replace_dead_actors() -> None:
    """Flower's Ray backend puts an actor back into its pool after the message it ran failed, also when the
    actor's process died (a client's segfault or ``os._exit``): every later message it draws goes to the dead
    actor and fails, an honest client's too. Here each pool a backend builds hands back only live actors
    (``hand_back_live_actors``), so that only the crashed client's message is lost. Patched over Flower's
    class, which its simulation looks up per run (as ``keep_actors_between_runs``, which builds on it)."""
    from flwr.server.superlink.fleet.vce.backend import raybackend

    class DeadActorsReplaced(raybackend.RayBackend):
        def build(self, app_fn) -> None:  # type: ignore[no-untyped-def]
            super().build(app_fn)
            if self.pool is not None:
                hand_back_live_actors(self.pool)

    raybackend.RayBackend = DeadActorsReplaced  # type: ignore[misc]


def hand_back_live_actors(pool: Any) -> None:
    """Make a Flower actor pool replace the dead actors (``renew_dead_actors``) when a message failed because its
    actor died, before any other message can draw one. Flower's backend hands the failed message's actor back
    and only then raises, and the engine's other threads draw from the top of the pool, where it lies: with fast
    rounds an honest client's message drew the dead actor in between, and two threads renewing at once lost
    track of the pool. Drawing, handing back and renewing now take turns on one lock."""
    import ray

    if getattr(pool, "hands_back_live_actors", False):
        return
    turns = threading.Lock()
    failed = threading.local()  # the future whose actor died, in the thread that fetched it
    submit, fetch, hand_back = pool.submit, pool.fetch_result_and_return_actor_to_pool, pool.add_actor_back_to_pool

    def draw(actor_fn: Any, job: Any) -> Any:
        with turns:
            return submit(actor_fn, job)

    def fetch_noting_death(future: Any) -> Any:
        try:
            return fetch(future)
        except ray.exceptions.RayActorError:
            failed.future = future
            raise

    def hand_back_renewed(future: Any) -> None:
        with turns:
            hand_back(future)
            if getattr(failed, "future", None) is future:
                failed.future = None
                renew_dead_actors(pool)

    pool.submit, pool.fetch_result_and_return_actor_to_pool = draw, fetch_noting_death
    pool.add_actor_back_to_pool, pool.hands_back_live_actors = hand_back_renewed, True


def renew_dead_actors(pool: Any, timeout_s: float = 10.0, start_s: float = 60.0) -> int:
    """Replace each idle actor of a Flower actor pool that does not answer by a new one that starts within
    ``start_s``; where none can start (the dead actor's node is gone, and its resources with it), by a live actor
    of the pool, which then takes two places in it (Ray queues an actor's tasks), so that the other actors serve
    its clients: Flower's engine runs as many messages at once as the pool had actors, so its size must stay.
    A dead actor with no live one to stand in stays (its messages fail rather than wait). How many were dead."""
    import ray

    live: list[Any] = []
    dead: list[Any] = []
    for actor in list(pool.pool):
        (live if answers(actor, timeout_s) else dead).append(actor)
    for actor in dead:
        new = pool.create_actor_fn()
        if not answers(new, start_s):
            ray.kill(new)
            new = live[0] if live else actor
        pool.pool[pool.pool.index(actor)] = new
    return len(dead)


def answers(actor: Any, timeout_s: float) -> bool:
    """Whether a Ray actor is up and answers within ``timeout_s``."""
    import ray

    try:
        ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - dead, not scheduled (no node has its resources), or its node lost
        return False
    return True


def keep_actors_between_runs() -> None:
    """Flower's Ray backend ends every run by terminating its actors (the client processes) and shutting Ray
    down, so every run would start Ray and client processes, which import torch, again. In a process that
    runs one run after another (``serve``), the backend's ``build`` reuses the previous run's actors when
    they ask for the same resources and all answer, and its ``terminate`` leaves them and Ray up: the
    process's exit ends both. The actors' client cache keys clients by run (``fedbr_flwr.node.ClientCache``),
    so a run never sees another's clients."""
    from flwr.server.superlink.fleet.vce.backend import raybackend

    class ActorsKept(raybackend.RayBackend):
        kept: Any = None  # the BasicActorPool of the run before

        def build(self, app_fn) -> None:
            kept = ActorsKept.kept
            if kept is not None and kept.client_resources == self.client_resources and all_idle_and_alive(kept):
                self.pool, self.app_fn = kept, app_fn
                return
            if kept is not None:
                kept.terminate_all_actors()
            super().build(app_fn)
            ActorsKept.kept = self.pool

        def terminate(self) -> None:
            pass

    raybackend.RayBackend = ActorsKept  # type: ignore[misc]  # Flower's simulation looks it up per run


def all_idle_and_alive(pool: Any, timeout_s: float = 10.0) -> bool:
    """Whether every actor of a Flower actor pool is back in it and answers."""
    import ray

    if len(pool.pool) != pool.num_actors or not pool.pool:
        return False
    try:
        ray.get([actor.__ray_ready__.remote() for actor in pool.pool], timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a dead actor, a lost node, a timeout: build new ones
        return False
    return True


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
    """Run the runs asked for on ``requests``, one JSON object per line (``run-config``, ``run-id``,
    ``supernodes``, ``cpus``, ``gpus``, ``log``, ``append``, ``cwd``, ``backend``), one after another in this
    process, on one Ray runtime and one set of client processes (``keep_actors_between_runs``), or with the clients
    in this process (``backend``: in-process); each run's output goes to
    its ``log``. Answers ``{"run-id", "started": true}`` when a run starts and ``{"run-id", "ok", "error"}``
    when Flower's part of it has ended. A run starts once the run before has ended or written its last event,
    so that it starts while Flower ends the old one (whose threads poll for up to a second). After a run
    that failed, the process ends (exit 1) instead of starting another: what a failure leaves behind (in Ray,
    the actors, threads) is not trusted with the next run. So does a process still running a client of the run
    before (``leftover_clients``): it answers the next request ``{"run-id", "retired": why}`` and ends."""
    replace_dead_actors()
    keep_actors_between_runs()  # before each run's simulate() chooses its backend (choose_backend_per_run)
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
        request = json.loads(line)
        leftover = leftover_clients()
        if leftover:
            answer(replies, {"run-id": request["run-id"], "retired": leftover})
            break
        if request.get("backend", "ray") == "ray":
            start_ray()  # in the main thread: the processes Ray starts end with the thread that started them
        runs.append((threading.Thread(target=run_requested, args=(request, replies, failed)), Path(request["cwd"])))
        runs[-1][0].start()
    for run, _ in runs:
        run.join()
    return 1 if failed.is_set() else 0


def leftover_clients() -> str:
    """Why this process must not take another run: a client thread of the run before that never returned (a
    round timeout gave up on it; a thread cannot be killed, and it would slow every later run). "" if none."""
    from .inprocess import clients_running

    count = clients_running()
    if not count:
        return ""
    return f"the simulation process still runs {count} client(s) the run before gave up on (never returned)"


def ray_likely(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether a run of this host will likely use Ray (``backend = auto`` picks it on a cluster or a GPU), told
    without importing torch: a wrong guess costs seconds, not correctness."""
    from .raycluster import PRIVATE

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
    from .progress import PROGRESS_FILE, SUMMARY_EVENT, read_events

    offset = 0
    while run.is_alive():
        events, offset = read_events(out_dir / PROGRESS_FILE, offset)
        if any(e.get("kind") == SUMMARY_EVENT for e in events):
            return
        run.join(0.05)


def run_requested(request: dict[str, Any], replies: IO[str], failed: threading.Event) -> None:
    """One run of ``serve``."""
    answer(replies, {"run-id": request["run-id"], "started": True})
    output_to(Path(request["log"]), bool(request["append"]))
    error = ""
    try:
        os.chdir(request["cwd"])
        print(STARTED.format(request["run-id"], os.getpid()), flush=True)
        simulate(
            run_config_from(Path(request["run-config"])),
            int(request["run-id"]),
            int(request["supernodes"]),
            float(request["cpus"]),
            float(request["gpus"]),
        )
    except BaseException as exc:  # noqa: BLE001 - also Flower's sys.exit: say so, then end
        traceback.print_exc()
        sys.stderr.flush()
        error = describe(exc)
        failed.set()
    answer(replies, {"run-id": request["run-id"], "ok": not error, "error": error})


_answering = threading.Lock()


def answer(replies: IO[str], reply: dict[str, Any]) -> None:
    with _answering:
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--serve"]:
        replies = os.fdopen(os.dup(1), "w")  # stdout itself goes to each run's log
        os.dup2(2, 1)
        return serve(sys.stdin, replies)
    if len(args) != 5:
        print(f"usage: {(__doc__ or '').split(':', 1)[0].strip('`')}", file=sys.stderr)
        return 2
    path, run_id, supernodes, cpus, gpus = args
    replace_dead_actors()
    print(STARTED.format(run_id, os.getpid()), flush=True)
    simulate(run_config_from(Path(path)), int(run_id), int(supernodes), float(cpus), float(gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
