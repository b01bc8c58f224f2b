"""The clients of a run, by partition id: discovery (each node reports its partition once), the check
that every node built the same partition, seeded sampling, and named requests to clients (a
``get_parameters`` message with ``config["request"]``)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from flwr.common import GetParametersIns, GetPropertiesIns
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from .. import payload, seeds
from ..config import sampled_per_round
from ..errors import ConfigError
from ..partition import heterogeneity_from_counts

log = logging.getLogger("flwr")
DISCOVERY_TIMEOUT_S = 600


class Federation:
    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.clients_by_pid: dict[int, ClientProxy] = {}
        self.pid_by_cid: dict[str, int] = {}
        self.class_counts: dict[int, np.ndarray] = {}  # each client's training samples per class
        self.partition_hash = ""

    @property
    def discovered(self) -> bool:
        return bool(self.clients_by_pid)

    def discover(self, client_manager: ClientManager, timeout_s: float | None = None) -> None:
        """Ask every node for its partition id once, so that sampling and per-client metrics are keyed by
        partition and a mis-configured federation stops with a clear message. Nodes that are already
        connected answer first, so a wrong federation size fails at once instead of after the wait for
        nodes that may still be starting (deployment)."""
        timeout_s = DISCOVERY_TIMEOUT_S if timeout_s is None else timeout_s
        expected = self.cfg["num-clients"]
        client_manager.wait_for(1, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        hashes = set()
        while True:
            new = [p for cid, p in client_manager.all().items() if cid not in self.pid_by_cid]
            for proxy, props in _ask_partitions(new):
                hashes.add(self._add(proxy, props, expected))
            num = len(self.clients_by_pid)
            if num >= (expected or 1):
                break
            if time.monotonic() > deadline:
                raise ConfigError(f"num-clients = {expected} but only {num} SuperNodes connected within "
                                  f"{timeout_s} s; start it with num-supernodes={expected} (fedbr-run does this)")
            log.info("[fedbr] %d of %d SuperNodes connected; waiting", num, expected)
            client_manager.wait_for(num + 1, timeout=min(10, timeout_s))
        if expected and num != expected:
            raise ConfigError(f"num-clients = {expected} but the federation has {num} SuperNodes; "
                              f"start it with num-supernodes={expected} (fedbr-run does this)")
        if sorted(self.clients_by_pid) != list(range(num)):
            raise ConfigError(f"partition ids must be 0..{num - 1}, got {sorted(self.clients_by_pid)}")
        if len(hashes) != 1:
            raise ConfigError(f"clients built different partitions (hashes {sorted(hashes)}): check that every "
                              "SuperNode has the same dataset files and run config")
        self.partition_hash = hashes.pop()

    def _add(self, proxy: ClientProxy, props: dict, expected: int) -> str:
        pid = int(props["partition-id"])
        if expected and int(props.get("num-partitions", expected)) != expected:
            raise ConfigError(f"num-clients = {expected} but SuperNode {proxy.cid} was started with "
                              f"num-partitions = {props['num-partitions']}: start the federation with "
                              f"num-supernodes={expected} (fedbr-run does this)")
        if pid in self.clients_by_pid:
            raise ConfigError(f"two SuperNodes claim partition-id {pid}: give each a distinct one")
        self.clients_by_pid[pid] = proxy
        self.pid_by_cid[proxy.cid] = pid
        if "class-counts" in props:
            self.class_counts[pid] = np.array(str(props["class-counts"]).split(","), dtype=np.int64)
        return props["partition-hash"]

    def pid_of(self, proxy: ClientProxy | None, metrics: dict) -> int:
        """The partition a result comes from: the node's, as learnt at discovery (a broken client's
        metrics may lack it)."""
        if proxy is not None and proxy.cid in self.pid_by_cid:
            return self.pid_by_cid[proxy.cid]
        return int(metrics.get("partition-id", -1))

    def sample(self, server_round: int) -> list[int]:
        """Seeded by (seed, round) over partition ids, so runs repeat whatever Flower's node ids are."""
        pids = sorted(self.clients_by_pid)
        m = sampled_per_round(self.cfg["fraction-fit"], len(pids))
        if m >= len(pids):
            return pids
        rng = seeds.rng("client-sampling", self.cfg["seed"], server_round)
        return sorted(rng.choice(pids, size=m, replace=False).tolist())

    def class_count_matrix(self) -> np.ndarray | None:
        """(clients, classes) training-sample counts in partition order; None unless every client reported."""
        if set(self.class_counts) != set(self.clients_by_pid):
            return None
        return np.stack([self.class_counts[pid] for pid in sorted(self.class_counts)])

    def partition_stats(self) -> dict[str, Any]:
        """The clients' class histograms and their distributional heterogeneity (DisTrans' DH)."""
        counts = self.class_count_matrix()
        if counts is None:
            return {}
        return {"class_counts": counts.tolist(), "distributional_heterogeneity": heterogeneity_from_counts(counts)}

    def request(self, name: str, args: dict[int, dict[str, Any]], group: int, what: str, required: bool = True
                ) -> dict[int, payload.Named]:
        """Send each listed client the named request ``name`` with its arguments, in parallel; return the
        arrays each answered. ``what`` names them in errors. With ``required=False`` a client that fails
        is logged and left out instead of raising."""
        timeout = self.cfg["round-timeout"] or None

        def ask(pid: int) -> tuple[int, payload.Named | None]:
            try:
                config = {**args[pid], "request": name}
                res = self.clients_by_pid[pid].get_parameters(GetParametersIns(config), timeout, group)
                if res.status.code.value != 0:
                    raise RuntimeError(res.status.message)
                return pid, payload.from_parameters(res.parameters)
            except Exception as exc:  # the node's ClientApp raised, or sent no named arrays: its message says why
                error = RuntimeError(f"client {pid} could not send {what}: {exc}")
                if required:
                    raise error from None
                log.warning("[fedbr] %s", error)
                return pid, None

        with ThreadPoolExecutor(max_workers=min(32, max(1, len(args)))) as pool:
            return {pid: arrays for pid, arrays in pool.map(ask, list(args)) if arrays is not None}


def _ask_partitions(proxies: list[ClientProxy]) -> list[tuple[ClientProxy, dict]]:
    def ask(proxy: ClientProxy) -> tuple[ClientProxy, dict]:
        try:
            res = proxy.get_properties(GetPropertiesIns({}), None, None)
        except Exception as exc:  # the node's ClientApp raised: its message says why
            raise ConfigError(f"SuperNode {proxy.cid} could not report its partition: {exc}") from None
        if res.status.code.value != 0 or "partition-id" not in res.properties:
            raise ConfigError(f"SuperNode {proxy.cid} could not report its partition: {res.status.message}")
        return proxy, res.properties

    if not proxies:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(proxies))) as pool:
        return list(pool.map(ask, proxies))
