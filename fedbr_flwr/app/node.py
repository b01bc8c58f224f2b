"""What runs on a node: Flower's NumPyClient over an algorithm's Flower-free client side, the node
state over Flower's ``context.state``, how a node builds its client, and the one per-process cache of
clients (with their data and models on the device).

Messages carry named arrays (``fedbr_flwr.app.payload``); ``get_parameters`` with ``config["request"]``
answers a named request (the client's state for a checkpoint, FedBR's RSM means, FedMix's means)."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import OrderedDict
from typing import Any, Mapping, cast

import numpy as np
from flwr.client import NumPyClient
from flwr.common import Array, ArrayRecord, ConfigRecord, RecordDict

from ..core.algorithm import ClientAlgorithm, FunctionalStep, NodeState
from ..core.config import common
from . import cohort, payload
from .raycluster import NODE, worker_node


class RecordState(NodeState):
    """A client's node state kept in Flower's ``context.state`` (a RecordDict): named arrays as an
    ArrayRecord, metadata as a ConfigRecord, one record per key (after ``prefix``: a cohort's node keeps
    each member's records under ``member/<pid>/``)."""

    def __init__(self, records: RecordDict, prefix: str = ""):
        self.records = records
        self.prefix = prefix

    def arrays(self, key):
        key = self.prefix + key
        if key not in self.records:
            return None
        return {name: array.numpy() for name, array in cast(ArrayRecord, self.records[key]).items()}

    def put_arrays(self, key, arrays):
        self.records[self.prefix + key] = ArrayRecord(
            OrderedDict((k, Array(np.array(v, copy=True))) for k, v in arrays.items())
        )

    def meta(self, key):
        key = self.prefix + key
        return dict(self.records[key]) if key in self.records else None

    def put_meta(self, key, values):
        self.records[self.prefix + key] = ConfigRecord(dict(values))

    def drop(self, key):
        self.records.pop(self.prefix + key, None)


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
        return payload.to_list(arrays), n, {**metrics, NODE: worker_node()}

    def evaluate(self, parameters: list[np.ndarray], config: dict) -> tuple[float, int, dict]:
        return self.algorithm.evaluate(payload.from_list(parameters), config)


class CohortClient(NumPyClient):
    """``engine=cohort``: one node's NumPyClient over the clients of a cohort, trained in this process one
    after another (``cohort-step=loop``) or all at once (``vmap``; ``graph``: vmap replayed as a CUDA graph).
    One ``ClientAlgorithm`` (one model) serves every member in turn, bound to that member's data and node
    state: the model holds nothing of a client between messages (it is loaded from the server's arrays), so
    a cohort of 1000 clients holds one model. Every message names the members it is about
    (``fedbr_flwr.app.cohort``); each member answers
    exactly as it would on a node of its own."""

    def __init__(
        self,
        algorithm: ClientAlgorithm,
        members: dict[int, Any],
        packed: Any,
        vectorised: bool = False,
        graph: bool = False,
    ):
        self.algorithm = algorithm
        self.members = members  # partition id -> its ClientData
        self.packed = packed  # their training partitions in one tensor (``pack_partitions``), which they view
        self.records = RecordDict()
        self.vectorised = vectorised  # cohort-step=vmap: fit all sampled members at once
        self.graph = graph  # cohort-step=graph: and replay each round's step as a CUDA graph

    def use_state(self, records: RecordDict) -> None:
        self.records = records

    def member(self, pid: int) -> ClientAlgorithm:
        self.algorithm.bind(self.members[pid], RecordState(self.records, prefix=cohort.member_key(pid, "")))
        return self.algorithm

    def get_properties(self, config: dict) -> dict:
        props = {cohort.MEMBERS: cohort.join_members(list(self.members))}
        for pid in self.members:
            for key, value in self.member(pid).properties().items():
                props.update({key: value} if key in COHORT_WIDE else {cohort.member_key(pid, key): value})
        return props

    def get_parameters(self, config: dict) -> list[np.ndarray]:
        if "request" not in config:
            return payload.to_list(self.algorithm.weights())
        answers = {pid: self.member(pid).answer(view) for pid, view in cohort.member_views(config).items()}
        return payload.to_list(cohort.join_arrays(answers))

    @staticmethod
    def split(parameters: list[np.ndarray], config: dict) -> list[tuple[int, dict, dict]]:
        """(pid, its arrays, its config) of each member a message is about."""
        arrays = cohort.member_views({**payload.from_list(parameters), cohort.MEMBERS: config[cohort.MEMBERS]})
        return [(pid, arrays[pid], own_config) for pid, own_config in cohort.member_views(config).items()]

    def each_member(self, parts: list[tuple[int, dict, dict]], together, method: str) -> list[tuple]:
        """(pid, *answer) of every member: all at once (``together``, cohort-step=vmap), or one after another
        through the algorithm's ``method`` ("fit" or "evaluate")."""
        if self.vectorised:
            return together(parts)
        return [(pid, *getattr(self.member(pid), method)(arrays, own_config)) for pid, arrays, own_config in parts]

    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int, dict]:
        returned, metrics, total = {}, {cohort.MEMBERS: config[cohort.MEMBERS], NODE: worker_node()}, 0
        for pid, named, n, own in self.each_member(self.split(parameters, config), self.fit_together, "fit"):
            returned.update(cohort.join_arrays({pid: named}))
            metrics.update({cohort.member_key(pid, k): v for k, v in {**own, "num-examples": n}.items()})
            total += n
        return payload.to_list(returned), total, metrics

    def fit_together(
        self, parts: list[tuple[int, dict, dict]], graph: bool | None = None
    ) -> list[tuple[int, dict, int, dict]]:
        """Every member's fit with one vmapped local step for all (``fedbr_flwr.core.vectorised``; ``graph``, by
        default the cohort's own choice: the step captured as a CUDA graph). Each member is a shallow copy of
        the one algorithm, with its own components, so that what a member keeps between ``start_fit`` and
        ``finish_fit`` (its data, state, received arrays, seed streams) stays its own."""
        from ..core.vectorised import Member, PackedBatches, StepOptions, copy_values, cuda_graph, run_members, snapshot

        algorithms, members = [], []
        for pid, arrays, own_config in parts:
            algorithm = copy.copy(self.member(pid))
            algorithm.components = algorithm.build_components()
            step, sampler = algorithm.start_fit(arrays, own_config)
            if not isinstance(step, FunctionalStep):
                raise TypeError(
                    f"cohort-step=vmap: strategy '{common(algorithm.cfg).strategy}' built a "
                    f"{type(step).__name__}, not a FunctionalStep: set vectorised = False on its client"
                )
            algorithms.append(algorithm)
            members.append(Member(step, sampler, snapshot(step)))
        run = common(self.algorithm.cfg)
        start = time.perf_counter()
        capture = cuda_graph if (self.graph if graph is None else graph) else None
        offsets = [self.packed.offsets[pid] for pid, _, _ in parts]
        batches = PackedBatches([m.sample for m in members], offsets, self.packed.x, self.packed.y)
        options = StepOptions(run.precision, run.cohort_conv, run.compile, self.algorithm.first_step_stats, capture)
        finals, stats = run_members(members, batches, run.local_steps, options)
        seconds = time.perf_counter() - start  # every member's fit took this long: they ran together
        results = []
        for (pid, _, _), algorithm, member, final, own in zip(parts, algorithms, members, finals, stats):
            copy_values(member.step.groups, final)  # its trained values, live
            results.append((pid, *algorithm.finish_fit(member.step, own, seconds)))
        return results

    def evaluate_together(
        self, parts: list[tuple[int, dict, dict]], max_images: int | None = None
    ) -> list[tuple[int, float, int, dict]]:
        """Every member's evaluation with one vmapped forward pass per chunk of the test sets
        (``fedbr_flwr.core.vectorised.evaluate_members``), a group of members at a time (``evaluation_groups``:
        at most ``max_images`` images a forward); each member is a shallow copy, as in ``fit_together``."""
        from ..core.vectorised import EVAL_IMAGES, evaluate_members, evaluation_groups, load_module_state, module_state

        lengths = [len(self.members[pid].y_test) for pid, _, _ in parts]
        results = {}
        for group in evaluation_groups(lengths, max_images=max_images or EVAL_IMAGES):
            algorithms, states = [], []
            for pid, arrays, own_config in (parts[i] for i in group):
                algorithm = copy.copy(self.member(pid))
                predictor = algorithm.start_evaluate(arrays, own_config)
                algorithms.append(algorithm)
                states.append(module_state(predictor))
            scores = evaluate_members(
                predictor,
                states,
                [a.data.x_test for a in algorithms],
                [a.data.y_test for a in algorithms],
                conv=common(self.algorithm.cfg).cohort_conv,
            )
            for i, algorithm, state, (loss, acc) in zip(group, algorithms, states, scores):
                load_module_state(algorithm.eval_module(), state)  # its own predictor again (DisTrans: its offset)
                results[i] = (parts[i][0], *algorithm.finish_evaluate(loss, acc))
        return [results[i] for i in range(len(parts))]

    def evaluate(self, parameters: list[np.ndarray], config: dict) -> tuple[float, int, dict]:
        metrics, results = {cohort.MEMBERS: config[cohort.MEMBERS]}, []
        for pid, loss, n, own in self.each_member(self.split(parameters, config), self.evaluate_together, "evaluate"):
            metrics.update({cohort.member_key(pid, k): v for k, v in {**own, "loss": loss, "num-examples": n}.items()})
            results.append((loss, n))
        total = sum(n for _, n in results)
        return sum(loss * n for loss, n in results) / max(total, 1), total, metrics


COHORT_WIDE = ("partition-hash", "num-partitions")  # properties every member of a cohort has alike


def cohort_members(cfg: Mapping[str, Any], cohort_id: int, num_cohorts: int) -> list[int]:
    """The partitions cohort ``cohort_id`` of ``num_cohorts`` hosts: every num_cohorts-th, from its own id."""
    return list(range(cohort_id, common(cfg).num_clients, num_cohorts))


def cohort_step(
    requested: str, device_type: str, algorithm: type[ClientAlgorithm], components: tuple = (), compile: bool = False
) -> str:
    """The step a cohort runs: ``requested``, or for ``auto`` on a GPU the CUDA-graph step where this very
    algorithm, with no components, has had its graph checked on one (faster than vmap there:
    docs/benchmarks.md), else vmap where it has a vectorised step (that compiles, with ``compile``); ``auto``
    on a CPU, where vmap's grouped convolutions run slower, loops. A subclass or a component changes the step,
    so the check is not inherited."""
    if requested != "auto":
        return requested
    if device_type != "cuda" or not algorithm.vectorised or (compile and not algorithm.compiles_vectorised):
        return "loop"
    checked = vars(algorithm).get("graph_checked_on_gpu", False) and not components
    return "graph" if checked else "vmap"


def build_client(
    run_config: Mapping[str, Any], node: Mapping[str, Any], state: RecordDict
) -> FlowerClient | CohortClient:
    """The algorithm's client for the partition named in the node config (with ``engine=cohort``: the
    clients of the cohort it names), its data on the device."""
    import torch

    from ..core.algorithm import client_class
    from ..core.config import components_of, from_run_config
    from ..core.errors import ConfigError
    from ..core.training import use_device
    from ..data.dataset import load_client_data, load_cohort_data

    cfg = from_run_config(run_config)
    if "partition-id" not in node:
        raise ConfigError(
            "this SuperNode has no 'partition-id' in its node config: start it with "
            '--node-config "partition-id=<i> num-partitions=<n>"'
        )
    pid = int(node["partition-id"])
    run = common(cfg)
    num_partitions = int(node.get("num-partitions", run.num_clients or 0))
    if run.engine == "cohort":
        if not run.num_clients:
            raise ConfigError("engine=cohort needs num-clients: the cohorts share them out")
        if not 0 <= pid < num_partitions <= run.num_clients or run.cohorts not in (0, num_partitions):
            raise ConfigError(
                f"engine=cohort with {run.num_clients} clients and cohorts = {run.cohorts}, but "
                f"this SuperNode is {pid} of {num_partitions}: start the simulation with "
                "num-supernodes = cohorts, at most num-clients (fedbr-run does this)"
            )
        torch.set_num_threads(run.client_cpus)
        device = use_device(cfg)
        members, packed = load_cohort_data(cfg, cohort_members(cfg, pid, num_partitions), device)
        first = next(iter(members.values()))
        algorithm = client_class(run.strategy)
        if run.cohort_step == "graph" and device.type != "cuda":
            raise ConfigError(
                f"cohort-step=graph replays CUDA graphs, but this cohort's device is {device}: "
                "use cohort-step=vmap or loop"
            )
        step = cohort_step(run.cohort_step, device.type, algorithm, components_of(cfg), run.compile)
        return CohortClient(
            algorithm(cfg, first, device), members, packed, vectorised=step in ("vmap", "graph"), graph=step == "graph"
        )
    if run.num_clients and num_partitions and run.num_clients != num_partitions:
        raise ConfigError(
            f"num-clients = {run.num_clients} but this SuperNode was told num-partitions = "
            f"{num_partitions}: drop num-clients, or give every node {run.num_clients} partitions (a simulation's "
            f"num-supernodes={run.num_clients}, a SuperNode's --num-partitions {run.num_clients})"
        )
    num_clients = run.num_clients or num_partitions
    if not num_clients:
        raise ConfigError("num-clients is 0 and the SuperNode has no num-partitions: set one of them")
    cfg["num-clients"] = num_clients
    if node.get("data-dir"):  # this machine's copy of the dataset
        cfg["data-dir"] = str(node["data-dir"])
    torch.set_num_threads(run.client_cpus)
    device = use_device(cfg)
    data = load_client_data(cfg, pid, device)
    return FlowerClient(client_class(run.strategy)(cfg, data, device, RecordState(state)))


class ClientCache:
    """The one cache of a client process (a simulation actor, a deployment worker): one client per
    (run, partition, settings), with its data and model on the device, built on first use and reused by
    later messages. Its one eviction rule: the clients of all but the ``runs_kept`` most recent runs are
    dropped, and with them everything they hold."""

    def __init__(self, runs_kept: int = 2):
        self.runs_kept = runs_kept
        self.clients: dict[tuple[int, int, str], FlowerClient | CohortClient] = {}  # oldest runs first
        self._lock = threading.Lock()  # the in-process backend's threads build a run's clients at once

    def get(
        self, run_id: int, run_config: Mapping[str, Any], node: Mapping[str, Any], state: RecordDict
    ) -> FlowerClient | CohortClient:
        """The client for this message, holding ``state`` (Flower's node state, a new copy per message)."""
        settings = json.dumps({"run": dict(run_config), "node": dict(node)}, sort_keys=True, default=str)
        key = (int(run_id), int(node.get("partition-id", -1)), settings)
        with self._lock:
            client = self.clients.get(key)
        if client is None:
            built = build_client(run_config, node, state)  # outside the lock: clients build in parallel
            with self._lock:
                client = self.clients.setdefault(key, built)
                self._forget_old_runs()
        client.use_state(state)
        return client

    def _forget_old_runs(self) -> None:
        runs = list(dict.fromkeys(run for run, _, _ in self.clients))
        for old in runs[: -self.runs_kept]:
            for key in [k for k in self.clients if k[0] == old]:
                del self.clients[key]
