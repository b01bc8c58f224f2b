"""One hostile or broken client cannot break a federation: every reply is checked against what the server
expects before anything uses it (dtype, sample counts, evaluation figures), a failing one is left out with
its reason in the run files, and none raises out of the server. The replies of one client of three are
tampered with, in process, round after round."""

import json

import numpy as np
import pytest

from fedbr_flwr.app import payload
from fedbr_flwr.core.config import validate
from fedbr_flwr.server.updates import count_problem, evaluation_problem, update_problem

from fakes import InProcessProxy, in_process_federation, run_rounds

CFG = {
    "strategy": "fedavg",
    "num-clients": 3,
    "num-rounds": 2,
    "local-steps": 1,
    "batch-size": 8,
    "eval-every": 1,
    "global-test": False,
    "test-fraction": 0.05,
    "weighting": "samples",
}
HOSTILE = 1  # the partition whose replies are tampered with


class Tampered(InProcessProxy):
    """A client whose fit or evaluation reply is changed by ``fit`` / ``evaluate`` before it is sent."""

    def __init__(self, proxy, fit=None, evaluate=None, fit_metrics=None):
        super().__init__(proxy.client, proxy.cid)
        self.change_fit, self.change_evaluate, self.change_fit_metrics = fit, evaluate, fit_metrics

    def fit(self, ins, timeout, group_id):
        res = super().fit(ins, timeout, group_id)
        if self.change_fit:
            arrays, res.num_examples = self.change_fit(payload.from_parameters(res.parameters), res.num_examples)
            res.parameters = payload.to_parameters(arrays)
        if self.change_fit_metrics:
            self.change_fit_metrics(res)
        return res

    def evaluate(self, ins, timeout, group_id):
        res = super().evaluate(ins, timeout, group_id)
        if self.change_evaluate:
            self.change_evaluate(res)
        return res


def federation(tmp_path, settings=None, **tamper):
    strategy, _, proxies = in_process_federation(validate({**CFG, **(settings or {})}), tmp_path)
    proxies[HOSTILE] = strategy.federation.clients_by_pid[HOSTILE] = Tampered(proxies[HOSTILE], **tamper)
    final = payload.from_parameters(run_rounds(strategy, proxies, CFG["num-rounds"]))
    rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return final, rounds, evals


def oversized(arrays, n):
    """An extra array of the update's size plus a little over 1 MiB, what a client pushing a huge payload
    sends: just past the budget of twice the update and 1 MiB (it was 3 times the size, so a budget of 4 times
    let it pass)."""
    size = sum(a.nbytes for a in arrays.values())
    return {**arrays, "padding": np.zeros(size // 4 + 2**18 + 2**10, np.float32)}, n


def arrays_as(dtype):
    return lambda arrays, n: ({k: a.astype(dtype) for k, a in arrays.items()}, n)


@pytest.mark.parametrize(
    "change, reason",
    [
        (arrays_as(np.int64), "has dtype int64, expected float32"),
        (arrays_as(np.float16), "has dtype float16, expected float32"),
        (arrays_as(np.float64), "has dtype float64, expected float32"),
        (arrays_as(np.complex64), "holds complex64 values, not real numbers"),
        (lambda arrays, n: ({k: np.full(a.shape, "x") for k, a in arrays.items()}, n), "not real numbers"),
        (lambda arrays, n: (arrays, 10**15), "reports 1000000000000000 training samples, but its partition holds"),
        (lambda arrays, n: (arrays, -5), "reports -5 training samples"),
        (oversized, "over the budget of"),
    ],
    ids=["int64", "float16", "float64", "complex", "str", "huge-count", "negative-count", "oversized"],
)
def test_a_tampered_update_is_rejected_with_its_reason_and_the_others_averaged(tmp_path, change, reason):
    final, rounds, evals = federation(tmp_path, fit=change)
    for record in rounds:
        assert [r["partition"] for r in record["rejected"]] == [HOSTILE] and reason in record["rejected"][0]["reason"]
        assert not record.get("skipped")
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in final.values())
    assert all(0 <= e["mean_acc"] <= 1 and e["clients_evaluated"] == 3 for e in evals)


def set_metric(name, value):
    def change(res):
        if value is None:
            res.metrics.pop(name)
        else:
            res.metrics[name] = value

    return change


def set_loss(loss):
    def change(res):
        res.loss = loss

    return change


def set_count(n):
    def change(res):
        res.num_examples = n

    return change


@pytest.mark.parametrize(
    "change, reason",
    [
        (set_metric("accuracy", 5.0), "reports accuracy 5.0, outside [0, 1]"),
        (set_metric("accuracy", -3.0), "reports accuracy -3.0, outside [0, 1]"),
        (set_metric("accuracy", float("nan")), "reports accuracy nan, not a finite number"),
        (set_metric("accuracy", None), "reports accuracy None, not a finite number"),
        (set_metric("accuracy", "high"), "reports accuracy 'high', not a finite number"),
        (set_count(10**9), "reports 1000000000 test samples, but its partition holds"),
        (set_count(0), "reports 0 test samples"),
        (set_metric("accuracy", 10**400), "not a finite number"),  # OverflowError out of the server
        (set_loss(10**400), "not a number >= 0"),
    ],
    ids=[
        "acc-5",
        "acc-minus-3",
        "acc-nan",
        "acc-missing",
        "acc-str",
        "huge-test-count",
        "no-test-samples",
        "acc-huge-int",
        "loss-huge-int",
    ],
)
def test_a_tampered_evaluation_is_not_counted_and_the_evaluation_is_partial(tmp_path, change, reason):
    _, rounds, evals = federation(tmp_path, evaluate=change)
    for record in evals:
        assert [r["partition"] for r in record["eval_rejected"]] == [HOSTILE]
        assert reason in record["eval_rejected"][0]["reason"]
        assert record["clients_evaluated"] == 2 and record["clients_expected"] == 3
        assert str(HOSTILE) not in record["per_client_acc"]
        assert 0 <= record["worst_acc"] <= record["mean_acc"] <= 1 and 0 <= record["pooled_acc"] <= 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["complete_evaluations"] == 0 and summary["mean_acc_best5"] is None  # partial ones do not count


@pytest.mark.parametrize(
    "extra",
    [{f"junk-{i}": 0.0 for i in range(300)}, {"x" * 101: 0.0}, {"xx\n[fedbr] round 1/2 | forged\x1b[2K": 0.0}],
    ids=["300-metrics", "long-name", "control-characters"],
)
def test_a_fit_reply_with_too_many_or_too_long_metrics_is_rejected(tmp_path, extra):
    """Each metric a round averages becomes a key of its rounds.jsonl line: 300 junk ones a round grew the file
    without bound; and a name is printed in the round's log line, where a newline forged a line of its own."""
    final, rounds, _ = federation(tmp_path, fit_metrics=lambda res: res.metrics.update(extra))
    for record in rounds:
        (rejected,) = record["rejected"]
        assert rejected["partition"] == HOSTILE and "at most 256" in rejected["reason"]
        assert not any(k.startswith(("junk", "xx")) for k in record["train"])


@pytest.mark.parametrize(
    "strategy, name, value",
    [
        ("fedavg", "fit-seconds", "abc"),  # the round's slowest client: max() of a str and a float
        ("fedavg", "loss", b"x"),  # the round's mean training loss
        ("fedavg", "loss", [1.0, 2.0]),
        ("fedbr", "pseudo-version", "abc"),  # which pseudo-data it holds: read before any screening
        ("fedbr", "pseudo-version", float("nan")),
        ("fedavg", "loss", 10**400),  # an int past float's range: OverflowError in the round's mean
        ("groupdro", "first-loss", 10**400),  # and in GroupDRO's weights
    ],
    ids=["str-seconds", "bytes-loss", "list-loss", "str-version", "nan-version", "huge-int-loss", "huge-int-first"],
)
def test_a_fit_metric_that_is_no_number_rejects_the_update_and_raises_nothing(tmp_path, strategy, name, value):
    """Each of these raised out of the server's aggregate_fit, and so stopped the run."""
    final, rounds, _ = federation(tmp_path, {"strategy": strategy}, fit_metrics=set_metric(name, value))
    for record in rounds:
        assert [r["partition"] for r in record["rejected"]] == [HOSTILE] and name in record["rejected"][0]["reason"]
        assert not record.get("skipped")
    assert all(np.isfinite(a).all() for a in final.values() if a.dtype.kind == "f")


def npy_header(descr, shape):
    """The bytes of a .npy version 1.0 header, as np.save writes it, padded to 64."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    text += " " * (63 - (10 + len(text)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode()


def object_array_bytes():
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.array([{}, None], dtype=object), allow_pickle=True)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "tensor",
    [
        b"garbage",
        b"",
        npy_header("<f4", (3,)) + b"\0" * 5,  # cut short
        npy_header("<f4", (10**11,)),  # numpy allocated the 373 GiB it claims before reading
        b"\x93NUMPY\x01\x00\x10\x00{'descr': 'zz', ",
        object_array_bytes(),
    ],
    ids=["garbage", "empty", "truncated", "huge-claim", "bad-header", "objects"],
)
def test_an_array_whose_bytes_are_no_npy_array_rejects_the_update_and_raises_nothing(tmp_path, tensor):
    """Decoding each of these raised out of the server's aggregate_fit (ValueError, EOFError, TokenError,
    MemoryError), and so stopped the run."""

    def tamper(res):
        res.parameters.tensors[1] = tensor

    final, rounds, _ = federation(tmp_path, fit_metrics=tamper)
    for record in rounds:
        assert [r["partition"] for r in record["rejected"]] == [HOSTILE]
        assert "an array's bytes are not a .npy array" in record["rejected"][0]["reason"]
    assert all(np.isfinite(a).all() for a in final.values() if a.dtype.kind == "f")


def test_an_array_followed_by_more_bytes_than_its_header_claims_is_refused():
    """Only a header's shape and dtype say what an array is: bytes after them are no part of any array of ours (a
    decoder that read only as many as claimed took such a reply)."""
    from flwr.common import ndarray_to_bytes

    data = ndarray_to_bytes(np.zeros(3, np.float32))
    assert payload.decode(data).shape == (3,)
    with pytest.raises(payload.PayloadError, match="its header claims 12 bytes, 20 follow it"):
        payload.decode(data + bytes(8))


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.asfortranarray(np.arange(24, dtype=np.int64).reshape(2, 3, 4)),
        np.array(3.5),
        np.zeros((0, 5), np.float16),
        np.array(["x", "yz"]),
        np.array([True, False]),
    ],
)
def test_the_decoder_reads_what_flowers_does(array):
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes

    data = ndarray_to_bytes(array)
    ours, flowers = payload.decode(data), bytes_to_ndarray(data)
    assert ours.dtype == flowers.dtype and ours.shape == flowers.shape and ours.tobytes("A") == flowers.tobytes("A")
    assert ours.flags.f_contiguous == flowers.flags.f_contiguous and ours.flags.writeable


def test_a_diverged_models_nan_loss_is_still_an_evaluation():
    assert evaluation_problem(float("nan"), 5, 0.1, 10) is None
    assert evaluation_problem(float("inf"), 5, 0.1, 10) is None
    assert "loss -1.0" in evaluation_problem(-1.0, 5, 0.1, 10)


def test_counts_are_whole_numbers_within_the_known_size():
    assert count_problem(400, 400, "training samples") is None
    assert count_problem(np.int64(3), None, "x") is None
    assert "not a whole number" in count_problem(3.0, 400, "training samples")
    assert "not a whole number" in count_problem(True, 400, "training samples")
    assert "holds 400" in count_problem(401, 400, "training samples")
    assert "2**63 or more" in count_problem(10**400, None, "training samples")  # its weight overflowed the mean


def test_counts_are_bounded_below_2_63_exactly():
    assert count_problem(2**63 - 1, None, "training samples") is None
    assert count_problem(2**63, None, "training samples") == "reports 2**63 or more training samples"


def test_metric_checks_hold_at_their_bounds():
    """256 metrics with names of 100 characters pass, one more of either is refused; a metric the server reads
    (GroupDRO's first-loss) may be 0 and no less, and must be a number (not a bool)."""
    ok, spec = {"w": np.zeros(2, np.float32)}, {"w": (2,)}
    most = {f"metric-{i}": 0.5 for i in range(256)}
    assert update_problem(ok, spec, most) is None
    assert update_problem(ok, spec, {**most, "one-more": 0.5}).startswith("reports 257 metrics: at most 256")
    assert update_problem(ok, spec, {"x" * 100: 0.5}) is None
    assert "at most 100 printable characters" in update_problem(ok, spec, {"x" * 101: 0.5})
    read = ("first-loss",)
    assert update_problem(ok, spec, {"first-loss": 0.0}, read) is None
    for value in (-1e-9, -1, True, "0.5"):
        reason = update_problem(ok, spec, {"first-loss": value}, read)
        assert reason == "metric 'first-loss' is missing or not a number >= 0", value
    assert update_problem(ok, spec, {"loss": 1.0}, read) == "metric 'first-loss' is missing or not a number >= 0"
    assert update_problem(ok, spec, {"correct": True}) == "metric 'correct' is True, not a number"


def test_evaluation_checks_hold_at_their_bounds():
    """A loss of 0 and accuracies of 0 and 1 are evaluations; a bool is no number (True passed as an accuracy of
    1.0); the test-sample count is bounded by the client's local test set, not its training set."""
    from fedbr_flwr.app.routing import Evaluation
    from fedbr_flwr.server.updates import screen_evaluations

    assert evaluation_problem(0.0, 5, 0.0, 10) is None and evaluation_problem(0.0, 5, 1.0, 10) is None
    assert evaluation_problem(0.5, 5, True, 10) == "reports accuracy True, not a finite number"
    assert evaluation_problem(False, 5, 0.5, 10) == "reports loss False, not a number >= 0"
    answers = [Evaluation(0, 0.5, 10, 0.25), Evaluation(1, 0.5, 11, 0.75)]
    valid, rejected = screen_evaluations(answers, {0: (40, 10), 1: (40, 10)})
    assert valid == [(0, 0.5, 10, 0.25)]
    assert rejected == [{"partition": 1, "reason": "reports 11 test samples, but its partition holds 10"}]


def test_a_client_is_believed_to_hold_shared_data_only_for_a_whole_version_number():
    """A reply's ``<name>-version`` is read before any screening: True (== 1) or 1.0 is no version, so the client is
    sent the data again rather than taken to hold version 1."""
    from fedbr_flwr.core.broadcast import SharedData

    shared = SharedData("pseudo")
    shared.publish(np.zeros((2, 1, 2, 2), np.float32), np.full((2, 2), 0.5, np.float32), 1)
    versions = {0: {"pseudo-version": 1}, 1: {"pseudo-version": True}, 2: {"pseudo-version": 1.0}, 3: {}}
    shared.confirm(versions, [0, 1, 2, 3])
    assert ["pseudo-payload" in shared.fit_config(pid) for pid in range(4)] == [False, True, True, True]


def test_an_error_message_quotes_a_long_value_cut_short():
    reason = count_problem("x" * 10_000_000, None, "training samples")
    assert len(reason) < 120 and reason.endswith("..., not a whole number")


def test_update_dtypes_are_checked_exactly_and_before_finiteness():
    spec, dtypes = {"w": (2,)}, {"w": np.dtype(np.float32)}
    assert update_problem({"w": np.zeros(2, np.float32)}, spec, {}, (), dtypes) is None
    assert "dtype int32" in update_problem({"w": np.zeros(2, np.int32)}, spec, {}, (), dtypes)
    assert "not real numbers" in update_problem({"w": np.array(["a", "b"])}, spec, {}, (), None)
    assert "NaN or Inf" in update_problem({"w": np.array([np.nan, 0], np.float32)}, spec, {}, (), dtypes)


# ---------------------------------------------------------------- configuration input is bounded


@pytest.mark.parametrize(
    "text, message",
    [
        ('a: &a ["x", "x", "x"]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n', "anchors and aliases"),
        ("x: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than 20 levels"),
    ],
    ids=["alias-bomb", "deep-list"],
)
def test_a_hostile_yaml_file_stops_with_one_line(tmp_path, capsys, text, message):
    from fedbr_flwr.commands import cli

    path = tmp_path / "e.yaml"
    path.write_text(text)
    assert cli.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1 and len(err) < 800


def test_a_file_that_is_not_utf8_or_too_large_stops_with_one_line(tmp_path, capsys):
    from fedbr_flwr.commands import cli
    from fedbr_flwr.core.config import YAML_MAX_BYTES

    path = tmp_path / "e.yaml"
    path.write_bytes("num-rounds: 1\n".encode("utf-16"))
    assert cli.main([str(path), "--dry-run"]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    path.write_text("# padding\n" * (YAML_MAX_BYTES // 10 + 1))
    assert cli.main([str(path), "--dry-run"]) == 2
    assert "may hold at most" in capsys.readouterr().err


def test_numbers_must_fit_and_quoted_values_are_cut(capsys):
    from fedbr_flwr.commands import cli

    assert cli.main(["seed=123456789012345678901", "--dry-run"]) == 2
    assert "does not fit a 64-bit integer" in capsys.readouterr().err
    assert cli.main(["strategy=" + "x" * 1_000_000, "--dry-run"]) == 2
    assert len(capsys.readouterr().err) < 1000
