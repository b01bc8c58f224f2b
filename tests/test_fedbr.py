"""FedBR on small tensors: its losses by hand, the max and min steps, each ablation switch, the
pseudo-data (RSM and Mixture) and its transport, and the strategy's averaging of phi, omega, theta."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, GetParametersRes, Status, ndarrays_to_parameters

from clients.fedbr import FedBRClient, FedBRStep, ProjectionHead, fedbr_contrastive_loss, mean_output_cross_entropy
from fedbr_flwr.app import payload
from fedbr_flwr.app.node import FlowerClient
from fedbr_flwr.core.algorithm import Batch
from fedbr_flwr.core.broadcast import SharedData
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.core.losses import soft_cross_entropy
from fedbr_flwr.core.model import build_model, count_parameters
from fedbr_flwr.core.training import load_module_arrays, module_arrays
from fedbr_flwr.data.dataset import ClientData
from fedbr_flwr.runfiles import codec
from fedbr_flwr.runfiles.run_io import RunRecorder
from fedbr_flwr.server.updates import weighted_mean
from pseudodata import uniform_labels
from pseudodata.mixture import load_proxy, mix
from pseudodata.rsm import allot, assemble, sample_means
from strategies.fedbr import FedBRStrategy

from fakes import OfflineProxy
from steps import started_components

B, C = 4, 10


def fedbr_cfg(**overrides):
    return validate({"strategy": "fedbr", "batch-size": B, "lr": 0.05, **overrides})


def make_algorithm(seed=0, **overrides):
    cfg = fedbr_cfg(**overrides)
    torch.manual_seed(seed)
    model = build_model("cnn", C, 1, 8)
    head = FedBRClient.extra_modules(model, cfg).get("head")
    g = torch.Generator().manual_seed(seed + 100)  # the same pseudo-data whether or not a head was built
    x_p = torch.randn(B, 1, 8, 8, generator=g)
    pool = (torch.randn(20, 1, 8, 8, generator=g), torch.randint(0, C, (20,), generator=g))
    return FedBRStep(
        model,
        cfg,
        FedBRClient.Settings.from_config(cfg),
        head,
        x_p,
        torch.full((B, C), 1.0 / C),
        pool,
        seed=seed,
        components=started_components(cfg, model, seed=seed + 1),
    )


def build_head(cfg, feature_dim):
    return FedBRClient.extra_modules(build_model("cnn", C, 1, 8), cfg).get("head") if feature_dim == 128 else None


def local_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, 8, 8, generator=g), torch.randint(0, C, (B,), generator=g)


def clone_params(module):
    return [p.detach().clone() for p in module.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- losses by hand


def test_contrastive_loss_matches_a_hand_computation():
    p_local = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    p_global = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    p_real = torch.tensor([[0.0, 1.0], [3.0, 0.0]])
    # cos: sample 0: (1/sqrt2, 0); sample 1: (1, 0)
    expected = []
    for cos_pos, cos_neg in ((1 / math.sqrt(2), 0.0), (1.0, 0.0)):
        f1, f2 = math.exp(2.0 * cos_pos), math.exp(3.0 * cos_neg)
        expected.append(-math.log(f1 / (f1 + f2)))
    got = fedbr_contrastive_loss(p_local, p_global, p_real, tau1_scale=2.0, tau2_scale=3.0)
    assert got.item() == pytest.approx(sum(expected) / 2, rel=1e-6)


def test_contrastive_loss_is_finite_for_large_scales():
    p = torch.tensor([[1.0, 0.0]])
    assert torch.isfinite(fedbr_contrastive_loss(p, -p, p, 500.0, 500.0))


def test_soft_cross_entropy_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # softmax (1/4, 3/4)
    target = torch.tensor([[0.5, 0.5]])
    expected = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))
    assert soft_cross_entropy(logits, target).item() == pytest.approx(expected, rel=1e-6)


def test_mean_output_cross_entropy_uses_the_mean_softmax():
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])  # mean softmax (1/2, 1/2)
    target = torch.full((2, 2), 0.5)
    assert mean_output_cross_entropy(logits, target).item() == pytest.approx(math.log(2.0), rel=1e-6)
    # per-sample soft CE of the same outputs is larger: each sample is confident
    assert soft_cross_entropy(logits, target).item() > math.log(2.0) + 0.1
    # not symmetric, and mixture pseudo-data's labels differ per sample: the mean of the softmax outputs
    # (3/8, 5/8), not the softmax of the mean logits, against the mean label (3/4, 1/4), not the first one
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    target = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    want = -(0.75 * math.log(3 / 8) + 0.25 * math.log(5 / 8))
    assert mean_output_cross_entropy(logits, target).item() == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------- the projection head


def test_projection_head_widths():
    head = ProjectionHead(128)
    widths = [(m.in_features, m.out_features) for m in head.net if isinstance(m, torch.nn.Linear)]
    assert widths == [(128, 256), (256, 256), (256, 128)]
    head = ProjectionHead(128, hidden=64, out=32)
    assert [m.out_features for m in head.net if isinstance(m, torch.nn.Linear)] == [64, 64, 32]
    assert build_head(fedbr_cfg(**{"fedbr-contrastive": False}), 128) is None
    assert (
        count_parameters(build_head(fedbr_cfg(**{"fedbr-proj-hidden": 64}), 128))
        == 128 * 64 + 64 + 64 * 64 + 64 + 64 * 128 + 128
    )


# ---------------------------------------------------------------- max and min steps


def test_max_step_raises_the_contrastive_loss_and_touches_only_theta():
    algo = make_algorithm()
    inputs = algo.step_inputs(*local_batch())
    shared = algo.prepare(algo.groups, inputs)
    model_before, head_before = clone_params(algo.model), clone_params(algo.head)
    before = algo.run_phase(algo.phases[0], inputs, shared)["con-max"]
    after, _ = algo.max_loss(algo.groups, inputs, shared)
    assert after.item() > before.item()
    assert same(model_before, clone_params(algo.model))
    assert not same(head_before, clone_params(algo.head))
    assert all(p.grad is None for p in algo.model.parameters())


def test_min_step_lowers_the_total_loss_and_leaves_theta_untouched():
    algo = make_algorithm(lr=0.01)
    inputs = algo.step_inputs(*local_batch())
    before = terms_at(algo, inputs)
    head_before = clone_params(algo.head)
    algo.run_phase(algo.phases[-1], inputs, algo.prepare(algo.groups, inputs))
    after = terms_at(algo, inputs)
    assert after["loss"].item() < before["loss"].item()
    assert same(head_before, clone_params(algo.head))
    assert all(p.grad is None for p in algo.head.parameters())


def test_global_features_are_frozen_at_round_start():
    algo = make_algorithm()
    z_g = algo.z_g_fixed.clone()
    for _ in range(3):
        algo.update(*local_batch())
    assert torch.equal(algo.global_feature(algo.x_p), z_g)
    assert not torch.equal(algo.model.features(algo.x_p).detach(), z_g)


def test_update_runs_max_then_min_step():
    algo = make_algorithm()
    ref = make_algorithm()  # same seed: same weights and pseudo-data
    x, y = local_batch()
    stats = algo.update(x, y)
    assert set(stats) == {"con-max", "ce", "balance", "con", "con-cos-pos", "con-cos-neg", "loss"}
    inputs = ref.step_inputs(x, y)
    shared = ref.prepare(ref.groups, inputs)
    assert [phase.groups for phase in ref.phases] == [("head",), ("model",)]
    ref.run_phase(ref.phases[0], inputs, shared)  # the max step on theta
    ref.run_phase(ref.phases[1], inputs, shared)  # then the min step, with the moved theta
    assert same(clone_params(algo.model), clone_params(ref.model))
    assert same(clone_params(algo.head), clone_params(ref.head))


# ---------------------------------------------------------------- ablation switches


def terms_at(algo, inputs):
    """The min step's loss terms on one step's inputs, at the current weights."""
    return algo.min_loss(algo.groups, inputs, algo.prepare(algo.groups, inputs))[1]


def terms_of(algo, x, y):
    return {k: v.item() for k, v in terms_at(algo, algo.step_inputs(x, y)).items()}


def test_each_switch_removes_exactly_its_term():
    x, y = local_batch()
    lam, mu = 0.7, 0.3
    full = terms_of(make_algorithm(**{"fedbr-lambda": lam, "fedbr-mu": mu}), x, y)
    assert full["loss"] == pytest.approx(full["ce"] + lam * full["balance"] + mu * full["con"], rel=1e-6)

    no_balance = terms_of(make_algorithm(**{"fedbr-lambda": lam, "fedbr-mu": mu, "fedbr-balance": False}), x, y)
    assert set(no_balance) == {"ce", "con", "con-cos-pos", "con-cos-neg", "loss"}
    assert no_balance["ce"] == pytest.approx(full["ce"], rel=1e-5)
    assert no_balance["con"] == pytest.approx(full["con"], rel=1e-5)
    assert no_balance["loss"] == pytest.approx(full["loss"] - lam * full["balance"], rel=1e-5)

    no_con = terms_of(make_algorithm(**{"fedbr-lambda": lam, "fedbr-mu": mu, "fedbr-contrastive": False}), x, y)
    assert set(no_con) == {"ce", "balance", "loss"}
    assert no_con["balance"] == pytest.approx(full["balance"], rel=1e-5)
    assert no_con["loss"] == pytest.approx(full["loss"] - mu * full["con"], rel=1e-5)


def test_the_contrastive_diagnostics_are_the_pairs_mean_cosines_and_change_no_gradient():
    x, y = local_batch()
    algo = make_algorithm()
    inputs = algo.step_inputs(x, y)
    z_l, z_p = algo.model.features(x), algo.model.features(inputs["x_p"])
    terms = terms_at(algo, inputs)
    p_p, p_g, p_l = (t.detach() for t in algo.head(torch.cat([z_p, inputs["z_g"], z_l])).split(B))
    cos = torch.nn.functional.cosine_similarity
    assert terms["con-cos-pos"].item() == pytest.approx(cos(p_p, p_g, dim=1).mean().item(), rel=1e-5)
    assert terms["con-cos-neg"].item() == pytest.approx(cos(p_p, p_l, dim=1).mean().item(), rel=1e-5)
    per_pair = torch.nn.functional.softplus(algo.s.tau2 * cos(p_p, p_l, dim=1) - algo.s.tau1 * cos(p_p, p_g, dim=1))
    assert terms["con"].item() == pytest.approx(per_pair.mean().item(), rel=1e-5)  # the same pairs as L_con
    assert not terms["con-cos-pos"].requires_grad and not terms["con-cos-neg"].requires_grad


def test_fedbr_reports_how_far_theta_moved_in_a_round():
    cfg = fedbr_cfg(**{"local-steps": 3})
    client = FedBRClient(cfg, client_data(0, 0.0), torch.device("cpu"))
    x_p = torch.randn(B, 1, 8, 8)
    step = FedBRStep(
        client.model,
        cfg,
        client.settings,
        client.modules["head"],
        x_p,
        torch.full((B, C), 1.0 / C),
        (client.data.x_train, client.data.y_train),
    )
    start = clone_params(client.modules["head"])
    for _ in range(3):
        step.update(*local_batch())
    moved = torch.sqrt(sum(((p - p0) ** 2).sum() for p, p0 in zip(clone_params(client.modules["head"]), start)))
    _, metrics = client.after_fit(step)
    assert metrics["head-update-norm"] == pytest.approx(moved.item(), rel=1e-6) and moved > 0
    off = FedBRClient(fedbr_cfg(**{"fedbr-contrastive": False}), client_data(0, 0.0), torch.device("cpu"))
    assert "head-update-norm" not in off.after_fit(None)[1]


def test_mean_output_switch_changes_only_the_balance_term():
    x, y = local_batch()
    full = make_algorithm()
    fedaug = make_algorithm(**{"fedbr-balance-loss": "mean-output"})
    a, b = terms_of(full, x, y), terms_of(fedaug, x, y)
    assert a["ce"] == pytest.approx(b["ce"], rel=1e-6) and a["con"] == pytest.approx(b["con"], rel=1e-6)
    inputs = fedaug.step_inputs(x, y)
    logits_p = fedaug.model(inputs["x_p"])
    assert b["balance"] == pytest.approx(mean_output_cross_entropy(logits_p, inputs["y_p"]).item(), rel=1e-5)
    assert b["balance"] != pytest.approx(a["balance"], rel=1e-3)


def test_without_max_step_theta_keeps_its_value_and_the_terms_are_unchanged():
    x, y = local_batch()
    algo = make_algorithm(**{"fedbr-max-step": False})
    head_before = clone_params(algo.head)
    stats = algo.update(x, y)
    assert "con-max" not in stats and "con" in stats
    assert same(head_before, clone_params(algo.head))
    assert terms_of(make_algorithm(**{"fedbr-max-step": False}), x, y) == pytest.approx(
        terms_of(make_algorithm(), x, y), rel=1e-6
    )


def test_mixup_mixes_the_local_batch_and_its_labels():
    x, y = local_batch()
    algo = make_algorithm(**{"fedbr-with": "mixup"})
    inputs = algo.step_inputs(x, y)
    local = Batch.from_tensors(inputs)
    assert 0 <= local.lam <= 1 and local.lam != 1.0 and local.lam_b == 1 - local.lam
    candidates = local.lam * x[:, None] + (1 - local.lam) * x[None, :]  # [i, j]: x_i mixed with x_j
    error = (candidates - local.x[:, None]).abs().flatten(2).amax(dim=2)
    assert bool((error.amin(dim=1) < 1e-5).all())
    perm = error.argmin(dim=1)
    assert torch.equal(local.y_b, y[perm]) and torch.equal(local.y, y)
    terms = terms_at(algo, inputs)
    logits = algo.model(local.x)
    ce = local.lam * torch.nn.functional.cross_entropy(logits, y) + (1 - local.lam) * torch.nn.functional.cross_entropy(
        logits, local.y_b
    )
    assert terms["ce"].item() == pytest.approx(ce.item(), rel=1e-5)
    plain = terms_of(make_algorithm(), x, y)
    assert terms["balance"].item() == pytest.approx(plain["balance"], rel=1e-5)  # pseudo-data untouched


# ---------------------------------------------------------------- pseudo-data


def test_rsm_means_are_means_of_m_distinct_samples_of_one_client():
    n, dim, m = 30, 30, 10
    x = torch.eye(n)[:, :dim].reshape(n, 1, 1, dim)  # sample i: 1 at position i
    g = torch.Generator().manual_seed(0)
    means = sample_means(x, 7, m, g)
    assert means.shape == (7, 1, 1, dim)
    for mean in means:
        spikes = mean.flatten() * m
        assert torch.allclose(spikes.sum(), torch.tensor(float(m)))  # M samples in the mean ...
        assert int((spikes > 0.5).sum()) == m  # ... all distinct


def test_rsm_allotment_gives_exactly_b_means_spread_evenly():
    counts = allot(64, list(range(10)), seed=0, version=1)
    assert sum(counts.values()) == 64 and set(counts.values()) == {6, 7}
    assert allot(64, list(range(10)), 0, 1) == counts  # seeded
    few = allot(3, list(range(10)), 0, 1)
    assert sum(few.values()) == 3 and max(few.values()) == 1
    # the remainder's clients are drawn anew each version (round), not always the first ones
    extra = {pid for version in range(1, 6) for pid, n in allot(64, list(range(10)), 0, version).items() if n == 7}
    assert not extra <= {0, 1, 2, 3}


def test_assemble_keeps_the_given_order_and_repeats_the_means_that_came_for_those_left_out():
    parts = [np.zeros((2, 1)), np.ones((0, 1)), np.full((1, 1), 2.0)]
    np.testing.assert_array_equal(assemble(parts, 3).ravel(), [0, 0, 2])
    np.testing.assert_array_equal(assemble(parts, 5).ravel(), [0, 0, 2, 0, 0])  # a client's 2 means did not come
    with pytest.raises(RuntimeError, match="no client sent pseudo-data means"):
        assemble([np.ones((0, 1))], 3)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_mixture_formula_and_labels_summing_to_one(k):
    g = torch.Generator().manual_seed(0)
    x_p, y_p = torch.randn(5, 1, 4, 4, generator=g), torch.full((5, C), 1.0 / C)
    x_k, y_k = torch.randn(k, 5, 1, 4, 4, generator=g), torch.randint(0, C, (k, 5), generator=g)
    x, y = mix(x_p, y_p, x_k, y_k, C)
    assert torch.allclose(y.sum(dim=1), torch.ones(5))
    assert torch.allclose(x, (x_p + x_k.sum(0)) / (k + 1))
    if k == 0:
        assert x is x_p and y is y_p
    else:
        assert torch.allclose(y[0, y_k[0, 0]], (1.0 / C + (y_k[:, 0] == y_k[0, 0]).sum()) / (k + 1))


def test_mixture_draws_its_local_samples_from_the_whole_pool():
    """An index drawn below len(pool) - 1 left the last local sample out of every mix; only golden files saw it."""
    algo = make_algorithm(**{"pseudo-data": "mixture", "mixture-k": 1})
    algo.local_pool = (torch.zeros(2, *algo.x_p.shape[1:]), torch.tensor([0, 1]))
    seen: set[int] = set()
    for _ in range(10):
        mixed_in = 2 * algo.draw(*local_batch())["y_p"] - algo.y_p  # k = 1: y_p' = (y_p + one-hot) / 2
        seen |= set(mixed_in.argmax(dim=1).tolist())
    assert seen == {0, 1}


def test_mixture_batches_change_every_step_and_keep_soft_labels():
    algo = make_algorithm(**{"pseudo-data": "mixture", "mixture-k": 1})
    x, y = local_batch()
    b1, b2 = algo.step_inputs(x, y), algo.step_inputs(x, y)
    assert not torch.equal(b1["x_p"], b2["x_p"])
    assert torch.allclose(b1["y_p"].sum(dim=1), torch.ones(B)) and b1["y_p"].max() > 0.5
    assert algo.z_g_fixed is None  # the global features follow the mixed batch


def test_proxy_dataset_is_converted_to_the_runs_image_shape(tmp_path, monkeypatch):
    from datafiles import trust_cifar, write_cifar

    proxy = load_proxy(fedbr_cfg(**{"pseudo-data": "mixture"}))
    assert proxy.shape[1:] == (1, 28, 28) and abs(proxy.mean().item()) < 0.2  # normalised MNIST digits
    write_cifar(tmp_path, "cifar100", per_file=6)  # torchvision's files (train, test, meta), md5s trusted
    trust_cifar(monkeypatch, tmp_path, "cifar100")
    cfg = fedbr_cfg(**{"pseudo-data": "mixture", "proxy-dataset": "cifar100", "data-dir": str(tmp_path)})
    proxy = load_proxy(cfg)
    assert proxy.shape == (6, 1, 28, 28)  # grey, resized
    from torch.nn import functional as F

    from fedbr_flwr.data.catalog import INFO, load_raw
    from fedbr_flwr.data.dataset import normalise, to_float

    colour = to_float(load_raw("cifar100", str(tmp_path), False)[0].x)
    grey = F.interpolate(colour.mean(dim=1, keepdim=True), size=(28, 28), mode="bilinear", antialias=True)
    torch.testing.assert_close(proxy, normalise(grey, INFO["mnist5k"]))  # grey: the mean of the three channels


def test_pseudo_payload_round_trips():
    x, y = np.random.rand(3, 1, 2, 2).astype(np.float32), uniform_labels(3, 4)
    shared = SharedData("pseudo")
    shared.publish(x, y, 1)
    arrays = codec.decode(shared.fit_config(0)["pseudo-payload"])
    x2, y2 = arrays["x"], arrays["y"]
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert np.allclose(y2.sum(1), 1.0)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"strategy": "fedavg", "fedbr-mu": 1.0}, r"belongs to fedbr \(strategy=fedbr\), not to .fedavg."),
        ({"strategy": "fedbr", "fedbr-balance": False, "fedbr-contrastive": False}, "use strategy=fedavg"),
        ({"strategy": "fedbr", "fedbr-contrastive": False, "fedbr-max-step": False}, "only applies"),
        ({"strategy": "fedbr", "pseudo-size": 16, "batch-size": 32}, "must be equal"),
        ({"strategy": "fedbr", "pseudo-data": "mix"}, "not one of"),
        ({"strategy": "fedbr", "fedbr-mu": -1}, ">= 0"),
    ],
)
def test_bad_fedbr_settings_stop_with_a_clear_message(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(overrides)


def test_fedbr_keys_at_their_defaults_are_accepted_with_other_strategies():
    validate({"strategy": "fedavg", "fedbr-mu": 0.5})  # Flower passes every key with its default
    assert validate({"strategy": "fedbr", "fedbr-contrastive": False, "pseudo-size": 16})["pseudo-size"] == 16


# ---------------------------------------------------------------- client and strategy (no processes)


def client_data(pid, offset, n=40):
    g = torch.Generator().manual_seed(pid)
    x = torch.randn(n, 1, 28, 28, generator=g) * 0.01 + offset
    y = torch.randint(0, C, (n,), generator=g)
    return ClientData(pid, x, y, x[:8], y[:8], C, False)


class ClientProxyOf(OfflineProxy):
    """Calls a client object in-process, as Flower would after its message round trip."""

    def __init__(self, client):
        super().__init__(f"node-{client.pid}")
        self.client, self.requests = client, []

    def get_parameters(self, ins, timeout, group_id):
        self.requests.append(dict(ins.config))
        arrays = FlowerClient(self.client).get_parameters(ins.config)
        return GetParametersRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays))


def make_fedbr_strategy(tmp_path, num_clients=3, **overrides):
    cfg = validate(
        {
            "strategy": "fedbr",
            "output-dir": str(tmp_path),
            "global-test": False,
            "batch-size": 8,
            "num-clients": num_clients,
            "local-steps": 2,
            **overrides,
        }
    )
    torch.manual_seed(0)
    strategy = FedBRStrategy(cfg, RunRecorder(cfg, tmp_path), FedBRClient.build_modules(cfg), None)
    clients = [FedBRClient(cfg, client_data(pid, offset=1.0 * pid), "cpu") for pid in range(num_clients)]
    strategy.federation.clients_by_pid = {c.pid: ClientProxyOf(c) for c in clients}
    return strategy, clients


def test_server_assembles_rsm_from_each_clients_means_in_partition_order(tmp_path):
    strategy, clients = make_fedbr_strategy(tmp_path)
    strategy.refresh_shared_data(1)
    x, y = strategy.shared.arrays
    assert x.shape == (8, 1, 28, 28) and np.allclose(y, 1.0 / C)
    owner = np.round(x.mean(axis=(1, 2, 3))).astype(int)  # each mean sits at its client's offset
    counts = allot(8, [0, 1, 2], 0, 1)
    assert owner.tolist() == [pid for pid in range(3) for _ in range(counts[pid])]
    requests = [p.requests for p in strategy.federation.clients_by_pid.values()]
    assert all(req[0]["pseudo-m"] == 10 and req[0]["request"] == "rsm-means" for req in requests)
    saved = np.load(tmp_path / "pseudo_data.npz")
    np.testing.assert_array_equal(saved["x"], x)


def test_payload_goes_once_to_each_client_and_again_after_a_failure(tmp_path):
    strategy, clients = make_fedbr_strategy(tmp_path)
    strategy.refresh_shared_data(1)
    params = payload.from_parameters(strategy.initialize_parameters(None))
    first = strategy.fit_config(1, 0)
    assert "pseudo-payload" in first and first["pseudo-version"] == 1
    weights, n, metrics = clients[0].fit(params, first)
    assert metrics["pseudo-version"] == 1
    strategy.sampled = [0, 1]
    fit_res = FitRes(Status(Code.OK, ""), payload.to_parameters(weights), n, metrics)
    strategy.aggregate_fit(1, [(None, fit_res)], [])
    assert "pseudo-payload" not in strategy.fit_config(2, 0)  # client 0 holds it in its state
    assert "pseudo-payload" in strategy.fit_config(2, 1)  # client 1 was sampled but did not answer
    clients[0].fit(params, strategy.fit_config(2, 0))  # trains from its stored copy
    with pytest.raises(RuntimeError, match="holds pseudo data version None"):
        clients[2].fit(params, strategy.fit_config(2, 0))  # never received it


def test_strategy_averages_phi_omega_and_theta(tmp_path):
    strategy, clients = make_fedbr_strategy(tmp_path, weighting="samples")
    model_arrays = len(strategy.model.state_dict())
    head_arrays = len(strategy.modules["head"].state_dict())
    initial = payload.from_parameters(strategy.initialize_parameters(None))
    assert len(initial) == model_arrays + head_arrays and list(initial) == list(clients[0].weights())
    rng = np.random.default_rng(0)
    updates = [{k: rng.standard_normal(a.shape).astype(a.dtype) for k, a in initial.items()} for _ in range(3)]
    sizes = [10, 20, 70]
    results = [
        (None, FitRes(Status(Code.OK, ""), payload.to_parameters(u), s, {"partition-id": i, "pseudo-version": 1}))
        for i, (u, s) in enumerate(zip(updates, sizes))
    ]
    strategy.sampled = [0, 1, 2]
    new, _ = strategy.aggregate_fit(1, results[::-1], [])
    got = payload.from_parameters(new)
    assert list(got) == list(initial)  # phi and omega ('model/...'), then theta ('head/...')
    for name in initial:
        expected = sum(s * u[name].astype(np.float64) for s, u in zip(sizes, updates)) / sum(sizes)
        np.testing.assert_allclose(got[name], expected, rtol=1e-6)
    head = build_head(strategy.cfg, 128)
    load_module_arrays(head, "head", got)
    head_names = [n for n in initial if n.startswith("head/")]
    np.testing.assert_allclose(
        module_arrays("head", head)[head_names[0]],
        weighted_mean([[u[n] for n in head_names] for u in updates], sizes)[0],
    )


def test_mixture_pseudo_data_comes_from_the_proxy_dataset(tmp_path):
    strategy, _ = make_fedbr_strategy(tmp_path, **{"pseudo-data": "mixture"})
    strategy.refresh_shared_data(1)
    assert all(not p.requests for p in strategy.federation.clients_by_pid.values())  # no client was asked
    x, _ = strategy.shared.arrays
    assert x.shape == (8, 1, 28, 28) and abs(float(x.mean())) < 1.0  # digit means, not client offsets
