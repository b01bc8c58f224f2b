"""Flower ClientApp: the configured algorithm's client for this node's partition.

In simulation, Flower's Ray actors are long-lived processes that each serve many messages (of any
partition): ``CLIENTS`` (``fedbr_flwr.app.node.ClientCache``) keeps one client object per (run, partition),
so the model, its optimisers and its data on the device are built once and reused by every later
round in that process.

Flower 1.41 starts a fresh ClientApp process for every message in a deployment (both isolation
modes). A SuperNode started with ``worker="<socket>"`` in its node config therefore hands each
message to a long-lived ``fedbr_flwr.launch.worker`` process, which keeps its clients in the same kind of
cache: ``WorkerClient`` forwards it, and this module then imports nothing heavy (no torch, nothing of the
launch layer) on that path."""

from __future__ import annotations

from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

from flwr.client import ClientApp, NumPyClient
from flwr.common import Context

from ..runfiles.run_io import code_hash

_CLIENTS = None


def key_path(address: str) -> Path:
    return Path(address + ".key")


def read_key(address: str) -> bytes:
    return key_path(address).read_bytes()


class WorkerClient(NumPyClient):
    """Runs in Flower's per-message ClientApp process: forwards each call to the node's worker."""

    def __init__(self, address: str, context: Context):
        self.address = address
        self.context = context

    def call(self, method: str, *args: Any) -> Any:
        try:
            conn = Client(self.address, family="AF_UNIX", authkey=read_key(self.address))
        except (OSError, EOFError) as exc:
            raise RuntimeError(
                f"no fedbr worker answers at {self.address} ({exc}): start it with "
                f"`fedbr-worker --address {self.address}` (fedbr-deploy supernode does)"
            ) from None
        with conn:
            conn.send(
                {
                    "code": code_hash(),
                    "run_id": self.context.run_id,
                    "run_config": dict(self.context.run_config),
                    "node_config": dict(self.context.node_config),
                    "state": self.context.state,
                    "method": method,
                    "args": args,
                }
            )
            try:
                status, result, state = conn.recv()
            except EOFError:
                raise RuntimeError(f"the fedbr worker at {self.address} died during '{method}'") from None
        if status != "ok":
            raise RuntimeError(f"fedbr worker {self.address}: {result}")
        self.context.state.clear()  # the same object: Flower keeps it for the node's next message
        self.context.state.update(state)
        return result

    def get_properties(self, config):
        return self.call("get_properties", config)

    def get_parameters(self, config):
        return self.call("get_parameters", config)

    def fit(self, parameters, config):
        return self.call("fit", parameters, config)

    def evaluate(self, parameters, config):
        return self.call("evaluate", parameters, config)


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
