"""FedDyn as its authors run it: alpha scaled by each client's size."""

import pytest
from test_adding_an_algorithm import toy_data

from fedbr_flwr import registry
from fedbr_flwr.algorithm import MemoryState
from fedbr_flwr.config import validate
from fedbr_flwr.run_io import RunRecorder
from fedbr_flwr.server.updates import size_share


def test_a_clients_size_share_is_its_training_samples_over_the_mean():
    sizes = {0: (50, 5), 1: (100, 10), 2: (150, 15)}  # mean 100
    assert [size_share(sizes, pid) for pid in range(3)] == [0.5, 1.0, 1.5]
    assert size_share({0: (40, 4), 1: (40, 9)}, 1) == 1.0
    assert size_share(sizes, 7) == 1.0  # not known


def test_the_server_sends_each_client_its_alpha_k_and_the_client_trains_with_it(tmp_path):
    cfg = validate({"strategy": "feddyn", "feddyn-alpha": 0.1, "num-clients": 3, "global-test": False})
    modules = registry.client_class("feddyn").build_modules(cfg)
    strategy = registry.strategy_class("feddyn")(cfg, RunRecorder(cfg, tmp_path), modules, None)
    strategy.federation.sizes = {0: (50, 5), 1: (100, 10), 2: (150, 15)}
    assert [strategy.fit_config(1, pid)["feddyn-alpha-k"] for pid in range(3)] == pytest.approx([0.2, 0.1, 0.1 / 1.5])

    client = registry.client_class("feddyn")(cfg, toy_data(), "cpu", MemoryState())
    assert client.make_step(1, {"feddyn-alpha-k": 0.2}).alpha == 0.2
    assert client.make_step(1, {}).alpha == 0.1  # no size known: alpha
