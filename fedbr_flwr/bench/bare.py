"""The bare loop: what a federated round costs with no framework. Every client's ``fit`` (the same local-step code
Flower calls) one after another in this process, then the same averaging; no messages, no processes. The
benchmarks measure Flower's runs against it (``command``, ``startup``)."""

from __future__ import annotations

import tempfile
import time

import torch

from ..app.server_app import build_strategy
from ..core.algorithm import client_class
from ..core.broadcast import SharedData
from ..core.config import common
from ..core.training import peak_memory_mb, use_device
from ..data.dataset import load_client_data
from ..server.updates import named_mean


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def initial_arrays(cfg: dict) -> dict:
    """The server's seeded initial weights (its strategy built on a throw-away output-dir)."""
    with tempfile.TemporaryDirectory(prefix="fedbr-bench-") as tmp:
        return build_strategy({**cfg, "output-dir": tmp, "global-test": False}).initial_arrays()


def bare_loop_round_seconds(cfg: dict, rounds: int) -> tuple[list[float], float]:
    """The reference: every client's ``fit`` (the same local-step code Flower calls) one after
    another in this process, then the same averaging; no messages, no processes. What a client returns
    and takes back is averaged and sent back with the model (DisTrans: the offsets, as
    ``distrans-agg=avg`` does). Returns the timed rounds' seconds (after one untimed round) and this
    process's peak memory in MB (GPU on CUDA, else RSS)."""
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
    global_arrays = initial_arrays(cfg)
    client_cls = client_class(run.strategy)
    clients = [client_cls(cfg, load_client_data(cfg, pid, device), device) for pid in range(run.num_clients)]
    fit_config = bare_fit_config(cfg, clients)
    if on_start:
        on_start()
    times = []
    for server_round in range(1, rounds + 1):
        start = time.perf_counter()
        updates, sizes = [], []
        for client in clients:
            arrays, n, _ = client.fit(global_arrays, fit_config(server_round))
            updates.append(arrays)
            sizes.append(n if run.weighting == "samples" else 1.0)
        names = [n for n in updates[0] if n in global_arrays or n.startswith(client_cls.accepts)]
        global_arrays = named_mean(updates, sizes, names)
        synchronize(device)
        times.append(time.perf_counter() - start)
        if on_round:
            on_round(server_round, times[-1])
    return times, clients, global_arrays


def bare_fit_config(cfg: dict, clients: list | dict):
    """Fit config per round; for FedBR the pseudo-data is built once, as the strategy does at round 1.
    ``clients``: the clients' ``ClientAlgorithm`` objects by partition id (a list: ids 0, 1, ...)."""
    if common(cfg).strategy != "fedbr":
        return lambda server_round: {"server-round": server_round}
    from pseudodata import PseudoDataSettings, build
    from pseudodata.mixture import load_proxy

    by_pid = dict(enumerate(clients)) if isinstance(clients, list) else clients
    own = PseudoDataSettings.from_config(cfg)
    proxy = load_proxy(cfg) if own.pseudo_data == "mixture" else None

    def collect(counts, version):
        request = {"request": "rsm-means", "pseudo-m": own.pseudo_m, "version": version}
        return [by_pid[pid].answer({**request, "count": n})["means"] for pid, n in counts.items()]

    shared = SharedData("pseudo")
    shared.publish(*build(cfg, 1, sorted(by_pid), collect, proxy), 1)
    return lambda server_round: {
        "server-round": server_round,
        "pseudo-version": 1,
        **({"pseudo-payload": shared.payload} if server_round == 1 else {}),
    }
