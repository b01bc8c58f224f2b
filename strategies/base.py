"""The Flower side every algorithm's strategy shares: client discovery and seeded sampling, the
evaluation schedule, server-side evaluation on the global test set, and recording of the run files.
Subclasses override Flower-free hooks: ``aggregate`` (a rule over lists of arrays),
``aggregation_weights`` (GroupDRO), ``fit_extras`` (arrays sent after the weights: SCAFFOLD's c,
FedCM's Delta), ``extra_initial_weights`` (modules averaged beside the model: FedBR's head, DANN's
discriminator), ``make_shared_data`` (data broadcast once: FedBR, FedMix, VHL) and ``fit_config``."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from flwr.common import (EvaluateIns, EvaluateRes, FitIns, FitRes, GetParametersIns, GetPropertiesIns, Parameters,
                         ndarrays_to_parameters, parameters_to_ndarrays)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from fedbr_flwr.broadcast import SharedData
from fedbr_flwr.config import ConfigError
from fedbr_flwr.dataset import save_partition
from fedbr_flwr.partition import heterogeneity_from_counts
from fedbr_flwr.registry import client_class
from fedbr_flwr.run_io import RunRecorder, save_npz_atomically
from fedbr_flwr.training import evaluate, get_weights, set_weights

log = logging.getLogger("flwr")
DISCOVERY_TIMEOUT_S = 600
NOT_TRAINING_METRICS = ("partition-id", "fit-seconds")  # bookkeeping, not averaged (nor are "*-version")


def weighted_mean(arrays: list[list[np.ndarray]], weights: list[float]) -> list[np.ndarray]:
    """Layer-wise sum_i w_i * arrays_i / sum_i w_i (in float64, cast back to each layer's dtype)."""
    if not arrays:
        raise ValueError("nothing to average")
    w = np.asarray(weights, dtype=np.float64)
    if len(w) != len(arrays):
        raise ValueError(f"{len(arrays)} updates but {len(w)} weights")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"averaging weights must be >= 0 with a positive sum, got {weights}")
    w = w / w.sum()
    out = []
    for layers in zip(*arrays):
        acc = np.zeros(layers[0].shape, dtype=np.float64)
        for wi, layer in zip(w, layers):
            acc += wi * layer
        out.append(acc.astype(layers[0].dtype))
    return out


class FederatedStrategy(Strategy):
    def __init__(self, cfg: dict[str, Any], recorder: RunRecorder, model: torch.nn.Module,
                 global_test: tuple[torch.Tensor, torch.Tensor] | None):
        self.cfg = cfg
        self.recorder = recorder
        self.client_class = client_class(cfg["strategy"])
        device = next(model.parameters()).device
        # the global model, for initial weights and server-side evaluation: the backbone as the clients wrap it
        self.model = self.client_class.wrap_model(model, cfg).to(device)
        self.global_test = global_test
        self.clients_by_pid: dict[int, ClientProxy] = {}
        self.pid_by_cid: dict[str, int] = {}
        self._global_acc: dict[int, tuple[float, float]] = {}
        self._fit_start = 0.0
        self._last_train: dict[str, float] = {}
        self.num_model_arrays = len(self.model.state_dict())
        self.sampled: list[int] = []  # partition ids sent fit instructions this round
        self.result_pids: list[int] = []  # partition ids of the updates being aggregated, in their order
        self.class_counts: dict[int, np.ndarray] = {}  # each client's training samples per class
        self.server_metrics: dict[str, float] = {}  # what aggregate() measured this round (recorded with it)
        self.shared: SharedData | None = None  # data broadcast to every client (set by FedBR, FedMix, VHL)

    # ------------------------------------------------------------ hooks for algorithms
    def aggregate(self, arrays: list[list[np.ndarray]], weights: list[float]) -> list[np.ndarray]:
        return weighted_mean(arrays, weights)

    def fit_config(self, server_round: int, pid: int) -> dict[str, Any]:
        shared = self.shared.fit_config(pid) if self.shared is not None else {}
        return {"server-round": server_round, **shared}

    def fit_extras(self) -> list[np.ndarray]:
        """Arrays sent to every sampled client after the weights with this round's fit instructions
        (SCAFFOLD's c, FedCM's Delta); serialised once per round. Per-client arrays: ``client_parameters``."""
        return []

    def aggregation_weights(self, results: list[FitRes]) -> list[float]:
        """One weight per update, in the order of ``results`` (GroupDRO's come from the clients' losses)."""
        return [res.num_examples if self.cfg["weighting"] == "samples" else 1.0 for res in results]

    def make_shared_data(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) to broadcast as ``self.shared``; called before round 1 and whenever ``shared_is_stale``."""
        raise NotImplementedError

    def shared_is_stale(self, server_round: int) -> bool:
        return self.shared.arrays is None

    def extra_initial_weights(self) -> list[np.ndarray]:
        """Arrays trained and averaged beside the model (e.g. FedBR's projection head), sent after it."""
        return []

    def client_parameters(self, parameters: Parameters, pid: int) -> Parameters:
        """What client ``pid`` receives with fit and evaluate instructions (DisTrans adds its offset)."""
        return parameters

    def after_discovery(self) -> dict[str, Any]:
        """Called once every client has reported its partition; returns extra manifest entries."""
        return {}

    def global_test_module(self) -> torch.nn.Module:
        """What the server evaluates on the global test set, once ``self.model`` holds the new weights."""
        return self.client_class.predictor(self.model, self.cfg)

    # ------------------------------------------------------------ Flower Strategy API
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return ndarrays_to_parameters(get_weights(self.model) + self.extra_initial_weights())

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                      ) -> list[tuple[ClientProxy, FitIns]]:
        if not self.clients_by_pid:
            self._discover(client_manager)
        self._fit_start = time.perf_counter()
        if self.shared is not None and self.shared_is_stale(server_round):
            self.refresh_shared_data(server_round)
        self.sampled = self.sample_partitions(server_round)
        extras = ndarrays_to_parameters(self.fit_extras()).tensors
        return [(self.clients_by_pid[pid],
                 FitIns(self._with_extras(self.client_parameters(parameters, pid), extras),
                        self.fit_config(server_round, pid)))
                for pid in self.sampled]

    @staticmethod
    def _with_extras(parameters: Parameters, extras: list[bytes]) -> Parameters:
        if not extras:
            return parameters
        return Parameters(tensors=[*parameters.tensors, *extras], tensor_type=parameters.tensor_type)

    def refresh_shared_data(self, server_round: int) -> None:
        """Build the broadcast data anew; it is saved as <name>_data.npz in the run folder."""
        x, y = self.make_shared_data(server_round)
        self.shared.publish(x, y, server_round)
        save_npz_atomically(self.recorder.out_dir / f"{self.shared.name}_data.npz", x=x, y=y, version=server_round)

    def sample_partitions(self, server_round: int) -> list[int]:
        """Seeded by (seed, round) over partition ids, so runs repeat whatever Flower's node ids are."""
        pids = sorted(self.clients_by_pid)
        m = max(1, int(round(self.cfg["fraction-fit"] * len(pids))))
        if m >= len(pids):
            return pids
        rng = np.random.default_rng([self.cfg["seed"], 6, server_round])
        return sorted(rng.choice(pids, size=m, replace=False).tolist())

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list) -> tuple[Parameters | None, dict[str, Any]]:
        for failure in failures:
            log.warning("[fedbr] round %d: a client failed: %r", server_round, _describe(failure))
        results = _in_partition_order(results)
        self.result_pids = [int(res.metrics["partition-id"]) for _, res in results]
        if self.shared is not None:
            self.shared.confirm({int(res.metrics["partition-id"]): res.metrics for _, res in results}, self.sampled)
        self.server_metrics = {}
        new = None
        if results:
            arrays = [parameters_to_ndarrays(res.parameters) for _, res in results]
            weights = self.aggregation_weights([res for _, res in results])
            new = ndarrays_to_parameters(self.aggregate(arrays, weights))
        self._last_train = _mean_metrics([res.metrics for _, res in results], skip=NOT_TRAINING_METRICS)
        self.recorder.log_round({
            "round": server_round, "clients": len(results), "failures": len(failures),
            "train": self._last_train, "seconds": round(time.perf_counter() - self._fit_start, 4),
            "client_fit_seconds": max((res.metrics.get("fit-seconds", 0.0) for _, res in results), default=0.0),
            **({"server": self.server_metrics} if self.server_metrics else {}),
        })
        if not results:
            log.error("[fedbr] round %d: no client returned an update; the global model is unchanged", server_round)
        return new, self._last_train

    def is_eval_round(self, server_round: int) -> bool:
        return server_round % self.cfg["eval-every"] == 0 or server_round == self.cfg["num-rounds"]

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                           ) -> list[tuple[ClientProxy, EvaluateIns]]:
        if not self.is_eval_round(server_round):
            return []
        config = {"server-round": server_round}
        return [(self.clients_by_pid[pid], EvaluateIns(self.client_parameters(parameters, pid), config))
                for pid in sorted(self.clients_by_pid)]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list) -> tuple[float | None, dict[str, Any]]:
        results = _in_partition_order(results)
        per_client = {int(res.metrics["partition-id"]): float(res.metrics["accuracy"]) for _, res in results}
        if not per_client:
            log.error("[fedbr] round %d: no client returned an evaluation", server_round)
            return None, {}
        n = sum(res.num_examples for _, res in results)
        loss = sum(res.loss * res.num_examples for _, res in results) / max(n, 1)
        accs = list(per_client.values())
        global_loss, global_acc = self._global_acc.get(server_round, (None, None))
        record = {
            "round": server_round,
            "mean_acc": float(np.mean(accs)),
            "worst_acc": float(np.min(accs)),
            "pooled_acc": sum(res.metrics["accuracy"] * res.num_examples for _, res in results) / max(n, 1),
            "loss": loss,
            "global_acc": global_acc,
            "global_loss": global_loss,
            "train": self._last_train,
            "per_client_acc": {str(k): per_client[k] for k in sorted(per_client)},
            "eval_failures": len(failures),
        }
        self.recorder.log_eval(record)
        if server_round == self.cfg["num-rounds"]:
            self.recorder.finalize()
        return loss, {"mean_acc": record["mean_acc"], "worst_acc": record["worst_acc"]}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Any]] | None:
        if self.global_test is None or server_round == 0 or not self.is_eval_round(server_round):
            return None
        set_weights(self.model, parameters_to_ndarrays(parameters)[:self.num_model_arrays])
        device = next(self.model.parameters()).device
        x, y = self.global_test
        loss, acc = evaluate(self.global_test_module(), x.to(device), y.to(device))
        self._global_acc[server_round] = (loss, acc)
        return loss, {"global_acc": acc}

    # ------------------------------------------------------------ discovery
    def _discover(self, client_manager: ClientManager) -> None:
        """Ask every node for its partition id once, so that sampling and per-client metrics are
        keyed by partition and a mis-configured federation stops with a clear message. Nodes that
        are already connected answer first, so a wrong federation size fails at once instead of
        after the wait for nodes that may still be starting (deployment)."""
        expected = self.cfg["num-clients"]
        client_manager.wait_for(1, timeout=DISCOVERY_TIMEOUT_S)
        deadline = time.monotonic() + DISCOVERY_TIMEOUT_S
        hashes = set()
        while True:
            new = [p for cid, p in client_manager.all().items() if cid not in self.pid_by_cid]
            for proxy, props in self._ask_partitions(new):
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
                hashes.add(props["partition-hash"])
            num = len(self.clients_by_pid)
            if num >= (expected or 1):
                break
            if time.monotonic() > deadline:
                raise ConfigError(f"num-clients = {expected} but only {num} SuperNodes connected within "
                                  f"{DISCOVERY_TIMEOUT_S} s; start it with num-supernodes={expected} "
                                  "(fedbr-run does this)")
            log.info("[fedbr] %d of %d SuperNodes connected; waiting", num, expected)
            client_manager.wait_for(num + 1, timeout=min(10, DISCOVERY_TIMEOUT_S))
        if expected and num != expected:
            raise ConfigError(f"num-clients = {expected} but the federation has {num} SuperNodes; "
                              f"start it with num-supernodes={expected} (fedbr-run does this)")
        if sorted(self.clients_by_pid) != list(range(num)):
            raise ConfigError(f"partition ids must be 0..{num - 1}, got {sorted(self.clients_by_pid)}")
        if len(hashes) != 1:
            raise ConfigError(f"clients built different partitions (hashes {sorted(hashes)}): check that every "
                              "SuperNode has the same dataset files and run config")
        self.cfg["num-clients"] = num
        self.recorder.cfg["num-clients"] = num
        client_hash = hashes.pop()
        try:
            server_hash = save_partition(self.cfg, self.recorder.out_dir / "partition.npz")
        except ConfigError as exc:  # a deployed server may lack the dataset files: record what clients said
            log.warning("[fedbr] partition not saved (%s)", exc)
            server_hash = client_hash
        if server_hash != client_hash:
            raise ConfigError(f"the clients' partition (hash {client_hash}) differs from the server's "
                              f"({server_hash}): check that both use the same dataset files and config")
        extra = self.after_discovery()
        self.recorder.write_manifest(partition_hash=client_hash, num_partitions=num, **self.partition_stats(),
                                     **extra)
        log.info("[fedbr] %d clients found; writing run files to %s", num, self.recorder.out_dir)

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

    def request_arrays(self, requests: dict[int, dict[str, Any]], group: int, what: str
                       ) -> dict[int, list[np.ndarray]]:
        """Send each listed client a ``get_parameters`` message with its config, in parallel; return
        the arrays each answered (FedBR's RSM means, FedMix's mean data). ``what`` names them in errors."""

        def ask(pid: int) -> tuple[int, list[np.ndarray]]:
            try:
                res = self.clients_by_pid[pid].get_parameters(GetParametersIns(requests[pid]), None, group)
            except Exception as exc:  # the node's ClientApp raised: its message says why
                raise RuntimeError(f"client {pid} could not send {what}: {exc}") from None
            if res.status.code.value != 0:
                raise RuntimeError(f"client {pid} could not send {what}: {res.status.message}")
            return pid, parameters_to_ndarrays(res.parameters)

        with ThreadPoolExecutor(max_workers=min(32, max(1, len(requests)))) as pool:
            return dict(pool.map(ask, list(requests)))

    @staticmethod
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


def _in_partition_order(results: list) -> list:
    """Results arrive in completion order; a fixed order keeps float sums, and so runs, repeatable."""
    return sorted(results, key=lambda r: int(r[1].metrics.get("partition-id", -1)))


def _mean_metrics(metrics: list[dict], skip: tuple[str, ...]) -> dict[str, float]:
    keys = {k for m in metrics for k in m
            if k not in skip and not k.endswith("-version") and isinstance(m[k], (int, float))}
    return {k: float(np.mean([m[k] for m in metrics if k in m])) for k in sorted(keys)}


def _describe(failure: Any) -> str:
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {failure}"
    return str(failure)
