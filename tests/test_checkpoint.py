"""Checkpoint and resume, driven in-process: a run stopped after round 3 and resumed from its round-2
checkpoint, with fresh strategy and client objects (as after a crash: no Flower state survives),
must end with exactly the weights and metric lines of a run never stopped."""

import json
import re

import numpy as np
import pytest

from fedbr_flwr.app import payload
from fedbr_flwr.app.checkpointing import ResumedRun
from fedbr_flwr.app.server_app import check_resumable
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.runfiles import codec
from fedbr_flwr.runfiles.checkpoint import (
    CHECKPOINT_NAME,
    checkpoint_header,
    checkpoint_round,
    load_checkpoint,
    save_checkpoint,
)
from fedbr_flwr.runfiles.run_io import keep_rounds_up_to

from fakes import in_process_federation, records_without_timing, run_rounds


def run_cfg(name, **extra):
    return validate(
        {
            "strategy": name,
            "num-clients": 3,
            "local-steps": 2,
            "batch-size": 8,
            "num-rounds": 4,
            "eval-every": 2,
            "checkpoint-every": 2,
            "global-test": False,
            "model": "cnn-small",  # what a checkpoint carries does not depend on the backbone's size
            **extra,
        }
    )


# every piece of state a checkpoint must carry: server (SCAFFOLD c, FedCM Delta, GroupDRO p, DisTrans
# offsets and network, broadcast data) and client (SCAFFOLD c_i, MOON's last model, DisTrans offset)
@pytest.mark.parametrize(
    "name, extra",
    [
        ("fedavg", {"global-test": True}),
        ("scaffold", {}),
        ("fedcm", {}),
        ("groupdro", {}),
        ("moon", {}),
        ("distrans", {"distrans-agg": "nn"}),
        ("distrans", {"distrans-agg": "none"}),
        ("fedbr", {}),
        ("fedbr", {"fedbr-with": "fedcm", "pseudo-refresh": "every-round"}),
        ("fedmix", {}),
        ("vhl", {"vhl-size": 50}),
    ],
)
def test_resumed_run_ends_exactly_like_an_uninterrupted_one(tmp_path, name, extra):
    cfg = run_cfg(name, **extra)
    straight, _, proxies = in_process_federation(cfg, tmp_path / "straight")
    expected = list(payload.from_parameters(run_rounds(straight, proxies, 4)).values())

    first, _, proxies = in_process_federation(cfg, tmp_path / "stopped")
    run_rounds(first, proxies, 3)  # "killed" after round 3: its lines are in the files, its checkpoint is not
    assert load_checkpoint(tmp_path / "stopped")[1]["round"] == 2

    resumed, clients, proxies = in_process_federation({**cfg, "resume": True}, tmp_path / "stopped")
    assert resumed.resumed_round == 2
    final = list(payload.from_parameters(run_rounds(ResumedRun(resumed, 2), proxies, 2)).values())

    assert len(final) == len(expected)
    for got, want in zip(final, expected):
        np.testing.assert_array_equal(got, want)
    for file in ("metrics.jsonl", "rounds.jsonl"):
        stopped, straight = tmp_path / "stopped" / file, tmp_path / "straight" / file
        assert records_without_timing(stopped) == records_without_timing(straight)
    manifest = json.loads((tmp_path / "stopped" / "manifest.json").read_text())
    assert [r["after_round"] for r in manifest["resumed"]] == [2]
    assert manifest["resumed"][0]["host"].keys() == manifest["host"].keys()  # the piece names its machine


def test_client_state_is_collected_at_checkpoints_and_handed_back_once(tmp_path):
    cfg = run_cfg("scaffold")
    strategy, clients, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy, proxies, 2)
    arrays, _ = load_checkpoint(tmp_path)
    saved = codec.decode(arrays["client-state/1"].tobytes())
    live = clients[1].state.arrays("scaffold-control")
    assert sorted(saved) == sorted(f"scaffold-control/{name}" for name in live)
    assert all(np.array_equal(saved[f"scaffold-control/{name}"], a) for name, a in live.items())

    resumed, fresh, proxies = in_process_federation({**cfg, "resume": True}, tmp_path)
    ins = ResumedRun(resumed, 2).configure_fit(1, resumed.initialize_parameters(None), None)
    assert all("client-state" in fit_ins.config for _, fit_ins in ins)
    assert fresh[1].state.arrays("scaffold-control") is None  # a new run: Flower's node state is empty
    fresh[1].restore_state(ins[1][1].config)
    restored = fresh[1].state.arrays("scaffold-control")
    assert sorted(restored) == sorted(live) and all(np.array_equal(restored[k], live[k]) for k in live)
    # applied once: a resend must not roll the client back
    name = next(iter(live))
    fresh[1].restore_state({"client-state": codec.encode({f"scaffold-control/{name}": np.zeros(1)})})
    assert all(np.array_equal(fresh[1].state.arrays("scaffold-control")[k], live[k]) for k in live)
    # once a client has answered, the server stops sending its state
    resumed.aggregate_fit(3, [(proxies[1], proxies[1].fit(ins[1][1], None, 3))], [])
    assert 1 not in resumed.checkpointer.pending and 0 in resumed.checkpointer.pending


def test_checkpoint_replaces_atomically_and_reads_back(tmp_path):
    save_checkpoint(tmp_path, {"a": np.arange(3)}, {"round": 1, "config": {}})
    save_checkpoint(tmp_path, {"a": np.arange(4)}, {"round": 2, "config": {}})
    arrays, header = load_checkpoint(tmp_path)
    assert header["round"] == 2 and arrays["a"].tolist() == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]  # no temporary left behind


def test_no_array_may_take_the_checkpoint_header_s_name(tmp_path):
    with pytest.raises(ValueError, match="reserved for the checkpoint header"):
        save_checkpoint(tmp_path, {"__header__": np.zeros(2)}, {"round": 1, "config": {}})
    assert not (tmp_path / CHECKPOINT_NAME).exists()


def test_the_rng_state_a_checkpoint_holds_sets_torch_and_numpy_back(tmp_path):
    """numpy's global state with a cached Gaussian too (its draws come from it first)."""
    import torch

    from fedbr_flwr.runfiles.checkpoint import rng_state, set_rng_state

    np.random.standard_normal()  # leaves the second Gaussian of a pair cached
    save_checkpoint(tmp_path, rng_state(), {"round": 1, "config": {}})
    drawn = np.random.standard_normal(3), np.random.random(3), torch.rand(3)
    set_rng_state(load_checkpoint(tmp_path)[0])
    again = np.random.standard_normal(3), np.random.random(3), torch.rand(3)
    assert all(np.array_equal(a, b) for a, b in zip(drawn, again))


def test_a_checkpoint_of_another_algorithm_or_format_stops_with_a_clear_message(tmp_path):
    cfg = run_cfg("fedavg")
    save_checkpoint(tmp_path, {"global/model/other": np.zeros(2)}, {"round": 2, "config": cfg, "elapsed": 0.0})
    (tmp_path / "rounds.jsonl").write_text('{"round": 1}\n{"round": 2}\n')  # the records are whole
    (tmp_path / "metrics.jsonl").write_text('{"round": 2}\n')
    with pytest.raises(ConfigError, match="has no global array model/"):
        in_process_federation({**cfg, "resume": True}, tmp_path)
    arrays, header = load_checkpoint(tmp_path)
    codec.write(tmp_path / CHECKPOINT_NAME, {"__header__": np.frombuffer(b'{"format": 1}', np.uint8)})
    with pytest.raises(ConfigError, match="has format 1, this code reads 2"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "header, message",
    [
        (b"[2]", "a header that is not a JSON object"),
        (b'{"format": 2, "config": {}}', "header whose round is None, not a whole number >= 0"),
        (b'{"format": 2, "round": "two", "config": {}}', "header whose round is 'two'"),
        (b'{"format": 2, "round": 2, "config": [1]}', "header whose config is [1], not a mapping of keys"),
        (b'{"format": 2, "round": 2, "config": {}, "elapsed": "x"}', "header whose elapsed is 'x'"),
        (b'{"format": 2, "round": 2, "config": {}, "elapsed": true}', "header whose elapsed is True"),
    ],
)
def test_a_checkpoint_header_a_resume_cannot_read_is_one_clear_message(tmp_path, header, message):
    """Each raised KeyError, ValueError, TypeError or AttributeError out of fedbr-run --resume and the report."""
    codec.write(tmp_path / CHECKPOINT_NAME, {"__header__": np.frombuffer(header, np.uint8)})
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_checkpoint(tmp_path)


def test_a_checkpoints_header_is_read_without_its_arrays(tmp_path):
    """The report, a sweep's check before its runs and a time limit's watch read the round and config only, not
    arrays that may be gigabytes; the resume reads them all, and finds one damaged."""
    save_checkpoint(tmp_path, {"a": np.full(1000, 7, np.uint8)}, {"round": 3, "config": {}})
    path = tmp_path / CHECKPOINT_NAME
    data = path.read_bytes()
    at = data.index(b"\x07" * 1000)
    path.write_bytes(data[:at] + b"\x08" + data[at + 1 :])  # its CRC no longer matches
    assert checkpoint_round(tmp_path) == 3 and checkpoint_header(tmp_path)["round"] == 3
    with pytest.raises(ConfigError, match="damaged or truncated"):
        load_checkpoint(tmp_path)


def test_missing_or_corrupt_checkpoint_stops_with_a_clear_message(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint to resume from"):
        load_checkpoint(tmp_path)
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"not a zip file")
    with pytest.raises(ConfigError, match="damaged or truncated"):
        load_checkpoint(tmp_path)
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"")
    with pytest.raises(ConfigError, match=r"damaged or truncated \(the file is empty\)"):
        load_checkpoint(tmp_path)


def test_an_npz_of_another_program_or_one_that_cannot_be_read_is_named_as_such(tmp_path, monkeypatch):
    from fedbr_flwr.runfiles import checkpoint

    codec.write(tmp_path / CHECKPOINT_NAME, {"weights": np.zeros(2)})
    with pytest.raises(ConfigError, match="is not a checkpoint of this project"):
        load_checkpoint(tmp_path)

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint, "open", denied, raising=False)  # chmod would not stop root reading it
    with pytest.raises(ConfigError, match="cannot be read: Permission denied"):
        load_checkpoint(tmp_path)


def test_resume_refuses_a_changed_config_or_nothing_left_to_do():
    saved = run_cfg("fedavg")
    check_resumable(saved, {**saved, "num-rounds": 10, "resume": True}, 2)
    with pytest.raises(ConfigError, match="lr = 0.05 in the checkpoint, 0.1 now"):
        check_resumable(saved, {**saved, "lr": 0.1}, 2)
    with pytest.raises(ConfigError, match="nothing to resume"):
        check_resumable(saved, saved, 4)


def test_resume_takes_a_key_the_checkpoint_predates_as_its_default():
    """A checkpoint of an earlier version lacks a key added since: that run ran as the key's default, so a resume
    that sets it otherwise changes the run (it was let through)."""
    now = run_cfg("fedavg", **{"attack": "scale", "attack-ids": "0", "num-rounds": 10})
    saved = {k: v for k, v in now.items() if k != "attack-arrays"}
    check_resumable(saved, now, 2)
    with pytest.raises(ConfigError, match=r"\(attack-arrays = 'model' in the checkpoint, 'all' now\)"):
        check_resumable(saved, {**now, "attack-arrays": "all"}, 2)


def test_line_files_keep_rounds_up_to_the_checkpoint_and_drop_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n{"round": 2}\n{"round": 3}\n{"rou')
    keep_rounds_up_to(path, 2)
    assert path.read_text() == '{"round": 1}\n{"round": 2}\n'


def damaged_run(tmp_path, rounds, metrics='{"round": 2}\n', manifest="{}"):
    """A run folder checkpointed after round 3 whose line files and manifest hold these texts."""
    config = validate({"num-rounds": 4, "output-dir": str(tmp_path)})
    save_checkpoint(tmp_path, {"global/w": np.ones(3, np.float32)}, {"round": 3, "config": config})
    for name, text in (("rounds.jsonl", rounds), ("metrics.jsonl", metrics), ("manifest.json", manifest)):
        (tmp_path / name).write_text(text)
    return tmp_path


WHOLE = '{"round": 1}\n{"round": 2}\n{"round": 3}\n'


@pytest.mark.parametrize(
    "rounds, metrics, manifest, problem",
    [
        ('{"round": 1}\n{"round": 3}\n', '{"round": 2}\n', "{}", "no record of round 2 (1 of the 3 rounds"),
        ("", "", "{}", "no record of round 1 (3 of the 3 rounds"),
        (WHOLE, 'x\n{"round": 2}\n', "{}", "line 1 of metrics.jsonl is not a record of a round"),
        (WHOLE + '{"round": "4"}\n{"round": 5}\n', "", "{}", "line 4 of rounds.jsonl is not a record"),
        (WHOLE + "{not json}\n", "", "{}", "line 4 of rounds.jsonl is not a record"),
        (WHOLE + '{"round": true}\n', "", "{}", "line 4 of rounds.jsonl is not a record"),
        ('{"round": 1}\nx\n{"round": 2}\n{"round": 3}\n{"rou', "", "{}", "line 2 of rounds.jsonl is not a record"),
        (WHOLE, "", "[1, 2]", "manifest.json is not a JSON object"),
        (WHOLE, "", "{not json", "manifest.json is not a JSON object"),
        (
            WHOLE,
            "",
            '{"config": {"lr": 0.5}}',
            "its checkpoint is of another run than its manifest.json (lr = 0.05 in the checkpoint, 0.5 in the",
        ),
    ],
    ids=[
        "gap",
        "emptied",
        "garbage-line",
        "round-not-a-number",
        "ended-garbage-last-line",
        "round-true",
        "garbage-line-before-a-torn-last-one",
        "manifest-list",
        "manifest-torn",
        "other-run",
    ],
)
def test_a_resume_over_damaged_records_stops_with_one_line_and_writes_nothing(
    tmp_path, rounds, metrics, manifest, problem
):
    from fedbr_flwr.launch.plan import resume_config

    out = damaged_run(tmp_path, rounds, metrics, manifest)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ConfigError, match=re.escape(problem)) as e:
        resume_config(out, [])
    assert "\n" not in str(e.value) and "start the run again with --overwrite" in str(e.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_manifest_of_the_same_run_may_differ_in_what_a_resume_may_change(tmp_path):
    """Its latest piece raised num-rounds and moved the folder; its start used another lr (the latest counts)."""
    from fedbr_flwr.launch.plan import resume_config

    piece = {"config": {"num-rounds": 9, "output-dir": "/moved", "lr": 0.05}}
    out = damaged_run(tmp_path, WHOLE, manifest=json.dumps({"config": {"lr": 0.5}, "resumed": [piece]}))
    assert resume_config(out, [])["lr"] == 0.05


def test_a_resume_cannot_move_its_run_to_another_output_dir(tmp_path):
    from fedbr_flwr.launch.plan import resume_config

    (tmp_path / "run").mkdir()
    out = damaged_run(tmp_path / "run", WHOLE)
    assert resume_config(out, [f"output-dir={out}"])["output-dir"] == str(out.resolve())  # its own: fine
    with pytest.raises(ConfigError, match="continues the run in its own folder.*output-dir cannot move it"):
        resume_config(out, [f"output-dir={tmp_path / 'elsewhere'}"])


def test_the_server_checks_the_records_too_for_a_plain_flwr_run_with_resume(tmp_path):
    from fedbr_flwr.app.server_app import build_strategy

    out = damaged_run(tmp_path, '{"round": 1}\n{"round": 3}\n')
    with pytest.raises(ConfigError, match="no record of round 2"):
        build_strategy(validate({"num-rounds": 4, "output-dir": str(out), "resume": True}))


def test_a_resume_takes_a_line_a_crash_cut_short_and_a_missing_manifest(tmp_path):
    from fedbr_flwr.runfiles.run_io import check_records_continue

    out = damaged_run(tmp_path, WHOLE + '{"round": 4, "cli', '{"round": 2}\n{"rou')
    (out / "manifest.json").unlink()
    check_records_continue(out, 3)  # the torn lines come after the checkpoint; a new manifest is written


def test_a_resume_passes_over_blank_lines_as_the_readers_of_the_records_do(tmp_path):
    from fedbr_flwr.runfiles.run_io import check_records_continue

    out = damaged_run(tmp_path, WHOLE.replace("\n", "\n\n"), '\n{"round": 2}\n\n')
    check_records_continue(out, 3)


def test_a_sweep_starts_again_a_run_whose_records_are_damaged(tmp_path, capsys):
    from fedbr_flwr.commands.sweep import resumable_round

    cfg = validate({"output-dir": str(tmp_path)})
    save_checkpoint(tmp_path, {"global/w": np.ones(3, np.float32)}, {"round": 2, "config": cfg})
    (tmp_path / "rounds.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    (tmp_path / "metrics.jsonl").write_text('{"round": 2}\n')
    assert resumable_round(cfg) == 2
    (tmp_path / "rounds.jsonl").write_text('{"round": 1}\n')
    assert resumable_round(cfg) is None
    said = capsys.readouterr().out
    assert "no record of round 2" in said and said.rstrip().endswith("starting it again")


def test_a_resume_refuses_a_run_whose_metrics_jsonl_is_gone(tmp_path):
    """It resumed without a word and wrote a metrics.jsonl of the later rounds only: the evaluations up to the
    checkpoint were lost from the records and the summary."""
    from fedbr_flwr.runfiles.run_io import check_records_continue

    out = damaged_run(tmp_path, WHOLE)
    (out / "metrics.jsonl").unlink()
    with pytest.raises(ConfigError, match="metrics.jsonl is missing"):
        check_records_continue(out, 3)


def test_a_resumed_run_s_evaluations_count_its_wall_time_from_its_start(tmp_path):
    """The checkpoint's elapsed seconds go on; the summary's wall time is the last evaluation's."""
    from fedbr_flwr.runfiles.run_io import RunRecorder

    recorder = RunRecorder(validate({"output-dir": str(tmp_path)}), tmp_path, resume_round=2, elapsed=1000.0)
    recorder.log_eval({"round": 3, "mean_acc": 0.5, "worst_acc": 0.4, "loss": 1.0})
    wall = json.loads((tmp_path / "metrics.jsonl").read_text())["wall_time"]
    assert 1000.0 <= wall < 1100.0 and recorder.summary()["wall_time_s"] == wall


class Killed(BaseException):
    """The ServerApp's process killed (kill -9) at this point: nothing after it runs."""


def killed_after_its_last_checkpoint(cfg, folder, monkeypatch):
    """The run of ``cfg`` in ``folder``, killed between the checkpoint of its last round and its end (plotting
    takes a second): its records are complete, but summary.md, convergence.png and its last event are not
    written. Returns its records."""
    from fedbr_flwr.runfiles.progress import last_event_kind

    strategy, _, proxies = in_process_federation(cfg, folder)

    def killed():
        raise Killed

    monkeypatch.setattr(strategy.recorder, "finalize", killed)
    with pytest.raises(Killed):
        run_rounds(strategy, proxies, cfg["num-rounds"])
    assert checkpoint_round(folder) == cfg["num-rounds"] and last_event_kind(folder) == "checkpoint"
    assert not (folder / "summary.md").exists() and not (folder / "convergence.png").exists()
    return {name: (folder / name).read_text() for name in ("metrics.jsonl", "rounds.jsonl")}


def assert_ended(folder, records):
    """The run in ``folder`` has its end, as an uninterrupted run writes it, and the same ``records``."""
    from fedbr_flwr.runfiles.progress import last_event_kind

    assert (folder / "summary.md").is_file() and (folder / "convergence.png").is_file()
    assert last_event_kind(folder) == "summary"
    assert {name: (folder / name).read_text() for name in records} == records


def test_a_run_killed_after_its_last_checkpoint_is_resumed_to_its_end(tmp_path, capsys, monkeypatch):
    """`fedbr-run --resume` refused such a run ("nothing to resume"), also where fedbr-run had itself said to
    resume it (a time limit, SIGTERM); it writes its end now, and a second --resume has nothing left to do."""
    from fedbr_flwr.commands import cli

    records = killed_after_its_last_checkpoint(run_cfg("scaffold", **{"num-rounds": 2}), tmp_path, monkeypatch)
    assert cli.main(["--resume", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr()
    assert "stopped after its last round, before its summary: writing it" in out.out and not out.err, out
    assert_ended(tmp_path, records)
    assert json.loads((tmp_path / "summary.json").read_text())["last_round"] == 2
    assert cli.main(["--resume", str(tmp_path)]) == 2
    assert "nothing to resume" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", [["local", "--supernodes", "3"], ["run", "--superlink", "127.0.0.1:9093", "--insecure"]]
)
def test_fedbr_deploy_writes_the_end_of_a_run_killed_after_its_last_checkpoint(tmp_path, capsys, monkeypatch, command):
    """It refused such a run ("nothing to resume") as fedbr-run did; it writes the end now, starting no Flower."""
    from fedbr_flwr.commands import deploy

    records = killed_after_its_last_checkpoint(run_cfg("scaffold", **{"num-rounds": 2}), tmp_path, monkeypatch)
    monkeypatch.setattr(deploy, "submit_run", lambda *args, **kwargs: pytest.fail("the run has trained its rounds"))
    assert deploy.main([*command, "--resume", str(tmp_path)]) == 0, capsys.readouterr().err
    assert "stopped after its last round, before its summary: writing it" in capsys.readouterr().out
    assert_ended(tmp_path, records)


def test_a_sweep_writes_the_end_of_a_run_killed_after_its_last_checkpoint(tmp_path, capsys, monkeypatch):
    """Its summary.json was of its last round, so the sweep kept it as finished, without its plot and summary."""
    from contextlib import nullcontext

    from fedbr_flwr.commands import sweep

    path = tmp_path / "s.yaml"
    path.write_text(
        "dataset: mnist5k\nnum-clients: 3\nnum-rounds: 2\nlocal-steps: 2\nbatch-size: 8\nmodel: cnn-small\n"
        "global-test: false\nsweep:\n  seeds: [0]\n  runs:\n    SCAFFOLD: {strategy: scaffold}\n"
    )
    out = tmp_path / "out"
    [(_, _, cfg)] = sweep.plan(str(path), [], out.resolve(), None)
    folder = out / "SCAFFOLD" / "seed0"
    records = killed_after_its_last_checkpoint(cfg, folder, monkeypatch)
    monkeypatch.setattr(sweep, "run_flower", lambda *args, **kwargs: pytest.fail("the run is finished"))
    monkeypatch.setattr(sweep, "shared_host", lambda jobs: nullcontext(None))
    assert sweep.main([str(path), "--out", str(out), "--quiet"]) == 0
    assert "already finished in" in capsys.readouterr().out
    assert_ended(folder, records)


def killed_before_its_last_checkpoint(tmp_path, monkeypatch):
    """A sweep of one 2-round run (checkpoint-every=1), killed after its round-2 evaluation but before that
    round's checkpoint: summary.json, refreshed at every evaluation, is of round 2 and the checkpoint of round 1.
    Returns the sweep file, its --out and the run's folder."""
    from fedbr_flwr.app import checkpointing
    from fedbr_flwr.commands import sweep
    from fedbr_flwr.runfiles.progress import last_event_kind

    path = tmp_path / "s.yaml"
    path.write_text(
        "dataset: mnist5k\nnum-clients: 3\nnum-rounds: 2\nlocal-steps: 2\nbatch-size: 8\nmodel: cnn-small\n"
        "global-test: false\neval-every: 1\ncheckpoint-every: 1\n"
        "sweep:\n  seeds: [0]\n  runs:\n    SCAFFOLD: {strategy: scaffold}\n"
    )
    out = tmp_path / "out"
    [(_, _, cfg)] = sweep.plan(str(path), [], out.resolve(), None)
    folder = out / "SCAFFOLD" / "seed0"
    strategy, _, proxies = in_process_federation(cfg, folder)
    save = checkpointing.save_checkpoint

    def killed_at_the_last(out_dir, arrays, header):
        if header["round"] == 2:
            raise Killed
        return save(out_dir, arrays, header)

    monkeypatch.setattr(checkpointing, "save_checkpoint", killed_at_the_last)
    with pytest.raises(Killed):
        run_rounds(strategy, proxies, 2)
    monkeypatch.setattr(checkpointing, "save_checkpoint", save)
    assert json.loads((folder / "summary.json").read_text())["last_round"] == 2
    assert checkpoint_round(folder) == 1 and last_event_kind(folder) != "summary"
    return path, out, folder


def test_a_sweep_continues_a_run_killed_between_its_last_evaluation_and_its_checkpoint(tmp_path, capsys, monkeypatch):
    """The sweep kept such a run as finished, without its end, its checkpoint a round behind. It continues from
    that checkpoint now."""
    from contextlib import nullcontext

    from fedbr_flwr.commands import sweep

    path, out, _ = killed_before_its_last_checkpoint(tmp_path, monkeypatch)
    continued = []
    monkeypatch.setattr(sweep, "run_flower", lambda plan, **kwargs: continued.append(dict(plan.config)))
    monkeypatch.setattr(sweep, "shared_host", lambda jobs: nullcontext(None))
    sweep.main([str(path), "--out", str(out), "--quiet"])
    assert "continues after round 1" in capsys.readouterr().out
    assert [c["resume"] for c in continued] == [True]


def test_a_sweeps_table_leaves_out_a_run_killed_between_its_last_evaluation_and_its_checkpoint(tmp_path, monkeypatch):
    """Its simulation process killed there, the sweep reported the run failed and went on, and its table averaged
    the run in as finished."""
    from fedbr_flwr.commands import report

    _, _, folder = killed_before_its_last_checkpoint(tmp_path, monkeypatch)
    assert report.seed_result(folder) == (None, "failed after round 2")


def test_a_full_disk_leaves_the_last_checkpoint_whole_and_no_temporary_file(tmp_path, monkeypatch):
    """A write that fails part way (ENOSPC at the flush to disk, or at the rename) keeps the checkpoint and the
    text file that were there, and removes the half-written temporary file."""
    import errno
    import os

    from fedbr_flwr.runfiles.jsonsafe import write_text_atomically

    save_checkpoint(tmp_path, {"global/w": np.ones(3, np.float32)}, {"round": 1, "config": {}})
    (tmp_path / "summary.json").write_text("{}")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    for where in ("fsync", "replace"):
        with monkeypatch.context() as m:
            m.setattr(os, where, full)
            with pytest.raises(OSError, match="No space left"):
                save_checkpoint(tmp_path, {"global/w": np.zeros(3, np.float32)}, {"round": 2, "config": {}})
            if where == "replace":
                with pytest.raises(OSError, match="No space left"):
                    write_text_atomically(tmp_path / "summary.json", '{"new": 1}')
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz", "summary.json"], where
    arrays, header = load_checkpoint(tmp_path)
    assert header["round"] == 1 and arrays["global/w"].tolist() == [1, 1, 1]
    assert (tmp_path / "summary.json").read_text() == "{}"


def test_a_run_started_again_in_a_folder_leaves_nothing_of_the_old_run_to_resume_or_report(tmp_path):
    """Without overwrite the server refuses the folder (a run submitted from another machine was checked only
    there). --overwrite: a new run stopped before its first checkpoint must not resume the old run's checkpoint
    (which would join two runs' records), nor leave its summary where a report or the CLI reads it."""
    cfg = run_cfg("fedavg", **{"output-dir": str(tmp_path)})
    strategy, _, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy, proxies, 4)
    old = {
        name for name in ("summary.json", "summary.md", "manifest.json", CHECKPOINT_NAME) if (tmp_path / name).exists()
    }
    assert old == {"summary.json", "summary.md", "manifest.json", CHECKPOINT_NAME}
    with pytest.raises(ConfigError, match="already holds a run; pick another output-dir"):
        in_process_federation({**cfg, "lr": cfg["lr"] / 2}, tmp_path)  # a deploy's server checks it too
    assert {name for name in old if (tmp_path / name).exists()} == old
    strategy, _, proxies = in_process_federation({**cfg, "lr": cfg["lr"] / 2, "overwrite": True}, tmp_path)
    run_rounds(strategy, proxies, 1)  # stopped before its first checkpoint (round 2)
    with pytest.raises(ConfigError, match="no checkpoint"):
        load_checkpoint(tmp_path)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "summary.md").exists()
    assert json.loads((tmp_path / "manifest.json").read_text())["config"]["lr"] == cfg["lr"] / 2


def test_a_header_of_round_0_is_whole_and_one_of_round_minus_1_or_true_is_not():
    from fedbr_flwr.runfiles.checkpoint import header_problem

    header = {"config": {}, "elapsed": 0.0}
    assert header_problem({**header, "round": 0}) is None
    assert "round is -1" in header_problem({**header, "round": -1})
    assert "round is true" in header_problem({**header, "round": True}).lower()


def test_a_run_stopped_early_is_not_ended_by_lowering_num_rounds(tmp_path, monkeypatch):
    """Only a run killed after the checkpoint of its own last round has its end written on resume: one stopped
    at round 2 of 4 (a time limit) and resumed with num-rounds=2 still has nothing to resume."""
    from fedbr_flwr.launch.plan import resume_config

    killed_after_its_last_checkpoint(run_cfg("fedavg", **{"num-rounds": 2}), tmp_path, monkeypatch)
    _, header = load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, load_checkpoint(tmp_path)[0], {**header, "config": {**header["config"], "num-rounds": 4}})
    with pytest.raises(ConfigError, match="nothing to resume"):
        resume_config(tmp_path, ["num-rounds=2"])
    assert resume_config(tmp_path, [])["num-rounds"] == 4
