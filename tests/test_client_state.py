"""A client's cross-round state (FedDyn's g_k, SCAFFOLD's c_i, MOON's previous model, DisTrans' offset)
is kept only when the server used the update it came with: after a rejected update or a round below
min-fit-clients the client goes on from the state it had, so the server's state stays the clients' mean."""

import numpy as np
import pytest
from flwr.common import FitRes

from fedbr_flwr.app import payload
from fedbr_flwr.core.algorithm import PENDING_PREFIX, UPDATE_USED, MemoryState
from fedbr_flwr.core.config import validate
from fedbr_flwr.runfiles.metrics import read_jsonl

from fakes import InProcessProxy, in_process_federation, run_rounds

CFG = {
    "num-clients": 2,
    "num-rounds": 3,
    "local-steps": 2,
    "batch-size": 8,
    "eval-every": 1,
    "global-test": False,
    "test-fraction": 0.05,
    "device": "cpu",
}


class RejectedProxy(InProcessProxy):
    """Its client trains, but the update it returns in ``rounds`` holds a NaN, so the server rejects it."""

    def __init__(self, client, rounds):
        super().__init__(client)
        self.rounds = rounds

    def fit(self, ins, timeout, group_id):
        res = super().fit(ins, timeout, group_id)
        if int(ins.config["server-round"]) not in self.rounds:
            return res
        arrays = payload.from_parameters(res.parameters)
        name = next(iter(arrays))
        arrays[name] = np.full_like(arrays[name], np.nan)
        return FitRes(res.status, payload.to_parameters(arrays), res.num_examples, res.metrics)


def federation_with_a_rejected_update(tmp_path, strategy, rounds, **overrides):
    cfg = validate({**CFG, "strategy": strategy, "num-rounds": rounds, **overrides})
    server, clients, proxies = in_process_federation(cfg, tmp_path)
    proxies[1] = server.federation.clients_by_pid[1] = RejectedProxy(proxies[1].client, rounds={1})
    return server, clients, proxies


def kept(client, key):
    """The client's committed state ``key`` by parameter name (zero where it has none yet)."""
    stored = client.state.arrays(key) or {}
    return {name: stored.get(name, np.zeros(p.shape, np.float32)) for name, p in client.model.named_parameters()}


def assert_feddyn_h_is_the_mean_of_g(server, clients):
    """h = (1/m) sum_k g_k: FedDyn's fixed point rests on it (equal sizes: every alpha_k = alpha)."""
    gs = [kept(c, "feddyn-g") for c in clients]
    for name, h in server.h.items():
        mean = sum(g[name.removeprefix("model/")] for g in gs) / len(gs)
        np.testing.assert_allclose(h, mean, atol=1e-6)


def test_feddyn_h_stays_the_clients_mean_after_a_rejected_update(tmp_path):
    server, clients, proxies = federation_with_a_rejected_update(tmp_path, "feddyn", 1, **{"feddyn-alpha": 0.1})
    run_rounds(server, proxies, 1)
    assert not any(g.any() for g in kept(clients[1], "feddyn-g").values())  # its update was not used
    assert any(g.any() for g in kept(clients[0], "feddyn-g").values())
    assert_feddyn_h_is_the_mean_of_g(server, clients)
    proxies[1].rounds = set()
    run_rounds(server, proxies, 1, parameters=payload.to_parameters(server.latest))  # round "1" again: all used
    assert any(g.any() for g in kept(clients[1], "feddyn-g").values())
    assert_feddyn_h_is_the_mean_of_g(server, clients)


def test_a_round_below_min_fit_clients_leaves_every_clients_state_as_it_was(tmp_path):
    server, clients, proxies = federation_with_a_rejected_update(
        tmp_path, "feddyn", 1, **{"feddyn-alpha": 0.1, "min-fit-clients": 2}
    )
    run_rounds(server, proxies, 1)
    assert not any(h.any() for h in server.h.values())  # the round was skipped
    for client in clients:
        assert not any(g.any() for g in kept(client, "feddyn-g").values())
    assert_feddyn_h_is_the_mean_of_g(server, clients)


def test_scaffold_c_stays_the_clients_mean_after_a_rejected_update(tmp_path):
    server, clients, proxies = federation_with_a_rejected_update(tmp_path, "scaffold", 1)
    run_rounds(server, proxies, 1)
    cs = [kept(c, "scaffold-control") for c in clients]
    assert not any(c.any() for c in cs[1].values()) and any(c.any() for c in cs[0].values())
    for name in cs[0]:
        np.testing.assert_allclose(server.control[name], (cs[0][name] + cs[1][name]) / 2, atol=1e-6)


def moved(client, key):
    return any(a.any() for a in kept(client, key).values())


@pytest.mark.parametrize("strategy", ["scaffold", "feddyn"])
@pytest.mark.parametrize("rule", ["krum", "multi-krum"])
def test_only_the_clients_krum_keeps_keep_their_state(tmp_path, strategy, rule):
    """An update Krum drops was not used: its client goes on from the state it had, and the server's state
    moves by the kept clients' changes alone, so it stays the clients' mean."""
    own = {"feddyn-alpha": 0.1} if strategy == "feddyn" else {}
    cfg = validate({**CFG, "strategy": strategy, "num-clients": 5, "aggregation": rule, "byzantine-clients": 1, **own})
    server, clients, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(server, proxies, 1)
    (record,) = read_jsonl(tmp_path / "rounds.jsonl")
    selected = record["aggregation"]["selected"]
    assert len(selected) == (1 if rule == "krum" else 4)
    key = "scaffold-control" if strategy == "scaffold" else "feddyn-g"
    assert [pid for pid, c in enumerate(clients) if moved(c, key)] == selected
    if strategy == "feddyn":
        assert_feddyn_h_is_the_mean_of_g(server, clients)
        return
    cs = [kept(c, key) for c in clients]
    for name, control in server.control.items():
        np.testing.assert_allclose(control, sum(c[name] for c in cs) / len(cs), atol=1e-6)


def test_the_checkpoint_holds_only_used_state(tmp_path):
    """A checkpoint after the rejected round asks each client for its state: the message settles it first."""
    server, clients, proxies = federation_with_a_rejected_update(
        tmp_path, "feddyn", 1, **{"feddyn-alpha": 0.1, "eval-every": 5, "checkpoint-every": 1}
    )
    run_rounds(server, proxies, 1)
    from fedbr_flwr.runfiles import codec

    saved = codec.decode(server.checkpointer.client_states[1])
    assert saved == {} or not any(a.any() for a in saved.values())
    assert any(a.any() for a in codec.decode(server.checkpointer.client_states[0]).values())


@pytest.mark.parametrize(
    "update_used, used",
    [(3, True), (2, False), (None, True)],  # None: a caller that says nothing (the bare loop) used every update
)
def test_a_fits_state_is_pending_until_the_server_says_whether_it_used_the_update(tmp_path, update_used, used):
    from test_adding_an_algorithm import toy_data

    from fedbr_flwr.core.algorithm import PENDING_ROUND, client_class

    cfg = validate({**CFG, "strategy": "feddyn", "num-clients": 4, "output-dir": str(tmp_path)})
    client = client_class("feddyn")(cfg, toy_data(), "cpu", MemoryState())
    arrays = client.weights()
    client.fit(arrays, {"server-round": 3, UPDATE_USED: 0})
    assert client.state.arrays("feddyn-g") is None and client.state.arrays(PENDING_PREFIX + "feddyn-g") is not None
    client.evaluate(arrays, {"server-round": 3, **({} if update_used is None else {UPDATE_USED: update_used})})
    assert (client.state.arrays("feddyn-g") is not None) == used
    assert client.state.arrays(PENDING_PREFIX + "feddyn-g") is None and client.state.meta(PENDING_ROUND) is None
