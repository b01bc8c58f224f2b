"""The Flower adapter: Flower's legacy Strategy API in, plain Python out. It runs a round with the
server's parts (``Federation``, ``Checkpointer``, the recorder) and calls the hooks that
``strategies.base.FederatedStrategy`` defines with FedAvg's behaviour and algorithms override. Flower
types (Parameters, FitRes, ClientProxy) stop here: the hooks see partition ids, named arrays and dicts."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
from flwr.common import EvaluateIns, FitIns, Parameters
from flwr.server.client_manager import ClientManager
from flwr.server.strategy import Strategy

from .. import payload
from ..dataset import FILE_DATASETS, data_folder, partition_sizes, save_partition
from ..errors import ConfigError
from ..training import evaluate, load_module_arrays
from . import routing
from .checkpointing import Checkpointer
from .federation import Federation
from .recording import eval_record, round_record
from .updates import ClientUpdate, byte_budget, count_problem, known_size, screen_evaluations, update_problem


class FlowerStrategy(Strategy):
    required_metrics: tuple[str, ...] = ()  # fit metrics the strategy reads (GroupDRO's first-loss)

    # What the algorithm layer (strategies/base.py, FederatedStrategy) provides and this adapter calls:
    # declared here for the type checker, defined there with FedAvg's behaviour.
    model: torch.nn.Module
    global_test: tuple[torch.Tensor, torch.Tensor] | None
    initial_arrays: Callable[[], payload.Named]
    returned_shapes: Callable[[], dict[str, tuple[int, ...]]]
    before_round: Callable[[int], None]
    round_arrays: Callable[[int, payload.Named], payload.Named]
    client_arrays: Callable[[int], payload.Named]
    fit_config: Callable[[int, int], dict[str, Any]]
    after_answers: Callable[[dict[int, dict]], None]
    aggregation_weights: Callable[[list[ClientUpdate]], list[float]]
    aggregate: Callable[[list[ClientUpdate], list[float]], payload.Named]
    after_aggregate: Callable[[payload.Named], None]
    after_discovery: Callable[[], dict[str, Any]]
    global_test_module: Callable[[], torch.nn.Module]
    reported_arrays: Callable[[payload.Named], payload.Named]
    checkpoint_state: Callable[[], payload.Named]
    restore_state: Callable[[payload.Named], None]

    def __init__(self, cfg: dict[str, Any], recorder, clients_have_state: bool):
        self.cfg = cfg
        self.recorder = recorder
        self.federation = Federation(cfg)
        self.checkpointer = Checkpointer(cfg, recorder, self.federation, clients_have_state)
        self.latest: payload.Named | None = None  # the global arrays after the last finished round
        self.round_global: payload.Named | None = None  # the global arrays sent this round
        self.update_spec: dict[str, tuple[int, ...]] | None = None  # names and shapes each update must hold
        self.update_dtypes: dict[str, np.dtype] | None = None  # and the dtype of each
        self.sampled: list[int] = []  # partition ids sent fit instructions this round
        self.server_metrics: dict[str, float] = {}  # what aggregate() measured this round (recorded with it)
        self._round: dict[str, Any] = {"start": time.perf_counter(), "bytes_down": 0}  # the round's start and bytes
        self._last_train: dict[str, float] = {}
        self._global_result: dict[int, tuple[float, float]] = {}
        self._served_result: dict[int, float] = {}  # the served model's global test accuracy, where another is reported

    # ------------------------------------------------------------ Flower's Strategy API
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters:
        return payload.to_parameters(self.latest if self.latest is not None else self.initial_arrays())

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        if not self.federation.discovered:
            self._discover(client_manager)
        self.checkpointer.restore_after_discovery(self.restore_state)
        sent = self.round_global = payload.from_parameters(parameters)
        self._round = {"start": time.perf_counter(), "bytes_down": 0}
        if self.update_spec is None:
            self.update_spec = {**{n: tuple(a.shape) for n, a in sent.items()}, **self.returned_shapes()}
            # what was sent comes back as it went; the other returned arrays are float32, like the model's
            self.update_dtypes = {
                **{n: np.dtype(np.float32) for n in self.returned_shapes()},
                **{n: a.dtype for n, a in sent.items()},
            }
        self.before_round(server_round)
        self.sampled = self.federation.sample(server_round)
        common = payload.Serialised.from_parameters(parameters) + payload.Serialised.of(
            self.round_arrays(server_round, sent)
        )
        parts = {
            pid: (payload.Serialised.of(self.client_arrays(pid)), self.fit_config(server_round, pid))
            for pid in self.sampled
        }
        instructions = [
            (proxy, FitIns(params, config))
            for proxy, params, config in routing.messages(self.federation, common, parts)
        ]
        self._round["bytes_down"] = sum(payload_bytes(ins.parameters, ins.config) for _, ins in instructions)
        return instructions

    def aggregate_fit(self, server_round: int, results: list, failures: list):
        answers = routing.fit_answers(self.federation, results, byte_budget(self.update_spec, self.update_dtypes))
        errors = [routing.describe_failure(self.federation, f) for f in failures]
        for error in errors:
            self.recorder.progress.emit("warning", f"round {server_round}: a client failed: {error}")
        self.after_answers({a.pid: a.metrics for a in answers})
        accepted, rejected = self._screen(server_round, answers)
        missing = sorted(set(self.sampled) - {a.pid for a in answers})
        self.server_metrics = {}
        skipped = len(accepted) < self.cfg["min-fit-clients"]
        if skipped:
            self.recorder.progress.emit(
                "error",
                f"round {server_round}: {len(accepted)} valid update(s), "
                f"min-fit-clients = {self.cfg['min-fit-clients']}: the global model "
                "is unchanged",
                round=server_round,
            )
            self.latest = self.round_global if self.round_global is not None else self.latest
        else:
            self.latest = self.aggregate(accepted, self.aggregation_weights(accepted))
            self.after_aggregate(self.latest)
            self.checkpointer.updates_used(server_round, [u.pid for u in accepted])
        record = round_record(
            server_round,
            accepted,
            len(failures),
            missing,
            errors,
            rejected,
            skipped,
            time.perf_counter() - self._round["start"],
            self._round["bytes_down"],
            sum(payload.nbytes(r.parameters) for _, r in results),
            self.server_metrics,
            routing.placement(answers),
        )
        self._last_train = record["train"]
        self.recorder.log_round(record)
        if skipped or self.latest is None:
            return None, self._last_train
        return payload.to_parameters(self.latest), self._last_train

    def configure_evaluate(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        if not self.is_eval_round(server_round):
            self.end_round(server_round)  # Flower calls no aggregate_evaluate this round
            return []
        parts = {
            pid: (
                payload.Serialised.of(self.client_arrays(pid)),
                {"server-round": server_round, **self.checkpointer.config_for(pid)},
            )
            for pid in self.federation.clients_by_pid
        }
        served = payload.from_parameters(parameters)
        reported = self.reported_arrays(served)
        common = (
            payload.Serialised.from_parameters(parameters) if reported is served else payload.Serialised.of(reported)
        )
        return [
            (proxy, EvaluateIns(params, config))
            for proxy, params, config in routing.messages(self.federation, common, parts)
        ]

    def aggregate_evaluate(self, server_round: int, results: list, failures: list):
        answers, rejected = screen_evaluations(
            routing.evaluate_answers(self.federation, results), self.federation.sizes
        )
        for r in rejected:
            self.recorder.progress.emit(
                "warning",
                f"round {server_round}: evaluation of client {r['partition']} not counted: it {r['reason']}",
                round=server_round,
            )
        for pid, *_ in answers:
            self.checkpointer.answered(pid)
        if not answers:
            self.recorder.progress.emit("error", f"round {server_round}: no client returned an evaluation")
            self.end_round(server_round)
            return None, {}
        record = eval_record(
            server_round,
            answers,
            len(failures),
            sorted(self.federation.clients_by_pid),
            self._last_train,
            self._global_result.get(server_round, (None, None)),
        )
        if rejected:
            record["eval_rejected"] = rejected
        if server_round in self._served_result:
            record["served_global_acc"] = self._served_result[server_round]
        self.recorder.log_eval(record)
        self.end_round(server_round)
        if server_round == self.cfg["num-rounds"]:
            self.recorder.finalize()
        return record["loss"], {"mean_acc": record["mean_acc"], "worst_acc": record["worst_acc"]}

    def evaluate(self, server_round: int, parameters: Parameters):
        if self.global_test is None or server_round == 0 or not self.is_eval_round(server_round):
            return None
        served = payload.from_parameters(parameters)
        reported = self.reported_arrays(served)
        if reported is not served:
            self._served_result[server_round] = self.global_test_accuracy(served)[1]
        loss, acc = self.global_test_accuracy(reported)
        self._global_result[server_round] = (loss, acc)
        return loss, {"global_acc": acc}

    def global_test_accuracy(self, arrays: payload.Named) -> tuple[float, float]:
        """(loss, accuracy) on the global test set of the model holding ``arrays``."""
        assert self.global_test is not None
        load_module_arrays(self.model, "model", arrays)
        device = next(self.model.parameters()).device
        x, y = self.global_test
        return evaluate(self.global_test_module(), x.to(device), y.to(device))

    # ------------------------------------------------------------ the round's parts
    def is_eval_round(self, server_round: int) -> bool:
        return server_round % self.cfg["eval-every"] == 0 or server_round == self.cfg["num-rounds"]

    def end_round(self, server_round: int) -> None:
        if self.latest is not None:
            self.checkpointer.round_completed(server_round, self.latest, self.checkpoint_state())

    def _screen(self, server_round: int, answers: list[routing.Answer]) -> tuple[list[ClientUpdate], list[dict]]:
        """Updates that may be averaged in, and the rejected ones with their reason."""
        accepted, rejected = [], []
        for a in answers:
            problem = (
                a.problem
                or count_problem(a.num_examples, known_size(self.federation.sizes, a.pid, 0), "training samples")
                or update_problem(a.arrays, self.update_spec, a.metrics, self.required_metrics, self.update_dtypes)
            )
            if problem is None:
                accepted.append(ClientUpdate(a.pid, a.arrays, a.num_examples, a.metrics))
                self.checkpointer.answered(a.pid)
            else:
                rejected.append({"partition": a.pid, "reason": problem})
                self.recorder.progress.emit(
                    "warning", f"round {server_round}: update of client {a.pid} rejected: {problem}", round=server_round
                )
        return accepted, rejected

    def _discover(self, client_manager: ClientManager) -> None:
        self.federation.discover(client_manager, say=lambda text: self.recorder.progress.emit("waiting", text))
        num = len(self.federation.clients_by_pid)
        self.cfg["num-clients"] = self.recorder.cfg["num-clients"] = num
        try:
            server_hash = save_partition(self.cfg, self.recorder.out_dir / "partition.npz")
            self.federation.sizes = partition_sizes(self.cfg)  # the server's own, not what clients said
        except ConfigError as exc:  # a deployed server may lack the dataset files: record what clients said
            self.recorder.progress.emit("warning", f"partition not saved ({exc})")
            server_hash = self.federation.partition_hash
        if server_hash != self.federation.partition_hash:
            raise ConfigError(
                f"the clients' partition (hash {self.federation.partition_hash}) differs from the "
                f"server's ({server_hash}): check that both use the same dataset files and config"
            )
        extra = self.after_discovery()
        if self.cfg["dataset"] in FILE_DATASETS:  # where this machine read it (clients resolve their own)
            extra = {"data_folder": str(data_folder(self.cfg["data-dir"])), **extra}
        self.recorder.write_manifest(
            partition_hash=server_hash, num_partitions=num, **self.federation.partition_stats(), **extra
        )
        self.recorder.progress.emit("start", f"{num} clients found; writing run files to {self.recorder.out_dir}")


def payload_bytes(parameters: Parameters, config: dict[str, Any] | None = None) -> int:
    """Bytes of a message's arrays and of its config's byte and string values (e.g. FedBR's pseudo-data)."""
    return payload.nbytes(parameters) + sum(len(v) for v in (config or {}).values() if isinstance(v, (bytes, str)))
