"""The Flower side every algorithm's strategy shares: client discovery and seeded sampling, the
evaluation schedule, server-side evaluation on the global test set, and recording of the run files.
Subclasses override Flower-free hooks: ``aggregate`` (a rule over lists of arrays),
``aggregation_weights`` (GroupDRO), ``fit_extras`` (arrays sent after the weights: SCAFFOLD's c,
FedCM's Delta), ``extra_initial_weights`` (modules averaged beside the model: FedBR's head, DANN's
discriminator), ``make_shared_data`` (data broadcast once: FedBR, FedMix, VHL), ``fit_config``, and
``checkpoint_state`` / ``restore_state`` (what a checkpoint must hold beyond the global weights).

Faults: an update with the wrong number or shapes of arrays, NaN/Inf values or non-finite metrics
is rejected before aggregation; failed, missing and rejected clients are recorded in rounds.jsonl,
and a round with fewer than ``min-fit-clients`` valid updates leaves the global model unchanged."""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
from flwr.common import (EvaluateIns, EvaluateRes, FitIns, FitRes, GetParametersIns, GetPropertiesIns, Parameters,
                         ndarrays_to_parameters, parameters_to_ndarrays)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from fedbr_flwr.broadcast import SharedData
from fedbr_flwr.checkpoint import flatten, rng_state, save_checkpoint, set_rng_state, unflatten
from fedbr_flwr.config import ConfigError, sampled_per_round
from fedbr_flwr.dataset import save_partition
from fedbr_flwr.partition import heterogeneity_from_counts
from fedbr_flwr.registry import client_class
from fedbr_flwr.run_io import RunRecorder, code_hash, save_npz_atomically
from fedbr_flwr.training import evaluate, get_weights, set_weights

log = logging.getLogger("flwr")
DISCOVERY_TIMEOUT_S = 600
# bookkeeping, not averaged (nor are "*-version")
NOT_TRAINING_METRICS = ("partition-id", "fit-seconds", "peak-rss-mb", "peak-gpu-mb")


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


def update_problem(arrays: list[np.ndarray], shapes: list[tuple[int, ...]] | None, metrics: dict[str, Any]
                   ) -> str | None:
    """Why a client's update must not be averaged in, or None when it may be (``shapes``: what it must
    hold, None: not known)."""
    if shapes is not None and len(arrays) != len(shapes):
        return f"{len(arrays)} arrays, expected {len(shapes)}"
    for i, a in enumerate(arrays):
        if shapes is not None and tuple(a.shape) != tuple(shapes[i]):
            return f"array {i} has shape {tuple(a.shape)}, expected {tuple(shapes[i])}"
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            return f"array {i} holds NaN or Inf"
    bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        return f"metrics {', '.join(bad)} are NaN or Inf"
    return None


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
        self._bytes_down = 0  # payload of this round's fit instructions
        self._last_train: dict[str, float] = {}
        self.num_model_arrays = len(self.model.state_dict())
        self.sampled: list[int] = []  # partition ids sent fit instructions this round
        self.result_pids: list[int] = []  # partition ids of the updates being aggregated, in their order
        self.class_counts: dict[int, np.ndarray] = {}  # each client's training samples per class
        self.server_metrics: dict[str, float] = {}  # what aggregate() measured this round (recorded with it)
        self.shared: SharedData | None = None  # data broadcast to every client (set by FedBR, FedMix, VHL)
        self.update_shapes: list[tuple[int, ...]] | None = None  # what each client update must hold
        self._round_parameters: Parameters | None = None  # the global weights sent this round
        self.latest: list[np.ndarray] | None = None  # the global weights after the last finished round
        self.client_states: dict[int, bytes] = {}  # each client's own state, as last collected (SCAFFOLD's c_i)
        self.pending_client_states: dict[int, bytes] = {}  # after a resume: handed back until each client answers
        self.resumed_round = 0  # the checkpoint's round when this run continues another
        self._resume_arrays: dict[str, np.ndarray] | None = None  # strategy state, restored after discovery

    # ------------------------------------------------------------ hooks for algorithms
    def aggregate(self, arrays: list[list[np.ndarray]], weights: list[float]) -> list[np.ndarray]:
        return weighted_mean(arrays, weights)

    def fit_config(self, server_round: int, pid: int) -> dict[str, Any]:
        shared = self.shared.fit_config(pid) if self.shared is not None else {}
        return {"server-round": server_round, **shared, **self._client_state_config(pid)}

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

    def returned_extra_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the arrays each client returns after the global ones (SCAFFOLD's Delta c_i, DisTrans' offset)."""
        return []

    def checkpoint_state(self) -> dict[str, np.ndarray]:
        """Strategy state a checkpoint holds beyond the global weights; subclasses add theirs to this."""
        if self.shared is None or self.shared.arrays is None:
            return {}
        x, y = self.shared.arrays
        return {"shared/x": x, "shared/y": y, "shared/version": np.array(self.shared.version)}

    def restore_state(self, arrays: dict[str, np.ndarray]) -> None:
        """The inverse of ``checkpoint_state``; called after discovery, before the first resumed round."""
        if self.shared is not None and "shared/x" in arrays:  # clients lost it with the old run: all are sent it
            self.shared.publish(arrays["shared/x"], arrays["shared/y"], int(arrays["shared/version"]))

    # ------------------------------------------------------------ Flower Strategy API
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        if self.latest is not None:  # resumed: the checkpoint's weights
            return ndarrays_to_parameters(self.latest)
        return ndarrays_to_parameters(get_weights(self.model) + self.extra_initial_weights())

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                      ) -> list[tuple[ClientProxy, FitIns]]:
        if not self.clients_by_pid:
            self._discover(client_manager)
        if self._resume_arrays is not None:
            self._restore_after_discovery()
        self._fit_start = time.perf_counter()
        self._round_parameters = parameters
        if self.update_shapes is None:
            self.update_shapes = [a.shape for a in parameters_to_ndarrays(parameters)] + self.returned_extra_shapes()
        if self.shared is not None and self.shared_is_stale(server_round):
            self.refresh_shared_data(server_round)
        self.sampled = self.sample_partitions(server_round)
        extras = ndarrays_to_parameters(self.fit_extras()).tensors
        instructions = [(self.clients_by_pid[pid],
                         FitIns(self._with_extras(self.client_parameters(parameters, pid), extras),
                                self.fit_config(server_round, pid)))
                        for pid in self.sampled]
        self._bytes_down = sum(payload_bytes(ins.parameters, ins.config) for _, ins in instructions)
        return instructions

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
        m = sampled_per_round(self.cfg["fraction-fit"], len(pids))
        if m >= len(pids):
            return pids
        rng = np.random.default_rng([self.cfg["seed"], 6, server_round])
        return sorted(rng.choice(pids, size=m, replace=False).tolist())

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list) -> tuple[Parameters | None, dict[str, Any]]:
        results = _in_partition_order(results)
        errors = [self._describe_failure(f) for f in failures]
        for error in errors:
            log.warning("[fedbr] round %d: a client failed: %s", server_round, error)
        if self.shared is not None:
            self.shared.confirm({self._pid(proxy, res): res.metrics for proxy, res in results}, self.sampled)
        accepted, rejected = [], []
        for proxy, res in results:
            arrays = parameters_to_ndarrays(res.parameters)
            problem = update_problem(arrays, self.update_shapes, res.metrics)
            if problem is None:
                accepted.append((self._pid(proxy, res), res, arrays))
                self.pending_client_states.pop(self._pid(proxy, res), None)
            else:
                rejected.append({"partition": self._pid(proxy, res), "reason": problem})
                log.warning("[fedbr] round %d: update of client %s rejected: %s", server_round,
                            self._pid(proxy, res), problem)
        self.result_pids = [pid for pid, _, _ in accepted]
        missing = sorted(set(self.sampled) - {self._pid(proxy, res) for proxy, res in results})
        self.server_metrics = {}
        new = None
        skipped = len(accepted) < self.cfg["min-fit-clients"]
        if skipped:
            log.error("[fedbr] round %d: %d valid update(s), min-fit-clients = %d: the global model is unchanged",
                      server_round, len(accepted), self.cfg["min-fit-clients"])
        else:
            weights = self.aggregation_weights([res for _, res, _ in accepted])
            self.latest = self.aggregate([arrays for _, _, arrays in accepted], weights)
            new = ndarrays_to_parameters(self.latest)
        if new is None and self._round_parameters is not None:
            self.latest = parameters_to_ndarrays(self._round_parameters)
        self._last_train = _mean_metrics([res.metrics for _, res, _ in accepted], skip=NOT_TRAINING_METRICS)
        faults = {"failed_clients": missing, "errors": errors, "rejected": rejected} \
            if missing or errors or rejected else {}
        self.recorder.log_round({
            "round": server_round, "clients": len(accepted), "failures": len(failures) + len(rejected),
            **faults, **({"skipped": True} if skipped else {}),
            "train": self._last_train, "seconds": round(time.perf_counter() - self._fit_start, 4),
            "client_fit_seconds": max((res.metrics.get("fit-seconds", 0.0) for _, res, _ in accepted), default=0.0),
            "bytes_down": self._bytes_down, "bytes_up": sum(payload_bytes(res.parameters) for _, res in results),
            **peak_client_memory([res.metrics for _, res, _ in accepted]),
            **({"server": self.server_metrics} if self.server_metrics else {}),
        })
        return new, self._last_train

    def _pid(self, proxy: ClientProxy, res: FitRes | EvaluateRes) -> int:
        """The partition a result comes from: the node's, as learnt at discovery (a broken client's
        metrics may lack it)."""
        if proxy is not None and proxy.cid in self.pid_by_cid:
            return self.pid_by_cid[proxy.cid]
        return int(res.metrics.get("partition-id", -1))

    def _describe_failure(self, failure: Any) -> str:
        if isinstance(failure, BaseException):
            return f"{type(failure).__name__}: {failure}"[:500]
        proxy, res = failure
        return f"client {self.pid_by_cid.get(proxy.cid, proxy.cid)}: {res.status.message}"[:500]

    def is_eval_round(self, server_round: int) -> bool:
        return server_round % self.cfg["eval-every"] == 0 or server_round == self.cfg["num-rounds"]

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager
                           ) -> list[tuple[ClientProxy, EvaluateIns]]:
        if not self.is_eval_round(server_round):
            self.end_round(server_round)  # Flower calls no aggregate_evaluate this round
            return []
        return [(self.clients_by_pid[pid], EvaluateIns(self.client_parameters(parameters, pid),
                                                       {"server-round": server_round, **self._client_state_config(pid)}))
                for pid in sorted(self.clients_by_pid)]

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list) -> tuple[float | None, dict[str, Any]]:
        results = _in_partition_order(results)
        per_client = {self._pid(proxy, res): float(res.metrics["accuracy"]) for proxy, res in results}
        for pid in per_client:
            self.pending_client_states.pop(pid, None)
        if not per_client:
            log.error("[fedbr] round %d: no client returned an evaluation", server_round)
            self.end_round(server_round)
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
            **({"eval_failed_clients": sorted(set(self.clients_by_pid) - set(per_client))} if failures else {}),
        }
        self.recorder.log_eval(record)
        self.end_round(server_round)
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

    # ------------------------------------------------------------ checkpoints
    def end_round(self, server_round: int) -> None:
        every = self.cfg["checkpoint-every"]
        if self.latest is not None and every and (server_round % every == 0 or server_round == self.cfg["num-rounds"]):
            self.save_checkpoint(server_round)

    def save_checkpoint(self, server_round: int) -> None:
        """Everything a resumed run needs to go on as if never stopped, in one atomically replaced file."""
        start = time.perf_counter()
        if self.client_class.state_keys:
            self.collect_client_states()
        arrays = {**flatten("global", self.latest), **self.checkpoint_state(), **rng_state(),
                  **{f"client-state/{pid}": np.frombuffer(b, dtype=np.uint8) for pid, b in self.client_states.items()}}
        header = {"round": server_round, "config": self.cfg, "elapsed": self.recorder.elapsed(),
                  "git_commit": self.cfg.get("git-commit", ""), "code_hash": code_hash(),
                  "utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        path = save_checkpoint(self.recorder.out_dir, arrays, header)
        log.info("[fedbr] round %d: checkpoint saved to %s (%.2f s)", server_round, path,
                 time.perf_counter() - start)

    def collect_client_states(self) -> None:
        """Ask every client for its own state (``state_keys`` of its context.state); a client that cannot
        answer keeps the state it last sent."""
        answers = self.request_arrays({pid: {"client-state": True} for pid in self.clients_by_pid}, 0,
                                      "its state for the checkpoint", required=False)
        for pid, (payload,) in answers.items():
            self.client_states[pid] = payload.tobytes()

    def resume_from(self, arrays: dict[str, np.ndarray], header: dict[str, Any]) -> None:
        """Continue after the checkpoint's round: its weights at once, the rest after discovery."""
        self.resumed_round = int(header["round"])
        self.latest = unflatten(arrays, "global")
        self.client_states = {int(k.split("/")[1]): v.tobytes() for k, v in arrays.items()
                              if k.startswith("client-state/")}
        self.pending_client_states = dict(self.client_states)
        self._resume_arrays = arrays

    def _restore_after_discovery(self) -> None:
        arrays, self._resume_arrays = self._resume_arrays, None
        self.restore_state(arrays)
        set_rng_state(arrays)
        log.info("[fedbr] resumed after round %d from %s", self.resumed_round, self.recorder.out_dir / "checkpoint.npz")

    def _client_state_config(self, pid: int) -> dict[str, Any]:
        return {"client-state": self.pending_client_states[pid]} if pid in self.pending_client_states else {}

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

    def request_arrays(self, requests: dict[int, dict[str, Any]], group: int, what: str, required: bool = True
                       ) -> dict[int, list[np.ndarray]]:
        """Send each listed client a ``get_parameters`` message with its config, in parallel; return
        the arrays each answered (FedBR's RSM means, FedMix's mean data). ``what`` names them in errors.
        With ``required=False`` a client that fails is logged and left out instead of raising."""
        timeout = self.cfg["round-timeout"] or None

        def ask_or_skip(pid: int) -> tuple[int, list[np.ndarray] | None]:
            try:
                return ask(pid)
            except RuntimeError as exc:
                if required:
                    raise
                log.warning("[fedbr] %s", exc)
                return pid, None

        def ask(pid: int) -> tuple[int, list[np.ndarray]]:
            try:
                res = self.clients_by_pid[pid].get_parameters(GetParametersIns(requests[pid]), timeout, group)
            except Exception as exc:  # the node's ClientApp raised: its message says why
                raise RuntimeError(f"client {pid} could not send {what}: {exc}") from None
            if res.status.code.value != 0:
                raise RuntimeError(f"client {pid} could not send {what}: {res.status.message}")
            return pid, parameters_to_ndarrays(res.parameters)

        with ThreadPoolExecutor(max_workers=min(32, max(1, len(requests)))) as pool:
            return {pid: arrays for pid, arrays in pool.map(ask_or_skip, list(requests)) if arrays is not None}

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


def payload_bytes(parameters: Parameters, config: dict[str, Any] | None = None) -> int:
    """Bytes of a message's arrays and of its config's byte and string values (e.g. FedBR's pseudo-data)."""
    size = sum(len(t) for t in parameters.tensors)
    return size + sum(len(v) for v in (config or {}).values() if isinstance(v, (bytes, str)))


def peak_client_memory(metrics: list[dict]) -> dict[str, float]:
    """The largest peak memory any client process reported this round (keys as in rounds.jsonl)."""
    names = {"peak-rss-mb": "client_peak_rss_mb", "peak-gpu-mb": "client_peak_gpu_mb"}
    return {name: max(m[key] for m in metrics if key in m)
            for key, name in names.items() if any(key in m for m in metrics)}


def _mean_metrics(metrics: list[dict], skip: tuple[str, ...]) -> dict[str, float]:
    keys = {k for m in metrics for k in m
            if k not in skip and not k.endswith("-version") and isinstance(m[k], (int, float))}
    return {k: float(np.mean([m[k] for m in metrics if k in m])) for k in sorted(keys)}


class ResumedRun(Strategy):
    """Flower numbers a resumed run's rounds from 1 again: this shifts them by the checkpoint's round,
    so that the strategy sees (and records) the rounds of the run it continues."""

    def __init__(self, strategy: FederatedStrategy, rounds_done: int):
        self.strategy = strategy
        self.offset = rounds_done

    def initialize_parameters(self, client_manager):
        return self.strategy.initialize_parameters(client_manager)

    def configure_fit(self, server_round, parameters, client_manager):
        return self.strategy.configure_fit(server_round + self.offset, parameters, client_manager)

    def aggregate_fit(self, server_round, results, failures):
        return self.strategy.aggregate_fit(server_round + self.offset, results, failures)

    def configure_evaluate(self, server_round, parameters, client_manager):
        return self.strategy.configure_evaluate(server_round + self.offset, parameters, client_manager)

    def aggregate_evaluate(self, server_round, results, failures):
        return self.strategy.aggregate_evaluate(server_round + self.offset, results, failures)

    def evaluate(self, server_round, parameters):
        if server_round == 0:  # Flower's evaluation before its first round: the checkpoint's round, done already
            return None
        return self.strategy.evaluate(server_round + self.offset, parameters)
