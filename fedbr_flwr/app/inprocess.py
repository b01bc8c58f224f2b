"""``backend = in-process``: Flower's simulation engine with the clients in the simulation process's own threads
instead of Ray's processes (``fedbr_flwr.app.flower_adapter.choose_backend_per_run`` hands it to Flower per run)."""

from __future__ import annotations

import copy
import os
import threading
from typing import Callable

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import ClientAppException, LoadClientAppError
from flwr.server.superlink.fleet.vce.backend import Backend, BackendConfig

from ..core.errors import describe
from ..runfiles.codec import serialize_ast_parsing

IN_PROCESS = "in_process"  # the backend config's key that asks for it (Flower's keys use "_")

_running: set[int] = set()  # the threads now inside a ClientApp call of this backend
_running_lock = threading.Lock()


def clients_running() -> int:
    """How many ClientApp calls of this process have not returned. Between runs, any is a client the run before
    gave up on (its round timed out): a thread that cannot be stopped, still holding a core."""
    with _running_lock:
        return len(_running)


def worker_threads(backend_config: BackendConfig, cpus: int | None = None) -> int:
    """How many clients run at once: as many as ``client_resources`` fit in this machine's cores, as Ray counts
    its actors."""
    wanted = backend_config.get("client_resources", {}).get("num_cpus", 1)
    wanted = float(wanted) if isinstance(wanted, (int, float)) and wanted > 0 else 1.0
    return max(1, int((cpus or os.cpu_count() or 1) // max(1.0, wanted)))


class InProcessBackend(Backend):
    """Each of Flower's simulation worker threads runs the ClientApp on its message itself, as a Ray actor would
    in a process of its own: no Ray runtime and no client processes start, which took seconds of every run
    (docs/benchmarks.md). The clients' torch ops run on ``client-cpus`` threads, as in an actor
    (``node.build_client``), so the numbers are the Ray backend's, bit for bit. The ClientApp gets a copy of the
    node's context, as Ray ships one to an actor: a client that raises leaves the node's state as it was. What a
    process of its own would still isolate: a crash of the process (a segfault, the out-of-memory killer) ends
    the run, which is then resumed from its last checkpoint, where Ray would lose one actor."""

    def __init__(self, backend_config: BackendConfig) -> None:
        super().__init__(backend_config)
        serialize_ast_parsing()
        self.workers = worker_threads(backend_config)
        self.app_fn: Callable[[], ClientApp] | None = None

    def build(self, app_fn: Callable[[], ClientApp]) -> None:
        self.app_fn = app_fn

    @property
    def num_workers(self) -> int:
        return self.workers

    def is_worker_idle(self) -> bool:
        return True

    def terminate(self) -> None:
        pass

    def process_message(self, message: Message, context: Context) -> tuple[Message, Context]:
        if self.app_fn is None:
            raise ValueError("build() the backend before it processes messages")
        own = copy.deepcopy(context)
        with _running_lock:
            _running.add(threading.get_ident())
        try:
            reply = self.app_fn()(message=message, context=own)
        except LoadClientAppError:
            raise
        except Exception as exc:  # as an actor reports it: Flower's engine makes it the node's error reply
            raise ClientAppException(describe(exc)) from exc
        finally:
            with _running_lock:
                _running.discard(threading.get_ident())
        return reply, own
