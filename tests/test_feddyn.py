"""FedDyn as its authors run it: alpha scaled by each client's size, gradients clipped (a common key),
and the mean of the round's client models reported beside the server model."""

import json

import numpy as np
import pytest
import torch
from test_adding_an_algorithm import toy_data
from torch.nn import functional as F

from fedbr_flwr.app import payload
from fedbr_flwr.core.algorithm import MemoryState, client_class
from fedbr_flwr.core.config import validate
from fedbr_flwr.core.training import clip_norm_
from fedbr_flwr.runfiles.run_io import RunRecorder
from fedbr_flwr.server.updates import size_share
from strategies.base import strategy_class

from fakes import in_process_federation


def test_a_clients_size_share_is_its_training_samples_over_the_mean():
    sizes = {0: (50, 5), 1: (100, 10), 2: (150, 15)}  # mean 100
    assert [size_share(sizes, pid) for pid in range(3)] == [0.5, 1.0, 1.5]
    assert size_share({0: (40, 4), 1: (40, 9)}, 1) == 1.0
    assert size_share(sizes, 7) == 1.0  # not known


def test_the_server_sends_each_client_its_alpha_k_and_the_client_trains_with_it(tmp_path):
    cfg = validate({"strategy": "feddyn", "feddyn-alpha": 0.1, "num-clients": 3, "global-test": False})
    modules = client_class("feddyn").build_modules(cfg)
    strategy = strategy_class("feddyn")(cfg, RunRecorder(cfg, tmp_path), modules, None)
    strategy.federation.sizes = {0: (50, 5), 1: (100, 10), 2: (150, 15)}
    assert [strategy.fit_config(1, pid)["feddyn-alpha-k"] for pid in range(3)] == pytest.approx([0.2, 0.1, 0.1 / 1.5])

    client = client_class("feddyn")(cfg, toy_data(), "cpu", MemoryState())
    assert client.make_step(1, {"feddyn-alpha-k": 0.2}).alpha == 0.2
    assert client.make_step(1, {}).alpha == 0.1  # no size known: alpha


def test_the_local_loss_adds_alpha_k_over_two_times_the_squared_distance_from_the_round_start():
    """The step tests run at the round's weights, where the proximal term is zero whatever its weight."""
    cfg = validate({"strategy": "feddyn", "num-clients": 3, "global-test": False, "lr": 0.5})
    client = client_class("feddyn")(cfg, toy_data(), "cpu", MemoryState())
    step = client.make_step(1, {"feddyn-alpha-k": 0.3})
    x, y = client.data.x_train[:16], client.data.y_train[:16]
    step.update(x, y)  # away from the round's weights
    with torch.no_grad():
        distance = sum(float(((p - s) ** 2).sum()) for p, s in zip(client.model.parameters(), step.start))
        ce = F.cross_entropy(client.model(x), y).item()
    terms = step.update(x, y)
    assert terms["prox"].item() == pytest.approx(distance, rel=1e-5) and distance > 0
    assert terms["loss"].item() == pytest.approx(ce + 0.3 / 2 * distance, rel=1e-5)


def test_clip_norm_scales_a_gradient_above_the_norm_down_to_it_and_leaves_one_below():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]  # joint norm 5
    clip_norm_(grads, 1.0)
    torch.testing.assert_close(grads[0], torch.tensor([0.6, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[1], torch.tensor([[0.8]]), atol=1e-6, rtol=0)
    small = [torch.tensor([0.3, 0.4])]
    clip_norm_(small, 1.0)
    torch.testing.assert_close(small[0], torch.tensor([0.3, 0.4]))


@pytest.mark.parametrize("strategy", ["fedavg", "feddyn"])
def test_a_local_step_clips_the_corrected_gradient_by_hand(strategy, tmp_path):
    """One SGD step with clip-grad-norm: w - lr * g * c / ||g||, g the whole gradient (FedDyn's -g_k included)."""
    lr, clip = 0.1, 0.05
    cfg = validate(
        {
            "strategy": strategy,
            "lr": lr,
            "clip-grad-norm": clip,
            "local-steps": 1,
            "batch-size": 16,
            "num-clients": 4,
            "global-test": False,
        }
    )
    client = client_class(strategy)(cfg, toy_data(), "cpu", MemoryState())
    if strategy == "feddyn":
        client.state.put_arrays(
            "feddyn-g", {n: np.full(p.shape, 0.3, np.float32) for n, p in client.model.named_parameters()}
        )
    step = client.make_step(1, {})
    x, y = client.data.x_train, client.data.y_train
    params = list(client.model.parameters())
    before = [p.detach().clone() for p in params]
    grads = list(torch.autograd.grad(F.cross_entropy(client.model(x), y), params))
    if strategy == "feddyn":
        grads = [g - 0.3 for g in grads]  # the proximal term is zero at the round's weights
    norm = float(np.sqrt(sum(float((g.double() ** 2).sum()) for g in grads)))
    assert norm > clip  # the clipping binds
    step.update(x, y)
    for p, b, g in zip(params, before, grads):
        torch.testing.assert_close(p.detach(), b - lr * g * (clip / (norm + 1e-6)), atol=1e-7, rtol=1e-5)


def test_the_clients_mean_is_reported_and_the_served_model_recorded_beside_it(tmp_path):
    """gamma = mean of the round's client models is evaluated (local and global tests), as the authors
    report it; theta = gamma - h / alpha is what clients train from, its global test accuracy recorded."""
    cfg = validate(
        {
            "strategy": "feddyn",
            "feddyn-alpha": 0.1,
            "num-clients": 2,
            "local-steps": 2,
            "batch-size": 8,
            "test-fraction": 0.05,
            "model": "cnn-small",  # the global test runs six times: the small CNN keeps that cheap
            "global-test": True,
            "eval-every": 1,
            "device": "cpu",
        }
    )
    strategy, _, proxies = in_process_federation(cfg, tmp_path)
    start = strategy.initialize_parameters(None)
    results = [(proxy, proxy.fit(ins, None, 1)) for proxy, ins in strategy.configure_fit(1, start, None)]
    models = [payload.from_parameters(res.parameters) for _, res in results]
    served, _ = strategy.aggregate_fit(1, results, [])
    theta = payload.from_parameters(served)
    gamma = {name: (models[0][name] + models[1][name]) / 2 for name in theta}
    (_, ins), _ = strategy.configure_evaluate(1, served, None)
    sent = payload.from_parameters(ins.parameters)
    for name in theta:
        np.testing.assert_allclose(sent[name], gamma[name], rtol=1e-5, atol=1e-7)
    assert any(not np.allclose(theta[n], gamma[n]) for n in theta)  # h is not zero after a round

    _, metrics = strategy.evaluate(1, served)
    assert metrics["global_acc"] == strategy.server_tests_of(gamma)["global_acc"]
    served_acc = strategy.server_tests_of(theta)["global_acc"]
    assert metrics["served_global_acc"] == served_acc
    eval_results = [
        (proxy, proxy.evaluate(ins, None, 1)) for proxy, ins in strategy.configure_evaluate(1, served, None)
    ]
    strategy.aggregate_evaluate(1, eval_results, [])
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["served_global_acc"] == served_acc

    resumed, _, _ = in_process_federation(cfg, tmp_path / "resumed")
    resumed.restore_state(strategy.checkpoint_state())  # a resume (or a skipped round) reports the same gamma
    for name in theta:
        np.testing.assert_array_equal(resumed.reported_arrays(theta)[name], strategy.mean[name])
