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

from ..core.attack import attack_manifest, attackers_that_answered
from ..core.config import common
from ..core.errors import ConfigError
from ..core.training import evaluate, load_module_arrays
from ..data.catalog import INFO, data_folder
from ..data.dataset import ServerTests, partition_class_counts, partition_sizes, save_partition
from ..server.recording import eval_record, round_record, server_test_fields
from ..server.robust import AggregationRound, JudgedGroup, RobustRule, RoundPlan
from ..server.updates import ClientUpdate, byte_budget, count_problem, known_size, screen_evaluations, update_problem
from . import payload, routing
from .checkpointing import Checkpointer
from .federation import Federation


class FlowerStrategy(Strategy):
    required_metrics: tuple[str, ...] = ()  # fit metrics the strategy reads, numbers >= 0 (GroupDRO's first-loss)

    # What the algorithm layer (strategies/base.py, FederatedStrategy) provides and this adapter calls:
    # declared here for the type checker, defined there with FedAvg's behaviour.
    model: torch.nn.Module
    server_tests: ServerTests | None
    initial_arrays: Callable[[], payload.Named]
    returned_shapes: Callable[[], dict[str, tuple[int, ...]]]
    before_round: Callable[[int], None]
    round_arrays: Callable[[int, payload.Named], payload.Named]
    client_arrays: Callable[[int], payload.Named]
    fit_config: Callable[[int, int], dict[str, Any]]
    after_answers: Callable[[dict[int, dict]], None]
    aggregation_weights: Callable[[list[ClientUpdate]], list[float]]
    judged_groups: Callable[[], tuple[JudgedGroup, ...]]
    aggregate: Callable[[AggregationRound], payload.Named]
    after_aggregate: Callable[[payload.Named], list[str]]
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
        self.sent: payload.Named | None = None  # the global arrays sent this round
        self.update_spec: dict[str, tuple[int, ...]] | None = None  # names and shapes each update must hold
        self.update_dtypes: dict[str, np.dtype] | None = None  # and the dtype of each
        self.sampled: list[int] = []  # partition ids sent fit instructions this round
        self.server_metrics: dict[str, float] = {}  # what aggregate() measured this round (recorded with it)
        run = common(cfg)
        self.robust_rule = RobustRule(
            run.aggregation, run.trim_fraction, run.byzantine_clients, run.norm_bound, run.norm_bound_multiple
        )
        self._round: dict[str, Any] = {"start": time.perf_counter(), "bytes_down": 0}  # the round's start and bytes
        self._last_train: dict[str, float] = {}
        self._server_results: dict[int, dict[str, Any]] = {}  # round -> the server-side tests' fields

    # ------------------------------------------------------------ Flower's Strategy API
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters:
        return payload.to_parameters(self.latest if self.latest is not None else self.initial_arrays())

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: ClientManager):
        if not self.federation.discovered:
            discover(self, client_manager)
        self.checkpointer.restore_after_discovery(self.restore_state)
        sent = self.sent = payload.from_parameters(parameters)
        self._round = {"start": time.perf_counter(), "bytes_down": 0}
        if self.update_spec is None:
            self.update_spec, self.update_dtypes = expected_updates(sent, self.returned_shapes())
        self.before_round(server_round)
        self.sampled = self.federation.sample(server_round)
        to_all = payload.Serialised.from_parameters(parameters) + payload.Serialised.of(
            self.round_arrays(server_round, sent)
        )
        parts = {
            pid: (payload.Serialised.of(self.client_arrays(pid)), self.fit_config(server_round, pid))
            for pid in self.sampled
        }
        instructions = [
            (p, FitIns(params, config)) for p, params, config in routing.messages(self.federation, to_all, parts)
        ]
        self._round["bytes_down"] = sum(payload_bytes(ins.parameters, ins.config) for _, ins in instructions)
        return instructions

    def aggregate_fit(self, server_round: int, results: list, failures: list):
        budget = byte_budget(self.update_spec, self.update_dtypes)
        answers = routing.fit_answers(self.federation, results, self.sampled, budget)
        errors = [routing.describe_failure(self.federation, f) for f in failures]
        self._warn(server_round, [f"a client failed: {error}" for error in errors])
        self.after_answers({a.pid: a.metrics for a in answers if a.pid in self.sampled})
        accepted, rejected = self._screen(server_round, answers)
        missing = sorted(set(self.sampled) - {a.pid for a in answers})
        self.server_metrics = {}
        plan, skipped = aggregate_accepted(self, server_round, accepted)
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
        record.update(plan.round_entry([u.pid for u in accepted], skipped))
        record.update(attackers_that_answered(self.cfg, {a.pid for a in answers}))
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
        to_all = reported_payload(parameters, self.reported_arrays)
        return [
            (proxy, EvaluateIns(params, config))
            for proxy, params, config in routing.messages(self.federation, to_all, parts)
        ]

    def aggregate_evaluate(self, server_round: int, results: list, failures: list):
        answers, rejected = screen_evaluations(
            routing.evaluate_answers(self.federation, results), self.federation.sizes
        )
        self._warn(
            server_round, [f"evaluation of client {r['partition']} not counted: it {r['reason']}" for r in rejected]
        )
        for pid, *_ in answers:
            self.checkpointer.answered(pid)
        if not answers:
            self.recorder.progress.emit("error", f"round {server_round}: no client returned an evaluation")
            self.end_eval_round(server_round)
            return None, {}
        record = eval_record(
            server_round,
            answers,
            len(failures),
            sorted(self.federation.clients_by_pid),
            self._last_train,
            self._server_results.pop(server_round, {}),
        )
        if rejected:
            record["eval_rejected"] = rejected
        self.recorder.log_eval(record)
        self.end_eval_round(server_round)
        return record["loss"], {"mean_acc": record["mean_acc"], "worst_acc": record["worst_acc"]}

    def evaluate(self, server_round: int, parameters: Parameters):
        tests = self.server_tests
        if tests is None or server_round == 0 or not is_server_test_round(self.cfg, server_round):
            return None
        served = payload.from_parameters(parameters)
        reported = self.reported_arrays(served)
        fields = self._server_results[server_round] = self.server_tests_of(reported)
        if reported is not served:  # FedDyn: the clients' mean is reported, the model they train from recorded
            fields["served_global_acc"] = self.server_tests_of(served).get("global_acc")
        loss = fields.get("global_loss", fields.get("extra_local_loss"))
        return loss, {k: v for k, v in fields.items() if isinstance(v, float) and not k.endswith("_loss")}

    def _warn(self, server_round: int, lines: list[str]) -> None:
        for line in lines:
            self.recorder.progress.emit("warning", f"round {server_round}: {line}", round=server_round)

    def server_tests_of(self, arrays: payload.Named) -> dict[str, Any]:
        """The server's tests of the model holding ``arrays``, as metrics.jsonl fields."""
        assert self.server_tests is not None
        load_module_arrays(self.model, "model", arrays)
        return run_server_tests(self.server_tests, self.global_test_module())

    # ------------------------------------------------------------ the round's parts
    def is_eval_round(self, server_round: int) -> bool:
        return is_eval_round(self.cfg, server_round)

    def end_eval_round(self, server_round: int) -> None:
        """end_round; at the last round also the run's summary and last event, with or without its evaluation."""
        self.end_round(server_round)
        if server_round == common(self.cfg).num_rounds:
            self.recorder.finalize()

    def end_round(self, server_round: int) -> None:
        self.recorder.tracking.flush()
        if self.latest is not None:
            self.checkpointer.round_completed(server_round, self.latest, self.checkpoint_state())

    def _screen(self, server_round: int, answers: list[routing.Answer]) -> tuple[list[ClientUpdate], list[dict]]:
        """Updates that may be averaged in, and the rejected ones with their reason."""
        expected = (self.update_spec, self.required_metrics, self.update_dtypes)
        accepted, rejected = screen_updates(answers, self.federation.sizes, *expected)
        for update in accepted:
            self.checkpointer.answered(update.pid)
        self._warn(server_round, [f"update of client {r['partition']} rejected: {r['reason']}" for r in rejected])
        return accepted, rejected


def aggregate_accepted(
    strategy: FlowerStrategy, server_round: int, accepted: list[ClientUpdate]
) -> tuple[RoundPlan, bool]:
    """The round's aggregation of the ``accepted`` updates into ``strategy.latest`` (its robust rule's plan), or
    the global model left unchanged where they are too few (then True: the round was skipped)."""
    plan = RoundPlan(strategy.robust_rule)
    problem = too_few_updates(strategy.cfg, strategy.robust_rule, len(accepted), bool(strategy.judged_groups()))
    if problem is not None:
        strategy.recorder.progress.emit("error", f"round {server_round}: {problem}", round=server_round)
        strategy.latest = strategy.sent if strategy.sent is not None else strategy.latest
        return plan, True
    # no configure_fit before it: the latest arrays, else the initial ones
    sent = strategy.sent if strategy.sent is not None else strategy.latest or strategy.initial_arrays()
    if not plan.is_mean:
        plan = strategy.robust_rule.plan([u.arrays for u in accepted], sent, strategy.judged_groups())
    weights = strategy.aggregation_weights(accepted)
    rnd = AggregationRound(server_round, sent, accepted, weights, plan)
    strategy.latest = strategy.aggregate(rnd)
    strategy._warn(server_round, strategy.after_aggregate(strategy.latest))
    strategy.checkpointer.updates_used(server_round, [u.pid for u in rnd.used])
    return plan, False


def discover(strategy: FlowerStrategy, client_manager: ClientManager) -> None:
    """The federation's clients found (``Federation.discover``), the partition checked, the manifest written."""
    federation, recorder, cfg = strategy.federation, strategy.recorder, strategy.cfg
    federation.discover(client_manager, say=lambda text: recorder.progress.emit("waiting", text))
    num = len(federation.clients_by_pid)
    cfg["num-clients"] = recorder.cfg["num-clients"] = num
    recorder.check_same_partition(federation.partition_hash)  # before partition.npz is written again
    server_hash = check_partition(cfg, federation, recorder)
    extra = {**strategy.after_discovery(), **attack_manifest(cfg)}
    run = common(cfg)
    if INFO[run.dataset].in_data_folder:  # where this machine read it (clients resolve their own)
        extra = {"data_folder": str(data_folder(run.data_dir)), **extra}
    recorder.write_manifest(partition_hash=server_hash, num_partitions=num, **federation.partition_stats(), **extra)
    recorder.progress.emit("start", f"{num} clients found; writing run files to {recorder.out_dir}")


def reported_payload(parameters: Parameters, reported_arrays: Callable[[payload.Named], payload.Named]):
    """What an evaluation sends: the served global arrays, or what the strategy reports instead (FedDyn)."""
    served = payload.from_parameters(parameters)
    reported = reported_arrays(served)
    return payload.Serialised.from_parameters(parameters) if reported is served else payload.Serialised.of(reported)


def is_eval_round(cfg: dict[str, Any], server_round: int) -> bool:
    run = common(cfg)
    return server_round % run.eval_every == 0 or server_round == run.num_rounds


def is_server_test_round(cfg: dict[str, Any], server_round: int) -> bool:
    """An evaluation round in which the server also runs its own tests (``server-test-every``)."""
    run = common(cfg)
    every, last = run.server_test_every, server_round == run.num_rounds
    return is_eval_round(cfg, server_round) and (not every or server_round % every == 0 or last)


def screen_updates(
    answers: list[routing.Answer],
    sizes: dict[int, tuple[int, int]],
    spec: dict[str, tuple[int, ...]] | None,
    required_metrics: tuple[str, ...],
    dtypes: dict[str, np.dtype] | None,
) -> tuple[list[ClientUpdate], list[dict]]:
    """The answers whose updates may be averaged in, and the others with the reason each is rejected."""
    accepted, rejected = [], []
    for a in answers:
        problem = (
            a.problem
            or count_problem(a.num_examples, known_size(sizes, a.pid, 0), "training samples")
            or update_problem(a.arrays, spec, a.metrics, required_metrics, dtypes)
        )
        if problem is None:
            accepted.append(ClientUpdate(a.pid, a.arrays, a.num_examples, a.metrics))
        else:
            rejected.append({"partition": a.pid, "reason": problem})
    return accepted, rejected


def expected_updates(
    sent: payload.Named, returned_shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, tuple[int, ...]], dict[str, np.dtype]]:
    """The names and shapes every update must hold, and their dtypes: what was sent comes back as it went; the
    other returned arrays are float32, like the model's."""
    shapes = {**{n: tuple(a.shape) for n, a in sent.items()}, **returned_shapes}
    dtypes = {**{n: np.dtype(np.float32) for n in returned_shapes}, **{n: a.dtype for n, a in sent.items()}}
    return shapes, dtypes


def too_few_updates(cfg: dict[str, Any], rule: RobustRule, valid: int, judged: bool = False) -> str | None:
    """Why a round with ``valid`` updates (with ``judged`` groups beside the model or without) leaves the global
    model unchanged (None: it aggregates)."""
    run = common(cfg)
    fewest = max(run.min_fit_clients, rule.fewest_updates(judged))
    if valid >= fewest:
        return None
    needs = "" if rule.name == "mean" else f", aggregation={rule.name} needs {fewest}"
    return f"{valid} valid update(s), min-fit-clients = {run.min_fit_clients}{needs}: the global model is unchanged"


def run_server_tests(tests: ServerTests, module: torch.nn.Module) -> dict[str, Any]:
    """The server's own tests of ``module`` (the global model), as metrics.jsonl fields."""
    device = next(module.parameters()).device
    by_angle = {angle: evaluate(module, x.to(device), y.to(device)) for angle, (x, y) in tests.global_copies.items()}
    extra = [evaluate(module, x.to(device), y.to(device)) for x, y in tests.extra_local]
    return server_test_fields(by_angle, extra)


def check_partition(cfg: dict[str, Any], federation: Federation, recorder) -> str:
    """Save the server's own partition and take its sizes and class histograms; its hash, which must equal the
    clients'. A deployed server that lacks the dataset files records what the clients said."""
    try:
        server_hash = save_partition(cfg, recorder.out_dir / "partition.npz")
        federation.sizes = partition_sizes(cfg)  # the server's own, not what clients said
        federation.class_counts = partition_class_counts(cfg)
    except ConfigError as exc:
        recorder.progress.emit("warning", f"partition not saved ({exc})")
        server_hash = federation.partition_hash
    if server_hash != federation.partition_hash:
        raise ConfigError(
            f"the clients' partition (hash {federation.partition_hash}) differs from the "
            f"server's ({server_hash}): check that both use the same dataset files and config"
        )
    return server_hash


def payload_bytes(parameters: Parameters, config: dict[str, Any] | None = None) -> int:
    """Bytes of a message's arrays and of its config's byte and string values (e.g. FedBR's pseudo-data)."""
    return payload.nbytes(parameters) + sum(len(v) for v in (config or {}).values() if isinstance(v, (bytes, str)))
