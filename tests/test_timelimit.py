"""Time-boxed runs (``--time-limit``): the duration, the rule that decides whether another round fits, the watch
that applies it to a run's events, the lines the commands print, and a sweep's choice to continue a run from
its checkpoint. End to end (real Flower runs): test_e2e.py and test_campaign.py."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fedbr_flwr.commands import cli, sweep
from fedbr_flwr.core.errors import ConfigError
from fedbr_flwr.launch import launcher
from fedbr_flwr.launch.launcher import RunFailed
from fedbr_flwr.launch.timelimit import (
    EXIT_TIME_LIMIT,
    RoundWatch,
    TimeLimitReached,
    next_round_fits,
    parse_duration,
    stop_deadline,
    stopped_line,
)
from fedbr_flwr.runfiles.checkpoint import save_checkpoint
from fedbr_flwr.runfiles.progress import PROGRESS_FILE, SUMMARY_EVENT, append_event, read_events, stopped_on_purpose


@pytest.mark.parametrize(
    "text, seconds",
    [("90s", 90), ("15m", 900), ("1h30m", 5400), ("2h", 7200), ("1m30s", 90), ("45", 45), ("0.5h", 1800)],
)
def test_a_duration_reads_hours_minutes_and_seconds(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "15x", "m", "1h-30m", "0s", "30m1h"])
def test_a_bad_duration_is_one_clear_error(text):
    with pytest.raises(ConfigError, match="--time-limit .* (is not a duration|must be longer than 0 s)"):
        parse_duration(text)


@pytest.mark.parametrize("command", [cli.main, lambda argv: sweep.main(["experiments/quickstart.yaml", *argv])])
def test_a_bad_time_limit_stops_the_command_with_exit_2_and_one_line(command, capsys):
    assert command(["--time-limit", "soon", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--time-limit 'soon' is not a duration" in err[0], err


def test_runs_stop_a_share_of_the_limit_early_to_end_within_it():
    assert stop_deadline(100.0, 20.0) == 118.0  # 10% of a short limit
    assert stop_deadline(100.0, 3600.0) == 3670.0  # at most 30 s of a long one


def test_another_round_fits_when_the_mean_round_with_its_margin_ends_by_the_deadline():
    assert next_round_fits(now=0.0, deadline=15.0, round_seconds=[8.0, 12.0])  # 1.5 x 10 s
    assert not next_round_fits(now=0.1, deadline=15.0, round_seconds=[8.0, 12.0])
    assert next_round_fits(now=0.0, deadline=1.0, round_seconds=[])  # nothing measured: while time is left
    assert not next_round_fits(now=1.0, deadline=1.0, round_seconds=[])


def events(*pairs):
    return [{"kind": kind, "round": rnd, "time": at, "message": ""} for kind, rnd, at in pairs]


def test_the_watch_stops_a_run_after_the_checkpoint_of_the_last_round_that_fits(monkeypatch):
    """Rounds of 10 s from the clients' discovery at t=0; deadline t=40: after round 2 (t=20) a round of 15 s
    still fits, after round 3 (t=30) it does not; the round events alone decide nothing."""
    clock = {"now": 0.0}
    monkeypatch.setattr("fedbr_flwr.launch.timelimit.time.time", lambda: clock["now"])
    watch = RoundWatch(deadline=40.0, num_rounds=100)
    for event in events(("start", None, 0.0), ("round", 1, 9.0), ("checkpoint", 1, 10.0), ("checkpoint", 2, 20.0)):
        clock["now"] = event["time"]
        watch.on_event(event)
    assert not watch.stop.is_set() and watch.saved_round == 2 and watch.round_seconds == [10.0, 10.0]
    clock["now"] = 30.0
    watch.on_event(events(("checkpoint", 3, 30.0))[0])
    assert watch.stop.is_set() and watch.saved_round == 3


def test_the_watch_lets_the_last_round_finish_and_stops_anything_at_the_deadline(monkeypatch):
    clock = {"now": 30.0}
    monkeypatch.setattr("fedbr_flwr.launch.timelimit.time.time", lambda: clock["now"])
    watch = RoundWatch(deadline=40.0, num_rounds=3, resumed_round=2)
    assert watch.saved_round == 2  # the checkpoint it continues, until it writes one
    for event in events(("start", None, 0.0), ("checkpoint", 3, 30.0)):
        watch.on_event(event)
    assert not watch.stop.is_set() and not watch.at_deadline()  # the run ends by itself after its last round
    clock["now"] = 40.0
    assert watch.at_deadline() and watch.stop.is_set()


def test_the_stop_line_says_where_the_run_stopped_and_how_to_continue():
    line = stopped_line("fedbr-run", "/r", 12, 1000, "fedbr-run --resume /r --time-limit 15m")
    assert line == (
        "fedbr-run: time limit reached after round 12 of 1000 in /r (checkpoint saved); "
        "continue with: fedbr-run --resume /r --time-limit 15m"
    )
    assert "before the first round of /r ended (no checkpoint)" in stopped_line("fedbr-run", "/r", None, 5, "x")
    assert EXIT_TIME_LIMIT == 75


def test_the_command_that_starts_a_run_again_names_its_folder_once():
    args = SimpleNamespace(items=["x.yaml", "output_dir=runs/r", "lr=0.1"], time_limit="15m", superlink=False)
    assert cli.again(args, Path("/abs/runs/r"), TimeLimitReached(None, "/abs/runs/r", 5)) == (
        "fedbr-run x.yaml lr=0.1 output-dir=/abs/runs/r --overwrite --time-limit 15m"
    )


def test_fedbr_run_at_its_time_limit_exits_75_with_the_resume_command(tmp_path, capsys, monkeypatch):
    """The run's stop (the launcher raises TimeLimitReached) becomes exit 75 and one line; the run was told to
    checkpoint after every round and handed a watch with the limit."""
    seen = {}

    def stopped(plan, echo, superlink=False, host=None, watch=None):
        seen.update(cfg=plan.config, watch=watch)
        raise TimeLimitReached(4)

    monkeypatch.setattr(cli, "run_flower", stopped)
    monkeypatch.setattr(cli, "early_host", lambda args: None)
    out = tmp_path / "run"
    code = cli.main(["num-clients=2", "num-rounds=9", f"output-dir={out}", "--time-limit", "10m", "--quiet"])
    assert code == EXIT_TIME_LIMIT
    assert seen["cfg"]["checkpoint-every"] == 1 and seen["watch"].num_rounds == 9
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"fedbr-run: time limit reached after round 4 of 9 in {out} (checkpoint saved); "
        f"continue with: fedbr-run --resume {out} --time-limit 10m"
    )


@pytest.mark.parametrize(
    "stop, how",
    [(TimeLimitReached(4), "time limit"), (KeyboardInterrupt(), "interrupted"), (SystemExit(143), "SIGTERM")],
)
def test_a_run_its_command_stops_says_so_last_in_its_events_after_its_processes_are_down(
    tmp_path, monkeypatch, stop, how
):
    """The report tells a run stopped on purpose (it continues from its checkpoint) from one that crashed by
    this last event; the run's simulation process is stopped first, so that no event of it comes after."""
    events = tmp_path / PROGRESS_FILE
    events.write_text(json.dumps({"kind": "round", "round": 3, "message": "round 3/9"}) + "\n")
    (tmp_path / "checkpoint.npz").write_bytes(b"")  # there is one to continue from
    order = []

    class Host:
        def close(self):
            order.append(("closed", stopped_on_purpose(tmp_path)))

    def stopped(*args):
        raise stop

    monkeypatch.setattr(launcher, "_run_flower", stopped)
    plan = SimpleNamespace(out_dir=tmp_path)
    with pytest.raises(type(stop)):
        launcher.run_flower(plan, host=Host())
    assert order == [("closed", False)] and stopped_on_purpose(tmp_path)
    assert read_events(events)[0][-1]["message"] == f"run stopped ({how}); continue it from its last checkpoint"
    append_event(events, SUMMARY_EVENT, "run files in ...")  # a stop as the run shut down: it had ended
    with pytest.raises(type(stop)):
        launcher.run_flower(plan, host=Host())
    assert read_events(events)[0][-1]["kind"] == SUMMARY_EVENT


def test_a_run_that_failed_is_not_marked_stopped(tmp_path, monkeypatch):
    (tmp_path / PROGRESS_FILE).write_text("")

    def failed(*args):
        raise RunFailed("boom")

    monkeypatch.setattr(launcher, "_run_flower", failed)
    with pytest.raises(RunFailed):
        launcher.run_flower(SimpleNamespace(out_dir=tmp_path))
    assert not stopped_on_purpose(tmp_path) and (tmp_path / PROGRESS_FILE).read_text() == ""


def sweep_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "dataset: mnist5k\nnum-clients: 2\nnum-rounds: 6\nlocal-steps: 1\n"
        "sweep:\n  seeds: [0]\n  runs:\n    FedAvg: {strategy: fedavg}\n    FedBR: {strategy: fedbr}\n"
    )
    return str(path)


def checkpoint_of(cfg, round_, **changed):
    """A checkpoint after ``round_`` with the records a run writes up to it (one line a round)."""
    save_checkpoint(cfg["output-dir"], {"global/x": np.zeros(1)}, {"round": round_, "config": {**cfg, **changed}})
    records = "".join(json.dumps({"round": r}) + "\n" for r in range(1, round_ + 1))
    (Path(cfg["output-dir"]) / "rounds.jsonl").write_text(records)
    (Path(cfg["output-dir"]) / "metrics.jsonl").write_text(records)


def test_a_sweep_continues_a_run_from_its_checkpoint_and_refuses_one_of_other_settings(tmp_path, capsys):
    (_, _, cfg), _ = sweep.plan(sweep_file(tmp_path), [], tmp_path / "out", None)
    assert sweep.resumable_round(cfg) is None  # no checkpoint
    (tmp_path / "out" / "FedAvg" / "seed0").mkdir(parents=True)
    checkpoint_of(cfg, 3, **{"checkpoint-every": 1, "git-commit": "older"})
    assert sweep.resumable_round(cfg) == 3
    checkpoint_of(cfg, 3, lr=0.5)
    with pytest.raises(ConfigError, match=r"cannot continue \(cannot resume with a different config \(lr"):
        sweep.resumable_round(cfg)  # it was started again, and its records replaced
    (tmp_path / "out" / "FedAvg" / "seed0" / "checkpoint.npz").write_bytes(b"torn")
    assert sweep.resumable_round(cfg) is None
    assert "its checkpoint cannot continue this run (checkpoint" in capsys.readouterr().out


def test_a_time_limited_sweep_resumes_unfinished_runs_and_stops_with_the_same_command(tmp_path, capsys, monkeypatch):
    """Run 1 has a checkpoint at round 3: it continues from it, told to checkpoint every round, and stops at the
    limit; the sweep then exits 75 with a line naming that run and the command that started the sweep. Run again
    with the time spent, it stops before starting anything."""
    path, out = sweep_file(tmp_path), tmp_path / "out"
    jobs = sweep.plan(path, [], out.resolve(), None)
    (out / "FedAvg" / "seed0").mkdir(parents=True)
    checkpoint_of(jobs[0][2], 3)
    started = []

    def stopped(plan, echo, host=None, watch=None):
        started.append((plan.config["resume"], plan.config["checkpoint-every"], watch.saved_round))
        raise TimeLimitReached(5)

    monkeypatch.setattr(sweep, "run_flower", stopped)
    monkeypatch.setattr(sweep, "shared_host", lambda jobs: __import__("contextlib").nullcontext(None))
    argv = [path, "--out", str(out), "--quiet", "--time-limit", "1h"]
    assert sweep.main(argv) == EXIT_TIME_LIMIT
    assert started == [(True, 1, 3)]
    captured = capsys.readouterr()
    assert "[1/2] FedAvg seed 0: continues after round 3" in captured.out
    assert captured.err.strip().splitlines()[-1] == (
        f"fedbr-sweep: time limit reached after round 5 of 6 in FedAvg seed 0 ({out.resolve() / 'FedAvg' / 'seed0'}) "
        f"(checkpoint saved); continue with: fedbr-sweep {path} --out {out} --quiet --time-limit 1h"
    )
    assert not (out / "comparison.md").exists()

    monkeypatch.setattr(sweep, "stop_deadline", lambda start, limit: start - 1)  # the time is spent
    assert sweep.main(argv) == EXIT_TIME_LIMIT and len(started) == 1


def test_a_run_finished_under_a_time_limit_is_kept_by_a_sweep_without_one(tmp_path):
    """A time-limited run checkpoints every round, which changes none of its results."""
    (_, _, cfg), _ = sweep.plan(sweep_file(tmp_path), [], tmp_path / "out", None)
    folder = tmp_path / "out" / "FedAvg" / "seed0"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("")
    (folder / "manifest.json").write_text(json.dumps({"config": {**cfg, "checkpoint-every": 1}}))
    (folder / "summary.json").write_text(json.dumps({"last_round": cfg["num-rounds"]}))
    assert sweep.finished_with_same_config(cfg)


def test_a_time_limit_no_round_fits_in_says_so(tmp_path, capsys, monkeypatch):
    """`--time-limit 4s` with a 5 s start-up printed the same continue command forever, never saying that no
    round had ended in the limit (a limit that some round fits in: the test above, its line unchanged)."""
    monkeypatch.setattr(cli, "run_flower", lambda plan, **kwargs: (_ for _ in ()).throw(TimeLimitReached(None)))
    monkeypatch.setattr(cli, "early_host", lambda args: None)
    out = tmp_path / "run"
    assert cli.main(["num-clients=2", f"output-dir={out}", "--time-limit", "4s", "--quiet"]) == EXIT_TIME_LIMIT
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("--overwrite --time-limit 4s (no round ended within 4s: give a longer --time-limit)")
