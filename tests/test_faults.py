"""Faults the server must survive: failed clients, updates with NaN/Inf or the wrong arrays, too few
answers; and bad input that must stop before any training with one clear message."""

import json

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from fedbr_flwr.app import payload
from fedbr_flwr.commands import cli
from fedbr_flwr.commands.report import Setting
from fedbr_flwr.core.config import validate
from fedbr_flwr.runfiles.run_io import RunRecorder
from fedbr_flwr.server.updates import update_problem
from pseudodata.rsm import allot
from strategies.fedavg import FedAvgStrategy
from strategies.scaffold import ScaffoldStrategy

from fakes import OfflineProxy

SHAPES = {"model/weight": (2, 2), "model/bias": (2,)}


def arrays_of(value, shapes=SHAPES):
    return {name: np.full(s, value, np.float32) for name, s in shapes.items()}


def fit_res(arrays, pid, loss=1.0):
    return FitRes(Status(Code.OK, ""), payload.to_parameters(arrays), 10, {"loss": loss, "partition-id": pid})


def strategy_with_round_started(tmp_path, cls=FedAvgStrategy, model=None, **overrides):
    cfg = validate({"output-dir": str(tmp_path), "global-test": False, "num-clients": 4, **overrides})
    model = model or torch.nn.Linear(2, 2)
    strategy = cls(cfg, RunRecorder(cfg, tmp_path), {"model": model}, None)
    proxies = [OfflineProxy(f"node-{i}") for i in range(4)]
    strategy.federation.clients_by_pid = {i: p for i, p in enumerate(proxies)}
    strategy.federation.pid_by_cid = {p.cid: i for i, p in enumerate(proxies)}
    global_arrays = strategy.initial_arrays()
    strategy.configure_fit(1, payload.to_parameters(global_arrays), None)
    return strategy, proxies, global_arrays


def last_round(tmp_path):
    return json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize(
    "arrays, reason",
    [
        (
            {"model/weight": np.full((2, 2), np.nan, np.float32), "model/bias": np.zeros(2, np.float32)},
            "array 'model/weight' holds NaN or Inf",
        ),
        (
            {"model/weight": np.zeros((2, 2), np.float32), "model/bias": np.array([0.0, np.inf], np.float32)},
            "array 'model/bias' holds NaN or Inf",
        ),
        (
            {"model/weight": np.zeros((2, 3), np.float32), "model/bias": np.zeros(2, np.float32)},
            "array 'model/weight' has shape (2, 3), expected (2, 2)",
        ),
        (  # as many values in another shape: averaged in, it raised out of the round (no broadcast of (4,) to (2, 2))
            {"model/weight": np.zeros(4, np.float32), "model/bias": np.zeros((2, 1), np.float32)},
            "array 'model/weight' has shape (4,), expected (2, 2)",
        ),
        ({"model/weight": np.zeros((2, 2), np.float32)}, "missing arrays model/bias (1 of 2)"),
        ({**arrays_of(0.0), "head/weight": np.zeros(2, np.float32)}, "unexpected arrays 'head/weight'"),
        (  # a name is quoted and cut: a newline in it forged a log line of its own, 5,000 characters long
            {**arrays_of(0.0), "x\nWARNING forged" + "y" * 5000: np.zeros(2, np.float32)},
            "unexpected arrays 'x\\nWARNING forged" + "y" * 39 + "...",
        ),
        ([np.zeros((2, 2), np.float32), np.zeros(2, np.float32)], "not a named payload: the first array does not name"),
    ],
)
def test_a_bad_update_is_rejected_logged_and_never_averaged_in(tmp_path, arrays, reason):
    strategy, proxies, _ = strategy_with_round_started(tmp_path)
    bad = (
        fit_res(arrays, 1)
        if isinstance(arrays, dict)
        else FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 10, {"loss": 1.0, "partition-id": 1})
    )
    results = [
        (proxies[0], fit_res(arrays_of(1.0), 0)),
        (proxies[1], bad),
        (proxies[2], fit_res(arrays_of(3.0), 2)),
        (proxies[3], fit_res(arrays_of(5.0), 3)),
    ]
    params, _ = strategy.aggregate_fit(1, results, [])
    for layer in payload.from_parameters(params).values():
        np.testing.assert_allclose(layer, 3.0)  # the mean of 1, 3 and 5: the bad update is not in it
    record = last_round(tmp_path)
    assert record["clients"] == 3 and record["failures"] == 1 and record["failed_clients"] == [1]
    assert len(record["rejected"]) == 1 and record["rejected"][0]["partition"] == 1
    assert record["rejected"][0]["reason"].startswith(reason)


def names_then(names, *arrays):
    """Tensors of a reply whose first array holds ``names`` (bytes, as sent) and then ``arrays``."""
    from flwr.common import ndarray_to_bytes

    first = names if isinstance(names, np.ndarray) else np.frombuffer(names, np.uint8)
    return [ndarray_to_bytes(first), *(ndarray_to_bytes(a) for a in arrays)]


WEIGHT, BIAS = np.zeros((2, 2), np.float32), np.zeros(2, np.float32)


@pytest.mark.parametrize(
    "tensors, reason",
    [
        # json.loads raised RecursionError, which no check caught: out of aggregate_fit, and the run stopped
        (names_then(b"[" * 100_000, WEIGHT, BIAS), "not a named payload: the first array does not name the others"),
        (names_then(np.array(["model/weight", "model/bias"]), WEIGHT, BIAS), "the first array does not name"),
        (  # were a name given twice read, one of its arrays would be used: the other may be what the client meant
            names_then(b'["model/weight", "model/bias", "model/weight"]', WEIGHT + 7, BIAS, WEIGHT),
            "the first array must hold a JSON list of distinct names",
        ),
        (names_then(b"[1, 2]", WEIGHT, BIAS), "the first array must hold a JSON list of distinct names"),
        (names_then(b'["model/weight", "model/bias", "x"]', WEIGHT, BIAS), "3 names for 2 arrays"),
        ([], "not a named payload: an empty message"),
    ],
    ids=["deep-json", "str-array", "name-twice", "not-strings", "more-names", "empty"],
)
def test_a_reply_whose_names_cannot_be_read_is_rejected_and_raises_nothing(tmp_path, tensors, reason):
    """Each is left out with its reason, and the round is the mean of the others."""
    from flwr.common import Parameters

    strategy, proxies, _ = strategy_with_round_started(tmp_path)
    bad = FitRes(Status(Code.OK, ""), Parameters(tensors, "numpy.ndarray"), 10, {"loss": 1.0})
    results = [(proxies[pid], fit_res(arrays_of(float(pid)), pid)) for pid in (0, 2, 3)] + [(proxies[1], bad)]
    params, _ = strategy.aggregate_fit(1, results, [])
    for layer in payload.from_parameters(params).values():
        np.testing.assert_allclose(layer, (0 + 2 + 3) / 3)
    record = last_round(tmp_path)
    assert record["clients"] == 3 and record["failed_clients"] == [1]
    (rejected,) = record["rejected"]
    assert rejected["partition"] == 1 and reason in rejected["reason"]


def test_numbers_too_long_to_print_reject_the_reply_and_raise_nothing(tmp_path):
    """Python prints no int of more than 4,300 digits (ValueError), and a check quoted such a loss, accuracy, metric
    or sample count in its reason: the error left aggregate_fit or aggregate_evaluate and stopped the run."""
    from flwr.common import EvaluateRes

    huge, ok = 10**5000, Status(Code.OK, "")
    strategy, proxies, _ = strategy_with_round_started(tmp_path)
    results = [
        (proxies[0], fit_res(arrays_of(1.0), 0)),
        (proxies[1], fit_res(arrays_of(9.0), 1, loss=huge)),
        (proxies[2], FitRes(ok, payload.to_parameters(arrays_of(9.0)), -huge, {"loss": 1.0})),
        (proxies[3], fit_res(arrays_of(4.0), 3)),
    ]
    params, _ = strategy.aggregate_fit(1, results, [])
    for layer in payload.from_parameters(params).values():
        np.testing.assert_allclose(layer, (1.0 + 4.0) / 2)
    assert last_round(tmp_path)["rejected"] == [
        {"partition": 1, "reason": "metric 'loss' is <int too large to print>, not a number"},
        {"partition": 2, "reason": "reports <int too large to print> training samples"},
    ]
    evaluations = [
        (proxies[0], EvaluateRes(ok, 0.5, 5, {"accuracy": 0.75})),
        (proxies[1], EvaluateRes(ok, huge, 5, {"accuracy": 0.5})),
        (proxies[2], EvaluateRes(ok, 0.5, 5, {"accuracy": huge})),
        (proxies[3], EvaluateRes(ok, 0.5, -huge, {"accuracy": 0.5})),
    ]
    loss, metrics = strategy.aggregate_evaluate(1, evaluations, [])
    assert (loss, metrics["mean_acc"]) == (0.5, 0.75)
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["per_client_acc"] == {"0": 0.75} and line["eval_rejected"] == [
        {"partition": 1, "reason": "reports loss <int too large to print>, not a number >= 0"},
        {"partition": 2, "reason": "reports accuracy <int too large to print>, not a finite number"},
        {"partition": 3, "reason": "reports <int too large to print> test samples"},
    ]


def test_non_finite_metrics_reject_the_update():
    assert update_problem(arrays_of(0.0), SHAPES, {"loss": float("nan")}) == "metrics loss are NaN or Inf"
    assert update_problem(arrays_of(0.0), SHAPES, {"loss": 1.0, "partition-id": 3}) is None


def test_failed_and_missing_clients_are_recorded_and_the_round_goes_on(tmp_path):
    strategy, proxies, _ = strategy_with_round_started(tmp_path)
    results = [(proxies[0], fit_res(arrays_of(2.0), 0)), (proxies[2], fit_res(arrays_of(4.0), 2))]
    crashed = (proxies[3], FitRes(Status(Code.FIT_NOT_IMPLEMENTED, "worker died"), ndarrays_to_parameters([]), 0, {}))
    params, _ = strategy.aggregate_fit(1, results, [ValueError("Node Unavailable"), crashed])
    for layer in payload.from_parameters(params).values():
        np.testing.assert_allclose(layer, 3.0)
    record = last_round(tmp_path)
    assert record["clients"] == 2 and record["failures"] == 2 and record["failed_clients"] == [1, 3]
    assert record["errors"] == ["ValueError: Node Unavailable", "client 3: worker died"]


def test_fewer_valid_updates_than_min_fit_clients_keep_the_global_model(tmp_path):
    strategy, proxies, global_arrays = strategy_with_round_started(tmp_path, **{"min-fit-clients": 3})
    results = [
        (proxies[0], fit_res(arrays_of(2.0), 0)),
        (proxies[1], fit_res(arrays_of(np.nan), 1)),
        (proxies[2], fit_res(arrays_of(4.0), 2)),
    ]
    params, _ = strategy.aggregate_fit(1, results, [RuntimeError("timeout")])
    assert params is None
    record = last_round(tmp_path)
    assert record["skipped"] is True and record["clients"] == 2 and record["failures"] == 2
    assert list(strategy.latest) == list(global_arrays)  # what a checkpoint now would hold
    for name, sent in global_arrays.items():
        np.testing.assert_array_equal(strategy.latest[name], sent)


def test_scaffold_update_without_its_control_variate_change_is_rejected(tmp_path):
    model = torch.nn.Linear(2, 2)
    strategy, proxies, global_arrays = strategy_with_round_started(
        tmp_path, ScaffoldStrategy, model, strategy="scaffold"
    )
    moved = {name: a + 1 for name, a in global_arrays.items()}
    good = {**moved, **{name.replace("model/", "control-delta/"): np.ones_like(a) for name, a in global_arrays.items()}}
    results = [(proxies[0], fit_res(good, 0)), (proxies[1], fit_res(moved, 1))]
    strategy.aggregate_fit(1, results, [])
    assert last_round(tmp_path)["rejected"] == [
        {"partition": 1, "reason": "missing arrays control-delta/weight, control-delta/bias (2 of 4)"}
    ]
    # c moved by client 0's change only: 1/N with N = 4 clients
    for c in strategy.control.values():
        np.testing.assert_allclose(c, 0.25)


# ---------------------------------------------------------------- bad input stops before anything runs


@pytest.mark.parametrize(
    "content, args, message",
    [
        ("lr: [0.1\n", [], "is not valid YAML"),
        ("lr: 0.1\nlearning_rate: 0.2\n", [], "unknown config key 'learning_rate'"),
        ("", ["lr=fast"], "config key 'lr' must be float, got str 'fast'"),
        ("", ["alpha=0"], "config key 'alpha' = 0.0 must be > 0"),
        ("", ["alpha=-0.5"], "config key 'alpha' = -0.5 must be > 0"),
        (
            "",
            ["num-clients=10", "fraction-fit=0.3", "min-fit-clients=4"],
            "min-fit-clients = 4 but only 3 of the 10 clients are sampled per round",
        ),
        ("", ["min-fit-clients=11"], "min-fit-clients = 11 but only 10 of the 10 clients"),
        ("", ["strategy=fedbr", "pseudo-size=16", "batch-size=32"], "pseudo-size = 16 but batch-size = 32"),
        ("", ["strategy=fedbr", "moon-mu=2"], "config key 'moon-mu' belongs to moon (strategy=moon), not to 'fedbr'"),
        (
            "",
            ["strategy=fedbr", "mixup=true"],
            "config key 'mixup' is gone: FedBR on the Mixup backbone is fedbr-with=mixup",
        ),
        ("", ["checkpoint-every=-1"], "config key 'checkpoint-every' = -1 must be >= 0"),
        ("", ["num-clients=20000"], "num-clients = 20000 but mnist5k has 4500 training samples"),
    ],
)
def test_bad_input_stops_before_training_with_one_message(tmp_path, capsys, content, args, message):
    config = tmp_path / "exp.yaml"
    config.write_text(content)
    out = tmp_path / "run"
    code = cli.main([str(config), *args, f"output-dir={out}"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("error:") == 1
    assert not out.exists()  # nothing started, nothing written


def test_resume_without_a_checkpoint_or_with_a_changed_config_stops_with_a_message(tmp_path, capsys):
    assert cli.main(["--resume", str(tmp_path)]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err
    from fedbr_flwr.runfiles.checkpoint import save_checkpoint

    save_checkpoint(tmp_path, {}, {"round": 2, "config": validate({"num-rounds": 4})})
    assert cli.main(["--resume", str(tmp_path), "lr=0.5"]) == 2
    assert "cannot resume with a different config (lr = 0.05 in the checkpoint, 0.5 now)" in capsys.readouterr().err
    assert cli.main(["--resume", str(tmp_path), "experiments/quickstart.yaml"]) == 2
    assert "give only key=value overrides" in capsys.readouterr().err


def test_prerequisites_that_would_fail_inside_flower_stop_the_command_first(tmp_path, capsys, monkeypatch):
    """`resume=true` as a setting, and mixture pseudo-data whose proxy dataset is missing, used to fail only
    after Flower had started (exit 1, files written): now exit 2, one line, nothing written."""
    out = tmp_path / "run"
    assert cli.main(["resume=true", "num-clients=2", "num-rounds=1", f"output-dir={out}"]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err and not out.exists()

    from fedbr_flwr.runfiles.checkpoint import save_checkpoint

    (tmp_path / "old").mkdir()
    save_checkpoint(tmp_path / "old", {}, {"round": 1, "config": validate({"num-rounds": 4})})
    assert cli.main(["resume=true", "num-clients=2", f"output-dir={tmp_path / 'old'}"]) == 2
    assert f"fedbr-run --resume {tmp_path / 'old'}" in capsys.readouterr().err

    empty = tmp_path / "no-datasets"
    empty.mkdir()
    settings = ["strategy=fedbr", "pseudo-data=mixture", "proxy-dataset=cifar10", "num-clients=2", "num-rounds=1"]
    assert cli.main([*settings, f"data-dir={empty}", "download=never", f"output-dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dataset 'cifar10' not found" in err[0] and not out.exists()


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold"])
def test_an_unexpected_server_error_checkpoints_the_last_finished_round_and_resumes_exactly(
    tmp_path, monkeypatch, strategy
):
    """checkpoint-every=0, and the server fails in round 3 (after the clients trained): the ServerApp still
    checkpoints round 2, says so in one line naming the resume command, and fails as before. Resumed from
    it, two more rounds give the records of an uninterrupted 4-round run. Not where clients keep state of their
    own (SCAFFOLD's c_i): it was collected at the last checkpoint, and a resume from the server's round 2 with the
    clients' state of another round gave other round-4 records."""
    from flwr.app import Context, RecordDict

    from fedbr_flwr.app import server_app
    from fedbr_flwr.runfiles.checkpoint import load_checkpoint

    from fakes import FixedClientManager, InProcessProxy, flower_client, records_without_timing, run_rounds

    settings = {"num-clients": 2, "local-steps": 2, "batch-size": 8, "global-test": False, "checkpoint-every": 0}
    settings["strategy"] = strategy
    settings["model"] = "cnn-small"
    cfg = validate({**settings, "output-dir": str(tmp_path / "failed")})

    def clients():
        torch.manual_seed(123)
        return [InProcessProxy(flower_client(cfg, pid)) for pid in range(2)]

    def grid_failing_in_round_3(grid, config, strategy):
        proxies = clients()
        run_rounds(strategy, proxies, 2, FixedClientManager(proxies))
        original = strategy.aggregate
        strategy.aggregate = lambda *a: (_ for _ in ()).throw(RuntimeError("a bug in round 3"))
        try:
            run_rounds(strategy, proxies, 1, parameters=payload.to_parameters(strategy.latest))
        finally:
            strategy.aggregate = original

    monkeypatch.setattr(server_app, "start_grid", grid_failing_in_round_3)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg)
    with pytest.raises(RuntimeError, match="a bug in round 3"):
        server_app.main(object(), context)
    out = tmp_path / "failed"
    said = [json.loads(line)["message"] for line in (out / "progress.jsonl").read_text().splitlines()]
    if strategy == "scaffold":
        assert not (out / "checkpoint.npz").exists()
        assert any("round 2 is not checkpointed, as its clients' own state is not at hand; start it" in s for s in said)
        return
    _, header = load_checkpoint(out)
    assert header["round"] == 2
    assert any("round 2 is checkpointed" in s and f"fedbr-run --resume {out}" in s for s in said), said

    # resumed from that checkpoint, rounds 3-4 equal those of a run that never failed
    resumed = server_app.build_strategy({**cfg, "resume": True, "num-rounds": 4})
    proxies = clients()
    run_rounds(server_app.ResumedRun(resumed, 2), proxies, 2, FixedClientManager(proxies))
    whole = server_app.build_strategy({**cfg, "output-dir": str(tmp_path / "whole"), "num-rounds": 4})
    proxies = clients()
    run_rounds(whole, proxies, 4, FixedClientManager(proxies))
    for name in ("rounds.jsonl", "metrics.jsonl"):
        assert records_without_timing(out / name) == records_without_timing(tmp_path / "whole" / name), name
    assert [r["round"] for r in records_without_timing(out / "rounds.jsonl")] == [1, 2, 3, 4]


def test_a_disk_that_fills_up_during_a_run_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    """fedbr-run's own writes (flower.log, run_config.toml) failing with ENOSPC mid-run: one line naming the
    folder, exit 1, no traceback; in a sweep the run is failed with that reason and the sweep goes on."""
    import errno

    from fedbr_flwr.commands import sweep
    from fedbr_flwr.launch import launcher

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(launcher, "simulate_run", disk_full)  # a run of its own
    monkeypatch.setattr(launcher.RunHost, "run", disk_full)  # a sweep's run
    out = tmp_path / "run"
    assert cli.main(["num-clients=2", "num-rounds=1", f"output-dir={out}", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err == f"fedbr-run: error: the run stopped: cannot write to {out}: No space left on device\n"
    cfg = validate({"num-rounds": 1, "num-clients": 2, "output-dir": str(tmp_path / "s")})
    fedavg = Setting("fedavg")
    status = sweep.run_all([(fedavg, 0, cfg), (fedavg, 1, {**cfg, "seed": 1})], quiet=True)
    assert all(
        v.endswith("No space left on device") and v.startswith("failed: cannot write to") for v in status.values()
    )


def test_a_reply_flower_expired_under_round_timeout_reads_as_a_timeout():
    from flwr.server.superlink.linkstate.utils import (
        MESSAGE_UNAVAILABLE_ERROR_REASON,
        NODE_UNAVAILABLE_ERROR_REASON,
        REPLY_MESSAGE_UNAVAILABLE_ERROR_REASON,
    )

    from fedbr_flwr.app.federation import Federation
    from fedbr_flwr.app.routing import describe_failure

    federation = Federation(validate({"round-timeout": 10}))
    federation.pid_by_cid["node-3"] = 3
    proxy = type("Proxy", (), {"cid": "node-3"})()
    for flower_reason in (MESSAGE_UNAVAILABLE_ERROR_REASON, REPLY_MESSAGE_UNAVAILABLE_ERROR_REASON):
        failure = (proxy, FitRes(Status(Code.FIT_NOT_IMPLEMENTED, flower_reason), None, 0, {}))
        assert describe_failure(federation, failure) == "client 3: timed out: no reply within round-timeout = 10 s"
    raised = ValueError(f"Message contains an Error (reason: {MESSAGE_UNAVAILABLE_ERROR_REASON}). It originated ...")
    assert describe_failure(federation, raised) == "timed out: no reply within round-timeout = 10 s"
    node_lost = (proxy, FitRes(Status(Code.FIT_NOT_IMPLEMENTED, NODE_UNAVAILABLE_ERROR_REASON), None, 0, {}))
    assert "Node Unavailable" in describe_failure(federation, node_lost)
    federation.cfg = validate({"round-timeout": 0})  # no timeout set: Flower's reason is all there is
    assert "Message Unavailable" in describe_failure(federation, failure)


def test_sigterm_during_a_run_says_it_was_stopped_and_how_to_resume(tmp_path, capsys, monkeypatch):
    """fedbr-run's SIGTERM handler exits 143 through the launcher's clean-up; the command says so in one line."""

    def terminated(*args, **kwargs):
        raise SystemExit(143)  # what the handler raises in the middle of a run

    monkeypatch.setattr(cli, "run_flower", terminated)
    out = tmp_path / "run"
    assert cli.main(["num-rounds=2", f"output-dir={out}"]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedbr-run: stopped by SIGTERM; {cli.stopped_run(out)}"]
    assert "no round was checkpointed, so there is nothing to continue" in err[0]  # it said to resume it
    out.mkdir(exist_ok=True)
    (out / "checkpoint.npz").touch()
    assert cli.stopped_run(out).endswith(f"continue with `fedbr-run --resume {out}`")


def test_a_process_killed_by_a_signal_is_named_by_its_signal():
    from fedbr_flwr.launch.launcher import how_it_ended

    assert how_it_ended(1) == "exited with code 1"
    assert how_it_ended(-11) == "was killed by SIGSEGV (a crash)"
    assert how_it_ended(-9) == "was killed by SIGKILL (the out-of-memory killer, or kill -9)"
    assert how_it_ended(-15) == "was killed by SIGTERM"
    assert how_it_ended(-200) == "was killed by signal 200"


def test_an_exception_without_a_message_still_says_what_happened():
    from fedbr_flwr.app.inprocess import InProcessBackend
    from fedbr_flwr.core.errors import describe

    assert describe(MemoryError()) == "MemoryError: out of memory"
    assert describe(KeyError()) == "KeyError"
    assert describe(ValueError("two\n  lines")) == "ValueError: two lines"

    def app(message, context):
        raise MemoryError()

    backend = InProcessBackend({"client_resources": {"num_cpus": 1}})
    backend.build(lambda: app)
    with pytest.raises(Exception, match="Message: MemoryError: out of memory$"):
        backend.process_message(None, None)


# ---------------------------------------------------------------- answers to the server's requests


def federation_with_one_bad_answer(tmp_path, strategy, request, bad, **extra):
    """An in-process federation of 3 clients (real data, CPU) whose client 1 answers ``request`` with
    ``bad(its honest answer)``."""
    from test_checkpoint import run_cfg

    from fakes import in_process_federation

    server, algorithms, proxies = in_process_federation(run_cfg(strategy, **extra), tmp_path)
    honest = algorithms[1].answer
    algorithms[1].answer = lambda config: bad(honest(config)) if config.get("request") == request else honest(config)
    return server, proxies


def test_shared_inputs_are_held_to_the_images_range_within_a_mean_s_rounding_and_labels_to_probabilities():
    """A mutation audit found that a slack of 0.1 of the range instead of 1e-4, and labels whose rows do not sum
    to 1, passed every test: each test's bad value broke a coarser rule too."""
    from fedbr_flwr.data.catalog import INFO
    from fedbr_flwr.server.updates import images_problem, soft_labels_problem

    info = INFO["mnist5k"]
    (low,), (high,) = info.input_range()
    edge = np.full((2, *info.image_shape), high, np.float32)
    assert images_problem(edge + 0.5e-4 * (high - low), 2, info) is None  # a float32 mean's rounding
    assert "outside the images' range" in images_problem(edge + 2e-3 * (high - low), 2, info)
    assert "outside the images' range" in images_problem(edge * 0 + low - 2e-3 * (high - low), 2, info)
    assert soft_labels_problem(np.full((2, 4), 0.25, np.float32), 2, 4) is None
    assert "not class probabilities" in soft_labels_problem(np.full((2, 4), 0.125, np.float32), 2, 4)


def test_shared_inputs_must_be_floats_and_labels_each_in_0_1():
    """Inputs of whole numbers or text, and labels whose rows sum to 1 with values outside [0, 1], passed the checks
    of a mutant each; text inputs raised out of the server (no >= between text and a float bound)."""
    from fedbr_flwr.data.catalog import INFO
    from fedbr_flwr.server.updates import images_problem, soft_labels_problem

    info = INFO["mnist5k"]
    shape = (2, *info.image_shape)
    assert images_problem(np.zeros(shape, np.float32), 2, info) is None
    assert images_problem(np.zeros(shape, np.int64), 2, info) == "inputs of type int64, not floats"
    assert images_problem(np.full(shape, "0"), 2, info) == "inputs of type <U1, not floats"
    negative = np.array([[1.5, -0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]], np.float32)
    assert "not class probabilities" in soft_labels_problem(negative, 2, 4)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (lambda a: {"means": np.full_like(a["means"], np.nan)}, "outside the images' range (or NaN)"),
        (lambda a: {"means": np.full_like(a["means"], 1e30)}, "outside the images' range"),
        (lambda a: {"means": a["means"][:, :, :3]}, "inputs of shape"),
        (lambda a: {"means": a["means"][:1]}, "inputs of shape"),
        (lambda a: {"other": a["means"]}, "inputs of type NoneType"),
    ],
    ids=["nan", "huge", "shape", "count", "missing"],
)
def test_pseudo_data_means_that_cannot_be_used_are_left_out_and_the_honest_clients_train(tmp_path, caplog, bad, reason):
    """One client's NaN or huge means in the shared pseudo-data made every client's update NaN (each rejected,
    every round); a missing or misshapen answer raised out of the server."""
    from fakes import run_rounds

    server, proxies = federation_with_one_bad_answer(tmp_path, "fedbr", "rsm-means", bad)
    run_rounds(server, proxies, 2)
    assert "client 1 sent its pseudo-data means that cannot be used (" in caplog.text and reason in caplog.text
    assert "rejected" not in caplog.text  # every fit was averaged in
    x, _ = server.shared_data().arrays
    came = 8 - allot(8, [0, 1, 2], 0, 1)[1]  # batch-size 8 means, but client 1's share did not come
    assert len(x) == 8 and np.isfinite(x).all()
    np.testing.assert_array_equal(x[came:], x[: 8 - came])  # in its place, the means that came, from the first
    rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [(r["clients"], r["failures"], np.isfinite(r["train"]["loss"])) for r in rounds] == [(3, 0, True)] * 2


@pytest.mark.parametrize(
    "bad, reason",
    [
        (lambda a: {**a, "x": np.full_like(a["x"], np.nan)}, "outside the images' range (or NaN)"),
        (lambda a: {"x": a["x"]}, "labels of shape ?"),
        (lambda a: {**a, "y": a["y"] * 2}, "labels that are not class probabilities"),
        # 50 times its n // M means: most of the pool, sent to every client, would have been its own
        (lambda a: {k: np.concatenate([v] * 50) for k, v in a.items()}, "inputs of shape"),
    ],
    ids=["nan", "no-labels", "labels", "too-many"],
)
def test_fedmix_mean_data_that_cannot_be_used_is_left_out(tmp_path, caplog, bad, reason):
    from fakes import run_rounds

    server, proxies = federation_with_one_bad_answer(tmp_path, "fedmix", "fedmix-means", bad)
    run_rounds(server, proxies, 1)
    assert "client 1 sent its mean data that cannot be used (" in caplog.text and reason in caplog.text
    x, y = server.shared_data().arrays
    assert np.isfinite(x).all() and np.allclose(y.sum(axis=1), 1.0)
    assert "rejected" not in caplog.text


def compressed_zeros(count):
    """A named-arrays archive of a few kilobytes that expands to ``count`` float64 zeros (1e10: 80 GB, decoded)."""
    import io

    buffer = io.BytesIO()
    np.savez_compressed(buffer, zeros=np.zeros(count))
    return np.frombuffer(buffer.getvalue(), np.uint8)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (lambda a: {}, "no 'state' array of bytes"),
        (lambda a: {"state": np.frombuffer(b"x" * 9, np.uint8)}, "decode"),
        (lambda a: {"state": compressed_zeros(10**7)}, "bytes"),
    ],
    ids=["missing", "garbage", "zip-bomb"],
)
def test_a_client_state_that_cannot_be_kept_leaves_the_state_it_sent_last(tmp_path, caplog, bad, reason):
    """A missing 'state' raised out of the checkpoint (a KeyError ended the run); bytes that are no named arrays
    were kept, for the client to fail on after a resume."""
    from fakes import run_rounds

    server, proxies = federation_with_one_bad_answer(tmp_path, "scaffold", "client-state", bad)
    run_rounds(server, proxies, 2)  # checkpoint-every 2
    assert "client 1 sent its state for the checkpoint that cannot be used (" in caplog.text and reason in caplog.text
    assert sorted(server.checkpointer.client_states) == [0, 2]
