"""Experiment tracking (tracking = tensorboard / wandb): in-process federations stopped after round 3 and
resumed from their round-2 checkpoint, read back with TensorBoard's own event reader and W&B's own record
format: every round once, with the values of metrics.jsonl and rounds.jsonl."""

import numpy as np
import pytest

from fedbr_flwr.app.checkpointing import ResumedRun
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.launch.plan import config_from_settings
from fedbr_flwr.runfiles import tracking
from fedbr_flwr.runfiles.metrics import read_jsonl
from fedbr_flwr.runfiles.progress import read_events
from fedbr_flwr.runfiles.run_io import RunRecorder

from fakes import in_process_federation, run_rounds


def run_cfg(**extra):
    return validate(
        {
            "num-clients": 3,
            "local-steps": 2,
            "batch-size": 8,
            "num-rounds": 4,
            "eval-every": 1,
            "checkpoint-every": 2,
            "global-test": False,
            "model": "cnn-small",
            **extra,
        }
    )


def stopped_and_resumed(cfg, out):
    """3 rounds (the checkpoint is at round 2), then the run resumed by new objects to round 4."""
    first, _, proxies = in_process_federation(cfg, out)
    run_rounds(first, proxies, 3)
    resumed, _, proxies = in_process_federation({**cfg, "resume": True}, out)
    run_rounds(ResumedRun(resumed, 2), proxies, 2)


def expected_curves(out):
    """tag -> [(round, value)] as metrics.jsonl and rounds.jsonl hold them (after the resume rewrote them)."""
    curves = {}
    for record in read_jsonl(out / "rounds.jsonl"):
        values = {
            **{f"train/{k}": v for k, v in record["train"].items()},
            **{f"server/{k}": v for k, v in record.get("server", {}).items()},
            "round/seconds": record["seconds"],
            "round/bytes_up": record["bytes_up"],
            "round/clients": record["clients"],
        }
        for tag, value in values.items():
            curves.setdefault(tag, []).append((record["round"], value))
    for record in read_jsonl(out / "metrics.jsonl"):
        for key in ("mean_acc", "worst_acc", "pooled_acc", "loss", "wall_time"):
            curves.setdefault(f"eval/{key}", []).append((record["round"], record[key]))
    return curves


def test_tensorboard_holds_every_round_once_with_the_values_of_the_run_files(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed here")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    stopped_and_resumed(run_cfg(strategy="fedbr", tracking="tensorboard"), out)

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    expected = expected_curves(out)
    assert "train/con-cos-pos" in expected and "train/head-update-norm" in expected  # FedBR's diagnostics
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(step, float(np.float32(value))) for step, value in points], tag
    histograms = events.Histograms("eval/per_client_acc")
    assert [h.step for h in histograms] == [1, 2, 3, 4]
    assert all(h.histogram_value.num == 3 for h in histograms)  # one accuracy per client
    assert "_hparams_/experiment" in events.Tags()["tensors"] or events.PluginTagToContent("hparams")


wandb_records = tracking.wandb_log_records


def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed here")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")


def wandb_history(out, rows=4):
    """Every history row of the run folder's W&B files (its offline runs), by key, once they hold ``rows`` rows or
    after 30 s: W&B's finish returns before its service has written the last records to the file."""
    import json
    import time

    deadline = time.monotonic() + 30
    while True:
        files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
        history = [
            {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for f in files
            for r in wandb_records(f)
            if r.WhichOneof("record_type") == "history"
        ]
        if len(history) >= rows or time.monotonic() > deadline:
            return history
        time.sleep(0.1)


def test_wandb_offline_history_holds_every_round_once_with_the_values_of_the_run_files(tmp_path, monkeypatch):
    offline_wandb(tmp_path, monkeypatch)
    out = tmp_path / "sweep" / "FedAvg" / "seed0"
    out.mkdir(parents=True)
    tracking.label_sweep_run(out, "sweep", "FedAvg/seed0", ["FedAvg", "seed0"])
    stopped_and_resumed(run_cfg(tracking="wandb"), out)

    history = wandb_history(out)
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # the run, and its resumed part under the same id
    records = [r for f in files for r in wandb_records(f)]
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {(r.run_id, r.run_group, r.display_name, tuple(r.tags)) for r in runs} == {
        (tracking.read_state(out)["wandb_id"], "sweep", "FedAvg/seed0", ("FedAvg", "seed0"))
    }
    assert [row["_step"] for row in history] == [1, 2, 3, 4]
    by_step = {row["_step"]: row for row in history}
    for tag, points in expected_curves(out).items():
        if tag in ("round/seconds", "eval/wall_time"):  # round 3 is measured again after the resume
            continue
        assert [(step, by_step[step][tag]) for step, _ in points] == points, tag
    assert all(by_step[step]["eval/per_client_acc/_type"] == "histogram" for step in by_step)


def test_a_resume_logs_again_the_rounds_a_killed_process_handed_wandb_but_it_never_wrote(tmp_path, monkeypatch):
    """W&B writes its files every 15 s: a process killed sooner leaves them without the rounds it handed W&B, which
    tracking.json counts as logged. The resume logs those from the run files (up to its checkpoint), then its own."""
    offline_wandb(tmp_path, monkeypatch)
    import wandb

    class KilledBeforeItWrote:  # a W&B run handed every round, of a process killed before W&B wrote any
        def log(self, *args, **kwargs):
            pass

        def finish(self):
            pass

    out = tmp_path / "run"
    cfg = run_cfg(tracking="wandb")
    with monkeypatch.context() as patched:
        patched.setattr(wandb, "init", lambda **kwargs: KilledBeforeItWrote())
        first, _, proxies = in_process_federation(cfg, out)
        run_rounds(first, proxies, 3)
        first.recorder.tracking.stop()
    assert tracking.read_state(out)["wandb_step"] == 3
    assert tracking.written_step(out, tracking.read_state(out)["wandb_id"]) == 0
    resumed, _, proxies = in_process_federation({**cfg, "resume": True}, out)
    run_rounds(ResumedRun(resumed, 2), proxies, 2)

    history = wandb_history(out)
    assert [row["_step"] for row in history] == [1, 2, 3, 4]
    by_step = {row["_step"]: row for row in history}
    for tag, points in expected_curves(out).items():  # timings too: each round's are those of the run files
        assert [(step, by_step[step][tag]) for step, _ in points] == points, tag


def test_wandbs_files_read_up_to_where_a_killed_writer_stopped(tmp_path, monkeypatch):
    """Cut anywhere, a transaction log gives the rounds it holds whole; a file of another format gives None (then
    tracking.json's count stands)."""
    offline_wandb(tmp_path, monkeypatch)
    trackers = tracking.Tracking(validate({"tracking": "wandb"}), tmp_path, None, warn=print)
    for round_ in (1, 2, 3):
        trackers.log_round({"round": round_, "train": {f"m{i}": i / round_ for i in range(3000)}})  # 3 blocks each
        trackers.flush()
    trackers.close()
    assert len(wandb_history(tmp_path, rows=3)) == 3  # written
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    run_id, whole = log.stem[4:], log.read_bytes()
    assert tracking.written_step(tmp_path, run_id) == 3
    held = []
    for cut in range(7, len(whole) + 1, 211):
        log.write_bytes(whole[:cut])
        held.append(tracking.written_step(tmp_path, run_id))
    assert held == sorted(held) and held[0] == 0 and set(held) == {0, 1, 2, 3}
    log.write_bytes(b"PK\x03\x04" + whole[4:])
    assert tracking.written_step(tmp_path, run_id) is None


def test_wandbs_files_read_up_to_a_record_that_was_written_torn(tmp_path):
    """A chunk of the full length whose bytes never reached the disk whole ends the log there."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed here")
    import struct

    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    record.history.step.num = 5
    body = record.SerializeToString()
    chunk = lambda data: struct.pack("<IHB", 0, len(data), 1) + data  # noqa: E731  (a FULL chunk)
    (tmp_path / "wandb" / "offline-run-x-abcd").mkdir(parents=True)
    log = tmp_path / "wandb" / "offline-run-x-abcd" / "run-abcd.wandb"
    log.write_bytes(b":W&B\xe1\xbe\x00" + chunk(body) + chunk(b"\xff" * 40) + chunk(body))
    assert [r.history.step.num for r in tracking.wandb_log_records(log)] == [5]


def test_a_run_that_adds_its_trackers_on_resume_logs_its_earlier_rounds_from_the_run_files(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed here")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    offline_wandb(tmp_path, monkeypatch)
    out = tmp_path / "run"
    first, _, proxies = in_process_federation(run_cfg(), out)
    run_rounds(first, proxies, 3)
    resumed, _, proxies = in_process_federation({**run_cfg(tracking="tensorboard,wandb"), "resume": True}, out)
    run_rounds(ResumedRun(resumed, 2), proxies, 2)

    assert [row["_step"] for row in wandb_history(out)] == [1, 2, 3, 4]
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag, points in expected_curves(out).items():
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(r, float(np.float32(v))) for r, v in points], tag


def test_an_unavailable_extra_stops_before_the_run_with_the_command_to_install_it(monkeypatch):
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as exc:
        config_from_settings({"tracking": "tensorboard"})
    assert str(exc.value) == 'tracking=tensorboard needs the tensorboard extra: pip install -e ".[tensorboard]"'
    assert config_from_settings({})["tracking"] == "none"
    with pytest.raises(ConfigError, match="tracking' = 'tensorbord' must be none or a comma-separated list"):
        validate({"tracking": "tensorbord"})


def test_a_failing_tracker_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    class FullDisk:
        def __init__(self, *args):
            pass

        def log(self, *args):
            raise OSError(28, "No space left on device")

        def close(self):
            raise AssertionError("a tracker that failed is not used again")

    monkeypatch.setitem(tracking.OPENERS, "tensorboard", FullDisk)
    cfg = run_cfg(tracking="tensorboard", **{"num-rounds": 2})
    strategy, _, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy, proxies, 2)

    events, _ = read_events(tmp_path / "progress.jsonl")
    warnings = [e["message"] for e in events if e["kind"] == "warning"]
    assert warnings == [
        "tracking: tensorboard failed (OSError: [Errno 28] No space left on device); the run goes on without it"
    ]
    assert [r["round"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "summary.md").exists()


def test_a_tracker_that_cannot_start_is_one_warning(tmp_path, monkeypatch):
    def unreachable(*args):
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setitem(tracking.OPENERS, "wandb", unreachable)
    recorder = RunRecorder(run_cfg(tracking="wandb"), tmp_path)
    recorder.log_round({"round": 1, "train": {"loss": 0.5}, "seconds": 0.1})
    events, _ = read_events(tmp_path / "progress.jsonl")
    assert [e["message"] for e in events if e["kind"] == "warning"] == [
        "tracking: wandb failed (ConnectionError: api.wandb.ai unreachable); the run goes on without it"
    ]


def test_a_sweep_labels_each_run_for_its_wandb_group_before_it_runs(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed here")
    from fedbr_flwr.commands import sweep
    from fedbr_flwr.commands.report import Setting

    seen = {}

    def run_flower(plan, **kwargs):
        seen[plan.out_dir.relative_to(tmp_path).as_posix()] = tracking.read_state(plan.out_dir)

    monkeypatch.setattr(sweep, "run_flower", run_flower)
    out = tmp_path / "mysweep"
    jobs = [
        (setting, seed, validate({"tracking": "wandb", "num-clients": 2, "output-dir": str(setting.folder(out, seed))}))
        for setting in (Setting("FedAvg"), Setting("FedBR", (("lr", 0.01),)))
        for seed in (0, 1)
    ]
    sweep.run_all(jobs, quiet=True, isolated=True, out=out)
    assert seen == {
        f"mysweep/{name}/seed{seed}": {"group": "mysweep", "name": f"{name}/seed{seed}", "tags": [label, f"seed{seed}"]}
        for name, label in (("FedAvg", "FedAvg"), ("FedBR/lr=0.01", "FedBR lr=0.01"))
        for seed in (0, 1)
    }


def test_wandb_run_group_in_the_environment_names_the_group_of_a_sweeps_runs(tmp_path, monkeypatch):
    """W&B's own WANDB_RUN_GROUP wins over the sweep folder's name, which two sweeps in runs/a/x and runs/b/x share."""
    wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed here")
    opened = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: opened.append(kwargs))
    tracking.label_sweep_run(tmp_path, "mysweep", "FedAvg/seed0", ["FedAvg", "seed0"])
    tracking.WandbSink(validate({"tracking": "wandb"}), tmp_path, None)
    monkeypatch.setenv("WANDB_RUN_GROUP", "exp1")
    tracking.WandbSink(validate({"tracking": "wandb"}), tmp_path, None)
    assert [(kwargs["group"], kwargs["name"]) for kwargs in opened] == [
        ("mysweep", "FedAvg/seed0"),
        ("exp1", "FedAvg/seed0"),
    ]


class HeldStepRun:
    """W&B's rule for a step: held in the process until it is committed or a later step is logged; a run stopped
    then (a time limit, SIGTERM) loses it."""

    def __init__(self):
        self.committed, self.held = [], None

    def log(self, data, step, commit=None):
        if self.held is not None and step != self.held[0]:
            self.committed.append(self.held)
            self.held = None
        self.held = (step, {**(self.held or (step, {}))[1], **data})
        if commit:
            self.committed.append(self.held)
            self.held = None

    def finish(self):
        if self.held is not None:  # what it holds is written
            self.committed.append(self.held)
        self.held, self.finished = None, True


def test_each_round_reaches_wandb_before_its_checkpoint_and_only_then_counts_as_logged(tmp_path, monkeypatch):
    """A run stopped right after round 2's checkpoint had round 2 held by W&B and counted as logged: it was
    lost, and its resume skipped it. Now each round (its training and evaluation) is one committed step when it
    ends; a round not yet ended is not counted, so a resume logs it again."""
    wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed here")
    run = HeldStepRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    cfg = run_cfg(tracking="wandb", **{"checkpoint-every": 1})
    strategy, _, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy, proxies, 2)  # stopped after round 2's checkpoint: the process ends without a word
    assert [step for step, _ in run.committed] == [1, 2] and run.held is None
    assert {"train/loss", "eval/mean_acc"} <= set(run.committed[1][1])
    assert tracking.read_state(tmp_path)["wandb_step"] == 2

    resumed = tracking.Tracking(cfg, tmp_path, resume_round=2, warn=print)
    resumed.log_round({"round": 3, "train": {"loss": 1.0}})
    assert tracking.read_state(tmp_path)["wandb_step"] == 2  # round 3 has not ended: a resume logs it again
    assert resumed in tracking.OPEN
    tracking.stop_open_trackers()  # the process is stopped in round 3: W&B finishes without it
    assert run.finished and [step for step, _ in run.committed] == [1, 2]
    assert resumed not in tracking.OPEN and tracking.read_state(tmp_path)["wandb_step"] == 2


STOPPED_WHILE_TRACKING = """
import signal, sys, time
from pathlib import Path
from fedbr_flwr.core.config import validate
from fedbr_flwr.launch import simulation
from fedbr_flwr.runfiles.tracking import Tracking

signal.signal(signal.SIGTERM, simulation.stop_on_sigterm)  # as the simulation process does
trackers = Tracking(validate({"tracking": "wandb"}), Path(sys.argv[1]), None, warn=print)
for round_ in (1, 2):
    trackers.log_round({"round": round_, "train": {"loss": 1.0 / round_}})
    trackers.flush()  # the round ended
trackers.log_round({"round": 3, "train": {"loss": 0.3}})
print("ready", flush=True)
time.sleep(300)
"""


def test_a_stopped_simulation_process_finishes_wandb_with_the_rounds_that_ended(tmp_path, monkeypatch):
    """The launcher stops a run's simulation process (a time limit, SIGTERM): W&B, which writes what it was handed
    to its files only every 15 s and when its run finishes, keeps rounds 1 and 2 (they ended) and not round 3 (its
    resume logs it again)."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed here")
    import subprocess
    import sys

    from fedbr_flwr.launch.launcher import TRACKERS_STOP_S, stop_tree

    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_WHILE_TRACKING, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        stop_tree(proc, grace_s=0.5, first_s=TRACKERS_STOP_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    records = [r for f in (out / "wandb").glob("offline-run-*/run-*.wandb") for r in wandb_records(f)]
    assert [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"] == [1, 2]
    assert tracking.read_state(out)["wandb_step"] == 2


def test_a_run_started_again_in_its_folder_leaves_nothing_of_the_old_runs_trackers(tmp_path):
    """--overwrite: the old run's TensorBoard curves and W&B files would show as the new run's (a sweep folder's
    TensorBoard, `wandb sync`), and its W&B id would be reopened; a sweep's labels for the new run stay."""
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1").write_bytes(b"old")
    (tmp_path / "wandb" / "offline-run-1-abcd").mkdir(parents=True)
    tracking.write_state(tmp_path, {"wandb_id": "abcd", "wandb_step": 9, "group": "s", "name": "A/seed0", "tags": []})
    RunRecorder(run_cfg(), tmp_path)
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()
    assert tracking.read_state(tmp_path) == {"group": "s", "name": "A/seed0", "tags": []}
    (tmp_path / "wandb").mkdir()
    tracking.write_state(tmp_path, {"wandb_id": "ef01", "wandb_step": 2})
    RunRecorder(run_cfg(), tmp_path, resume_round=2)  # a resume keeps them
    assert (tmp_path / "wandb").exists() and tracking.read_state(tmp_path)["wandb_id"] == "ef01"


def test_per_client_accuracies_are_one_histogram_of_the_finite_ones_and_no_curves():
    record = {"round": 3, "mean_acc": 0.5, "per_client_acc": {"0": 0.25, "1": float("nan"), "2": 0.75}}
    assert tracking.eval_scalars(record) == {"eval/mean_acc": 0.5}
    assert tracking.eval_histograms(record) == {"eval/per_client_acc": [0.25, 0.75]}


def test_a_sweep_labelling_a_run_it_continues_keeps_its_wandb_run(tmp_path):
    """A paused seed's W&B id and step stay, so its resume continues the same W&B run."""
    tracking.write_state(tmp_path, {"wandb_id": "abcd1234", "wandb_step": 3})
    tracking.label_sweep_run(tmp_path, "mysweep", "FedAvg/seed0", ["FedAvg", "seed0"])
    assert tracking.read_state(tmp_path) == {
        "wandb_id": "abcd1234",
        "wandb_step": 3,
        "group": "mysweep",
        "name": "FedAvg/seed0",
        "tags": ["FedAvg", "seed0"],
    }
