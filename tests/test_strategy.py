"""The strategy's Flower-facing logic driven directly with fake client proxies (no processes)."""

import json
import time

import numpy as np
import pytest
import torch
from flwr.common import Code, EvaluateRes, FitRes, GetPropertiesRes, Status
from flwr.server.client_manager import SimpleClientManager

import fedbr_flwr.app.federation as federation
from fedbr_flwr.app import payload
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.data.catalog import load_raw
from fedbr_flwr.data.dataset import client_indices, make_partition
from fedbr_flwr.runfiles.run_io import RunRecorder
from strategies.fedavg import FedAvgStrategy

from fakes import OfflineProxy


class FakeProxy(OfflineProxy):
    def __init__(self, cid, pid, phash=None, num_partitions=None):
        super().__init__(cid)
        self.pid, self.phash, self.num_partitions = pid, phash, num_partitions

    def get_properties(self, ins, timeout, group_id):
        props = {"partition-id": self.pid, "partition-hash": self.phash, "num-train": 40, "num-test": 10}
        if self.num_partitions is not None:
            props["num-partitions"] = self.num_partitions
        return GetPropertiesRes(Status(Code.OK, ""), props)


def make_strategy(tmp_path, proxies, model=None, **overrides):
    cfg = validate({"output-dir": str(tmp_path), "global-test": False, **overrides})
    strategy = FedAvgStrategy(cfg, RunRecorder(cfg, tmp_path), {"model": model or torch.nn.Linear(2, 2)}, None)
    manager = SimpleClientManager()
    real_hash = make_partition({**cfg, "num-clients": len(proxies)})[1] if proxies else None
    for p in proxies:
        p.phash = p.phash or real_hash
        manager.register(p)
    return strategy, manager


def test_sampling_is_seeded_by_round_and_independent_of_node_ids(tmp_path):
    proxies = [FakeProxy(f"node{i * 7919 % 1000}", i) for i in range(100)]
    strategy, manager = make_strategy(tmp_path, proxies, **{"fraction-fit": 0.1, "num-clients": 100})
    picks = [strategy.configure_fit(r, payload.to_parameters({}), manager) for r in (1, 2)]
    pids = [[strategy.federation.pid_by_cid[proxy.cid] for proxy, _ in p] for p in picks]
    assert all(len(set(p)) == 10 for p in pids) and pids[0] != pids[1]
    # another run whose nodes got other ids samples the same partitions
    other, manager2 = make_strategy(
        tmp_path / "b",
        [FakeProxy(f"x{i}", i) for i in reversed(range(100))],
        **{"fraction-fit": 0.1, "num-clients": 100},
    )
    again = other.configure_fit(1, payload.to_parameters({}), manager2)
    assert [other.federation.pid_by_cid[p.cid] for p, _ in again] == pids[0]
    assert picks[0][0][1].config["server-round"] == 1


def test_discovery_rejects_a_wrong_federation(tmp_path, monkeypatch):
    monkeypatch.setattr(federation, "DISCOVERY_TIMEOUT_S", 0.1)
    strategy, manager = make_strategy(tmp_path, [FakeProxy("a", 0), FakeProxy("b", 0)])
    with pytest.raises(ConfigError, match="two SuperNodes claim partition-id 0"):
        strategy.configure_fit(1, payload.to_parameters({}), manager)
    strategy, manager = make_strategy(tmp_path, [FakeProxy("a", 0), FakeProxy("b", 1)], **{"num-clients": 3})
    with pytest.raises(ConfigError, match="only 2 SuperNodes connected"):
        strategy.configure_fit(1, payload.to_parameters({}), manager)


def test_a_discovery_that_waits_for_supernodes_says_so_in_the_progress(tmp_path, monkeypatch):
    """A deployment whose second SuperNode comes late: the wait is reported as a progress event (what
    `fedbr-deploy run --echo progress` prints), then discovery goes on once it connects."""
    import threading

    monkeypatch.setattr(federation, "WAIT_NOTICE_S", 0.2)
    late = FakeProxy("b", 1)
    strategy, manager = make_strategy(tmp_path, [FakeProxy("a", 0), late], **{"num-clients": 2})
    manager.unregister(late)
    threading.Timer(0.7, manager.register, args=(late,)).start()
    strategy.configure_fit(1, payload.to_parameters({}), manager)
    events = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    waits = [e["message"] for e in events if e["kind"] == "waiting"]
    assert waits and waits[0].startswith("1 of 2 clients' SuperNodes connected after 0 s; waiting"), waits
    assert sorted(strategy.federation.clients_by_pid) == [0, 1]


def test_discovery_fails_at_once_when_nodes_were_told_another_size(tmp_path, monkeypatch):
    monkeypatch.setattr(federation, "DISCOVERY_TIMEOUT_S", 60)  # must not be waited for
    proxies = [FakeProxy("a", 0, num_partitions=2), FakeProxy("b", 1, num_partitions=2)]
    strategy, manager = make_strategy(tmp_path, proxies, **{"num-clients": 3})
    start = time.monotonic()
    with pytest.raises(ConfigError, match="num-partitions = 2"):
        strategy.configure_fit(1, payload.to_parameters({}), manager)
    assert time.monotonic() - start < 5
    strategy, manager = make_strategy(tmp_path, [FakeProxy("a", 0, "h1"), FakeProxy("b", 1, "h2")])
    with pytest.raises(ConfigError, match="different partitions"):
        strategy.configure_fit(1, payload.to_parameters({}), manager)
    strategy, manager = make_strategy(tmp_path, [FakeProxy("a", 0, "h1"), FakeProxy("b", 1, "h1")])
    with pytest.raises(ConfigError, match="differs from the server's"):
        strategy.configure_fit(1, payload.to_parameters({}), manager)


class PropertiesProxy(FakeProxy):
    """A node whose properties are a real node's with ``changed`` over them."""

    def __init__(self, cid, pid, changed):
        super().__init__(cid, pid)
        self.changed = changed

    def get_properties(self, ins, timeout, group_id):
        return GetPropertiesRes(
            Status(Code.OK, ""), {**super().get_properties(ins, timeout, group_id).properties, **self.changed}
        )


@pytest.mark.parametrize(
    "changed, reason",
    [
        ({"partition-id": "abc"}, "invalid literal for int"),
        ({"class-counts": "1,x"}, "invalid literal for int"),
        ({"class-counts": "-5" + ",3" * 9}, "are not 10 counts >= 0"),
        ({"class-counts": "1,2"}, "are not 10 counts >= 0"),
        ({"partition-hash": None}, "partition-hash None is not a string"),
        ({"partition-id": float("inf")}, "OverflowError"),
        ({"class-counts": "9" * 20 + ",3" * 9}, "OverflowError"),
        ({"num-train": float("inf")}, "num-train inf is not a sample count"),
        ({"num-train": "9" * 400}, "num-train '9999.* is not a sample count"),
        ({"num-test": -3}, "num-test -3 is not a sample count"),
        ({"num-train": True}, "num-train True is not a sample count"),
        ({"num-train": 2**63}, "num-train 9223372036854775808 is not a sample count"),
    ],
    ids=[
        "partition-id",
        "class-counts-text",
        "negative-count",
        "two-counts",
        "no-hash",
        "inf-id",
        "huge-count",
        "inf-size",
        "text-size",
        "negative-size",
        "bool-size",
        "int64-size",
    ],
)
def test_a_node_whose_partition_cannot_be_read_stops_discovery_with_one_message(tmp_path, changed, reason):
    """These raised a bare ValueError or TypeError that named no node (or, for counts, went into DisTrans' DH)."""
    strategy, manager = make_strategy(tmp_path, [FakeProxy("a", 0), PropertiesProxy("b", 1, changed)])
    with pytest.raises(
        ConfigError, match=f"SuperNode b reported its partition in properties that cannot be read .*{reason}"
    ):
        strategy.configure_fit(1, payload.to_parameters({}), manager)


def test_a_node_of_no_training_samples_has_every_update_rejected_and_feddyn_scales_it_by_one():
    """A node's reported size of 0 made FedDyn's alpha_k divide by zero; an unreadable one was taken as unknown,
    and its later counts were then bounded by nothing (any weight under weighting=samples)."""
    from fedbr_flwr.app.federation import Federation
    from fedbr_flwr.server.updates import count_problem, known_size, size_share

    federation = Federation(validate({"strategy": "feddyn"}))
    federation._add_sizes(0, {"num-train": 0, "num-test": 5})
    federation._add_sizes(1, {"num-train": 40, "num-test": 5})
    assert federation.sizes == {0: (0, 5), 1: (40, 5)} and size_share(federation.sizes, 0) == 1.0
    assert "its partition holds 0" in count_problem(1, known_size(federation.sizes, 0, 0), "training samples")
    assert size_share({0: (0, 5), 1: (0, 5)}, 0) == 1.0  # FedDyn's alpha_k = alpha / share: no zero division
    assert size_share({0: (10, 5), 1: (30, 5)}, 0) == 0.5


def test_the_server_takes_its_own_class_histograms_not_a_nodes_word(tmp_path):
    """A node's class counts set DisTrans' DH (and with distrans-agg=auto its mode) and its offset embeddings."""
    lie = {"class-counts": ",".join(["1000"] + ["0"] * 9)}
    strategy, manager = make_strategy(tmp_path, [FakeProxy("a", 0), PropertiesProxy("b", 1, lie)])
    strategy.configure_fit(1, payload.to_parameters({}), manager)
    train, _ = load_raw("mnist5k")
    for pid in range(2):
        want = np.bincount(train.y[client_indices(strategy.cfg, pid)[0]], minlength=10)
        np.testing.assert_array_equal(strategy.federation.class_counts[pid], want)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["class_counts"][1] == strategy.federation.class_counts[1].tolist() != [1000] + [0] * 9


def test_a_resume_onto_another_partition_stops_at_discovery_and_keeps_the_one_it_started_on(tmp_path):
    """Another numpy or other dataset files can deal the same config differently: the resumed run trained on it
    without a word, and partition.npz was replaced by it."""
    strategy, manager = make_strategy(tmp_path, [FakeProxy("a", 0), FakeProxy("b", 1)])
    strategy.configure_fit(1, payload.to_parameters({}), manager)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["partition_hash"]) == 16  # the manifest names the partition the run started on
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "partition_hash": "0" * 16}))
    saved = (tmp_path / "partition.npz").read_bytes()
    cfg = strategy.cfg
    resumed = FedAvgStrategy(cfg, RunRecorder(cfg, tmp_path, resume_round=1), {"model": torch.nn.Linear(2, 2)}, None)
    with pytest.raises(ConfigError, match="started on partition 0{16} but its clients now deal partition [0-9a-f]{16}"):
        resumed.configure_fit(2, payload.to_parameters({}), manager)
    assert (tmp_path / "partition.npz").read_bytes() == saved
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    FedAvgStrategy(
        cfg, RunRecorder(cfg, tmp_path, resume_round=1), {"model": torch.nn.Linear(2, 2)}, None
    ).configure_fit(2, payload.to_parameters({}), manager)
    manifest.pop("partition_hash")  # a manifest written before partition hashes: nothing to compare with
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    RunRecorder(cfg, tmp_path, resume_round=1).check_same_partition("f" * 16)


def test_discovery_saves_the_partition_and_its_hash(tmp_path):
    strategy, manager = make_strategy(tmp_path, [FakeProxy("a", 1), FakeProxy("b", 0), FakeProxy("c", 2)])
    strategy.configure_fit(1, payload.to_parameters({}), manager)
    saved = np.load(tmp_path / "partition.npz")
    cfg = {**strategy.cfg}
    assert cfg["num-clients"] == 3
    for pid in range(3):
        train, test = client_indices(cfg, pid)
        np.testing.assert_array_equal(saved[f"train_{pid}"], train)
        np.testing.assert_array_equal(saved[f"test_{pid}"], test)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["partition_hash"] == make_partition(cfg)[1] and manifest["num_partitions"] == 3


def fit_res(value, n, pid=0):
    arrays = {"model/weight": np.full((2, 2), value, np.float32), "model/bias": np.full(2, value, np.float32)}
    return FitRes(Status(Code.OK, ""), payload.to_parameters(arrays), n, {"loss": value, "partition-id": pid})


def test_aggregate_fit_does_not_depend_on_arrival_order(tmp_path):
    strategy, _ = make_strategy(tmp_path, [], model=torch.nn.Linear(200_000, 1, bias=False), weighting="samples")
    rng = np.random.default_rng(0)
    results = []
    for pid in range(7):
        arrays = {"model/weight": rng.normal(size=(1, 200_000)).astype(np.float32)}
        res = FitRes(Status(Code.OK, ""), payload.to_parameters(arrays), 3 + pid, {"partition-id": pid})
        results.append((None, res))
    strategy.sampled = list(range(7))
    bits = set()
    for order in (results, results[::-1], results[3:] + results[:3], results[1::2] + results[::2]):
        params, _ = strategy.aggregate_fit(1, order, [])
        bits.add(payload.from_parameters(params)["model/weight"].tobytes())
    assert len(bits) == 1


@pytest.mark.parametrize("weighting,expected", [("uniform", (1 + 4) / 2), ("samples", (1 * 10 + 4 * 30) / 40)])
def test_aggregate_fit_is_the_weighted_mean_and_records_the_round(tmp_path, weighting, expected):
    strategy, _ = make_strategy(tmp_path, [], weighting=weighting)
    strategy.sampled = [0, 1]
    params, metrics = strategy.aggregate_fit(3, [(None, fit_res(1.0, 10)), (None, fit_res(4.0, 30, pid=1))], [])
    for layer in payload.from_parameters(params).values():
        np.testing.assert_allclose(layer, expected)
    assert metrics["loss"] == pytest.approx(2.5)
    rounds = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert rounds[-1]["round"] == 3 and rounds[-1]["clients"] == 2 and rounds[-1]["failures"] == 0


def test_aggregate_fit_keeps_the_model_when_every_client_failed(tmp_path):
    strategy, _ = make_strategy(tmp_path, [])
    params, _ = strategy.aggregate_fit(1, [], [RuntimeError("boom")])
    assert params is None
    assert json.loads((tmp_path / "rounds.jsonl").read_text())["failures"] == 1


def eval_res(pid, acc, n):
    return EvaluateRes(Status(Code.OK, ""), 1.0 - acc, n, {"accuracy": acc, "partition-id": pid})


def test_evaluation_schedule_metrics_line_and_final_files(tmp_path):
    strategy, _ = make_strategy(tmp_path, [], **{"num-rounds": 5, "eval-every": 2})
    assert [r for r in range(1, 6) if strategy.is_eval_round(r)] == [2, 4, 5]
    strategy.aggregate_evaluate(4, [(None, eval_res(1, 0.5, 10)), (None, eval_res(0, 0.9, 30))], [])
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["per_client_acc"] == {"0": 0.9, "1": 0.5}
    assert line["mean_acc"] == pytest.approx(0.7) and line["worst_acc"] == pytest.approx(0.5)
    assert line["pooled_acc"] == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)
    assert not (tmp_path / "convergence.png").exists()
    strategy.aggregate_evaluate(5, [(None, eval_res(0, 0.8, 30)), (None, eval_res(1, 0.6, 10))], [])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mean_acc_best5"] == pytest.approx(0.7) and summary["last_round"] == 5
    assert (tmp_path / "convergence.png").exists() and (tmp_path / "summary.md").exists()


def test_a_result_of_an_unknown_node_whose_partition_id_is_no_number_is_refused_not_raised():
    """int("abc") raised out of the server's round; -1 is a partition never sampled, whose reply is refused."""
    from fedbr_flwr.app.federation import Federation

    federation = Federation(validate({}))
    assert [federation.pid_of(None, m) for m in ({"partition-id": "abc"}, {"partition-id": 2}, {})] == [-1, 2, -1]
    assert federation.pid_of(None, {"partition-id": True}) == -1  # not client 1
    assert federation.pid_of(None, {"partition-id": 10**5000}) == -1  # its warning could not print it
