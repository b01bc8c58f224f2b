"""Flower ClientApp: the configured algorithm's client for this node's partition.

In simulation, Flower's Ray actors are long-lived processes that each serve many messages (of any
partition): ``CLIENTS`` (``fedbr_flwr.app.node.ClientCache``) keeps one client object per (run, partition),
so the model, its optimisers and its data on the device are built once and reused by every later
round in that process.

Flower 1.41 starts a fresh ClientApp process for every message in a deployment (both isolation
modes). A SuperNode started with ``worker="<socket>"`` in its node config therefore hands each
message to a long-lived ``fedbr_flwr.launch.worker`` process, which keeps its clients in the same kind of
cache; this module then imports nothing heavy (no torch) on that path."""

from __future__ import annotations

from flwr.client import ClientApp
from flwr.common import Context

from ..launch.worker import WorkerClient

_CLIENTS = None


def client_cache():
    """This process's client cache, made on first use (so that the worker path never imports torch)."""
    global _CLIENTS
    if _CLIENTS is None:
        from .node import ClientCache

        _CLIENTS = ClientCache()
    return _CLIENTS


def client_fn(context: Context):
    if context.node_config.get("worker"):
        return WorkerClient(str(context.node_config["worker"]), context).to_client()
    return client_cache().get(context.run_id, context.run_config, context.node_config, context.state).to_client()


app = ClientApp(client_fn=client_fn)
