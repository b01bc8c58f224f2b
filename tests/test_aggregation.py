"""Aggregation rule, FedAvg client step, weight (de)serialisation, batch sampling and evaluation."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from clients.fedavg import SupervisedStep as FedAvg
from fedbr_flwr.core.config import validate
from fedbr_flwr.core.model import SplitModel
from fedbr_flwr.core.seeds import hash_seed as step_seed
from fedbr_flwr.core.training import BatchSampler, evaluate, load_module_arrays, module_arrays, run_local_steps
from fedbr_flwr.data.dataset import ClientData
from fedbr_flwr.server.updates import named_mean, weighted_mean


def three_clients(dtype=np.float32):
    rng = np.random.default_rng(0)
    return [[rng.normal(size=(2, 3)).astype(dtype), rng.normal(size=(4,)).astype(dtype)] for _ in range(3)]


# ---------------------------------------------------------------- weighted_mean


def test_weighted_mean_by_hand():
    arrays = three_clients()
    out = weighted_mean(arrays, [1, 2, 3])
    assert len(out) == 2
    for layer in range(2):
        a, b, c = (arrays[i][layer].astype(np.float64) for i in range(3))
        expected = (1 * a + 2 * b + 3 * c) / 6
        assert out[layer].shape == expected.shape
        np.testing.assert_allclose(out[layer], expected, rtol=1e-6, atol=1e-7)


def test_weighted_mean_scalar_example():
    out = weighted_mean([[np.array([0.0])], [np.array([3.0])], [np.array([6.0])]], [1, 2, 3])
    assert out[0][0] == pytest.approx((0 + 6 + 18) / 6)


def test_weighted_mean_uniform_equals_mean():
    arrays = three_clients()
    out = weighted_mean(arrays, [1.0, 1.0, 1.0])
    for layer in range(2):
        np.testing.assert_allclose(out[layer], np.mean([a[layer] for a in arrays], axis=0), rtol=1e-6)


def test_weighted_mean_scale_invariant_and_zero_weight():
    arrays = three_clients()
    a = weighted_mean(arrays, [1, 2, 3])
    b = weighted_mean(arrays, [10, 20, 30])
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6)
    only_last = weighted_mean(arrays, [0, 0, 5])
    for x, y in zip(only_last, arrays[2]):
        np.testing.assert_allclose(x, y, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weighted_mean_preserves_dtype(dtype):
    out = weighted_mean(three_clients(dtype), [1, 2, 3])
    assert all(o.dtype == dtype for o in out)


def test_weighted_mean_does_not_modify_inputs():
    arrays = three_clients()
    before = copy.deepcopy(arrays)
    weighted_mean(arrays, [1, 2, 3])
    for x, y in zip(arrays, before):
        for a, b in zip(x, y):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("weights", [[1, -1, 1], [0, 0, 0]])
def test_weighted_mean_rejects_bad_weights(weights):
    with pytest.raises(ValueError):
        weighted_mean(three_clients(), weights)


def test_named_mean_averages_by_name_whatever_the_order_of_the_dicts():
    a = {"model/w": np.array([0.0, 2.0]), "model/b": np.array([1.0])}
    b = {"model/b": np.array([3.0]), "model/w": np.array([4.0, 6.0])}  # same names, another order
    out = named_mean([a, b], [1, 3], ["model/w", "model/b"])
    assert list(out) == ["model/w", "model/b"]
    np.testing.assert_allclose(out["model/w"], [3.0, 5.0])
    np.testing.assert_allclose(out["model/b"], [2.5])


def test_weighted_mean_rejects_empty():
    with pytest.raises(ValueError):
        weighted_mean([], [])


# ---------------------------------------------------------------- FedAvg client step


def tiny_model(seed=0, num_classes=3):
    torch.manual_seed(seed)
    return SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.Tanh()), 5, num_classes)


def test_fedavg_update_is_one_sgd_step():
    cfg = validate({})
    assert cfg["momentum"] == 0.0 and cfg["weight-decay"] == 0.0
    model = tiny_model()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 2, 2, generator=g)
    y = torch.randint(0, 3, (8,), generator=g)

    loss_ref = nn.functional.cross_entropy(reference(x), y)
    params = list(reference.parameters())
    grads = torch.autograd.grad(loss_ref, params)
    expected = [(p - cfg["lr"] * gr).detach() for p, gr in zip(params, grads)]

    stats = FedAvg(model, cfg).update(x, y)
    assert set(stats) == {"loss"}
    assert float(stats["loss"].detach()) == pytest.approx(float(loss_ref.detach()), rel=1e-6)
    for p, e, p0 in zip(model.parameters(), expected, reference.parameters()):
        assert not torch.equal(p.detach(), p0.detach())
        assert torch.allclose(p.detach(), e, atol=1e-6)


def test_fedavg_lr_is_taken_from_cfg():
    cfg = validate({"lr": 0.5})
    a, b = tiny_model(), tiny_model()
    x = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0])
    start = [p.detach().clone() for p in a.parameters()]
    FedAvg(a, cfg).update(x, y)
    FedAvg(b, validate({"lr": 0.05})).update(x, y)
    for s, pa, pb in zip(start, a.parameters(), b.parameters()):
        np.testing.assert_allclose((pa - s).detach().numpy(), 10 * (pb - s).detach().numpy(), rtol=1e-4, atol=1e-7)


def test_run_local_steps_reduces_loss_and_averages_diagnostics():
    cfg = validate({"lr": 0.5})
    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 3, 2, 2, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    before, _ = evaluate(model, x, y)
    stats = run_local_steps(FedAvg(model, cfg), lambda: (x, y), steps=20)
    after, _ = evaluate(model, x, y)
    assert set(stats) == {"loss"}
    assert after < before
    assert after < stats["loss"] < before  # the mean loss over the steps lies between first and last


# ---------------------------------------------------------------- get/set weights


def test_module_arrays_round_trip_by_name():
    a, b = tiny_model(0), tiny_model(1)
    wa = module_arrays("model", a)
    assert list(wa) == [f"model/{k}" for k in a.state_dict()] and all(isinstance(w, np.ndarray) for w in wa.values())
    assert not all(np.array_equal(wa[k], w) for k, w in module_arrays("model", b).items())
    load_module_arrays(b, "model", {k: wa[k] for k in reversed(list(wa))})  # by name: the order does not matter
    for k, w in module_arrays("model", b).items():
        np.testing.assert_array_equal(w, wa[k])
    x = torch.randn(2, 3, 2, 2)
    assert torch.equal(a(x), b(x))


def test_load_module_arrays_rejects_a_missing_name_and_a_wrong_shape():
    model = tiny_model()
    w = module_arrays("model", model)
    first = next(iter(w))
    with pytest.raises(ValueError, match=f"no array for {first}"):
        load_module_arrays(model, "model", {k: v for k, v in w.items() if k != first})
    with pytest.raises(ValueError, match="no array for model/"):
        load_module_arrays(model, "model", module_arrays("head", model))
    bad = dict(w)
    bad[first] = np.zeros((w[first].shape[0] + 1,) + w[first].shape[1:], np.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        load_module_arrays(model, "model", bad)
    second = list(w)[1]
    bad = dict(w)
    bad[second] = bad[second].reshape(1, -1)  # same size, different shape
    with pytest.raises(ValueError, match="shape mismatch"):
        load_module_arrays(model, "model", bad)


# ---------------------------------------------------------------- batch sampling


def client_data(n=5, augment=False, channels=1, size=4):
    g = torch.Generator().manual_seed(0)
    return ClientData(
        partition_id=0,
        x_train=torch.randn(n, channels, size, size, generator=g),
        y_train=torch.arange(n),
        x_test=torch.zeros(0, channels, size, size),
        y_test=torch.zeros(0, dtype=torch.long),
        num_classes=n,
        augment=augment,
    )


def test_batch_sampler_seeded_shapes_and_replacement():
    data = client_data(n=5)
    s1, s2, s3 = BatchSampler(data, 12, seed=7), BatchSampler(data, 12, seed=7), BatchSampler(data, 12, seed=8)
    b1 = [s1() for _ in range(3)]
    b2 = [s2() for _ in range(3)]
    b3 = [s3() for _ in range(3)]
    for (x1, y1), (x2, y2) in zip(b1, b2):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not all(torch.equal(y1, y3) for (_, y1), (_, y3) in zip(b1, b3))
    assert not torch.equal(b1[0][1], b1[1][1])  # successive batches differ
    for x, y in b1:
        assert x.shape == (12, 1, 4, 4) and y.shape == (12,)
        # batch_size > n: drawn with replacement; images stay paired with their labels
        assert len(torch.unique(y)) <= 5
        for xi, yi in zip(x, y):
            assert torch.equal(xi, data.x_train[yi])


def test_batch_sampler_augments_when_asked():
    data = client_data(n=4, augment=True, channels=3, size=8)
    x, y = BatchSampler(data, 16, seed=0)()
    assert x.shape == (16, 3, 8, 8)
    # augmented batches are crops/flips: at least one image differs from its source
    assert any(not torch.equal(xi, data.x_train[yi]) for xi, yi in zip(x, y))
    plain_x, plain_y = BatchSampler(client_data(n=4, channels=3, size=8), 16, seed=0)()
    assert torch.equal(plain_y, y)  # labels drawn the same way


def test_batch_sampler_pads_crops_with_the_clients_border_value():
    data = client_data(n=4, augment=True, channels=3, size=8)
    data.border = (9.0, 9.0, 9.0)
    x, _ = BatchSampler(data, 64, seed=0)()
    assert (x == 9.0).any() and not (x == 0.0).any()


def test_step_seed_stable_and_distinct():
    assert step_seed(0, 1, 2) == step_seed(0, 1, 2)
    assert len({step_seed(0, r, c) for r in range(5) for c in range(5)}) == 25
    assert 0 <= step_seed(123, 4) < 2**63


# ---------------------------------------------------------------- evaluation


def test_evaluate_with_hand_set_logits():
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))  # logits = inputs
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0], [0.0, 0.5]])
    y = torch.tensor([0, 1, 1, 0])  # correct, correct, wrong, wrong
    loss, acc = evaluate(model, x, y, batch_size=3)  # batches of 3 + 1
    assert acc == pytest.approx(0.5)
    expected = np.mean(
        [
            -np.log(np.exp(2) / (np.exp(2) + 1)),
            -np.log(np.exp(1) / (1 + np.exp(1))),
            -np.log(np.exp(1) / (np.exp(3) + np.exp(1))),
            -np.log(1 / (1 + np.exp(0.5))),
        ]
    )
    assert loss == pytest.approx(expected, rel=1e-5)
    assert not model.training


def test_evaluate_empty_set():
    loss, acc = evaluate(nn.Linear(2, 2), torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
    assert loss == 0.0 and acc == 0.0


def test_weighted_mean_rejects_mismatched_or_nan_weights():
    arrays = [[np.ones(2, np.float32)], [np.zeros(2, np.float32)]]
    with pytest.raises(ValueError, match="weights"):
        weighted_mean(arrays, [1.0])
    with pytest.raises(ValueError):
        weighted_mean(arrays, [1.0, float("nan")])


def test_module_arrays_are_copies_not_views_of_the_parameters():
    model = nn.Linear(3, 2)
    snapshot = module_arrays("model", model)
    before = {k: w.copy() for k, w in snapshot.items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    for k, w in snapshot.items():
        np.testing.assert_array_equal(w, before[k])
