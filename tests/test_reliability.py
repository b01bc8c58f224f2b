"""Reliability (issue 18): a damaged checkpoint, non-finite settings, a run in which no round trained,
an output folder that cannot be written, NaN in the run files, and evaluations some client missed.
Each stops with one clear message, or is said plainly in the run's files, instead of a traceback or a
result that is none."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from flwr.common import Code, EvaluateRes, FitRes, Status

from fedbr_flwr.app import payload
from fedbr_flwr.commands import cli
from fedbr_flwr.commands.report import Setting
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.launch.protocol import RunPlan
from fedbr_flwr.runfiles import run_io
from fedbr_flwr.runfiles.checkpoint import CHECKPOINT_NAME, save_checkpoint
from fedbr_flwr.runfiles.metrics import plot_history, read_jsonl, summarize, summary_table
from fedbr_flwr.runfiles.progress import read_events
from fedbr_flwr.runfiles.run_io import RunRecorder, keep_rounds_up_to
from fedbr_flwr.server.recording import eval_record
from strategies.fedavg import FedAvgStrategy

from fakes import OfflineProxy, stop_as_it_replaces


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as strict readers (jq, JavaScript) do."""

    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def strict_lines(path):
    return [strict_json(line) for line in path.read_text().splitlines() if line.strip()]


def no_flower(*args, **kwargs):
    raise AssertionError("Flower was started")


# ---------------------------------------------------------------- 3: a damaged checkpoint on --resume


@pytest.mark.parametrize("damage", ["truncated", "cut-at-the-end", "empty", "random-bytes"])
def test_a_damaged_checkpoint_stops_resume_with_one_line_and_exit_2(tmp_path, capsys, monkeypatch, damage):
    monkeypatch.setattr(cli, "run_flower", no_flower)
    save_checkpoint(
        tmp_path,
        {"global/model/w": np.arange(4096, dtype=np.float32)},
        {"round": 2, "config": validate({"num-rounds": 4}), "elapsed": 1.0},
    )
    path = tmp_path / CHECKPOINT_NAME
    whole = path.read_bytes()
    path.write_bytes(
        {
            "truncated": whole[: len(whole) // 2],
            "cut-at-the-end": whole[:-7],
            "empty": b"",
            "random-bytes": np.random.default_rng(0).bytes(4096),
        }[damage]
    )
    assert cli.main(["--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedbr-run: error: ")
    assert f"checkpoint {path} is damaged or truncated" in err
    assert "--overwrite" in err and "pickled" not in err


# ---------------------------------------------------------------- 4: non-finite settings; no round trained


@pytest.mark.parametrize(
    "key, value, extra",
    [
        ("lr", ".inf", {}),
        ("weight-decay", ".inf", {}),
        ("round-timeout", ".inf", {}),
        ("momentum", "-.inf", {}),
        ("fedbr-lambda", ".inf", {"strategy": "fedbr"}),
        ("lr", "1e999", {}),
        ("lr", ".nan", {}),
        ("lr", "nan", {}),  # was "must be float, got str 'nan'"
        ("momentum", "-inf", {}),
    ],
)
def test_non_finite_floats_in_yaml_stop_with_the_key_named(tmp_path, capsys, monkeypatch, key, value, extra):
    monkeypatch.setattr(cli, "run_flower", no_flower)
    config = tmp_path / "exp.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in {**extra, key: value}.items()))
    assert cli.main([str(config), f"output-dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"config key '{key}' must be a finite number" in err and err.count("\n") == 1


@pytest.mark.parametrize("key", ["lr", "weight-decay", "round-timeout", "alpha", "target-acc", "client-gpus"])
def test_every_float_key_refuses_infinity(key):
    with pytest.raises(ConfigError, match=f"config key '{key}' must be a finite number"):
        validate({key: math.inf})


def fit_res(value, pid):
    arrays = {"model/weight": np.full((2, 2), value, np.float32), "model/bias": np.full(2, value, np.float32)}
    return FitRes(Status(Code.OK, ""), payload.to_parameters(arrays), 10, {"loss": 1.0, "partition-id": pid})


def eval_res(pid, acc, loss=1.0):
    return EvaluateRes(Status(Code.OK, ""), loss, 20, {"accuracy": acc, "partition-id": pid})


def small_run(tmp_path, clients=2, **overrides):
    """A FedAvg strategy over ``clients`` fake clients, discovered, Flower-free."""
    cfg = validate(
        {
            "output-dir": str(tmp_path),
            "global-test": False,
            "num-clients": clients,
            "checkpoint-every": 0,
            "eval-every": 1,
            **overrides,
        }
    )
    strategy = FedAvgStrategy(cfg, RunRecorder(cfg, tmp_path), {"model": torch.nn.Linear(2, 2)}, None)
    proxies = [OfflineProxy(f"node-{i}") for i in range(clients)]
    strategy.federation.clients_by_pid = dict(enumerate(proxies))
    strategy.federation.pid_by_cid = {p.cid: i for i, p in enumerate(proxies)}
    return strategy, proxies


def play_round(strategy, proxies, server_round, fit_values, eval_accs, eval_failures=()):
    """One round as Flower plays it: fit answers with arrays of ``fit_values`` (None: that client failed),
    then evaluation answers (None: that client's evaluation failed)."""
    parameters = payload.to_parameters(strategy.latest if strategy.latest is not None else strategy.initial_arrays())
    strategy.configure_fit(server_round, parameters, None)
    results = [(proxies[pid], fit_res(v, pid)) for pid, v in enumerate(fit_values) if v is not None]
    failures = [RuntimeError("lost") for v in fit_values if v is None]
    strategy.aggregate_fit(server_round, results, failures)
    strategy.configure_evaluate(server_round, parameters, None)
    results = [(proxies[pid], eval_res(pid, acc)) for pid, acc in enumerate(eval_accs) if acc is not None]
    strategy.aggregate_evaluate(server_round, results, [RuntimeError("lost") for a in eval_accs if a is None])


def test_a_run_whose_every_update_was_rejected_says_so_and_is_no_result(tmp_path):
    strategy, proxies = small_run(tmp_path, **{"num-rounds": 2})
    for server_round in (1, 2):  # lr = inf: every client's update holds NaN and is rejected
        play_round(strategy, proxies, server_round, [np.nan, np.inf], [0.209, 0.209])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds_without_update"] == [1, 2] and summary["rounds_trained"] == 0
    md = (tmp_path / "summary.md").read_text()
    assert "no round trained" in md and "rounds without update" in md
    problem = run_io.finished_run_problem(tmp_path)
    assert problem is not None and "no round trained" in problem and "\n" not in problem
    events, _ = read_events(tmp_path / "progress.jsonl")  # what fedbr-run and a deploy print as it ends
    assert [e["message"] for e in events if e["kind"] == "error"][-1] == problem


def test_a_run_with_some_rounds_without_update_names_them_and_is_a_result(tmp_path):
    strategy, proxies = small_run(tmp_path, **{"num-rounds": 3})
    play_round(strategy, proxies, 1, [1.0, 3.0], [0.3, 0.4])
    play_round(strategy, proxies, 2, [np.nan, None], [0.3, 0.4])
    play_round(strategy, proxies, 3, [1.0, 3.0], [0.5, 0.6])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds_without_update"] == [2] and summary["rounds_trained"] == 2
    assert "rounds without update (model unchanged) | 1: round 2" in (tmp_path / "summary.md").read_text()
    assert run_io.finished_run_problem(tmp_path) is None


def test_a_last_round_that_no_client_evaluated_still_ends_the_run_with_its_files(tmp_path):
    """Every client's last evaluation failed (timed out, say): the run still writes its summary and its last
    event, which fedbr-run waits for (without them it said 'ended without its last event')."""
    strategy, proxies = small_run(tmp_path, **{"num-rounds": 2})
    play_round(strategy, proxies, 1, [1.0, 3.0], [0.3, 0.4])
    play_round(strategy, proxies, 2, [1.0, 3.0], [None, None])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds_trained"] == 2 and summary["final_round"] == 1
    assert (tmp_path / "summary.md").exists()
    events, _ = read_events(tmp_path / "progress.jsonl")
    assert events[-1]["kind"] == "summary"
    assert "round 2: no client returned an evaluation" in [e["message"] for e in events if e["kind"] == "error"]


def test_a_summary_json_that_cannot_be_read_judges_no_run(tmp_path):
    """fedbr-run asks it after the run: a torn or hand-edited file is no verdict, not a traceback."""
    for text in ('{"rounds_trained": 0, "rou', "0"):
        (tmp_path / "summary.json").write_text(text)
        assert run_io.finished_run_problem(tmp_path) is None


def run_that_trained_nothing(plan, echo, superlink=False, host=None, watch=None):
    """In place of Flower: write the files of a run in which every update was rejected."""
    cfg, out = dict(plan.config), plan.out_dir
    recorder = RunRecorder(cfg, out)
    for r in range(1, cfg["num-rounds"] + 1):
        recorder.log_round(
            {
                "round": r,
                "clients": 0,
                "failures": 2,
                "skipped": True,
                "train": {},
                "seconds": 0.1,
                "rejected": [{"partition": 0, "reason": "array 'model/w' holds NaN or Inf"}],
            }
        )
        recorder.log_eval(
            {
                "round": r,
                "mean_acc": 0.209,
                "worst_acc": 0.2,
                "loss": math.nan,
                "clients_evaluated": 2,
                "clients_expected": 2,
            }
        )
    recorder.finalize()


def test_fedbr_sweep_counts_a_run_that_trained_nothing_as_failed(tmp_path, monkeypatch):
    from fedbr_flwr.commands import sweep

    monkeypatch.setattr(sweep, "run_flower", run_that_trained_nothing)
    cfg = validate({"num-rounds": 2, "num-clients": 2, "output-dir": str(tmp_path / "run")})
    status = sweep.run_all([(Setting("fedavg"), 0, cfg)], quiet=True)
    assert status[(Setting("fedavg"), 0)].startswith("failed: no round trained")


def test_fedbr_run_exits_1_when_no_round_trained(tmp_path, capsys, monkeypatch):
    """The CLI's path with Flower replaced by a run that writes the files of one that trained nothing."""
    monkeypatch.setattr(cli, "run_flower", run_that_trained_nothing)
    out = tmp_path / "run"
    assert cli.main(["num-rounds=2", "num-clients=2", f"output-dir={out}", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "no round trained" in captured.err and captured.err.count("\n") == 1
    assert "20.90" in captured.out  # the files and the table are there, marked
    assert (out / "summary.md").exists()
    assert f"run files: {out} (metrics.jsonl, rounds.jsonl, summary.json, convergence.png)" in captured.out
    (out / "convergence.png").unlink()  # as a run without an evaluation leaves it (this fake writes no manifest)
    cli.print_result(out, "fedbr-run", cli.RUN_FILES)
    assert f"run files: {out} (metrics.jsonl, rounds.jsonl, summary.json)\n" in capsys.readouterr().out


def test_fedbr_deploy_exits_1_when_no_round_trained(tmp_path, capsys):
    from fedbr_flwr.commands import deploy

    out = tmp_path / "run"
    cfg = validate({"num-rounds": 2, "num-clients": 2, "output-dir": str(out)})
    run_that_trained_nothing(RunPlan.of(cfg), None)
    assert deploy._print_result(out) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("fedbr-deploy: error: no round trained") and captured.err.count("\n") == 1


# ---------------------------------------------------------------- 5: an output folder that cannot be written


@pytest.mark.parametrize("where", ["file-in-its-place", "file-in-its-path"])
def test_an_output_dir_blocked_by_a_file_stops_before_flower_with_exit_2(tmp_path, capsys, monkeypatch, where):
    monkeypatch.setattr(cli, "run_flower", no_flower)
    (tmp_path / "blocker").write_text("not a folder")
    out = tmp_path / "blocker" if where == "file-in-its-place" else tmp_path / "blocker" / "run"
    assert cli.main(["num-clients=2", f"output-dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"output-dir {out}" in err and "is a file, not a folder" in err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("where", ["read-only-folder", "under-a-read-only-folder"])
def test_a_read_only_output_dir_stops_before_flower_with_exit_2(tmp_path, capsys, monkeypatch, where):
    monkeypatch.setattr(cli, "run_flower", no_flower)
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked if where == "read-only-folder" else locked / "run"
    locked.chmod(0o555)
    try:
        assert cli.main(["num-clients=2", f"output-dir={out}"]) == 2
    finally:
        locked.chmod(0o755)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"output-dir {out} is not writable" in err


def test_an_output_dir_without_write_permission_stops_before_flower_with_exit_2(tmp_path, capsys, monkeypatch):
    """As root too (where chmod does not stop writes): the probe file's write is refused."""
    import pathlib

    monkeypatch.setattr(cli, "run_flower", no_flower)
    real_write_text = pathlib.Path.write_text

    def refuse_probe(self, *args, **kwargs):
        if self.name == ".fedbr-write-probe":
            raise PermissionError(13, "Permission denied", str(self))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", refuse_probe)
    out = tmp_path / "run"
    assert cli.main(["num-clients=2", f"output-dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"output-dir {out} is not writable (Permission denied" in err


def test_the_output_dir_check_leaves_no_folder_behind(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    assert cli.main(["num-clients=2", f"output-dir={out}", "--dry-run"]) == 0
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- 8: NaN and infinity are written as null


def test_a_diverged_round_is_written_as_strict_json_with_null(tmp_path):
    cfg = validate({"output-dir": str(tmp_path), "num-rounds": 2, "eval-every": 1})
    recorder = RunRecorder(cfg, tmp_path)
    recorder.log_round(
        {
            "round": 1,
            "clients": 2,
            "failures": 0,
            "train": {"loss": math.nan, "grad-norm": math.inf},
            "seconds": 0.1,
            "server": {"drift": -math.inf},
        }
    )
    recorder.log_eval(
        {
            "round": 1,
            "mean_acc": 0.1,
            "worst_acc": 0.1,
            "pooled_acc": 0.1,
            "loss": math.nan,
            "global_acc": 0.1,
            "global_loss": math.inf,
            "train": {"loss": math.nan},
            "per_client_acc": {"0": 0.1},
            "clients_evaluated": 1,
            "clients_expected": 1,
        }
    )
    recorder.log_eval(
        {
            "round": 2,
            "mean_acc": 0.3,
            "worst_acc": 0.2,
            "loss": 1.0,
            "global_acc": None,
            "clients_evaluated": 1,
            "clients_expected": 1,
        }
    )
    recorder.finalize()
    metrics = strict_lines(tmp_path / "metrics.jsonl")
    assert metrics[0]["loss"] is None and metrics[0]["global_loss"] is None and metrics[0]["train"]["loss"] is None
    assert metrics[0]["mean_acc"] == 0.1
    rounds = strict_lines(tmp_path / "rounds.jsonl")
    assert rounds[0]["train"] == {"loss": None, "grad-norm": None} and rounds[0]["server"] == {"drift": None}
    strict_lines(tmp_path / "progress.jsonl")
    summary = strict_json((tmp_path / "summary.json").read_text())
    assert summary["final_mean_acc"] == 0.3
    keep_rounds_up_to(tmp_path / "metrics.jsonl", 1)  # resume keeps null lines like any other
    assert [r["round"] for r in strict_lines(tmp_path / "metrics.jsonl")] == [1]


def test_readers_treat_null_as_missing(tmp_path):
    history = [
        {"round": 1, "mean_acc": None, "worst_acc": None, "loss": None},
        {"round": 2, "mean_acc": 0.4, "worst_acc": None, "pooled_acc": None, "global_acc": None},
        {"round": 3, "mean_acc": 0.5, "worst_acc": 0.3, "global_acc": 0.45},
    ]
    s = summarize(history, 0.45)
    assert s["evaluations"] == 2 and s["best_mean_acc"] == 0.5 and s["worst_acc_best5"] == 0.3
    assert s["rounds_to_target"] == 3 and s["global_acc_best5"] == 0.45
    summary_table(s, "t")
    plot_history(history, tmp_path / "c.png", "t")
    assert (tmp_path / "c.png").stat().st_size > 0


# ---------------------------------------------------------------- 9: evaluations some client missed


def test_an_evaluation_line_says_whether_every_client_was_evaluated():
    complete = eval_record(2, [(0, 1.0, 20, 0.2), (1, 1.0, 20, 0.4)], 0, [0, 1], {}, {})
    partial = eval_record(2, [(1, 1.0, 20, 0.269)], 1, [0, 1], {}, {})
    assert (complete["clients_evaluated"], complete["clients_expected"]) == (2, 2)
    assert (partial["clients_evaluated"], partial["clients_expected"]) == (1, 2)
    assert partial["eval_failed_clients"] == [0]


def test_a_partial_evaluation_is_flagged_and_never_the_best(tmp_path):
    strategy, proxies = small_run(tmp_path, **{"num-rounds": 3})
    play_round(strategy, proxies, 1, [1.0, 3.0], [0.20, 0.22])
    play_round(strategy, proxies, 2, [1.0, 3.0], [None, 0.269])  # 1 of 2 clients answered: 26.9% over one
    play_round(strategy, proxies, 3, [1.0, 3.0], [0.24, 0.25])
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["clients_evaluated"], r["clients_expected"]) for r in lines] == [(2, 2), (1, 2), (2, 2)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["evaluations"] == 3 and summary["complete_evaluations"] == 2
    assert summary["partial_evaluations"] == [2]
    assert summary["best_mean_acc"] == pytest.approx(0.245)
    assert summary["mean_acc_best5"] == pytest.approx((0.21 + 0.245) / 2)
    assert summary["worst_acc_best5"] == pytest.approx((0.20 + 0.24) / 2)
    md = (tmp_path / "summary.md").read_text()
    assert "evaluations missing a client (not counted) | 1: round 2" in md
    events = strict_lines(tmp_path / "progress.jsonl")
    assert any("PARTIAL: 1 of 2 clients" in e["message"] for e in events if e.get("round") == 2)


def test_a_partial_last_evaluation_leaves_the_final_figures_to_the_last_complete_one():
    history = [
        {"round": 2, "mean_acc": 0.3, "worst_acc": 0.2, "clients_evaluated": 2, "clients_expected": 2},
        {"round": 4, "mean_acc": 0.9, "worst_acc": 0.9, "clients_evaluated": 1, "clients_expected": 2},
    ]
    s = summarize(history, 0.5)
    assert s["final_round"] == 2 and s["final_mean_acc"] == 0.3 and s["last_round"] == 4
    assert s["rounds_to_target"] is None  # only the partial evaluation reached it
    assert "round 2" in summary_table(s)


def test_no_complete_evaluation_is_said_and_gives_no_figures():
    history = [{"round": 2, "mean_acc": 0.269, "worst_acc": 0.269, "eval_failures": 1}]  # a line of before
    s = summarize(history, 0.5)
    assert s["complete_evaluations"] == 0 and s["partial_evaluations"] == [2]
    assert s["best_mean_acc"] is None and s["mean_acc_best5"] is None and s["final_mean_acc"] is None
    assert "no complete evaluation" in summary_table(s)


def test_the_manifest_commit_is_fedbr_commit_where_it_is_set(monkeypatch, tmp_path):
    """A copy of the tree on another machine may carry a .git that is not its own: FEDBR_COMMIT names the commit;
    unset, the commit is the checkout's HEAD (a 40-digit hash), and outside any checkout it is empty."""
    from fedbr_flwr.runfiles.run_io import git_commit

    monkeypatch.delenv("FEDBR_COMMIT", raising=False)
    assert len(git_commit().removesuffix("-dirty")) == 40
    assert git_commit(tmp_path) == ""
    monkeypatch.setenv("FEDBR_COMMIT", "d98afd8")
    assert git_commit() == git_commit(tmp_path) == "d98afd8"


@pytest.mark.parametrize("before", ["", '{"kind": "round", "message": "round 1"}\n', '{"kind": "round", "mess'])
def test_an_event_after_a_line_cut_short_is_read(tmp_path, before):
    """A run killed as it wrote an event left half a line; the resumed run's first event joined it, and
    readers skipped both as one line that is not JSON."""
    from fedbr_flwr.runfiles.progress import append_event

    path = tmp_path / "progress.jsonl"
    path.write_text(before)
    append_event(path, "info", "resumed")
    events, offset = read_events(path)
    assert [e["message"] for e in events] == ["round 1"] * ("message" in before) + ["resumed"]
    assert offset == path.stat().st_size


@pytest.mark.parametrize("name", ["summary.md", "convergence.png"])
def test_the_end_of_a_run_replaces_its_files_whole(tmp_path, monkeypatch, name):
    """summary.md and convergence.png were written in place: a run killed as it wrote them (its plot takes a
    second) left half a file. A rename that fails stands for the kill: the old file stays whole."""
    strategy, proxies = small_run(tmp_path, **{"num-rounds": 1})
    (tmp_path / name).write_bytes(b"the old file")
    stop_as_it_replaces(monkeypatch, name)
    with pytest.raises(KeyboardInterrupt):
        play_round(strategy, proxies, 1, [1.0, 3.0], [0.3, 0.4])
    assert (tmp_path / name).read_bytes() == b"the old file"
    assert not list(tmp_path.glob(".*.tmp"))
