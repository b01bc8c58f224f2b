"""The server's test environments (the reference code's): the balanced global test, one copy of the test
split per angle, and RotatedMNIST's extra local tests; their metrics.jsonl fields, summary and cadence."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.common import Code, EvaluateRes, Status

from fedbr_flwr.app import payload
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.core.training import module_arrays
from fedbr_flwr.data.catalog import INFO, load_raw
from fedbr_flwr.data.dataset import (
    ServerTests,
    client_indices,
    extra_local_test_indices,
    global_test_angles,
    load_extra_local_tests,
    load_global_test,
    load_server_tests,
    normalise,
    rotate,
    to_float,
)
from fedbr_flwr.runfiles.metrics import summarize, summary_table
from fedbr_flwr.runfiles.run_io import RunRecorder
from fedbr_flwr.server.recording import server_test_fields
from strategies.fedavg import FedAvgStrategy

ANGLES = tuple(range(0, 136, 15))


@pytest.mark.parametrize(
    "settings, angles",
    [
        ({}, ANGLES),
        ({"dataset": "mnist"}, ANGLES),
        ({"dataset": "cifar10"}, ANGLES),
        ({"rotate": False}, (0,)),
        ({"dataset": "cifar10", "rotate": False}, (0,)),
        ({"dataset": "cifar100"}, (0,)),
        ({"dataset": "synthetic"}, (0,)),
    ],
)
def test_the_balanced_global_test_has_one_copy_per_angle(settings, angles):
    assert global_test_angles(validate(settings)) == angles


def test_the_zero_degree_copy_is_the_test_split_untouched_and_the_others_differ():
    _, test = load_raw("mnist5k", "")
    copies = load_global_test(validate({}))
    unrotated = normalise(to_float(test.x), INFO["mnist5k"])
    assert torch.equal(copies[0][0], unrotated)
    assert all(not torch.allclose(copies[a][0], unrotated, atol=1e-3) for a in ANGLES[1:])
    assert all(torch.equal(y, torch.from_numpy(test.y)) for _, y in copies.values())


def test_without_rotation_the_global_test_is_one_unrotated_copy():
    _, test = load_raw("synthetic", "")
    copies = load_global_test(validate({"dataset": "synthetic"}))
    assert list(copies) == [0]
    assert torch.equal(copies[0][0], normalise(to_float(test.x), INFO["synthetic"]))


def test_the_global_test_does_not_depend_on_the_seed():
    a, b = load_global_test(validate({"seed": 0})), load_global_test(validate({"seed": 7}))
    assert all(torch.equal(a[k][0], b[k][0]) for k in ANGLES)


def test_extra_local_tests_deal_the_test_split_into_10_sets_with_skewed_label_mixes():
    _, test = load_raw("mnist5k", "")
    sets = extra_local_test_indices(test.y, 0.1, seed=0)
    assert [len(s) for s in sets] == [50] * 10  # mnist5k's 500 test images; MNIST's 10,000 give 1,000 each
    everything = np.concatenate(sets)
    assert len(np.unique(everything)) == 500  # without replacement: every test image in exactly one set
    mixes = np.array([np.bincount(test.y[s], minlength=10) / len(s) for s in sets])
    assert mixes.max(axis=1).min() > 0.3  # alpha = 0.1: every set dominated by a few classes
    assert not np.allclose(mixes[0], mixes[1])


def test_extra_local_tests_are_seeded_and_differ_from_the_clients_label_mixes():
    _, test = load_raw("mnist5k", "")
    same = extra_local_test_indices(test.y, 0.1, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(same, extra_local_test_indices(test.y, 0.1, seed=3)))
    assert any(not np.array_equal(a, b) for a, b in zip(same, extra_local_test_indices(test.y, 0.1, seed=4)))
    cfg = validate({"num-clients": 10})
    train, _ = load_raw("mnist5k", "")
    differ = 0
    for k, idx in enumerate(extra_local_test_indices(test.y, 0.1, seed=0)):
        own = np.concatenate(client_indices(cfg, k))
        client_mix = np.bincount(train.y[own], minlength=10) / len(own)
        differ += not np.allclose(np.bincount(test.y[idx], minlength=10) / len(idx), client_mix, atol=0.05)
    assert differ >= 8  # fresh draws: set k's classes are not client k's (two one-class mixes may coincide)


def test_extra_local_test_k_is_rotated_by_15k_degrees():
    cfg = validate({"extra-local-tests": True})
    _, test = load_raw("mnist5k", "")
    sets = load_extra_local_tests(cfg)
    for k, (idx, (x, y)) in enumerate(zip(extra_local_test_indices(test.y, cfg["alpha"], cfg["seed"]), sets)):
        expected = normalise(rotate(to_float(test.x[idx]), np.full(len(idx), 15.0 * k)), INFO["mnist5k"])
        assert torch.equal(x, expected)
        np.testing.assert_array_equal(y.numpy(), test.y[idx])
    unrotated = load_extra_local_tests(validate({"extra-local-tests": True, "rotate": False}))
    assert torch.equal(unrotated[3][0], normalise(to_float(test.x[idx_of(cfg, 3)]), INFO["mnist5k"]))


def idx_of(cfg, k):
    _, test = load_raw("mnist5k", "")
    return extra_local_test_indices(test.y, cfg["alpha"], cfg["seed"])[k]


def test_the_server_builds_what_the_keys_ask_for():
    assert load_server_tests(validate({"global-test": False})) is None
    only_extra = load_server_tests(validate({"global-test": False, "extra-local-tests": True}))
    assert only_extra is not None and not only_extra.global_copies and len(only_extra.extra_local) == 10
    both = load_server_tests(validate({"extra-local-tests": True}))
    assert both is not None and sorted(both.global_copies) == list(ANGLES) and len(both.extra_local) == 10


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"server-test-every": 3}, "server-test-every = 3 is not a multiple of eval-every = 2"),
        ({"server-test-every": -1}, "server-test-every"),
        ({"extra-local-tests": True, "dataset": "cifar10"}, "extra-local-tests = true is RotatedMNIST's"),
        ({"extra-local-tests": "yes"}, "extra-local-tests"),
    ],
)
def test_bad_server_test_keys_stop_with_one_line(settings, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(settings)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- the records


def test_server_test_fields_mean_per_angle_and_worst():
    fields = server_test_fields({0: (0.5, 0.9), 15: (1.0, 0.6), 30: (1.5, 0.6)}, [(0.2, 0.8), (0.4, 0.4)])
    assert fields["global_acc"] == pytest.approx(0.7) and fields["global_loss"] == pytest.approx(1.0)
    assert fields["global_acc_by_angle"] == {"0": 0.9, "15": 0.6, "30": 0.6}
    assert (fields["global_worst_acc"], fields["global_worst_angle"]) == (0.6, 15)  # a tie: the smaller angle
    assert fields["extra_local_acc"] == pytest.approx(0.6) and fields["extra_local_worst_acc"] == 0.4
    assert fields["extra_local_acc_by_set"] == {"0": 0.8, "1": 0.4}
    assert server_test_fields({}, []) == {}


def history():
    by_angle = [{"0": 0.9, "15": 0.5}, {"0": 0.8, "15": 0.7}, {"0": 0.6, "15": 0.2}]
    return [
        {
            "round": 2 * (i + 1),
            "mean_acc": 0.5,
            "worst_acc": 0.4,
            **server_test_fields({int(a): (1.0, v) for a, v in angles.items()}, [(1.0, 0.3 + i / 10), (1.0, 0.1)]),
        }
        for i, angles in enumerate(by_angle)
    ]


def test_the_summary_holds_the_worst_angle_the_last_angles_and_the_extra_local_tests():
    s = summarize(history(), 0.5)
    assert s["global_acc_best5"] == pytest.approx(np.mean([0.7, 0.75, 0.4]))
    assert s["global_worst_acc_best5"] == pytest.approx(np.mean([0.5, 0.7, 0.2]))
    assert s["final_global_acc_by_angle"] == {"0": 0.6, "15": 0.2} and s["final_global_worst_angle"] == 15
    assert s["final_global_worst_acc"] == 0.2
    assert s["extra_local_acc_best5"] == pytest.approx(np.mean([0.2, 0.25, 0.3]))
    assert s["extra_local_worst_acc_best5"] == pytest.approx(0.1)
    table = summary_table(s)
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines() if "|" in line}
    assert rows["global test worst angle, best 5 evals (%)"] == "46.67"
    assert "0: 60.00 / 15: 20.00" in table and "extra local tests mean / worst" in table


def test_a_run_without_server_tests_has_no_such_figures():
    s = summarize([{"round": 2, "mean_acc": 0.5, "worst_acc": 0.4, "global_acc": None}], 0.5)
    assert not [k for k in s if "global" in k or "extra" in k]
    assert "worst angle" not in summary_table(s) and "extra local" not in summary_table(s)


# ---------------------------------------------------------------- the server evaluates them on its schedule


def angle_test(value: float, label: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """n inputs (value, 0) labelled ``label``: a Linear(2, 2) with weight [[1, 0], [-1, 0]] calls them 0 when
    value > 0, else 1."""
    return torch.full((n, 2), 0.0).index_fill_(1, torch.tensor([0]), value), torch.full((n,), label)


def eval_res(pid, acc, n):
    return EvaluateRes(Status(Code.OK, ""), 1.0 - acc, n, {"accuracy": acc, "partition-id": pid})


def test_the_server_records_each_angle_and_runs_on_the_server_test_schedule(tmp_path):
    cfg = validate({"output-dir": str(tmp_path), "num-rounds": 5, "eval-every": 1, "server-test-every": 2})
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
    tests = ServerTests({0: angle_test(1.0, 0), 15: angle_test(1.0, 1), 30: angle_test(-1.0, 1)}, [angle_test(1.0, 0)])
    strategy = FedAvgStrategy(cfg, RunRecorder(cfg, tmp_path), {"model": model}, tests)
    params = payload.to_parameters(module_arrays("model", model))
    ran = [r for r in range(1, 6) if strategy.evaluate(r, params) is not None]
    assert ran == [2, 4, 5]  # every 2 rounds, and at the last
    for r in range(1, 6):
        strategy.aggregate_evaluate(r, [(None, eval_res(0, 0.5, 10))], [])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["global_acc"] is not None for line in lines] == [False, True, False, True, True]
    line = lines[1]
    assert line["global_acc_by_angle"] == {"0": 1.0, "15": 0.0, "30": 1.0}
    assert (line["global_worst_acc"], line["global_worst_angle"]) == (0.0, 15)
    assert line["global_acc"] == pytest.approx(2 / 3) and line["extra_local_acc"] == 1.0
    assert "global_acc_by_angle" not in lines[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_global_worst_angle"] == 15 and summary["global_worst_acc_best5"] == 0.0
