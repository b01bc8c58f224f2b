"""Flower ClientApp: builds the configured algorithm's NumPyClient for this node's partition."""

from __future__ import annotations

import torch
from flwr.client import ClientApp
from flwr.common import Context

from .config import ConfigError, from_run_config
from .dataset import load_client_data
from .registry import client_class
from .training import pick_device


def client_fn(context: Context):
    cfg = from_run_config(context.run_config)
    node = context.node_config
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
    torch.set_num_threads(cfg["client-cpus"])
    device = pick_device(cfg["device"])
    data = load_client_data(cfg, pid, device)
    return client_class(cfg["strategy"])(cfg, data, device, context.state).to_client()


app = ClientApp(client_fn=client_fn)
