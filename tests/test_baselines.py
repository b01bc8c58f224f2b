"""The baselines (SPEC section 4) and FedBR's combinations with them (paper Table 3): each test
targets a classic way the method goes wrong."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, Status
from torch.nn import functional as F

from clients.dann import DANNStep, build_discriminator, reverse_gradient
from clients.fedavg import SupervisedStep
from clients.fedbr import FedBRClient, FedBRStep
from clients.fedcm import blend_with_global_momentum
from clients.feddecorr import decorrelation_loss
from clients.fedmix import FedMixClient, fedmix_loss, mean_data
from clients.fedntd import not_true_distillation_loss
from clients.fedprox import proximal_term
from clients.mixup import Mixup
from clients.moon import MoonClient, MoonSettings, MoonStep, moon_contrastive_loss, moon_model
from clients.scaffold import ScaffoldClient, ScaffoldStep
from clients.vhl import RealClasses, VHLSettings, VHLStep, supervised_alignment_loss, vhl_model
from fedbr_flwr.app import payload
from fedbr_flwr.core.algorithm import UPDATE_USED, MemoryState, component_class
from fedbr_flwr.core.config import ConfigError, components_of, validate
from fedbr_flwr.core.model import build_model
from fedbr_flwr.core.registry import algorithm_names
from fedbr_flwr.core.training import module_arrays, parameter_tensors, round_sgd, state_arrays, steps_along_gradient
from fedbr_flwr.data.dataset import ClientData
from fedbr_flwr.runfiles.run_io import RunRecorder
from strategies.fedavg import FedAvgStrategy
from strategies.fedcm import GlobalDirection, global_update_direction
from strategies.groupdro import ClientWeights, GroupDROStrategy
from strategies.scaffold import ScaffoldStrategy, update_server_control
from strategies.vhl import virtual_data

from fakes import in_process_federation, run_rounds
from steps import named_like, started_components

B, C = 8, 10
LR = 0.05


def cfg_of(strategy, **overrides):
    return validate({"strategy": strategy, "batch-size": B, "lr": LR, **overrides})


def small_model(seed=0, **cfg):
    torch.manual_seed(seed)
    return build_model("cnn", C, 1, 8)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, 8, 8, generator=g), torch.randint(0, C, (B,), generator=g)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def grads_of(model, loss):
    model.zero_grad()
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def close(a, b, **kw):
    return all(torch.allclose(x, y, **kw) for x, y in zip(a, b))


def fedavg_step(model, cfg, received=None):
    """FedAvg's step with the components ``cfg`` selects (strategy=fedprox: FedAvg + fedprox, ...)."""
    return SupervisedStep(model, cfg, started_components(cfg, model, received))


def fit_res(arrays, n, metrics):
    return FitRes(Status(Code.OK, ""), payload.to_parameters(arrays), n, metrics)


def toy_data(pid, n=40, size=8):
    g = torch.Generator().manual_seed(pid)
    x = torch.randn(n, 1, size, size, generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    return ClientData(pid, x, y, x[:8], y[:8], C, False)


# ---------------------------------------------------------------- FedProx


def test_fedprox_gradient_adds_mu_times_the_drift_from_the_round_start():
    mu = 0.3
    model = small_model()
    algo = fedavg_step(model, cfg_of("fedprox", **{"fedprox-mu": mu}))
    anchor = algo.components[0].anchor
    start = params_of(model)
    with torch.no_grad():  # move away from the round-start weights
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, y = batch()
    ce_grads = grads_of(model, F.cross_entropy(model(x), y))
    total = F.cross_entropy(model(x), y) + 0.5 * mu * proximal_term(list(model.parameters()), anchor)
    prox_grads = grads_of(model, total)
    expected = [g + mu * (p.detach() - s) for g, p, s in zip(ce_grads, model.parameters(), start)]
    assert close(prox_grads, expected, atol=1e-6)
    assert all(torch.equal(a, s) for a, s in zip(anchor, start))  # the anchor is the round start


def test_fedprox_step_is_sgd_on_ce_plus_the_proximal_gradient():
    mu = 0.5
    model = small_model()
    algo = fedavg_step(model, cfg_of("fedprox", **{"fedprox-mu": mu}))
    with torch.no_grad():
        model.classifier.bias.add_(1.0)  # away from the anchor
    x, y = batch()
    before = params_of(model)
    ce_grads = grads_of(model, F.cross_entropy(model(x), y))
    algo.update(x, y)
    expected = [p - LR * (g + mu * (p - a)) for p, g, a in zip(before, ce_grads, algo.components[0].anchor)]
    assert close(params_of(model), expected, atol=1e-6)


# ---------------------------------------------------------------- SCAFFOLD


def zeros_like_params(model):
    return [torch.zeros_like(p) for p in model.parameters()]


def test_scaffold_with_zero_control_variates_equals_fedavg_for_one_step():
    x, y = batch()
    a, b = small_model(), small_model()
    ScaffoldStep(a, cfg_of("scaffold"), zeros_like_params(a), zeros_like_params(a)).update(x, y)
    fedavg_step(b, cfg_of("fedavg")).update(x, y)
    assert close(params_of(a), params_of(b), atol=0, rtol=0)


def test_scaffold_step_and_control_variate_follow_the_paper():
    model = small_model()
    g = torch.Generator().manual_seed(5)
    c_global = [0.1 * torch.randn(p.shape, generator=g) for p in model.parameters()]
    c_local = [0.1 * torch.randn(p.shape, generator=g) for p in model.parameters()]
    algo = ScaffoldStep(model, cfg_of("scaffold", **{"local-steps": 3}), c_global, c_local)
    start = params_of(model)
    x, y = batch()
    grads = grads_of(model, F.cross_entropy(model(x), y))
    algo.update(x, y)  # y <- y - lr (g - c_i + c)
    expected = [s - LR * (gr - cl + cg) for s, gr, cl, cg in zip(start, grads, c_local, c_global)]
    assert close(params_of(model), expected, atol=1e-6)
    for seed in (2, 3):
        algo.update(*batch(seed))
    new = algo.new_control_variate()  # option II: c_i - c + (x - y) / (K lr)
    by_hand = [cl - cg + (s - p) / (3 * LR) for cl, cg, s, p in zip(c_local, c_global, start, params_of(model))]
    assert close(new, by_hand, atol=1e-5)


def test_scaffold_control_variate_under_momentum_is_the_mean_corrected_gradient():
    """(x - y) / (K lr) is the mean gradient only without momentum: at 0.9 it overstated it about 3-fold over 4
    steps, and the variates grew by that each round (736 times the momentum-0 size after 5 rounds)."""
    model = small_model()
    g = torch.Generator().manual_seed(5)
    c_global = [0.1 * torch.randn(p.shape, generator=g) for p in model.parameters()]
    c_local = [0.1 * torch.randn(p.shape, generator=g) for p in model.parameters()]
    algo = ScaffoldStep(model, cfg_of("scaffold", **{"local-steps": 4, "momentum": 0.9}), c_global, c_local)
    start = params_of(model)
    for seed in range(4):
        algo.update(*batch(seed))
    steps = 1 + 1.9 + 2.71 + 3.439  # sum of (1 - 0.9^k) / 0.1 over k = 1..4
    by_hand = [cl - cg + (s - p) / (steps * LR) for cl, cg, s, p in zip(c_local, c_global, start, params_of(model))]
    assert close(algo.new_control_variate(), by_hand, atol=1e-5)


def test_a_constant_gradient_moves_sgd_by_lr_times_its_steps_along_the_gradient():
    assert steps_along_gradient(7, 0.0) == 7.0
    assert math.isclose(steps_along_gradient(50, 0.9), sum((1 - 0.9**k) / 0.1 for k in range(1, 51)))
    for momentum in (0.0, 0.5, 0.9):
        owner = torch.nn.Linear(3, 1)
        optimizer = round_sgd(owner, owner.parameters(), cfg_of("fedavg", momentum=momentum))
        before = owner.weight.detach().clone()
        for _ in range(50):
            owner.weight.grad, owner.bias.grad = torch.ones_like(owner.weight), torch.zeros_like(owner.bias)
            optimizer.step()
        moved = (before - owner.weight.detach()) / LR
        torch.testing.assert_close(moved, torch.full_like(moved, steps_along_gradient(50, momentum)), rtol=1e-5, atol=0)


def test_scaffold_server_control_moves_by_the_mean_change_over_all_clients():
    deltas = [np.full((2, 2), 2.0, np.float32), np.full((2, 2), 4.0, np.float32)]
    new = update_server_control(np.ones((2, 2), np.float32), deltas, num_clients=4)  # 2 of 4 clients answered
    np.testing.assert_allclose(new, 1 + (2 + 4) / 4)
    new = update_server_control(np.zeros(3, np.float32), [np.arange(3, dtype=np.float32), np.ones(3, np.float32)], 4)
    np.testing.assert_allclose(new, (np.arange(3) + 1) / 4)


def test_scaffold_client_keeps_its_variate_across_rounds_and_returns_its_change():
    cfg = cfg_of("scaffold", **{"local-steps": 2})
    state = MemoryState()
    client = ScaffoldClient(cfg, toy_data(0), torch.device("cpu"), state)
    weights = client.weights()
    zero_c = named_like(client.model, "control", 0.0)
    out1, _, _ = client.fit({**weights, **zero_c}, {"server-round": 1})
    assert sorted(out1) == sorted([*weights, *(k.replace("control/", "control-delta/") for k in zero_c)])
    first_change = {k: v for k, v in out1.items() if k.startswith("control-delta/")}
    # a fresh client object on the same node state (a node may rebuild its client)
    client2 = ScaffoldClient(cfg, toy_data(0), torch.device("cpu"), state)
    client2.restore_state({UPDATE_USED: 1})  # the server's next message: it used round 1's update
    kept = state_arrays(client2.model, "control-delta", client2.local_control())  # c_i started at 0: c_i = its change
    for name, change in first_change.items():
        np.testing.assert_allclose(kept[name], change)
    out2, _, _ = client2.fit({**{k: out1[k] for k in weights}, **zero_c}, {"server-round": 2})
    assert not all(np.allclose(out2[k], 0) for k in first_change)
    client3 = ScaffoldClient(cfg, toy_data(0), torch.device("cpu"), state)
    client3.restore_state({UPDATE_USED: 2})
    after = state_arrays(client3.model, "control-delta", client3.local_control())
    for name in first_change:  # round 2 returns c_i+ - c_i, not c_i+ (the same in round 1, from c_i = 0)
        np.testing.assert_allclose(out2[name], after[name] - kept[name], rtol=1e-5, atol=1e-7)


def test_scaffold_strategy_averages_models_and_sends_its_control_variate(tmp_path):
    cfg = cfg_of("scaffold", **{"num-clients": 4, "output-dir": str(tmp_path), "global-test": False})
    strategy = ScaffoldStrategy(cfg, RunRecorder(cfg, tmp_path), {"model": small_model()}, None)
    rng = np.random.default_rng(0)
    initial = strategy.initial_arrays()
    updates = [
        {
            **{k: rng.standard_normal(a.shape).astype(np.float32) for k, a in initial.items()},
            **{
                k.replace("model/", "control-delta/"): rng.standard_normal(a.shape).astype(np.float32)
                for k, a in initial.items()
            },
        }
        for _ in range(2)
    ]
    results = [(None, fit_res(u, 10, {"partition-id": i, "loss": 1.0})) for i, u in enumerate(updates)]
    strategy.sampled = [0, 1]
    new, _ = strategy.aggregate_fit(1, results, [])
    got = payload.from_parameters(new)
    assert list(got) == list(initial)  # the global arrays hold the model only
    first = next(iter(initial))
    np.testing.assert_allclose(got[first], (updates[0][first] + updates[1][first]) / 2, rtol=1e-6)
    key = first.removeprefix("model/")
    sent = strategy.round_arrays(2, got)[f"control/{key}"]
    np.testing.assert_allclose(
        sent, (updates[0][f"control-delta/{key}"] + updates[1][f"control-delta/{key}"]) / 4, rtol=1e-6
    )


# ---------------------------------------------------------------- MOON


def test_moon_loss_by_hand():
    z = torch.tensor([[1.0, 0.0]])
    z_glob = torch.tensor([[1.0, 1.0]])  # cos = 1/sqrt(2)
    z_prev = torch.tensor([[0.0, 1.0]])  # cos = 0
    tau = 0.5
    pos, neg = math.exp(2**-0.5 / tau), math.exp(0.0)
    assert moon_contrastive_loss(z, z_glob, z_prev, tau).item() == pytest.approx(-math.log(pos / (pos + neg)))


def test_moon_projection_layers_are_part_of_the_model():
    cfg = cfg_of("moon")
    model = moon_model(build_model("cnn", C, 1, 8), MoonSettings.from_config(cfg))
    assert model.feature_dim == 128 and model.classifier.in_features == 128
    assert model.features[1].out_features == 256


def test_moon_negative_pair_is_the_clients_own_last_local_model():
    cfg = cfg_of("moon", **{"local-steps": 2})
    state = MemoryState()
    client = MoonClient(cfg, toy_data(0), torch.device("cpu"), state)
    global_weights = client.weights()
    first = client.make_step(1, {})
    assert first.previous_features is first.global_features  # no last model yet: l_con = log 2, no gradient
    local_weights, _, _ = client.fit(global_weights, {"server-round": 1})

    # next round: a fresh client object on the same node; the server sends other (global) weights
    client2 = MoonClient(cfg, toy_data(0), torch.device("cpu"), state)
    other_global = {k: w + 0.5 for k, w in global_weights.items()}
    client2.restore_state({UPDATE_USED: 1})  # the server used round 1's update
    client2.receive(other_global)
    algo = client2.make_step(2, {})
    for key, got in algo.previous_features.state_dict().items():  # its own round-1 result, not a global model
        np.testing.assert_array_equal(got.numpy(), local_weights[f"model/features.{key}"])
    for key, got in algo.global_features.state_dict().items():
        np.testing.assert_array_equal(got.numpy(), other_global[f"model/features.{key}"])


def test_moon_weighs_its_contrastive_term_by_moon_mu():
    cfg = cfg_of("moon", **{"moon-mu": 5.0})
    settings = MoonSettings.from_config(cfg)
    terms = MoonStep(moon_model(build_model("cnn", C, 1, 8), settings), cfg, settings, None).update(*batch())
    assert terms["con"].item() > 0
    assert terms["loss"].item() == pytest.approx(terms["ce"].item() + 5.0 * terms["con"].item(), rel=1e-6)


def test_moon_first_round_contrastive_term_gives_no_gradient():
    settings = MoonSettings.from_config(cfg_of("moon"))
    model = moon_model(build_model("cnn", C, 1, 8), settings)
    algo = MoonStep(model, cfg_of("moon"), settings, None)
    x, y = batch()
    z = model.features(x)
    con = moon_contrastive_loss(z, algo.global_features(x), algo.previous_features(x), 0.5)
    assert con.item() == pytest.approx(math.log(2), rel=1e-5)


# ---------------------------------------------------------------- FedMix


def test_fedmix_extra_terms_vanish_at_lambda_zero():
    model = small_model()
    x, y = batch()
    g = torch.Generator().manual_seed(9)
    x_mean, y_mean = torch.randn(B, 1, 8, 8, generator=g), torch.softmax(torch.randn(B, C, generator=g), 1)
    terms = fedmix_loss(model, x, y, x_mean, y_mean, lam=0.0)
    ce = F.cross_entropy(model(x), y)
    assert terms["loss"].item() == pytest.approx(ce.item(), rel=1e-6)
    assert close(grads_of(model, terms["loss"]), grads_of(model, F.cross_entropy(model(x), y)), atol=1e-6)


def test_fedmix_loss_by_hand_on_a_linear_model():
    """Logits W u + c at u = (1 - lam) x: the input gradient of CE is W^T (softmax - onehot). The Taylor
    term takes it of the (1 - lam)-weighted batch-MEAN loss, as FedMix's reference implementations do: each
    sample's gradient carries 1/B (B = 3 here; of the summed loss, the term would be 3 times this)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    n = 3
    x = torch.randn(n, 3)
    y = torch.tensor([1, 3, 0])
    x_mean, y_mean = torch.randn(n, 3), torch.softmax(torch.randn(n, 4), 1)
    lam = 0.2
    terms = fedmix_loss(model, x, y, x_mean, y_mean, lam)
    w, c = model.weight.detach().double(), model.bias.detach().double()
    total = taylor = 0.0
    for i in range(n):
        u = (1 - lam) * x[i].double()
        logits = w @ u + c
        p = torch.softmax(logits, 0)
        ce = -torch.log(p[y[i]])
        soft = -(y_mean[i].double() * torch.log(p)).sum()
        grad_u = (1 - lam) * (w.T @ (p - F.one_hot(y[i], 4).double())) / n  # d/du_i of (1 - lam) * mean_j CE_j
        inner = float(grad_u @ x_mean[i].double())
        taylor += inner / n
        total += ((1 - lam) * ce + lam * soft + lam * inner).item() / n
    assert terms["taylor"].item() == pytest.approx(taylor, rel=1e-5)
    assert terms["loss"].item() == pytest.approx(total, rel=1e-5)


def test_fedmix_mean_data_are_means_of_m_samples_with_mean_labels():
    x = torch.arange(20, dtype=torch.float32).view(20, 1, 1, 1)
    y = torch.arange(20) % 5
    means_x, means_y = mean_data(x, y, 4, 5, torch.Generator().manual_seed(0))
    assert means_x.shape == (5, 1, 1, 1) and means_y.shape == (5, 5)
    assert torch.allclose(means_y.sum(1), torch.ones(5))
    assert 4 * means_x.sum().item() == pytest.approx(x.sum().item())  # disjoint groups cover every sample
    # each mean label is that of its own group: with each image its label's value, the two means agree
    means_x, means_y = mean_data(y.float().view(20, 1, 1, 1), y, 4, 5, torch.Generator().manual_seed(1))
    torch.testing.assert_close(means_x.view(-1), means_y @ torch.arange(5.0))
    assert len(set(means_x.view(-1).tolist())) > 1  # the groups differ: one sample's label would not do


def test_fedmix_pairs_each_mean_image_with_its_own_mean_label():
    from clients.fedmix import FedMixStep

    mean_x = torch.arange(6.0).view(6, 1, 1, 1)
    mean_y = torch.eye(6)  # mean i: image value i, label i
    step = FedMixStep(small_model(), cfg_of("fedmix"), 0.1, mean_x, mean_y, seed=0)
    x, y = batch()
    inputs = step.draw(x, y)
    torch.testing.assert_close(inputs["x_mean"].view(-1), inputs["y_mean"].argmax(dim=1).float())


def test_fedmix_client_answers_with_means_only():
    cfg = cfg_of("fedmix", **{"fedmix-m": 5})
    client = FedMixClient(cfg, toy_data(0), torch.device("cpu"))
    answer = client.answer({"request": "fedmix-means", "version": 1})
    x, y = answer["x"], answer["y"]
    assert x.shape == (8, 1, 8, 8) and y.shape == (8, C)
    assert not any(np.allclose(m, s) for m in x for s in client.data.x_train.numpy())


# ---------------------------------------------------------------- VHL


def test_vhl_virtual_data_is_seeded_balanced_and_class_dependent():
    x, y = virtual_data(C, 1, 8, 40, seed=3)
    x2, y2 = virtual_data(C, 1, 8, 40, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == (40, 1, 8, 8) and torch.bincount(y).tolist() == [4] * C
    within = (x[y == 0][0] - x[y == 0][1]).norm()
    between = (x[y == 0][0] - x[y == 1][0]).norm()
    assert between > within


def test_vhl_labels_virtual_data_past_the_real_classes_and_predicts_real_ones():
    model = vhl_model(build_model("cnn", C, 1, 8))
    assert model.classifier.out_features == 2 * C
    x, _ = batch()
    assert RealClasses(model, C)(x).shape == (B, C)
    vx, vy = virtual_data(C, 1, 8, 20, seed=0)
    algo = VHLStep(model, cfg_of("vhl"), VHLSettings.from_config(cfg_of("vhl")), vx, vy, seed=0)
    x, y = batch()
    idx = torch.randint(0, 20, (B,), generator=torch.Generator().manual_seed(0))
    z = model.features(torch.cat([x, vx[idx]]))
    logits = model.classifier(z)
    expected_virtual = F.cross_entropy(logits[B:], vy[idx] + C).item()
    terms = algo.update(x, y)
    assert terms["ce-virtual"].item() == pytest.approx(expected_virtual, rel=1e-5)


def test_vhl_weighs_its_virtual_cross_entropy_and_its_alignment_each_by_its_own_setting():
    cfg = cfg_of("vhl", **{"vhl-weight": 2.0, "vhl-align-weight": 3.0})
    vx, vy = virtual_data(C, 1, 8, 20, seed=0)
    terms = VHLStep(vhl_model(build_model("cnn", C, 1, 8)), cfg, VHLSettings.from_config(cfg), vx, vy, 0).update(
        *batch()
    )
    want = terms["ce"] + 2.0 * terms["ce-virtual"] + 3.0 * terms["align"]
    assert terms["loss"].item() == pytest.approx(want.item(), rel=1e-6)


def test_alignment_loss_by_hand():
    z_real = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y_real = torch.tensor([0, 2])  # class 2 has no virtual sample: that anchor is left out
    z_virtual = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y_virtual = torch.tensor([0, 1])
    tau = 0.5
    expected = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + math.exp(0)))
    assert supervised_alignment_loss(z_real, y_real, z_virtual, y_virtual, tau).item() == pytest.approx(expected)
    # two positives for the one anchor: the mean of their log-probabilities, not their sum
    z_virtual, y_virtual = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), torch.tensor([0, 1, 0])
    sims = [1 / tau, 0.0, 2**-0.5 / tau]
    log_norm = math.log(sum(math.exp(s) for s in sims))
    expected = -((sims[0] - log_norm) + (sims[2] - log_norm)) / 2
    got = supervised_alignment_loss(z_real[:1], y_real[:1], z_virtual, y_virtual, tau).item()
    assert got == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- FedDecorr, FedNTD


def test_decorrelation_loss_by_hand_in_the_official_form():
    a = torch.tensor([1.0, -1.0, 1.0, -1.0])
    b = torch.tensor([1.0, 1.0, -1.0, -1.0])
    # z-scored with the unbiased variance 4/3: z = a / sqrt(4/3); z^T z has 3 on its diagonal
    # the diagonal does not count
    assert decorrelation_loss(torch.stack([a, b], 1)).item() == pytest.approx(0.0, abs=1e-6)
    # columns a and 3a: the off-diagonal entries are 4 / (4/3) = 3; mean of their squares 9, divided by N = 4
    assert decorrelation_loss(torch.stack([a, 3 * a], 1)).item() == pytest.approx(9 / 4, rel=1e-5)
    # the same pattern twice (N = 8, variance 8/7): entries 8 / (8/7) = 7, so 49 / 8: the loss grows with N
    aa = torch.cat([a, a])
    assert decorrelation_loss(torch.stack([aa, 3 * aa], 1)).item() == pytest.approx(49 / 8, rel=1e-5)
    assert decorrelation_loss(torch.randn(1, 4)).item() == 0.0


def test_fedntd_ignores_the_true_class_logit():
    g = torch.Generator().manual_seed(0)
    logits, global_logits = torch.randn(4, C, generator=g), torch.randn(4, C, generator=g)
    y = torch.tensor([0, 3, 3, 9])
    base = not_true_distillation_loss(logits, global_logits, y, tau=1.0)
    moved_local, moved_global = logits.clone(), global_logits.clone()
    moved_local[torch.arange(4), y] += 5.0
    moved_global[torch.arange(4), y] -= 7.0
    assert not_true_distillation_loss(moved_local, moved_global, y, 1.0).item() == pytest.approx(base.item(), rel=1e-6)
    other = logits.clone()
    other[0, 1] += 2.0  # a not-true logit does count
    assert not_true_distillation_loss(other, global_logits, y, 1.0).item() != pytest.approx(base.item(), rel=1e-3)
    assert not_true_distillation_loss(global_logits, global_logits, y, 1.0).item() == pytest.approx(0.0, abs=1e-7)


def test_fedntd_value_by_hand_and_teacher_frozen_at_round_start():
    logits = torch.tensor([[2.0, 0.0, 1.0]])
    teacher = torch.tensor([[0.0, 1.0, 0.0]])
    y = torch.tensor([0])
    q = torch.softmax(torch.tensor([1.0, 0.0]), 0)  # teacher's not-true classes 1, 2
    p = torch.softmax(torch.tensor([0.0, 1.0]), 0)
    expected = float((q * (q / p).log()).sum())
    assert not_true_distillation_loss(logits, teacher, y, 1.0).item() == pytest.approx(expected, rel=1e-6)
    q, p = torch.softmax(torch.tensor([0.5, 0.0]), 0), torch.softmax(torch.tensor([0.0, 0.5]), 0)  # tau = 2
    expected = 4 * float((q * (q / p).log()).sum())  # tau^2 KL of both sides softened by tau
    assert not_true_distillation_loss(logits, teacher, y, 2.0).item() == pytest.approx(expected, rel=1e-6)
    model = small_model()
    algo = fedavg_step(model, cfg_of("fedntd"))
    start = module_arrays("m", model)
    algo.update(*batch())
    for a, b in zip(module_arrays("m", algo.components[0].teacher).values(), start.values()):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- FedCM


def test_fedcm_step_moves_along_alpha_g_plus_one_minus_alpha_delta():
    alpha = 0.1
    model = small_model()
    delta = [torch.full_like(p, 0.5) for p in model.parameters()]
    algo = fedavg_step(model, cfg_of("fedcm", **{"fedcm-alpha": alpha}), named_like(model, "fedcm-delta", 0.5))
    x, y = batch()
    before = params_of(model)
    g = grads_of(model, F.cross_entropy(model(x), y))
    algo.update(x, y)
    expected = [p - LR * (alpha * gi + (1 - alpha) * d) for p, gi, d in zip(before, g, delta)]
    assert close(params_of(model), expected, atol=1e-6)


def test_fedcm_server_direction_is_the_mean_step_in_gradient_units(tmp_path):
    start, new = np.ones(3, np.float32), np.full(3, 0.5, np.float32)
    np.testing.assert_allclose(global_update_direction(start, new, lr=0.1, steps=5), 1.0)
    cfg = cfg_of("fedcm", **{"num-clients": 2, "output-dir": str(tmp_path), "global-test": False, "local-steps": 4})
    strategy = FedAvgStrategy(cfg, RunRecorder(cfg, tmp_path), {"model": small_model()}, None)
    assert [type(c) for c in strategy.components] == [GlobalDirection]  # strategy=fedcm: FedAvg + its component
    initial = strategy.initial_arrays()
    sent = strategy.round_arrays(1, initial)
    assert sorted(sent) == sorted(k.replace("model/", "fedcm-delta/") for k in initial)
    assert all(not d.any() for d in sent.values())  # zero before the first round
    moved = {k: a - 0.2 for k, a in initial.items()}
    strategy.sampled = [0, 1]
    strategy.aggregate_fit(1, [(None, fit_res(moved, 10, {"partition-id": i})) for i in range(2)], [])
    for d in strategy.round_arrays(2, moved).values():
        np.testing.assert_allclose(d, 0.2 / (LR * 4), rtol=1e-5)


def test_fedcm_direction_under_momentum_decays_on_a_flat_loss_instead_of_growing():
    """On a flat loss each round's direction is (1 - alpha) of the last one. Divided by lr K, the momentum's
    own push made it 7.4 times the last one at momentum 0.9 and K = 50: FedCM diverged whatever the loss."""
    alpha, steps = 0.1, 50
    cfg = cfg_of("fedcm", **{"fedcm-alpha": alpha, "momentum": 0.9, "local-steps": steps})
    owner = torch.nn.Linear(4, 1, bias=False)
    weight, delta = owner.weight, torch.ones(1, 4)
    server = GlobalDirection(cfg, {"model/w": weight.detach().numpy().copy()})  # the server's own computation
    for _ in range(3):
        optimizer, start = round_sgd(owner, [weight], cfg), weight.detach().numpy().copy()
        server.round_arrays(1, {"model/w": start})
        for _ in range(steps):
            weight.grad = torch.zeros(1, 4)  # no gradient of its own: the step is the blend's (1 - alpha) delta
            blend_with_global_momentum([weight.grad], [delta], alpha)
            optimizer.step()
        assert server.after_aggregate({"model/w": weight.detach().numpy().copy()}) == []
        np.testing.assert_allclose(server.delta["w"], (1 - alpha) * delta.numpy(), rtol=1e-4)
        delta = torch.as_tensor(server.delta["w"])


def test_parameter_tensors_and_state_arrays_are_inverse():
    model = small_model()
    arrays = module_arrays("c", model)
    back = state_arrays(model, "c", parameter_tensors(model, "c", arrays))
    assert list(back) == list(arrays) and all(np.array_equal(back[k], arrays[k]) for k in arrays)


# ---------------------------------------------------------------- GroupDRO, DANN


def test_groupdro_weight_grows_for_the_client_with_the_highest_loss():
    weights = ClientWeights(3, eta=0.5)
    weights.update({0: 1.0, 1: 3.0, 2: 1.0})
    assert weights.p[1] > weights.p[0] == pytest.approx(weights.p[2])
    assert weights.p.sum() == pytest.approx(1.0)
    assert weights.p[1] / weights.p[0] == pytest.approx(math.exp(0.5 * 2.0))


def test_groupdro_weights_stay_a_distribution_when_a_reported_loss_overflows_the_product():
    weights = ClientWeights(3, eta=0.01)
    weights.update({0: 1e6, 1: 1.0})  # exp(1e4) is inf in float64: the plain product gave inf / inf = NaN
    np.testing.assert_allclose(weights.p, [1.0, 0.0, 0.0])
    weights = ClientWeights(3, eta=0.01)
    weights.update({1: 1e5, 2: 1e5 + 100})  # in log space: p_2 / p_1 = e^(0.01 * 100), p_0 / p_1 = e^-1000
    np.testing.assert_allclose(weights.p, [0.0, 1 / (1 + np.e), np.e / (1 + np.e)], atol=1e-300)
    weights = ClientWeights(2, eta=0.01)
    weights.update({0: -1e6, 1: -1e6 + 100})  # both products underflow to 0: 0 / 0 was NaN
    np.testing.assert_allclose(weights.p, [1 / (1 + np.e), np.e / (1 + np.e)])
    weights = ClientWeights(3, eta=10.0)
    for _ in range(3):  # eta * loss overflows to inf, and the others' logs went to -inf: inf - inf was NaN
        weights.update({0: 1.7e308, 1: 1.0, 2: 2.0})
    np.testing.assert_allclose(weights.p, [1.0, 0.0, 0.0])
    assert weights.weights([0, 1, 2], used=[1, 2]) == [0.0, 1.0, 1.0]  # past the bound, the kept ones alike


def test_groupdro_weighs_the_clients_a_mean_uses_from_the_logs_when_their_weights_underflowed():
    """One client's loss of 1e6 took the whole weight (p = 1, 0, 0); a mean without it had weights that sum to 0,
    and averaging raised out of the server."""
    weights = ClientWeights(3, eta=0.01)
    weights.update({0: 1e6, 1: 1.0, 2: 2.0})
    np.testing.assert_allclose(weights.p, [1.0, 0.0, 0.0])
    assert weights.weights([0, 1, 2], used=[0, 1, 2]) == [1.0, 0.0, 0.0]
    np.testing.assert_allclose(weights.weights([0, 1, 2], used=[1, 2]), [0.0, math.exp(-0.01), 1.0])


def test_groupdro_strategy_averages_with_its_client_weights(tmp_path):
    """The weights come from each client's first-step loss (at the global model), not its round-mean loss."""
    cfg = cfg_of(
        "groupdro", **{"num-clients": 2, "output-dir": str(tmp_path), "global-test": False, "groupdro-eta": 1.0}
    )
    strategy = GroupDROStrategy(cfg, RunRecorder(cfg, tmp_path), {"model": torch.nn.Linear(2, 1)}, None)
    updates = [
        {"model/weight": np.zeros((1, 2), np.float32), "model/bias": np.zeros(1, np.float32)},
        {"model/weight": np.ones((1, 2), np.float32), "model/bias": np.ones(1, np.float32)},
    ]
    results = [
        (None, fit_res(u, 10, {"partition-id": i, "first-loss": first, "loss": 5.0 - first}))
        for i, (u, first) in enumerate(zip(updates, [0.0, math.log(3.0)]))
    ]
    strategy.sampled = [0, 1]
    new, _ = strategy.aggregate_fit(1, results, [])
    np.testing.assert_allclose(payload.from_parameters(new)["model/bias"], 0.75, rtol=1e-6)  # weights 1 : 3


def test_groupdro_rejects_an_update_without_its_first_step_loss(tmp_path):
    """A loss below 0 (no cross-entropy is) was believed, and moved p away from that client for good."""
    cfg = cfg_of("groupdro", **{"num-clients": 4, "output-dir": str(tmp_path), "global-test": False})
    strategy = GroupDROStrategy(cfg, RunRecorder(cfg, tmp_path), {"model": torch.nn.Linear(2, 1)}, None)
    update = {"model/weight": np.ones((1, 2), np.float32), "model/bias": np.ones(1, np.float32)}
    results = [
        (None, fit_res(update, 10, {"partition-id": 0, "first-loss": 0.5})),
        (None, fit_res(update, 10, {"partition-id": 1, "loss": 0.5})),
        (None, fit_res(update, 10, {"partition-id": 2, "first-loss": "high"})),
        (None, fit_res(update, 10, {"partition-id": 3, "first-loss": -1e6})),
    ]
    strategy.sampled = [0, 1, 2, 3]
    new, metrics = strategy.aggregate_fit(1, results, [])
    assert new is not None
    reasons = [r["reason"] for r in json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])["rejected"]]
    assert reasons == ["metric 'first-loss' is missing or not a number >= 0"] * 3


def mixed_cross_entropy_by_hand(model, x, y, lam, perm):
    """lam * CE(f(x_mix), y) + (1 - lam) * CE(f(x_mix), y[perm]), x_mix = lam * x + (1 - lam) * x[perm]."""
    logits = model(lam * x + (1.0 - lam) * x[perm])
    return lam * F.cross_entropy(logits, y) + (1.0 - lam) * F.cross_entropy(logits, y[perm])


@pytest.mark.parametrize("mixup", [True, False])
@pytest.mark.parametrize("engine", ["loop", "vmap"])
def test_groupdro_clients_report_the_loss_of_their_first_step_at_the_global_model(engine, mixup):
    """first-loss is the loss of the first batch at the weights received: by default (the authors' code) the
    Mixup loss of that batch mixed with lam and the permutation of the mixup stream; with groupdro-mixup=false,
    its plain cross-entropy. loss is the mean over the steps."""
    from flwr.common import RecordDict

    from clients.mixup import MixupSampler
    from fedbr_flwr.app.node import build_client
    from fedbr_flwr.core import seeds
    from fedbr_flwr.core.training import BatchSampler

    cfg = cfg_of(
        "groupdro",
        **{
            "num-clients": 2,
            "local-steps": 4,
            "lr": 0.1,
            "engine": "cohort",
            "cohorts": 1,
            "cohort-step": engine,
            "device": "cpu",
            "groupdro-mixup": mixup,
            "seed": 31,  # both clients' first lam well inside (0, 1), where mixing changes the mean loss
        },
    )
    torch.manual_seed(0)  # a client's own initial weights come from torch's global generator (a run sends its own)
    cohort = build_client(cfg, {"partition-id": 0, "num-partitions": 1}, RecordDict())
    model = cohort.algorithm.model
    with torch.no_grad():  # sharper logits than at initialisation, so that mixing changes the loss clearly
        for parameter in model.parameters():
            parameter.mul_(6.0)
    weights = cohort.algorithm.weights()
    wanted = {}
    for pid, data in cohort.members.items():
        x, y = BatchSampler(data, cfg["batch-size"], seeds.seed("batches", cfg["seed"], 1, pid))()
        lam, perm = MixupSampler(0.2, seeds.seed("mixup", cfg["seed"], 1, pid), torch.device("cpu"))(len(y))
        assert 0.2 < lam < 0.8 and not torch.equal(perm, torch.arange(len(y)))
        with torch.no_grad():
            plain = F.cross_entropy(model(x), y).item()
            mixed = mixed_cross_entropy_by_hand(model, x, y, lam, perm).item()
        assert abs(mixed - plain) > 0.1  # the switch changes the figure
        wanted[pid] = mixed if mixup else plain
    parts = [(pid, weights, {"server-round": 1}) for pid in cohort.members]
    answers = (
        cohort.fit_together(parts)
        if engine == "vmap"
        else [(pid, *cohort.member(pid).fit(arrays, config)) for pid, arrays, config in parts]
    )
    for pid, _, _, metrics in answers:
        assert metrics["first-loss"] == pytest.approx(wanted[pid], rel=1e-4)
        assert abs(metrics["loss"] - metrics["first-loss"]) > 1e-3  # the round's mean is another figure


def test_groupdro_carries_mixup_unless_switched_off():
    assert components_of(validate({"strategy": "groupdro"})) == ("mixup",)
    assert components_of(validate({"strategy": "groupdro", "groupdro-mixup": False})) == ()
    assert validate({"strategy": "groupdro", "mixup-alpha": 0.4})["mixup-alpha"] == 0.4
    with pytest.raises(ConfigError, match="belongs to mixup"):
        validate({"strategy": "groupdro", "groupdro-mixup": False, "mixup-alpha": 0.4})


def test_gradient_reversal_flips_the_sign_for_the_features_only():
    z = torch.randn(4, 3, requires_grad=True)
    (reverse_gradient(z, 2.0) * torch.ones(4, 3)).sum().backward()
    assert torch.equal(z.grad, torch.full((4, 3), -2.0))


def test_dann_discriminator_learns_the_domain_while_features_unlearn_it():
    torch.manual_seed(0)
    model = build_model("cnn", C, 1, 8)
    disc = build_discriminator(model.feature_dim, 16, 3)
    algo = DANNStep(model, cfg_of("dann", **{"dann-weight": 1.0, "dann-hidden": 16}), 1.0, disc, domain=2)
    x, y = batch()
    z = model.features(x).detach()
    before = F.cross_entropy(disc(z), torch.full_like(y, 2)).item()
    algo.update(x, y)
    after_same_features = F.cross_entropy(disc(z), torch.full_like(y, 2)).item()
    assert after_same_features < before  # the discriminator descended on the domain loss
    # the features' gradient from the domain term is the reverse of the discriminator-side gradient
    zz = model.features(x)
    domain = F.cross_entropy(disc(reverse_gradient(zz)), torch.full_like(y, 2))
    (g_rev,) = torch.autograd.grad(domain, zz)
    zz2 = model.features(x)
    (g_fwd,) = torch.autograd.grad(F.cross_entropy(disc(zz2), torch.full_like(y, 2)), zz2)
    assert torch.allclose(g_rev, -g_fwd)


def test_dann_weight_scales_only_the_reversed_gradient_reaching_the_features():
    x, y = batch()

    def grads(weight):
        torch.manual_seed(0)
        model = build_model("cnn", C, 1, 8)
        disc = build_discriminator(model.feature_dim, 16, 3)
        step = DANNStep(model, cfg_of("dann"), weight, disc, domain=2)
        domain_ce = step.loss(step.groups, step.draw(x, y), {})[1]["domain-ce"]
        return (
            torch.autograd.grad(domain_ce, list(disc.parameters()), retain_graph=True),
            torch.autograd.grad(domain_ce, list(model.features.parameters())),
        )

    disc_small, feat_small = grads(0.1)
    disc_large, feat_large = grads(1.0)
    assert all(torch.equal(a, b) for a, b in zip(disc_small, disc_large))  # the discriminator: full weight
    assert all(torch.allclose(10 * a, b, atol=1e-7) for a, b in zip(feat_small, feat_large))
    assert any(a.abs().sum() > 0 for a in feat_small)


# ---------------------------------------------------------------- FedBR combined (paper Table 3)


def fedbr_algo(**overrides):
    cfg = validate({"strategy": "fedbr", "batch-size": 4, "lr": LR, **overrides})
    torch.manual_seed(0)
    model = build_model("cnn", C, 1, 8)
    head = FedBRClient.extra_modules(model, cfg)["head"]
    g = torch.Generator().manual_seed(100)
    x_p = torch.randn(4, 1, 8, 8, generator=g)
    components = started_components(cfg, model, named_like(model, "fedcm-delta", 0.3))
    return FedBRStep(
        model,
        cfg,
        FedBRClient.Settings.from_config(cfg),
        head,
        x_p,
        torch.full((4, C), 1.0 / C),
        None,
        seed=0,
        components=components,
    )


def fedbr_terms(algo):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, C, (4,), generator=g)
    inputs = algo.step_inputs(x, y)
    return {k: v.item() for k, v in algo.min_loss(algo.groups, inputs, algo.prepare(algo.groups, inputs))[1].items()}


@pytest.mark.parametrize(
    "method, term, weight_key, weight",
    [
        ("feddecorr", "decorr", "feddecorr-weight", 0.3),
        ("fedntd", "ntd", "fedntd-beta", 0.7),
    ],
)
def test_each_combination_adds_exactly_its_term(method, term, weight_key, weight):
    plain = fedbr_terms(fedbr_algo())
    algo = fedbr_algo(**{"fedbr-with": method, weight_key: weight})
    if method == "fedntd":  # a teacher different from the student, so the term is not zero
        with torch.no_grad():
            for p in algo.components[0].teacher.parameters():
                p.add_(0.05)
    combined = fedbr_terms(algo)
    assert set(combined) == set(plain) | {term}
    for k in plain:
        if k != "loss":
            assert combined[k] == pytest.approx(plain[k], rel=1e-5)
    assert combined[term] > 0
    assert combined["loss"] == pytest.approx(plain["loss"] + weight * combined[term], rel=1e-5)


def test_fedbr_with_fedcm_changes_only_the_min_step_direction():
    plain, cm = fedbr_algo(), fedbr_algo(**{"fedbr-with": "fedcm", "fedcm-alpha": 0.25})
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, C, (4,), generator=g)
    assert fedbr_terms(plain) == pytest.approx(fedbr_terms(cm), rel=1e-6)  # same loss terms
    start = params_of(plain.model)
    plain.update(x, y)
    cm.update(x, y)
    plain_step = [(s - p) / LR for s, p in zip(start, params_of(plain.model))]  # the gradient
    cm_step = [(s - p) / LR for s, p in zip(start, params_of(cm.model))]
    expected = [0.25 * gr + 0.75 * 0.3 for gr in plain_step]
    assert close(cm_step, expected, atol=1e-4)
    assert close(params_of(plain.head), params_of(cm.head), atol=1e-6)  # theta's max step is plain SGD


# ---------------------------------------------------------------- configuration


def test_every_baseline_is_registered():
    assert {
        "fedavg",
        "fedprox",
        "scaffold",
        "moon",
        "fedmix",
        "vhl",
        "feddecorr",
        "fedntd",
        "fedcm",
        "mixup",
        "groupdro",
        "dann",
        "fedbr",
        "distrans",
    } <= set(algorithm_names())


def test_strategy_mixup_and_fedbrs_mixup_are_one_component_selected_by_name():
    alone = validate({"strategy": "mixup"})
    with_fedbr = validate({"strategy": "fedbr", "fedbr-with": "mixup"})
    assert components_of(alone) == components_of(with_fedbr) == ("mixup",)
    assert component_class("mixup") is Mixup
    with pytest.raises(ConfigError, match="'mixup' is gone: FedBR on the Mixup backbone is fedbr-with=mixup"):
        validate({"strategy": "fedbr", "mixup": True})


def test_components_are_listed_in_order_and_checked():
    cfg = validate({"strategy": "fedbr", "fedbr-with": ["fedntd", "mixup", "fedcm"]})  # a YAML list
    assert cfg["fedbr-with"] == "fedntd,mixup,fedcm" and components_of(cfg) == ("fedntd", "mixup", "fedcm")
    assert components_of(validate({"strategy": "fedbr", "fedbr-with": "fedcm, fedntd"})) == ("fedcm", "fedntd")
    assert components_of(validate({"strategy": "fedbr"})) == ()
    with pytest.raises(ConfigError, match="names a component twice"):
        validate({"strategy": "fedbr", "fedbr-with": "fedcm,fedcm"})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"strategy": "fedprox2"},
            "unknown strategy 'fedprox2'. Did you mean 'fedprox'? Valid: dann, distrans, fedavg",
        ),
        (
            {"strategy": "fedavg", "fedprox-mu": 0.1},
            "belongs to fedprox (strategy=fedprox, or strategy=fedbr fedbr-with=fedprox), not to 'fedavg'",
        ),
        ({"strategy": "scaffold", "moon-mu": 0.1}, "Keys of 'scaffold': none beyond the common ones"),
        ({"strategy": "moon", "fedprox-mu": 0.1}, "Keys of 'moon': moon-mu, moon-tau, moon-proj-hidden"),
        (
            {"strategy": "fedbr", "feddecorr-weight": 0.2},
            "belongs to feddecorr (strategy=feddecorr, or strategy=fedbr fedbr-with=feddecorr), not to 'fedbr'",
        ),
        ({"strategy": "fedbr", "fedbr-with": "fedcm", "fedntd-beta": 0.2}, "Keys of 'fedbr + fedcm': fedbr-lambda"),
        (
            {"strategy": "fedavg", "mixup-alpha": 0.4},
            "belongs to mixup (strategy=mixup, or strategy=fedbr fedbr-with=mixup)",
        ),
        ({"strategy": "fedbr", "fedbr-with": "moon"}, "config key 'fedbr-with' = 'moon' names no component moon"),
        ({"strategy": "fedbr", "fedbr-with": "fedntdd"}, "Did you mean 'fedntd'?"),
        ({"strategy": "fedavg", "groupdro-eta": 0.5}, "belongs to groupdro (strategy=groupdro)"),
        ({"strategy": "fedmix", "fedmix-lambda": 1.0}, "must be in [0, 1)"),
        ({"strategy": "fedprox", "fedprox-mu": "a lot"}, "must be float"),
    ],
)
def test_bad_strategy_settings_stop_with_what_is_valid(overrides, message):
    with pytest.raises(ConfigError, match=_escape(message)):
        validate(overrides)


def _escape(text):
    import re

    return re.escape(text)


def test_combination_keys_belong_to_fedbr_only_with_that_combination():
    cfg = validate({"strategy": "fedbr", "fedbr-with": "feddecorr", "feddecorr-weight": 0.2})
    assert cfg["feddecorr-weight"] == 0.2
    assert validate({"strategy": "mixup", "mixup-alpha": 0.4})["mixup-alpha"] == 0.4


# ---------------------------------------------------------------- two rounds, in-process, of what no golden case runs
# (every strategy and the other combinations are golden cases: tests/golden.py, recorded bit for bit)


@pytest.mark.parametrize(
    "name, extra",
    [
        ("fedbr", {"fedbr-with": "fedprox"}),
        ("fedbr", {"fedbr-with": "mixup,fedntd,fedcm"}),  # combinations compose: one batch transform, one term, FedCM
    ],
)
def test_two_rounds_in_process(tmp_path, name, extra):
    cfg = validate(
        {
            "strategy": name,
            "num-clients": 3,
            "local-steps": 2,
            "batch-size": 8,
            "num-rounds": 2,
            "eval-every": 1,
            "global-test": False,
            **extra,
        }
    )
    strategy, clients, proxies = in_process_federation(cfg, tmp_path)
    final = payload.from_parameters(run_rounds(strategy, proxies, 2))
    assert list(final) == strategy.global_names and all(np.isfinite(a).all() for a in final.values())
    rounds = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["clients"] for r in rounds] == [3, 3] and all(np.isfinite(r["train"]["loss"]) for r in rounds)
    evals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(evals) == 2 and all(0 <= e["mean_acc"] <= 1 for e in evals)


def central_accuracy(model: torch.nn.Module, steps: int, lr: float, batch: int = 32, seed: int = 0) -> float:
    """``steps`` of plain SGD on all of mnist5k's training digits (no federation), then accuracy on its
    global test set."""
    from fedbr_flwr.data.catalog import INFO, load_raw
    from fedbr_flwr.data.dataset import normalise

    train, test = load_raw("mnist5k", "")
    x = normalise(torch.from_numpy(train.x).float() / 255.0, INFO["mnist5k"])
    x_test = normalise(torch.from_numpy(test.x).float() / 255.0, INFO["mnist5k"])
    y, y_test = torch.from_numpy(train.y), torch.from_numpy(test.y)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (batch,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


def test_moon_diagnostic_its_projection_layers_cost_little_central_training_on_the_lenet():
    """Whether MOON's architecture explains its slower CPU results: trained centrally for 200 steps of 32 at
    lr 0.05 (the CPU results' lr), the LeNet those results use, with MOON's projection layers between features
    and classifier (default initialisation), ends within 2 points of the LeNet alone. (On the paper's CNN the
    same layers cost over 10 points, which is why this was asked.) Run with -s to see both."""
    torch.manual_seed(0)
    backbone = build_model("lenet", 10, 1, 28)
    torch.manual_seed(0)
    with_head = moon_model(build_model("lenet", 10, 1, 28), MoonSettings.from_config(validate({"strategy": "moon"})))
    alone, moon = central_accuracy(backbone, 200, 0.05), central_accuracy(with_head, 200, 0.05)
    print(f"\ncentral, 200 SGD steps of 32 at lr 0.05: LeNet {alone:.3f}, LeNet + MOON's projection layers {moon:.3f}")
    assert alone > 0.9 and abs(alone - moon) < 0.02
