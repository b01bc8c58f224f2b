"""The bare loop: what a federated round costs with no framework. Every client's ``fit`` (the same local-step code
Flower calls) one after another in this process, then the same aggregation; no messages, no processes. What each
client is sent and how the replies are aggregated come from the run's own strategy (``BareServer``). The
benchmarks measure Flower's runs against it (``command``, ``startup``)."""

from __future__ import annotations

import tempfile
import time
from typing import Any, Callable

import torch
from flwr.common import Code, GetParametersIns, GetParametersRes, Status
from flwr.server.client_proxy import ClientProxy

from ..app import payload
from ..app.server_app import build_strategy
from ..app.strategy import aggregate_accepted
from ..core.algorithm import client_class
from ..core.config import common
from ..core.training import peak_memory_mb, use_device
from ..data.dataset import load_client_data, partition_class_counts, partition_sizes
from ..server.updates import ClientUpdate

Named = payload.Named


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class InProcessNode(ClientProxy):
    """A client in this process as the strategy's federation reaches it: its named requests (FedBR's RSM means,
    FedMix's mean data) go to the client's ``answer``, as a node's ``get_parameters`` sends them. The bench calls
    the client's ``fit`` itself, so nothing else is delivered."""

    def __init__(self, pid: int, client: Any):
        super().__init__(f"bench-client-{pid}")
        self.client = client

    def get_parameters(self, ins: GetParametersIns, timeout: float | None, group_id: int | None) -> GetParametersRes:
        return GetParametersRes(Status(Code.OK, ""), payload.to_parameters(self.client.answer(ins.config)))

    def get_properties(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
        raise NotImplementedError(NOT_DELIVERED)

    def fit(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
        raise NotImplementedError(NOT_DELIVERED)

    def evaluate(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
        raise NotImplementedError(NOT_DELIVERED)

    def reconnect(self, ins: Any, timeout: float | None, group_id: int | None) -> Any:
        raise NotImplementedError(NOT_DELIVERED)


NOT_DELIVERED = "the bench calls its in-process clients itself; only named requests go through the strategy"


class BareServer:
    """The run's strategy (``strategies/``) serving clients in this process, without Flower: what its
    ``configure_fit`` sends each client (the global arrays; the arrays for every sampled client, SCAFFOLD's c and
    FedCM's direction; the client's own, DisTrans' offset; the fit config with the broadcast data of FedBR,
    FedMix and VHL and FedDyn's alpha_k) built by its own hooks, and the replies aggregated by its own
    ``aggregate``. The bench's hand-built round messages lacked what some algorithms need, so it could not run
    them."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        # its run files (FedBR's pseudo_data.npz, DisTrans' offsets.npz) go here, removed with it
        self.folder = tempfile.TemporaryDirectory(prefix="fedbr-bench-")
        self.strategy = build_strategy({**cfg, "output-dir": self.folder.name, "global-test": False})
        self.pids: list[int] = []
        self.round = 0  # the round whose before_round ran last

    def initial_arrays(self) -> Named:
        """The server's seeded initial weights."""
        return self.strategy.initial_arrays()

    def connect(self, clients: list | dict) -> None:
        """Discovery, for clients in this process (``clients``: each client's ``ClientAlgorithm``, or anything
        with its ``answer``, by partition id; a list: ids 0, 1, ...): the strategy reaches them by partition id,
        and takes every client's sizes and the connected ones' class histograms from its own partition, as a
        server that holds the dataset does; then its ``after_discovery``."""
        by_pid = dict(enumerate(clients)) if isinstance(clients, list) else dict(clients)
        federation = self.strategy.federation
        federation.clients_by_pid = {pid: InProcessNode(pid, client) for pid, client in sorted(by_pid.items())}
        federation.sizes = partition_sizes(self.cfg)
        counts = partition_class_counts(self.cfg)
        federation.class_counts = {pid: counts[pid] for pid in by_pid}
        self.pids = sorted(by_pid)
        self.strategy.after_discovery()

    def start_round(self, server_round: int, global_arrays: Named | None = None) -> None:
        """The strategy's start of a round, as ``configure_fit`` begins it: every connected client sampled."""
        if server_round == self.round:
            return
        strategy = self.strategy
        strategy.sent = global_arrays if global_arrays is not None else strategy.latest or self.initial_arrays()
        strategy.before_round(server_round)
        strategy.sampled = list(self.pids)
        self.round = server_round

    def fit_config(self, server_round: int, pid: int) -> dict:
        """The fit config the strategy sends client ``pid`` in round ``server_round``."""
        self.start_round(server_round)
        return self.strategy.fit_config(server_round, pid)

    def messages(self, server_round: int, global_arrays: Named) -> dict[int, tuple[Named, dict]]:
        """The arrays and the fit config the strategy sends each connected client in round ``server_round``, the
        global arrays being ``global_arrays``."""
        self.start_round(server_round, global_arrays)
        strategy = self.strategy
        to_all = {**global_arrays, **strategy.round_arrays(server_round, global_arrays)}
        return {
            pid: ({**to_all, **strategy.client_arrays(pid)}, strategy.fit_config(server_round, pid))
            for pid in self.pids
        }

    def answered(self, metrics: dict[int, dict]) -> None:
        """The round's fit answers' metrics by partition id (what the clients confirm holding: broadcast data)."""
        self.strategy.after_answers(metrics)

    def held(self) -> dict[int, dict]:
        """The metrics by which every connected client confirms the current broadcast data, as its fit answer
        does (none where the strategy broadcasts nothing)."""
        shared = self.strategy.shared
        return {pid: {f"{shared.name}-version": shared.version} if shared else {} for pid in self.pids}

    def aggregate(self, server_round: int, replies: dict[int, tuple[Named, int, dict]]) -> Named:
        """The new global arrays: the strategy's aggregation of every client's fit reply (arrays, training
        samples, metrics), all accepted."""
        self.answered({pid: metrics for pid, (_, _, metrics) in replies.items()})
        updates = [ClientUpdate(pid, arrays, n, metrics) for pid, (arrays, n, metrics) in sorted(replies.items())]
        aggregate_accepted(self.strategy, server_round, updates)
        latest = self.strategy.latest
        assert latest is not None  # the round aggregated, or kept what it sent
        return latest


def bare_loop_round_seconds(cfg: dict, rounds: int) -> tuple[list[float], float]:
    """The reference: every client's ``fit`` (the same local-step code Flower calls) one after
    another in this process, then the strategy's aggregation; no messages, no processes. Each client is sent
    what the strategy sends it (``BareServer``: SCAFFOLD's control variate, DisTrans' offset, the broadcast
    data). Returns the timed rounds' seconds (after one untimed round) and this process's peak memory in MB
    (GPU on CUDA, else RSS)."""
    device = use_device(cfg)
    times, _, _ = bare_loop(cfg, rounds + 1, device)
    peak = peak_memory_mb(device)
    return times[1:], peak.get("peak-gpu-mb", peak["peak-rss-mb"])


def bare_loop(
    cfg: dict, rounds: int, device: torch.device, on_start=None, on_round=None
) -> tuple[list[float], list, dict]:
    """``rounds`` rounds of the bare loop (see ``bare_loop_round_seconds``); ``on_start()`` once the clients are
    built, ``on_round(round, seconds)`` after each. Returns each round's seconds, the clients and the last
    global arrays."""
    run = common(cfg)
    server = BareServer(cfg)
    global_arrays = server.initial_arrays()
    client_cls = client_class(run.strategy)
    clients = [client_cls(cfg, load_client_data(cfg, pid, device), device) for pid in range(run.num_clients)]
    server.connect(clients)
    if on_start:
        on_start()
    times = []
    for server_round in range(1, rounds + 1):
        start = time.perf_counter()
        messages = server.messages(server_round, global_arrays)
        replies = {client.pid: client.fit(*messages[client.pid]) for client in clients}
        global_arrays = server.aggregate(server_round, replies)
        synchronize(device)
        times.append(time.perf_counter() - start)
        if on_round:
            on_round(server_round, times[-1])
    return times, clients, global_arrays


def round_configs(server: BareServer) -> Callable[..., dict]:
    """``config_of(server_round, pid=None)``: the fit config ``server``'s strategy sends client ``pid`` (None: the
    first connected one) in that round. Each round's broadcast data is taken as held by every client once the next
    round starts, as their fit answers would confirm: FedBR's pseudo-data rides in round 1's configs only."""

    def config_of(server_round: int, pid: int | None = None) -> dict:
        if server.round and server_round != server.round:
            server.answered(server.held())
        return server.fit_config(server_round, server.pids[0] if pid is None else pid)

    return config_of
