"""The fast path keeps the results: clients reused across rounds train as new ones would, bf16
autocast and torch.compile stay within tolerance of fp32 eager, the traffic and memory a round
records are the messages' own, and the benchmark's suite and synthetic data are what they claim."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.common import RecordDict, ndarrays_to_parameters

from fedbr_flwr.app import payload
from fedbr_flwr.app.node import ClientCache, build_client
from fedbr_flwr.bench import command as bench
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.core.training import frozen_copy, round_sgd
from fedbr_flwr.data.catalog import SYNTHETIC_SIZES, load_raw
from fedbr_flwr.launch.plan import config_from_settings
from fedbr_flwr.runfiles.metrics import read_jsonl

from fakes import bare_fit_config, in_process_federation, run_rounds

NODE = {"partition-id": 1, "num-partitions": 2}


def run_config(**settings):
    return {"num-clients": 2, "local-steps": 3, "batch-size": 8, "device": "cpu", "momentum": 0.9, **settings}


def fit_rounds(cfg: dict, get_client, rounds: int = 2) -> list[list[np.ndarray]]:
    """What ``rounds`` fits return when each feeds the next, with the clients that ``get_client`` hands out,
    from the first client's seeded initial weights."""
    torch.manual_seed(0)
    first = get_client()
    weights = payload.from_list(first.get_parameters({}))
    fit_config = bare_fit_config(cfg, {1: first.algorithm})  # FedBR: the pseudo-data, sent at round 1
    returned = []
    for server_round in range(1, rounds + 1):
        arrays, _, _ = get_client().fit(payload.to_list(weights), fit_config(server_round))
        returned.append(arrays)
        weights = {k: v for k, v in payload.from_list(arrays).items() if k in weights}
    return returned


@pytest.mark.parametrize(
    "settings",
    [
        {"strategy": "fedavg"},
        {"strategy": "fedbr"},
        {"strategy": "fedbr", "fedbr-with": "fedntd"},
        {"strategy": "fedbr", "pseudo-data": "mixture", "proxy-dataset": "mnist5k"},
        {"strategy": "moon"},
        {"strategy": "fedntd"},
        {"strategy": "dann"},
        {"strategy": "distrans"},
        {"strategy": "fedprox"},
    ],
    ids=lambda s: "-".join(str(v) for v in s.values()),
)
def test_a_client_reused_across_rounds_trains_as_a_new_client_each_round_would(settings):
    """Simulation and worker keep one client per partition (model, optimisers, frozen copies); a new
    client per message, as Flower would build, must give the same arrays to the last bit."""
    config = run_config(**settings)
    cfg = config_from_settings(config)
    fresh_state, cached_state = RecordDict(), RecordDict()  # Flower's node state, kept across messages
    fresh = fit_rounds(cfg, lambda: build_client(config, NODE, fresh_state))
    cache = ClientCache()
    reused = fit_rounds(cfg, lambda: cache.get(5, config, NODE, cached_state))
    assert len(cache.clients) == 1
    for a_round, b_round in zip(fresh, reused):
        assert len(a_round) == len(b_round)
        for a, b in zip(a_round, b_round):
            np.testing.assert_array_equal(a, b)


def test_the_cache_keeps_a_client_per_run_and_config_and_drops_old_runs():
    cache = ClientCache(runs_kept=1)
    state = RecordDict()
    first = cache.get(1, run_config(), NODE, state)
    assert cache.get(1, run_config(), NODE, RecordDict()) is first
    assert first.algorithm.state.records is not state  # each message's own copy of Flower's state
    assert cache.get(1, run_config(lr=0.1), NODE, state) is not first  # another config: another client
    cache.get(2, run_config(), NODE, state)
    assert {run for run, _, _ in cache.clients} == {2}


def test_round_sgd_is_reused_with_its_momentum_cleared_and_frozen_copies_follow_the_model():
    model = torch.nn.Linear(3, 2)
    cfg = validate({"lr": 0.1, "momentum": 0.9, "weight-decay": 0.0})
    opt = round_sgd(model, model.parameters(), cfg)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert opt.state  # momentum buffers after a step
    again = round_sgd(model, model.parameters(), cfg)
    assert again is opt and not again.state  # the next round starts without momentum
    assert round_sgd(model, model.parameters(), cfg, lr=0.2) is not opt
    copy = frozen_copy(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(copy.weight, model.weight)  # frozen until the next round asks again
    assert frozen_copy(model) is copy and torch.equal(copy.weight, model.weight)
    assert not copy.weight.requires_grad and not copy.training


@pytest.mark.parametrize(
    "hyper",
    [
        {},
        {"momentum": 0.9, "weight_decay": 1e-2},
        {"momentum": 0.9, "nesterov": True},
        {"momentum": 0.5, "dampening": 0.1, "maximize": True},
    ],
)
def test_plain_sgd_is_torchs_sgd_on_a_cpu_bit_for_bit_and_imports_no_dynamo(hyper):
    import subprocess
    import sys

    from fedbr_flwr.core.training import PlainSGD

    torch.manual_seed(0)
    theirs, ours = torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    mine = [theirs.detach().clone().requires_grad_(), ours.detach().clone().requires_grad_()]
    reference = torch.optim.SGD([theirs, ours], lr=0.1, **hyper)
    plain = PlainSGD(mine, lr=0.1, **hyper)
    for step in range(4):
        grads = [torch.randn(4, 3), torch.randn(3)]
        for optimiser, params in ((reference, [theirs, ours]), (plain, mine)):
            optimiser.zero_grad(set_to_none=True)
            for p, g in zip(params, grads):
                p.grad = None if step == 2 and p.dim() == 1 else g.clone()  # a parameter without a gradient
            optimiser.step()
        assert torch.equal(mine[0], theirs) and torch.equal(mine[1], ours)
    plain.state.clear()
    assert not plain.state
    code = (
        "import sys, torch\nfrom torch import nn\nfrom fedbr_flwr.core.training import round_sgd\n"
        "from fedbr_flwr.core.config import validate\n"
        "m = nn.Linear(3, 2); o = round_sgd(m, m.parameters(), validate({'lr': 0.1, 'momentum': 0.9}))\n"
        "m(torch.ones(1, 3)).sum().backward(); o.step(); o.zero_grad()\n"
        "print(type(o).__name__, 'torch._dynamo' in sys.modules)"
    )
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert printed.split() == ["PlainSGD", "False"]


def local_losses(precision: str, compiled: bool = False, strategy: str = "fedbr") -> list[float]:
    """Per-step training losses of one client from the same weights and batches."""
    config = run_config(strategy=strategy, precision=precision, compile=compiled, **{"local-steps": 1})
    cfg = config_from_settings(config)
    torch.manual_seed(0)
    client = build_client(config, NODE, RecordDict())
    weights = client.get_parameters({})
    fit_config = bare_fit_config(cfg, {1: client.algorithm})
    losses = []
    for server_round in range(1, 6):
        _, _, metrics = client.fit(weights, fit_config(server_round))  # the same start, other batches
        losses.append(metrics["loss"])
    if compiled:
        assert client.algorithm.model.features._compiled_call_impl is not None
    return losses


@pytest.mark.parametrize("strategy", ["fedavg", "fedbr"])
def test_bf16_autocast_keeps_the_losses_near_fp32(strategy):
    fp32, bf16 = local_losses("fp32", strategy=strategy), local_losses("bf16", strategy=strategy)
    assert fp32 != bf16  # autocast did run in bf16
    np.testing.assert_allclose(bf16, fp32, rtol=0.03)


def step_losses(precision: str, strategy: str, steps: int = 4) -> list[float]:
    """The training loss of each of ``steps`` local steps of one client in one round (one fit)."""
    from fedbr_flwr.core.training import run_local_steps

    config = run_config(
        strategy=strategy,
        precision=precision,
        momentum=0.0,
        lr=0.05,
        model="cnn-small",
        **{"local-steps": steps, "batch-size": 32},
    )
    torch.manual_seed(0)
    client = build_client(config, NODE, RecordDict())
    algorithm = client.algorithm
    fit_config = bare_fit_config(config_from_settings(config), {1: algorithm})
    step, sampler = algorithm.start_fit(algorithm.weights(), fit_config(1))
    losses, update = [], step.update
    step.update = lambda x, y: (lambda stats: losses.append(float(stats["loss"])) or stats)(update(x, y))
    run_local_steps(step, sampler, steps, precision)
    return losses


@pytest.mark.parametrize("strategy", ["fedavg", "fedbr"])
def test_bf16_steps_each_run_on_the_current_weights(strategy):
    """Autocast caches its bf16 copies of the weights for as long as its region lasts: with one region over
    the K steps, steps 2..K ran on step 1's weights (their losses 2-5% off fp32's; every step's is within
    0.05% now)."""
    fp32, bf16 = step_losses("fp32", strategy), step_losses("bf16", strategy)
    assert fp32 != bf16 and len(fp32) == 4
    np.testing.assert_allclose(bf16, fp32, rtol=5e-3)
    assert abs(fp32[-1] - fp32[0]) > 20 * max(abs(a - b) for a, b in zip(bf16, fp32))  # the steps did move


def test_compiled_feature_extractor_keeps_the_losses_of_eager_fp32():
    np.testing.assert_allclose(local_losses("fp32", compiled=True), local_losses("fp32"), rtol=1e-4)


def test_a_round_records_the_bytes_of_its_messages_and_the_clients_peak_memory(tmp_path):
    cfg = config_from_settings(
        {
            "strategy": "fedbr",
            "num-clients": 3,
            "local-steps": 1,
            "batch-size": 8,
            "device": "cpu",
            "eval-every": 5,
            "global-test": False,
        }
    )
    strategy, clients, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy, proxies, 2)
    first, second = read_jsonl(tmp_path / "rounds.jsonl")
    weights = payload.to_list(clients[0].weights())  # the names, then the arrays
    serialised = sum(len(t) for t in ndarrays_to_parameters(weights).tensors)
    assert second["bytes_down"] == second["bytes_up"] == 3 * serialised
    pseudo = len(strategy.shared.payload)  # the pseudo-data goes out in round 1 only
    assert first["bytes_down"] - second["bytes_down"] == 3 * pseudo > 0
    assert second["client_peak_rss_mb"] > 50 and "client_peak_gpu_mb" not in second


def test_synthetic_data_is_cifar_shaped_balanced_and_the_same_everywhere():
    load_raw.cache_clear()
    train, test = load_raw("synthetic", "")
    assert train.x.shape == (SYNTHETIC_SIZES[0], 3, 32, 32) and len(test.y) == SYNTHETIC_SIZES[1]
    assert np.bincount(train.y).tolist() == [SYNTHETIC_SIZES[0] // 10] * 10
    load_raw.cache_clear()
    assert np.array_equal(load_raw("synthetic", "")[0].x, train.x)
    cfg = config_from_settings({"dataset": "synthetic"})
    assert bench.resolved_model(cfg) == "vgg11" and cfg["data-dir"] == ""


def test_the_suite_covers_each_shape_for_fedavg_fedbr_and_distrans_with_the_users_overrides():
    configs = bench.suite_configs(["num-clients=3", "local-steps=7"], list(bench.SUITE))
    got = [(shape, c["strategy"], c["dataset"], bench.resolved_model(c), c["batch-size"]) for shape, c in configs]
    assert got == [
        (shape, strategy, dataset, model, batch)
        for shape, dataset, model, batch in [
            ("rotmnist-cnn", "mnist5k", "cnn", 64),
            ("cifar-vgg11", "synthetic", "vgg11", 32),
            ("cifar-cct", "synthetic", "cct", 32),
        ]
        for strategy in ("fedavg", "fedbr", "distrans")
    ]
    assert all(c["num-clients"] == 3 and c["local-steps"] == 7 for _, c in configs)
    with pytest.raises(ConfigError, match="unknown shape"):
        bench.suite_configs([], ["cifar-vgg16"])
    with pytest.raises(ConfigError, match="moon"):
        bench.suite_configs([], ["rotmnist-cnn"], ["moon"])
    assert [c["strategy"] for _, c in bench.suite_configs([], ["rotmnist-cnn"], ["fedbr"])] == ["fedbr"]


def test_the_scale_cases_are_cohort_runs_of_many_clients_sampling_ten_each_round():
    from fedbr_flwr.core.config import sampled_per_round

    for _, preset in bench.SCALE:
        cfg = bench.cohort_config(config_from_settings(dict(item.split("=") for item in preset)))
        assert cfg["engine"] == "cohort" and cfg["cohorts"] >= 1 and cfg["num-clients"] in (100, 1000)
        assert sampled_per_round(cfg["fraction-fit"], cfg["num-clients"]) == 10


def test_the_suite_table_prints_the_ratios_and_rates_of_what_was_measured(capsys):
    def row(strategy, bare, flower, cohort, step):
        return {
            "shape": "s",
            "strategy": strategy,
            "batch_size": 4,
            "bare_s_per_round": bare,
            "flower_s_per_round": flower,
            "ratio": flower / bare,
            "cohort_s_per_round": cohort,
            "cohort_ratio": cohort / bare,
            "tflops": {"bare": 2.0 / bare, "clients": 2.0 / flower, "cohort": 2.0 / cohort},
            "client_peak_mb": 100.0,
            "cohort_peak_mb": 400.0,
            "bare_peak_mb": 300.0,
            "precision": "bf16",
            "memory": "host RSS",
            "bytes_per_round": 2e6,
            "clients": 2,
            "local_steps": 3,
            "step_s": {"fedavg": 0.1, "fedbr": step, "distrans": 0.2},
        }

    rows = [row("fedavg", 1.0, 1.5, 1.25, 0.15), row("fedbr", 3.0, 3.3, 3.0, 0.15)]
    bench.print_suite_table(rows, "NVIDIA H100 80GB")
    out = capsys.readouterr().out
    assert "| s | fedavg | 4 | 1.000 | 1.500 (1.50) | 1.250 (1.25) | 2 / 1.33 / 1.6 | 100, 400 (300) | 2.0 |" in out
    assert "| s | 0.1000 | 0.1500 | 0.2000 | 1.50 | 3.00 |" in out  # FedBR / FedAvg: step 1.5x, bare round 3x
    assert "device peak: 989 TFLOP/s (bf16, dense)" in out


def test_a_fits_counted_flops_grow_with_its_steps_and_batch_and_match_the_cnns_hand_count():
    def flops(**settings):
        return bench.fit_flops(config_from_settings({"num-clients": 2, "device": "cpu", **settings}))

    one = flops(**{"local-steps": 1, "batch-size": 8})
    assert flops(**{"local-steps": 2, "batch-size": 8}) == 2 * one
    assert flops(**{"local-steps": 1, "batch-size": 16}) == 2 * one
    # the CNN: 3x3 convs 1->64 (28x28), 64->128 (stride 2: 14x14), 128->128 twice (14x14), fc 128->10; a step
    # is the forward (2 FLOPs a multiply-add) and a backward of twice that, less the first layer's input gradient
    macs = [28 * 28 * 64 * 9, 14 * 14 * 128 * 64 * 9, 14 * 14 * 128 * 128 * 9, 14 * 14 * 128 * 128 * 9, 128 * 10]
    forward = 2 * sum(macs)
    assert one / 8 == pytest.approx(3 * forward - 2 * macs[0], rel=0.01)
    assert flops(strategy="fedbr", **{"local-steps": 1, "batch-size": 8}) > 1.5 * one  # pseudo-data and two steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", ["fedavg", "fedbr"])
def test_local_steps_on_cuda_wait_for_the_device_only_once_per_round(strategy):
    """Batches are drawn and diagnostics summed on the device: torch's sync checker raises on any
    host-device synchronisation inside the steps."""
    from fedbr_flwr.core.training import BatchSampler, run_local_steps

    config = run_config(strategy=strategy, device="cuda", **{"local-steps": 5})
    cfg = config_from_settings(config)
    client = build_client(config, NODE, RecordDict())
    fit_config = bare_fit_config(cfg, {1: client.algorithm})
    client.fit(client.get_parameters({}), fit_config(1))  # round 1: FedBR's pseudo-data arrives
    algorithm = client.algorithm.make_step(2, fit_config(2))
    sampler = BatchSampler(client.algorithm.data, cfg["batch-size"], seed=1)
    sampler()  # warm-up: the generator's and the kernels' first use
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            algorithm.update(*sampler())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert run_local_steps(algorithm, sampler, 1)["loss"] > 0  # one sync at the end: the diagnostics


@pytest.mark.e2e
@pytest.mark.long
def test_the_suite_runs_flower_and_the_bare_loop_and_prints_the_table(tmp_path, capsys):
    """One strategy, FedBR (the one with the most to send and compute), through the bare loop and both Flower
    engines; it is compared with FedAvg's figures counted here, without Flower. The table's FedBR / FedAvg
    columns are pinned by test_the_suite_table_prints_the_ratios_and_rates_of_what_was_measured."""
    from fedbr_flwr.app.server_app import build_strategy

    json_path = tmp_path / "suite.json"
    items = ["num-clients=2", "local-steps=1"]
    assert (
        bench.main(
            [
                "--suite",
                "--shapes",
                "rotmnist-cnn",
                "--strategies",
                "fedbr",
                *items,
                "--rounds",
                "1",
                "--steps",
                "1",
                "--json",
                str(json_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| rotmnist-cnn | fedbr | 64 |" in out
    [fedbr] = json.loads(json_path.read_text())["rows"]
    assert fedbr["client_peak_mb"] > 0 and fedbr["flower_s_per_round"] > 0 and fedbr["bare_s_per_round"] > 0
    assert fedbr["cohort_s_per_round"] > 0 and fedbr["cohort_peak_mb"] > 0 and "step_s" in fedbr

    configs = {cfg["strategy"]: cfg for _, cfg in bench.suite_configs(items, ["rotmnist-cnn"], ["fedavg", "fedbr"])}
    sizes = {}
    for name, cfg in configs.items():
        arrays = build_strategy({**cfg, "output-dir": str(tmp_path / name), "global-test": False}).initial_arrays()
        sizes[name] = sum(a.nbytes for a in arrays.values())
    # each of the 2 clients is sent FedBR's global arrays and sends them back: the model and its projection head
    assert sizes["fedbr"] > sizes["fedavg"] > 0
    assert 2 * 2 * sizes["fedbr"] <= fedbr["bytes_per_round"] < 2 * 2 * sizes["fedbr"] * 1.05
    # FedBR: twice the images, two steps
    assert fedbr["flops_per_round"] > 2 * 2 * bench.fit_flops(configs["fedavg"]) > 0
    assert fedbr["tflops"]["bare"] == pytest.approx(fedbr["flops_per_round"] / fedbr["bare_s_per_round"] / 1e12)
