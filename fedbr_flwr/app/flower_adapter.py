"""The one place that reaches into Flower's internals: its private simulation entry point, the classes and
module-level functions of its simulation engine that this package patches, and the in-memory grid's wait. Each
is checked on the Flower versions in ``CHECKED_ON`` (tests/test_flower_adapter.py fails on any other, so that an
upgrade is a deliberate re-check of what follows, not a surprise in a run)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

CHECKED_ON = ("1.41.0",)  # the flwr versions whose internals this module was written and tested against

# the frames (as py-spy names them) of the engine's threads, which ``fedbr-bench --round-profile`` sorts by
ENGINE_FRAMES: dict[str, Any] = {
    "worker": "worker (flwr/server/superlink/fleet/vce/vce_api.py",  # a thread that runs the clients' messages
    "replies": "send_and_receive (",  # a client proxy waiting for its reply
    "hand-over": ("add_messages_to_queue (", "put_message_into_state ("),  # the engine's two hand-over threads
}


def run_flower_simulation(
    run_id: int,
    run_config: dict[str, Any],
    project_dir: Path,
    supernodes: int,
    client_resources: dict[str, Any],
    in_process: bool,
    server_app_attr: str,
    client_app_attr: str,
) -> None:
    """One run through Flower's simulation entry point, as ``flwr-simulation`` starts it, with the clients on
    Ray or in this process (``in_process``: ``choose_backend_per_run``). Flower's public ``run_simulation``
    cannot take a run config; its private ``_run_simulation`` can."""
    from flwr.app import Context, RecordDict
    from flwr.common.config import get_fused_config_from_dir
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.run import Run
    from flwr.supercore.telemetry import EventType

    from .inprocess import IN_PROCESS

    choose_backend_per_run()
    run = Run.create_empty(run_id=run_id)
    run.override_config = run_config
    run.primary_task_id = run_id
    run.federation_id = NOOP_FEDERATION_ID
    fused = get_fused_config_from_dir(project_dir, run.override_config)
    context = Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=fused)
    _run_simulation(
        num_supernodes=supernodes,
        exit_event=EventType.FLWR_SIMULATION_RUN_LEAVE,
        server_app_attr=server_app_attr,
        client_app_attr=client_app_attr,
        backend_name="ray",
        backend_config={"client_resources": client_resources, "init_args": {}, IN_PROCESS: {"on": in_process}},
        app_dir=str(project_dir),
        run=run,
        server_app_context=context,
        is_app=True,
    )


def chooses_backend_per_run() -> bool:
    """Whether this process's Flower engine can run the clients in process (``choose_backend_per_run`` was
    installed): fedbr-run's simulation process, not Flower's own under ``flwr run`` or a deployment."""
    import sys

    backends = sys.modules.get("flwr.server.superlink.fleet.vce.backend.raybackend")
    return bool(getattr(getattr(backends, "RayBackend", None), "chooses_per_run", False))


def choose_backend_per_run() -> None:
    """Flower's simulation engine builds each run's backend as ``raybackend.RayBackend(backend_config)``: make
    that give an ``InProcessBackend`` where the run's backend config asks for one (``IN_PROCESS``), else the Ray
    backend it is (with ``keep_actors_between_runs``: the one that keeps its actors)."""
    from flwr.server.superlink.fleet.vce.backend import raybackend

    from .inprocess import IN_PROCESS, InProcessBackend

    if chooses_backend_per_run():
        return

    class PerRun(raybackend.RayBackend):  # type: ignore[misc,valid-type]
        chooses_per_run = True

        def __new__(cls, backend_config: dict[str, Any]) -> Any:
            if backend_config.get(IN_PROCESS, {}).get("on"):
                return InProcessBackend(backend_config)
            return super().__new__(cls)

    raybackend.RayBackend = PerRun  # type: ignore[misc]


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
    process's exit ends both. The actors' client cache keys clients by run (``fedbr_flwr.app.node.ClientCache``),
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
