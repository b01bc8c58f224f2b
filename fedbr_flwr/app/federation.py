"""The clients of a run, by partition id: discovery (each node reports its partition once), the check
that every node built the same partition, seeded sampling, and named requests to clients (a
``get_parameters`` message with ``config["request"]``)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from flwr.common import GetParametersIns, GetPropertiesIns
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from ..core import seeds
from ..core.config import common, sampled_per_round
from ..core.errors import ConfigError, quoted
from ..data.catalog import INFO
from ..data.partition import heterogeneity_from_counts
from ..server.updates import MAX_COUNT
from . import cohort, payload

log = logging.getLogger("flwr")
AnswerCheck = Callable[[int, payload.Named], str | None]  # why a client's answer may not be used, or None
DISCOVERY_TIMEOUT_S = 600
WAIT_NOTICE_S = 10.0  # how often a discovery that waits says so


class Federation:
    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.clients_by_pid: dict[int, ClientProxy] = {}  # the node that hosts each client
        self.pid_by_cid: dict[str, int] = {}  # a node of one client: that client
        self.members_by_cid: dict[str, list[int]] = {}  # a cohort's node (engine=cohort): its clients
        self.class_counts: dict[int, np.ndarray] = {}  # each client's training samples per class
        # each client's (training, local test) samples: what its discovery answer said, replaced by the
        # server's own partition where the server holds the dataset; replies are checked against them
        self.sizes: dict[int, tuple[int, int]] = {}
        self.partition_hash = ""

    @property
    def discovered(self) -> bool:
        return bool(self.clients_by_pid)

    def discover(self, client_manager: ClientManager, say: Callable[[str], None]) -> None:
        """Ask every node for its partition id once, so that sampling and per-client metrics are keyed by
        partition and a mis-configured federation stops with a clear message. Nodes that are already
        connected answer first, so a wrong federation size fails at once instead of after the wait for
        nodes that may still be starting (deployment). While it waits, ``say`` hears how many are there
        every ``WAIT_NOTICE_S``."""
        timeout_s = DISCOVERY_TIMEOUT_S
        expected = common(self.cfg).num_clients
        start = time.monotonic()
        hashes = set()
        while True:
            nodes = client_manager.all()
            new = [p for cid, p in nodes.items() if cid not in self.pid_by_cid and cid not in self.members_by_cid]
            for proxy, props in _ask_partitions(new):
                hashes.add(read_partition(self._add, proxy, props, expected))
            num = len(self.clients_by_pid)
            if num >= (expected or 1):
                break
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise ConfigError(
                    f"num-clients = {expected} but only {num} SuperNodes connected within "
                    f"{timeout_s} s; start it with num-supernodes={expected} (fedbr-run does this)"
                )
            if not wait_for_nodes(client_manager, len(nodes) + 1, min(WAIT_NOTICE_S, timeout_s - waited)):
                say(
                    f"{num} of {expected or 'the'} clients' SuperNodes connected after "
                    f"{time.monotonic() - start:.0f} s; waiting for the others (up to {timeout_s:g} s): start them, "
                    "or read their logs"
                )
        if expected and num != expected:
            raise ConfigError(
                f"num-clients = {expected} but the federation has {num} SuperNodes; "
                f"start it with num-supernodes={expected} (fedbr-run does this)"
            )
        if sorted(self.clients_by_pid) != list(range(num)):
            raise ConfigError(f"partition ids must be 0..{num - 1}, got {sorted(self.clients_by_pid)}")
        if len(hashes) != 1:
            raise ConfigError(
                f"clients built different partitions (hashes {sorted(hashes)}): check that every "
                "SuperNode has the same dataset files and run config"
            )
        self.partition_hash = hashes.pop()

    def _add(self, proxy: ClientProxy, props: dict, expected: int) -> str:
        if expected and int(props.get("num-partitions", expected)) != expected:
            raise ConfigError(
                f"num-clients = {expected} but SuperNode {proxy.cid} was started with "
                f"num-partitions = {props['num-partitions']}: start the federation with "
                f"num-supernodes={expected} (fedbr-run does this)"
            )
        if cohort.MEMBERS in props:  # a cohort's node: each member reports as a client of its own would
            self.members_by_cid[proxy.cid] = cohort.members_of(props)
            _, own = cohort.by_member(props)
            for pid in self.members_by_cid[proxy.cid]:
                self._add_client(proxy, pid, own[pid].get("class-counts"))
                self._add_sizes(pid, own[pid])
        else:
            self.pid_by_cid[proxy.cid] = int(props["partition-id"])
            self._add_client(proxy, int(props["partition-id"]), props.get("class-counts"))
            self._add_sizes(int(props["partition-id"]), props)
        return partition_hash(props)

    def _add_client(self, proxy: ClientProxy, pid: int, class_counts: str | None) -> None:
        if pid in self.clients_by_pid:
            raise ConfigError(f"two SuperNodes claim partition-id {pid}: give each a distinct one")
        self.clients_by_pid[pid] = proxy
        if class_counts is not None:
            self.class_counts[pid] = read_class_counts(class_counts, pid, INFO[common(self.cfg).dataset].num_classes)

    def _add_sizes(self, pid: int, props: dict) -> None:
        # what a node says here bounds its later counts where the server lacks the dataset: it must say something
        self.sizes[pid] = (reported_count(props, "num-train"), reported_count(props, "num-test"))

    def is_cohort(self, proxy: ClientProxy | None) -> bool:
        return proxy is not None and proxy.cid in self.members_by_cid

    def group(self, pids: list[int]) -> list[tuple[ClientProxy, list[int]]]:
        """The nodes that host ``pids``, each with the ones it hosts (in partition order)."""
        groups: dict[str, tuple[ClientProxy, list[int]]] = {}
        for pid in sorted(pids):
            proxy = self.clients_by_pid[pid]
            groups.setdefault(proxy.cid, (proxy, []))[1].append(pid)
        return list(groups.values())

    def pid_of(self, proxy: ClientProxy | None, metrics: dict) -> int:
        """The partition a result comes from: the node's, as learnt at discovery, else what its metrics say where
        that is a whole number below 2**63 (-1 otherwise: a partition never sampled, so the reply is refused; an
        int of 5,000 digits would not even print in its warning)."""
        if proxy is not None and proxy.cid in self.pid_by_cid:
            return self.pid_by_cid[proxy.cid]
        pid = metrics.get("partition-id", -1)
        return pid if isinstance(pid, int) and not isinstance(pid, bool) and -1 <= pid < 2**63 else -1

    def sample(self, server_round: int) -> list[int]:
        """Seeded by (seed, round) over partition ids, so runs repeat whatever Flower's node ids are."""
        run = common(self.cfg)
        pids = sorted(self.clients_by_pid)
        m = sampled_per_round(run.fraction_fit, len(pids))
        if m >= len(pids):
            return pids
        rng = seeds.rng("client-sampling", run.seed, server_round)
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

    def request(
        self, name: str, args: dict[int, dict[str, Any]], group: int, what: str, check: AnswerCheck | None = None
    ) -> dict[int, payload.Named]:
        """Send each listed client the named request ``name`` with its arguments, in parallel; return the
        arrays of each client that answered with arrays that may be used (``check``: why a client's arrays
        may not be, or None). ``what`` names them in the line logged for each client left out: one that
        failed, sent no named arrays, no answer of its own, or arrays ``check`` refuses. No answer raises."""
        timeout = common(self.cfg).round_timeout or None

        def ask(node: tuple[ClientProxy, list[int]]) -> dict[int, payload.Named]:
            proxy, pids = node
            configs = {pid: {**args[pid], "request": name} for pid in pids}
            try:
                config = cohort.join_configs(configs) if self.is_cohort(proxy) else configs[pids[0]]
                res = proxy.get_parameters(GetParametersIns(config), timeout, group)
                if res.status.code.value != 0:
                    raise RuntimeError(res.status.message)
                arrays = payload.from_parameters(res.parameters)
                answers = cohort.by_member(arrays)[1] if self.is_cohort(proxy) else {pids[0]: arrays}
            except Exception as exc:  # the node's ClientApp raised, or sent no named arrays: its message says why
                log.warning("[fedbr] client %s could not send %s: %s", cohort.join_members(pids), what, exc)
                return {}
            return usable_answers(answers, pids, what, check)

        nodes = self.group(list(args))
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(nodes)))) as pool:
            return {pid: arrays for answered in pool.map(ask, nodes) for pid, arrays in answered.items()}


def usable_answers(
    answers: dict[int, payload.Named], pids: list[int], what: str, check: AnswerCheck | None
) -> dict[int, payload.Named]:
    """The answers of ``pids`` that ``check`` lets through; a line for each client left out."""
    usable = {}
    for pid in pids:
        problem = "no answer of its own" if pid not in answers else check(pid, answers[pid]) if check else None
        if problem is None:
            usable[pid] = answers[pid]
        else:
            log.warning("[fedbr] client %d sent %s that cannot be used (%s): left out", pid, what, problem)
    return usable


def read_partition(add: Callable[[ClientProxy, dict, int], str], proxy: ClientProxy, props: dict, expected: int) -> str:
    """``add`` a node's partition, with properties it cannot read (another app version, a broken node) one clear
    message."""
    try:
        return add(proxy, props, expected)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(
            f"SuperNode {proxy.cid} reported its partition in properties that cannot be read "
            f"({type(exc).__name__}: {exc}): check that it runs this version of the app"
        ) from None


def reported_count(props: dict, key: str) -> int:
    """The sample count a node reports under ``key`` in its properties: a whole number that numpy can hold,
    >= 0; else ValueError (a discovery error)."""
    value: Any = props.get(key)
    whole = isinstance(value, (int, np.integer)) and not isinstance(value, bool)  # as count_problem reads one
    if not whole or not 0 <= value < MAX_COUNT:
        raise ValueError(f"{key} {quoted(value, 60)} is not a sample count")
    return int(value)


def partition_hash(props: dict) -> str:
    if not isinstance(props["partition-hash"], str):
        raise TypeError(f"partition-hash {props['partition-hash']!r} is not a string")
    return props["partition-hash"]


def read_class_counts(text: Any, pid: int, classes: int) -> np.ndarray:
    """A client's reported training samples per class ("12,0,7,..."): ``classes`` whole numbers >= 0."""
    counts = np.array(str(text).split(","), dtype=np.int64)
    if len(counts) != classes or (counts < 0).any():
        raise ValueError(f"class-counts {text!r} of client {pid} are not {classes} counts >= 0")
    return counts


def wait_for_nodes(client_manager: ClientManager, count: int, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Wait until ``count`` nodes are connected, or ``timeout_s``; whether they are. Not Flower's ``wait_for``:
    Flower's compat client manager registers new nodes every 5 s by itself, but at once when asked for
    ``all()`` (which it wraps to look first), so a node that connects late is seen at once."""
    deadline = time.monotonic() + timeout_s
    while len(client_manager.all()) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def _ask_partitions(proxies: list[ClientProxy]) -> list[tuple[ClientProxy, dict]]:
    def ask(proxy: ClientProxy) -> tuple[ClientProxy, dict]:
        try:
            res = proxy.get_properties(GetPropertiesIns({}), None, None)
        except Exception as exc:  # the node's ClientApp raised: its message says why
            raise ConfigError(f"SuperNode {proxy.cid} could not report its partition: {exc}") from None
        if res.status.code.value != 0 or not {"partition-id", cohort.MEMBERS} & set(res.properties):
            raise ConfigError(f"SuperNode {proxy.cid} could not report its partition: {res.status.message}")
        return proxy, res.properties

    if not proxies:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(proxies))) as pool:
        return list(pool.map(ask, proxies))
