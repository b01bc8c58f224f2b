"""Test doubles shared by test modules."""

import os
from pathlib import Path

from flwr.server.client_proxy import ClientProxy

from fedbr_flwr.runfiles import jsonsafe


def stop_as_it_replaces(monkeypatch, name: str) -> None:
    """A command stopped (Ctrl-C, kill -9) as an atomic write renames a new ``name`` over the old one: that rename
    raises KeyboardInterrupt; every other file is renamed as usual."""

    def stopped_at(src, dst):
        if Path(dst).name == name:
            raise KeyboardInterrupt
        os.rename(src, dst)

    monkeypatch.setattr(jsonsafe.os, "replace", stopped_at)


class OfflineProxy(ClientProxy):
    """A client proxy whose messages all fail; tests override the ones they exercise."""

    def get_properties(self, ins, timeout, group_id):
        raise NotImplementedError

    def get_parameters(self, ins, timeout, group_id):
        raise NotImplementedError

    def fit(self, ins, timeout, group_id):
        raise NotImplementedError

    def evaluate(self, ins, timeout, group_id):
        raise NotImplementedError

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError


class InProcessProxy(ClientProxy):
    """Delivers Flower's messages to a NumPyClient object in this process, as a SuperNode would."""

    def __init__(self, client, cid=None):
        super().__init__(cid or f"node-{client.algorithm.pid}")
        self.client = client

    def get_properties(self, ins, timeout, group_id):
        from flwr.common import Code, GetPropertiesRes, Status

        return GetPropertiesRes(Status(Code.OK, ""), self.client.get_properties(ins.config))

    def get_parameters(self, ins, timeout, group_id):
        from flwr.common import Code, GetParametersRes, Status, ndarrays_to_parameters

        return GetParametersRes(Status(Code.OK, ""), ndarrays_to_parameters(self.client.get_parameters(ins.config)))

    def fit(self, ins, timeout, group_id):
        from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

        arrays, n, metrics = self.client.fit(parameters_to_ndarrays(ins.parameters), ins.config)
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)

    def evaluate(self, ins, timeout, group_id):
        from flwr.common import Code, EvaluateRes, Status, parameters_to_ndarrays

        loss, n, metrics = self.client.evaluate(parameters_to_ndarrays(ins.parameters), ins.config)
        return EvaluateRes(Status(Code.OK, ""), loss, n, metrics)

    def reconnect(self, ins, timeout, group_id):
        raise NotImplementedError


def run_rounds(strategy, proxies, rounds, client_manager=None, parameters=None):
    """Drive ``strategy`` over in-process clients the way Flower's server loop does: its evaluation before
    round 1, then per round configure_fit (which discovers the clients through ``client_manager`` when
    they are not yet known), fit, aggregate_fit, the centralised evaluation, configure_evaluate, evaluate,
    aggregate_evaluate. Returns the global parameters after the last round."""
    parameters = parameters if parameters is not None else strategy.initialize_parameters(None)
    strategy.evaluate(0, parameters)
    for server_round in range(1, rounds + 1):
        fit_ins = strategy.configure_fit(server_round, parameters, client_manager)
        results = [(proxy, proxy.fit(ins, None, server_round)) for proxy, ins in fit_ins]
        new, _ = strategy.aggregate_fit(server_round, results, [])
        parameters = new if new is not None else parameters
        strategy.evaluate(server_round, parameters)
        eval_ins = strategy.configure_evaluate(server_round, parameters, client_manager)
        if eval_ins:  # Flower skips the evaluation round when no client is asked
            eval_results = [(proxy, proxy.evaluate(ins, None, server_round)) for proxy, ins in eval_ins]
            strategy.aggregate_evaluate(server_round, eval_results, [])
    return parameters


class FixedClientManager:
    """The part of Flower's ClientManager that discovery uses, over a fixed set of proxies."""

    def __init__(self, proxies):
        self.proxies = {p.cid: p for p in proxies}

    def wait_for(self, num_clients, timeout):
        return len(self.proxies) >= num_clients

    def all(self):
        return dict(self.proxies)


def flower_client(cfg, pid, state=None):
    """The configured algorithm's NumPyClient for partition ``pid`` (real data, CPU), on a node state."""
    import torch
    from flwr.common import RecordDict

    from fedbr_flwr.app.node import FlowerClient, RecordState
    from fedbr_flwr.core.algorithm import client_class
    from fedbr_flwr.data.dataset import load_client_data

    data = load_client_data(cfg, pid, torch.device("cpu"))
    state = RecordState(state if state is not None else RecordDict())
    return FlowerClient(client_class(cfg["strategy"])(cfg, data, torch.device("cpu"), state))


def in_process_federation(cfg, tmp_path):
    """The configured strategy and one client per partition of ``cfg`` (real data, CPU), connected
    in-process and discovered. Returns (strategy, the clients' ClientAlgorithm objects, proxies)."""
    import torch

    from fedbr_flwr.app.server_app import build_strategy
    from fedbr_flwr.app.strategy import discover

    strategy = build_strategy({**cfg, "output-dir": str(tmp_path)})
    strategy.initialize_parameters(None)  # as Flower does first
    torch.manual_seed(123)
    clients = [flower_client(cfg, pid) for pid in range(cfg["num-clients"])]
    proxies = [InProcessProxy(c) for c in clients]
    discover(strategy, FixedClientManager(proxies))
    return strategy, [c.algorithm for c in clients], proxies


# measurements, not results: time, memory, and bytes (a resumed round also carries the clients' saved state)
TIMING_KEYS = (
    "wall_time",
    "seconds",
    "client_fit_seconds",
    "client_peak_rss_mb",
    "client_peak_gpu_mb",
    "bytes_down",
    "bytes_up",
    "nodes",  # the host or Ray node each fit ran on
    "node_peak_rss_mb",
    "node_peak_gpu_mb",
)


def records_without_timing(path):
    """A run's JSON-lines file with the fields that measure time, memory and traffic left out: what must
    repeat exactly."""
    from fedbr_flwr.runfiles.metrics import read_jsonl

    out = []
    for record in read_jsonl(path):
        for k in TIMING_KEYS:
            record.pop(k, None)
        record.get("train", {}).pop("fit-seconds", None)
        out.append(record)
    return out


def bare_fit_config(cfg, clients):
    """The strategy's fit config of each round (``config_of(server_round, pid=None)``) for ``clients`` by partition
    id, which the test fits itself (fedbr-bench's ``BareServer``)."""
    from fedbr_flwr.bench.bare import BareServer, round_configs

    server = BareServer(cfg)
    server.connect(clients)
    return round_configs(server)
