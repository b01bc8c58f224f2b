"""What runs on a node: Flower's NumPyClient over an algorithm's Flower-free client side, the node
state over Flower's ``context.state``, how a node builds its client, and the one per-process cache of
clients (with their data and models on the device).

Messages carry named arrays (``fedbr_flwr.payload``); ``get_parameters`` with ``config["request"]``
answers a named request (the client's state for a checkpoint, FedBR's RSM means, FedMix's means)."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np
from flwr.client import NumPyClient
from flwr.common import Array, ArrayRecord, ConfigRecord, RecordDict

from . import payload
from .algorithm import ClientAlgorithm, NodeState


class RecordState(NodeState):
    """A client's node state kept in Flower's ``context.state`` (a RecordDict): named arrays as an
    ArrayRecord, metadata as a ConfigRecord, one record per key."""

    def __init__(self, records: RecordDict):
        self.records = records

    def arrays(self, key):
        if key not in self.records:
            return None
        return {name: array.numpy() for name, array in self.records[key].items()}

    def put_arrays(self, key, arrays):
        self.records[key] = ArrayRecord(OrderedDict((k, Array(np.array(v, copy=True))) for k, v in arrays.items()))

    def meta(self, key):
        return dict(self.records[key]) if key in self.records else None

    def put_meta(self, key, values):
        self.records[key] = ConfigRecord(dict(values))


class FlowerClient(NumPyClient):
    """The NumPyClient of every algorithm: it converts messages to named arrays and back."""

    def __init__(self, algorithm: ClientAlgorithm):
        self.algorithm = algorithm

    def use_state(self, records: RecordDict) -> None:
        """The node state of this message (Flower hands each message its own copy)."""
        self.algorithm.state = RecordState(records)

    def get_properties(self, config: dict) -> dict:
        return self.algorithm.properties()

    def get_parameters(self, config: dict) -> list[np.ndarray]:
        arrays = self.algorithm.answer(config) if "request" in config else self.algorithm.weights()
        return payload.to_list(arrays)

    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int, dict]:
        arrays, n, metrics = self.algorithm.fit(payload.from_list(parameters), config)
        return payload.to_list(arrays), n, metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict) -> tuple[float, int, dict]:
        return self.algorithm.evaluate(payload.from_list(parameters), config)


def build_client(run_config: Mapping[str, Any], node: Mapping[str, Any], state: RecordDict) -> FlowerClient:
    """The algorithm's client for the partition named in the node config, its data on the device."""
    import torch

    from .config import from_run_config
    from .dataset import load_client_data
    from .errors import ConfigError
    from .registry import client_class
    from .training import pick_device

    cfg = from_run_config(run_config)
    if "partition-id" not in node:
        raise ConfigError("this SuperNode has no 'partition-id' in its node config: start it with "
                          "--node-config \"partition-id=<i> num-partitions=<n>\"")
    pid = int(node["partition-id"])
    num_partitions = int(node.get("num-partitions", cfg["num-clients"] or 0))
    if cfg["num-clients"] and num_partitions and cfg["num-clients"] != num_partitions:
        raise ConfigError(f"num-clients = {cfg['num-clients']} but this SuperNode was told num-partitions = "
                          f"{num_partitions}: start the federation with num-supernodes={cfg['num-clients']}")
    cfg["num-clients"] = cfg["num-clients"] or num_partitions
    if not cfg["num-clients"]:
        raise ConfigError("num-clients is 0 and the SuperNode has no num-partitions: set one of them")
    if node.get("data-dir"):  # this machine's copy of the dataset
        cfg["data-dir"] = str(node["data-dir"])
    torch.set_num_threads(cfg["client-cpus"])
    device = pick_device(cfg["device"])
    data = load_client_data(cfg, pid, device)
    return FlowerClient(client_class(cfg["strategy"])(cfg, data, device, RecordState(state)))


class ClientCache:
    """The one cache of a client process (a simulation actor, a deployment worker): one client per
    (run, partition, settings), with its data and model on the device, built on first use and reused by
    later messages. Its one eviction rule: the clients of all but the ``runs_kept`` most recent runs are
    dropped, and with them everything they hold."""

    def __init__(self, runs_kept: int = 2):
        self.runs_kept = runs_kept
        self.clients: dict[tuple[int, int, str], FlowerClient] = {}  # in insertion order: oldest runs first

    def get(self, run_id: int, run_config: Mapping[str, Any], node: Mapping[str, Any],
            state: RecordDict) -> FlowerClient:
        """The client for this message, holding ``state`` (Flower's node state, a new copy per message)."""
        settings = json.dumps({"run": dict(run_config), "node": dict(node)}, sort_keys=True, default=str)
        key = (int(run_id), int(node.get("partition-id", -1)), settings)
        client = self.clients.get(key)
        if client is None:
            client = self.clients[key] = build_client(run_config, node, state)
            self._forget_old_runs()
        client.use_state(state)
        return client

    def _forget_old_runs(self) -> None:
        runs = list(dict.fromkeys(run for run, _, _ in self.clients))
        for old in runs[:-self.runs_kept]:
            for key in [k for k in self.clients if k[0] == old]:
                del self.clients[key]
