"""DisTrans on small tensors: the two input channels, the joint (model, offset) step, DH and class
shares, the three offset aggregations, the per-client offset kept across rounds, and evaluation with
each client's own offset."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, Status
from torch.nn import functional as F

from clients.distrans import (
    DisTransClient,
    DisTransSettings,
    DisTransStep,
    DoubleInputModel,
    Offset,
    WithOffset,
    initial_offset,
)
from fedbr_flwr.app import payload
from fedbr_flwr.core.algorithm import UPDATE_USED, MemoryState
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.core.model import build_model
from fedbr_flwr.core.training import evaluate
from fedbr_flwr.data.catalog import INFO
from fedbr_flwr.data.dataset import ClientData
from fedbr_flwr.data.partition import heterogeneity_from_counts
from fedbr_flwr.runfiles.run_io import RunRecorder
from strategies.distrans import (
    DisTransStrategy,
    OffsetAggregator,
    OffsetGenerator,
    build_offset_network,
    class_shares,
    finite_mean,
    resolve_mode,
)

C = 10


def distrans_cfg(**overrides):
    return validate({"strategy": "distrans", "batch-size": 8, **overrides})


def small_model(alpha=0.3, seed=0):
    torch.manual_seed(seed)
    return DoubleInputModel.from_backbone(build_model("cnn", C, 1, 8), alpha)


def batch(seed=1, n=8, size=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, size, size, generator=g), torch.randint(0, C, (n,), generator=g)


# ---------------------------------------------------------------- the double-input-channel model


def test_channels_follow_the_blend_formulas_and_give_back_the_input():
    model = small_model(alpha=0.3)
    x, _ = batch()
    t = torch.randn(1, 8, 8)
    x1, x2 = model.channels(x, t)
    torch.testing.assert_close(x1, 0.7 * x + 0.3 * t)
    torch.testing.assert_close(x2, 1.3 * x - 0.3 * t)
    torch.testing.assert_close((x1 + x2) / 2, x)  # the original input is recoverable
    torch.testing.assert_close((x1 - 0.7 * x) / 0.3, t.expand_as(x))


def test_one_fused_pass_equals_the_backbone_on_each_channel():
    model = small_model()
    x, _ = batch()
    t = torch.randn(1, 8, 8)
    x1, x2 = model.channels(x, t)
    expected = model.classifier(torch.cat([model.features(x1), model.features(x2)], dim=1))
    torch.testing.assert_close(model(x, t), expected)
    assert model.classifier.in_features == 2 * 128 and model.feature_dim == 256


def test_offset_changes_the_prediction():
    model = small_model()
    x, _ = batch()
    assert not torch.allclose(model(x, torch.zeros(1, 8, 8)), model(x, torch.ones(1, 8, 8)))


# ---------------------------------------------------------------- the client's joint step


def make_algorithm(**overrides):
    cfg = distrans_cfg(**overrides)
    model = small_model()
    offset = Offset((1, 8, 8))
    offset.t.data = torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(3))
    return DisTransStep(model, offset, cfg, DisTransSettings.from_config(cfg))


@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_simultaneous_step_moves_model_and_offset_by_one_gradient_each(decay):
    """With weight-decay, the model decays and the offset does not (an input, not a weight: the authors' code)."""
    algo = make_algorithm(**{"distrans-offset-lr": 0.5, "lr": 0.1, "weight-decay": decay})
    x, y = batch()
    t0 = algo.offset.t.detach().clone()
    w0 = [p.detach().clone() for p in algo.model.parameters()]
    loss = F.cross_entropy(algo.model(x, algo.offset.t), y)
    grads = torch.autograd.grad(loss, [algo.offset.t, *algo.model.parameters()])
    algo.update(x, y)
    assert grads[0].abs().sum() > 0  # the offset receives gradient ...
    torch.testing.assert_close(algo.offset.t.detach(), t0 - 0.5 * grads[0])  # ... and moves by it
    for p, p0, g in zip(algo.model.parameters(), w0, grads[1:]):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * (g + decay * p0))


def test_alternating_step_moves_the_offset_first_then_the_model_on_the_moved_offset():
    algo = make_algorithm(**{"distrans-update": "alternating", "distrans-offset-lr": 50.0, "lr": 0.1})
    x, y = batch()
    w0 = [p.detach().clone() for p in algo.model.parameters()]
    stats = algo.update(x, y)
    # the returned loss is on the moved offset with the model not yet stepped: the offset step lowered it
    assert stats["loss"] < stats["offset-loss"]
    t1 = algo.offset.t.detach().clone()
    ref = small_model()  # same init as the algorithm's model
    for p, p0 in zip(ref.parameters(), w0):
        p.data.copy_(p0)
    grads = torch.autograd.grad(F.cross_entropy(ref(x, t1), y), list(ref.parameters()))
    for p, p0, g in zip(algo.model.parameters(), w0, grads):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * g)


def test_initial_offset_is_a_normalised_uniform_image_and_seeded():
    info = INFO["mnist5k"]
    t = initial_offset(info, 5)
    assert t.shape == (1, 28, 28)
    pixels = t * info.std[0] + info.mean[0]
    assert 0 <= pixels.min() and pixels.max() < 1 and abs(pixels.mean() - 0.5) < 0.05
    np.testing.assert_array_equal(t, initial_offset(info, 5))
    assert not np.array_equal(t, initial_offset(info, 6))


# ---------------------------------------------------------------- DH, shares, modes


def test_dh_on_hand_made_histograms():
    iid = np.full((4, 10), 25)
    assert heterogeneity_from_counts(iid) == 0.0
    one_class_each = np.eye(10, dtype=int) * 50
    assert heterogeneity_from_counts(one_class_each) == 1.0
    # 2 clients x 3 classes: class 0 held by both (c=2), classes 1 and 2 by one each (c=0)
    counts = np.array([[5, 3, 0], [5, 0, 4]])
    assert heterogeneity_from_counts(counts) == pytest.approx(1 - 2 / 6)


def test_class_shares_are_each_clients_fraction_of_every_class():
    counts = np.array([[30, 0, 1], [10, 0, 3]])
    shares = class_shares(counts)
    np.testing.assert_allclose(shares, [[0.75, 0, 0.25], [0.25, 0, 0.75]])


@pytest.mark.parametrize(
    "mode, dh, expected",
    [
        ("auto", 0.5, "none"),
        ("auto", 0.8, "none"),
        ("auto", 0.49, "nn"),
        ("auto", 0.0, "nn"),
        ("avg", 0.9, "avg"),
        ("none", 0.0, "none"),
        ("nn", 1.0, "nn"),
    ],
)
def test_auto_picks_none_at_or_above_the_threshold_and_nn_below(mode, dh, expected):
    assert resolve_mode(mode, dh, 0.5) == expected


# ---------------------------------------------------------------- offset aggregation (Flower-free)


def offsets_of(num, seed=0, shape=(1, 28, 28)):
    rng = np.random.default_rng(seed)
    return {pid: rng.uniform(-0.4, 2.8, size=shape).astype(np.float32) for pid in range(num)}


def test_none_returns_no_offset():
    agg = OffsetAggregator("none", class_shares(np.eye(3)))
    assert agg.update(offsets_of(3), {0: 1.0, 1: 1.0, 2: 1.0}) == ({}, {})


def test_avg_gives_every_client_the_weighted_mean_even_the_unsampled_ones():
    agg = OffsetAggregator("avg", class_shares(np.ones((4, 10))))
    offs = offsets_of(3)
    nxt, _ = agg.update(offs, {0: 1.0, 1: 1.0, 2: 2.0})
    expected = (offs[0] + offs[1] + 2 * offs[2]) / 4
    assert sorted(nxt) == [0, 1, 2, 3]
    for t in nxt.values():
        np.testing.assert_allclose(t, expected, rtol=1e-5)


def test_nn_lowers_its_regression_loss_over_rounds_and_personalises():
    info = INFO["mnist5k"]
    torch.manual_seed(0)
    counts = np.random.default_rng(1).integers(0, 50, size=(6, 10))
    agg = OffsetAggregator("nn", class_shares(counts), build_offset_network(info), lr=1e-2, steps=5)
    targets = {pid: np.full((1, 28, 28), 0.2 * pid, np.float32) for pid in range(6)}  # learnable by h(e_i)
    losses = []
    for _ in range(15):
        nxt, diag = agg.update(targets, {pid: 1.0 for pid in targets})
        losses.append(diag["offset-nn-loss-before"])
        assert diag["offset-nn-loss-after"] < diag["offset-nn-loss-before"]
    assert losses[-1] < 0.5 * losses[0]
    low, high = -info.mean[0] / info.std[0], (1 - info.mean[0]) / info.std[0]
    for t in nxt.values():
        assert t.shape == (1, 28, 28) and low - 1e-5 <= t.min() and t.max() <= high + 1e-5
    assert not np.allclose(nxt[0], nxt[5])  # different class shares, different offsets


def test_nn_keeps_its_weights_when_one_finite_offset_far_out_would_make_them_nan():
    """Under aggregation=mean one client's offset of 1e30 (finite float32, so it passed the screening) overflowed
    the regression's loss: the network, and every client's next offset from then on, became NaN."""
    torch.manual_seed(0)
    counts = np.random.default_rng(1).integers(0, 50, size=(3, 10))
    agg = OffsetAggregator("nn", class_shares(counts), build_offset_network(INFO["mnist5k"]), lr=1e-2, steps=5)
    targets = {pid: np.full((1, 28, 28), 0.2 * pid, np.float32) for pid in range(3)}
    first, _ = agg.update(targets, {pid: 1.0 for pid in targets})
    weights = {name: t.clone() for name, t in agg.network.state_dict().items()}
    nxt, diag = agg.update({**targets, 1: np.full((1, 28, 28), 1e30, np.float32)}, {pid: 1.0 for pid in targets})
    assert nxt == {} and diag["offset-nn-diverged"] == 1.0  # each client keeps the offset it has
    assert all(torch.equal(t, weights[name]) for name, t in agg.network.state_dict().items())
    again, _ = agg.update(targets, {pid: 1.0 for pid in targets})
    assert all(np.isfinite(t).all() for t in again.values())


def test_offset_generator_reaches_the_input_shape():
    for size, channels in ((28, 1), (32, 3)):
        out = OffsetGenerator(10, channels, size)(torch.rand(2, 10))
        assert out.shape == (2, channels, size, size) and out.abs().max() <= 1


# ---------------------------------------------------------------- client state and evaluation


def client_data(pid, n=40):
    g = torch.Generator().manual_seed(pid)
    x = torch.randn(n, 1, 28, 28, generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    return ClientData(pid, x, y, x[:10], y[:10], C, False)


def make_client(pid, state, **overrides):
    cfg = distrans_cfg(**{"num-clients": 3, "local-steps": 2, "distrans-offset-lr": 1.0, **overrides})
    return DisTransClient(cfg, client_data(pid), "cpu", state)


def offset_used(client, arrays, used_round=1):
    """The offset the client trains and evaluates with after receiving ``arrays`` in a message that says
    the server used its update of ``used_round`` (its fit's offset was pending until then)."""
    client.restore_state({UPDATE_USED: used_round})
    client.receive(arrays)
    return client.offset.t.detach().numpy().copy()


def test_client_keeps_its_offset_across_rounds_in_its_state():
    state = MemoryState()
    client = make_client(1, state)
    model_arrays = client.weights()
    assert all(name.startswith("model/") for name in model_arrays)  # the offset is no global array
    drawn = offset_used(client, model_arrays)  # nothing stored yet: a freshly drawn offset
    weights, _, metrics = client.fit(model_arrays, {"server-round": 1})
    first = weights["offset"]
    assert not np.array_equal(first, drawn) and metrics["offset-fresh"] == 1.0
    rms = float(np.sqrt(np.mean((first.astype(np.float64) - drawn) ** 2)))
    assert metrics["offset-rms-change"] == pytest.approx(rms, rel=1e-5)  # root of the mean square move
    # round 2 runs in a fresh client object (a node may rebuild its client) over the same state
    again = make_client(1, state)
    np.testing.assert_array_equal(offset_used(again, model_arrays), first)
    weights2, _, metrics2 = again.fit(model_arrays, {"server-round": 2})
    assert not np.array_equal(weights2["offset"], first) and metrics2["offset-fresh"] == 0.0
    # another client's state is its own
    other = make_client(2, MemoryState())
    assert not np.array_equal(offset_used(other, model_arrays), first)


def test_a_client_whose_update_was_not_used_goes_on_from_the_offset_it_had():
    client = make_client(1, MemoryState())
    model_arrays = client.weights()
    client.fit(model_arrays, {"server-round": 1, UPDATE_USED: 0})
    first = offset_used(client, model_arrays, used_round=1)
    weights, _, _ = client.fit(model_arrays, {"server-round": 2, UPDATE_USED: 1})
    assert not np.array_equal(weights["offset"], first)
    np.testing.assert_array_equal(offset_used(client, model_arrays, used_round=1), first)  # round 2's was not used


def test_a_server_sent_offset_replaces_the_stored_one():
    state = MemoryState()
    client = make_client(0, state)
    arrays = client.weights()
    sent = np.full((1, 28, 28), 0.5, np.float32)
    client.evaluate({**arrays, "offset": sent}, {"server-round": 1})
    np.testing.assert_array_equal(offset_used(make_client(0, state), arrays), sent)


def test_evaluation_applies_each_clients_own_offset():
    states = [MemoryState(), MemoryState()]
    clients = [make_client(0, states[0]), make_client(0, states[1])]  # same data, different offsets
    arrays = clients[0].weights()
    offsets = [np.zeros((1, 28, 28), np.float32), np.full((1, 28, 28), 3.0, np.float32)]
    for client, t in zip(clients, offsets):
        client.evaluate({**arrays, "offset": t}, {"server-round": 1})  # stores t
    results = [make_client(0, s).evaluate(arrays, {"server-round": 2}) for s in states]  # no offset sent
    data = clients[0].data
    for (loss, _, metrics), t in zip(results, offsets):
        ref_loss, ref_acc = evaluate(WithOffset(clients[0].model, torch.as_tensor(t)), data.x_test, data.y_test)
        assert loss == pytest.approx(ref_loss, rel=1e-5) and metrics["accuracy"] == pytest.approx(ref_acc)
    assert results[0][0] != pytest.approx(results[1][0])


# ---------------------------------------------------------------- strategy (no processes)


def make_strategy(tmp_path, agg, counts, **overrides):
    cfg = validate(
        {
            "strategy": "distrans",
            "output-dir": str(tmp_path),
            "global-test": False,
            "batch-size": 8,
            "num-clients": len(counts),
            "local-steps": 2,
            "distrans-agg": agg,
            **overrides,
        }
    )
    torch.manual_seed(0)
    strategy = DisTransStrategy(cfg, RunRecorder(cfg, tmp_path), DisTransClient.build_modules(cfg), None)
    strategy.federation.clients_by_pid = {pid: None for pid in range(len(counts))}
    strategy.federation.class_counts = {pid: np.asarray(c) for pid, c in enumerate(counts)}
    info = strategy.after_discovery()
    return strategy, info


def one_round(strategy, clients, server_round, sizes=None):
    """configure -> client fit -> aggregate, in process, for every client."""
    params = strategy.initialize_parameters(None) if server_round == 1 else strategy.current
    results = []
    for pid, client in enumerate(clients):
        arrays = {**payload.from_parameters(params), **strategy.client_arrays(pid)}
        weights, n, metrics = client.fit(arrays, {"server-round": server_round})
        n = sizes[pid] if sizes else n
        results.append((None, FitRes(Status(Code.OK, ""), payload.to_parameters(weights), n, metrics)))
    strategy.sampled = list(range(len(clients)))
    strategy.current, _ = strategy.aggregate_fit(server_round, results, [])
    return results


IID_COUNTS = [[4] * 10] * 3
ONE_CLASS_COUNTS = np.eye(3, 10, dtype=int) * 40


def test_auto_resolves_from_the_reported_histograms(tmp_path):
    _, info = make_strategy(tmp_path / "a", "auto", IID_COUNTS)
    assert info["distrans"] == {"dh": 0.0, "offset_agg": "nn", "distrans_agg_setting": "auto"}
    _, info = make_strategy(tmp_path / "b", "auto", ONE_CLASS_COUNTS)
    assert info["distrans"]["dh"] == 1.0 and info["distrans"]["offset_agg"] == "none"


def test_none_sends_no_offset_and_each_client_continues_from_its_own(tmp_path):
    strategy, _ = make_strategy(tmp_path, "none", ONE_CLASS_COUNTS)
    states = [MemoryState() for _ in range(3)]
    clients = [make_client(pid, states[pid]) for pid in range(3)]
    results = one_round(strategy, clients, 1)
    current = payload.from_parameters(strategy.current)
    assert list(current) == strategy.global_names and "offset" not in current  # the global arrays hold no offset
    assert strategy.client_arrays(0) == {}
    for pid, (_, res) in enumerate(results):
        own = payload.from_parameters(res.parameters)["offset"]
        np.testing.assert_array_equal(offset_used(make_client(pid, states[pid]), current), own)


def test_avg_sends_every_client_the_mean_offset_and_the_model_is_the_weighted_mean(tmp_path):
    strategy, _ = make_strategy(tmp_path, "avg", IID_COUNTS, weighting="samples")
    clients = [make_client(pid, MemoryState()) for pid in range(3)]
    sizes = [10, 30, 60]
    results = one_round(strategy, clients, 1, sizes)
    returned = [payload.from_parameters(res.parameters) for _, res in results]
    got = payload.from_parameters(strategy.current)
    for name in strategy.global_names:
        expected = sum(s * r[name].astype(np.float64) for s, r in zip(sizes, returned)) / 100
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-7)
    mean_offset = sum(s * r["offset"] for s, r in zip(sizes, returned)) / 100
    saved = np.load(tmp_path / "offsets.npz")
    for pid in range(3):
        sent = strategy.client_arrays(pid)
        assert list(sent) == ["offset"]
        np.testing.assert_allclose(sent["offset"], mean_offset, rtol=1e-5)
        np.testing.assert_array_equal(saved[f"next_{pid}"], sent["offset"])
        np.testing.assert_array_equal(saved[f"returned_{pid}"], returned[pid]["offset"])


def test_nn_sends_each_client_the_networks_output_and_records_its_loss(tmp_path):
    strategy, _ = make_strategy(tmp_path, "nn", [[10, 0, 5] + [0] * 7, [0, 10, 5] + [0] * 7, [5] * 10])
    clients = [make_client(pid, MemoryState()) for pid in range(3)]
    one_round(strategy, clients, 1)
    assert set(strategy.server_metrics) == {"offset-nn-loss-before", "offset-nn-loss-after"}
    predicted = strategy.aggregator.predict()
    for pid in range(3):
        np.testing.assert_array_equal(strategy.client_arrays(pid)["offset"], predicted[pid])
    assert not np.allclose(predicted[0], predicted[2])


def test_global_test_sees_the_mean_of_the_returned_offsets(tmp_path):
    strategy, _ = make_strategy(tmp_path, "none", ONE_CLASS_COUNTS)
    assert float(strategy.global_test_module().t.abs().sum()) == 0.0  # before any round: zero offset
    clients = [make_client(pid, MemoryState()) for pid in range(3)]
    results = one_round(strategy, clients, 1)
    mean = np.mean([payload.from_parameters(res.parameters)["offset"] for _, res in results], axis=0)
    np.testing.assert_allclose(strategy.global_test_module().t.cpu().numpy(), mean, rtol=1e-6)


def test_the_global_test_offset_stays_finite_when_the_offsets_sum_past_float32(tmp_path):
    """Two valid offsets of 3e38 summed to Inf in float32: the recorded global test then saw an infinite offset."""
    strategy, _ = make_strategy(tmp_path, "none", ONE_CLASS_COUNTS)
    shape = strategy.returned_shapes()["offset"]
    strategy.returned_offsets = {0: np.full(shape, 3e38, np.float32), 1: np.full(shape, 1e38, np.float32)}
    np.testing.assert_allclose(strategy.global_test_module().t.cpu().numpy(), np.full(shape, 2e38), rtol=1e-6)
    small = np.asarray([[1.0, 2.0], [2.0, 5.0]], dtype=np.float32)
    np.testing.assert_array_equal(finite_mean(small), np.mean(small, axis=0))  # where finite: the float32 mean


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"strategy": "fedavg", "distrans-agg": "nn"}, "belongs to distrans"),
        ({"strategy": "distrans", "distrans-agg": "mean"}, "not one of: auto, none, avg, nn"),
        ({"strategy": "distrans", "distrans-alpha": 1.0}, r"in \(0, 1\)"),
        ({"strategy": "distrans", "distrans-update": "joint"}, "simultaneous, alternating"),
        ({"strategy": "fedbr", "distrans-offset-lr": 0.1}, "belongs to distrans"),
    ],
)
def test_bad_distrans_settings_stop_with_a_clear_message(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(overrides)
