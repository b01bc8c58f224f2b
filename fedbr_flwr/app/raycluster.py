"""Which Ray runtime a simulation uses: a private one (the default), or a running cluster it joins.

Flower's Ray backend calls ``ray.init()`` with no address, and Ray then reads ``RAY_ADDRESS``; left
unset, Ray would also join any cluster that ``ray start`` left on this machine. So the launcher always
sets ``RAY_ADDRESS`` for Flower's processes: the cluster's address when the run joins one, else
``local`` (Ray's own word for "start a private runtime"). Nothing here schedules or transports
anything: Ray places Flower's actors across the cluster's nodes."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..core.errors import ConfigError, quoted

PRIVATE = "local"
NODE = "node"  # the fit metric that says where a client's work ran (``worker_node``)
NODE_NAME_LIMIT = 120
CONNECT_TIMEOUT_S = 5.0


def requested_address(setting: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The cluster address a run joins, or None for a private runtime: the ``ray-address`` setting, else
    the ``RAY_ADDRESS`` environment variable (Ray's convention); ``local`` (either) means private."""
    address = (setting or environ.get("RAY_ADDRESS", "")).strip()
    return None if address in ("", PRIVATE) else address


def ray_environment(address: str | None) -> dict[str, str]:
    """What Flower's processes need in their environment to use that runtime."""
    return {"RAY_ADDRESS": address or PRIVATE}


def bootstrap_address(address: str) -> str:
    """``host:port`` of the cluster's GCS: ``auto`` is the cluster ``ray start`` left on this machine."""
    from ray._private import services

    try:
        resolved = services.canonicalize_bootstrap_address_or_die(address)
    except (ConnectionError, ValueError) as exc:
        raise ConfigError(f"ray-address = {quoted(address)}: {exc}") from None
    if resolved.startswith(("ray://", "http://", "https://")):
        raise ConfigError(
            f"ray-address = {quoted(address)}: give the cluster's GCS address (host:port, as `ray start "
            "--head` prints it) or auto, not a Ray Client or dashboard URL"
        )
    return resolved


def check_answers(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """The cluster's ``host:port`` once something listens there; ConfigError within ``timeout_s`` otherwise
    (Ray itself would wait for minutes)."""
    resolved = bootstrap_address(address)
    host, _, port = resolved.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return resolved
    except (OSError, ValueError) as exc:
        if isinstance(exc, TimeoutError):
            reason = f"no answer within {timeout_s:g} s"
        else:
            reason = (getattr(exc, "strerror", None) or type(exc).__name__).lower()
        raise ConfigError(
            f"ray-address = {quoted(address)}: no Ray cluster answers at {resolved} ({reason}); start one with "
            "`ray start --head`, or leave ray-address empty for a private runtime"
        ) from None


@dataclass(frozen=True)
class Cluster:
    """What a run can use of a joined cluster (alive nodes only)."""

    address: str
    nodes: int
    cpus: int
    gpus: int
    largest_node_cpus: int


def describe(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Cluster:
    """Connect to the cluster at ``address`` briefly, as a driver of its own, and count its resources."""
    resolved = check_answers(address, timeout_s)
    import ray

    try:
        ray.init(address=resolved, logging_level=logging.ERROR, log_to_driver=False)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
    except Exception as exc:  # noqa: BLE001 - Ray raises many kinds; all mean "cannot use this cluster"
        raise ConfigError(
            f"ray-address = {quoted(address)}: cannot join the Ray cluster at {resolved}: {exc}"
        ) from None
    finally:
        if ray.is_initialized():
            ray.shutdown()  # a joined cluster: this only disconnects
    cpus = [int(n["Resources"].get("CPU", 0)) for n in nodes]
    gpus = sum(int(n["Resources"].get("GPU", 0)) for n in nodes)
    if not nodes or not max(cpus):
        raise ConfigError(f"ray-address = {quoted(address)}: the Ray cluster at {resolved} has no node with a CPU")
    return Cluster(resolved, len(nodes), sum(cpus), gpus, max(cpus))


def answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def log_tail(path: Path, chars: int = 500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip() or "(no output)"
    except OSError:
        return "(no output)"


def worker_node() -> str:
    """Where a client's work ran, as the run files record it: in a Ray actor, its node's id; elsewhere this
    machine's host name. A client in the simulation process itself (``backend = in-process``) is not in an
    actor, also where the process has a Ray runtime (a sweep's keeps one from an earlier run)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        context = ray.get_runtime_context()
        if context.get_actor_id() is not None:
            return context.get_node_id()
    return socket.gethostname()


def reported_node(value: object) -> str | None:
    """The node a reply says it ran on, if it names one readably (replies are untrusted input)."""
    if isinstance(value, str) and 0 < len(value) <= NODE_NAME_LIMIT and value.isprintable():
        return value
    return None
