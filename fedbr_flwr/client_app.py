"""Flower ClientApp: builds the configured algorithm's NumPyClient for this node's partition.

In simulation, Flower's Ray actors are long-lived processes that each serve many messages (of any
partition): ``CLIENTS`` keeps one client object per (run, partition), so the model, its optimisers
and its data on the device are built once and reused by every later round in that process.

Flower 1.41 starts a fresh ClientApp process for every message in a deployment (both isolation
modes). A SuperNode started with ``worker="<socket>"`` in its node config therefore hands each
message to a long-lived ``fedbr_flwr.worker`` process, which keeps its clients in the same kind of
cache; this module then imports nothing heavy (no torch) on that path."""

from __future__ import annotations

import json
from typing import Any, Mapping

from flwr.client import ClientApp
from flwr.common import Context, RecordDict


def build_client(run_config: Mapping[str, Any], node: Mapping[str, Any], state: RecordDict):
    """The algorithm's client for the partition named in the node config, its data on the device."""
    import torch

    from .config import ConfigError, from_run_config
    from .dataset import load_client_data
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
    return client_class(cfg["strategy"])(cfg, data, device, state)


class ClientCache:
    """One client object per (run, partition, run config), built on first use and reused afterwards;
    the clients of all but the ``runs_kept`` most recent runs are dropped with their device memory."""

    def __init__(self, runs_kept: int = 2):
        self.runs_kept = runs_kept
        self.clients: dict[tuple[int, int, str], Any] = {}  # in insertion order: oldest runs first

    def get(self, run_id: int, run_config: Mapping[str, Any], node: Mapping[str, Any], state: RecordDict):
        """The client for this message, holding ``state`` (Flower's node state, a new copy per message)."""
        settings = json.dumps({"run": dict(run_config), "node": dict(node)}, sort_keys=True, default=str)
        key = (int(run_id), int(node.get("partition-id", -1)), settings)
        client = self.clients.get(key)
        if client is None:
            client = self.clients[key] = build_client(run_config, node, state)
            self._forget_old_runs()
        client.state = state
        return client

    def _forget_old_runs(self) -> None:
        runs = list(dict.fromkeys(run for run, _, _ in self.clients))
        for old in runs[:-self.runs_kept]:
            for key in [k for k in self.clients if k[0] == old]:
                del self.clients[key]


CLIENTS = ClientCache()


def client_fn(context: Context):
    if context.node_config.get("worker"):
        from .worker import WorkerClient

        return WorkerClient(str(context.node_config["worker"]), context).to_client()
    return CLIENTS.get(context.run_id, context.run_config, context.node_config, context.state).to_client()


app = ClientApp(client_fn=client_fn)
