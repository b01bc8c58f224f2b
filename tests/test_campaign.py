"""The Table 1 campaign (experiments/campaign_table1.sh) in pieces, end to end on the CPU with a tiny config:
each piece stops (its time limit, or SIGTERM as a scheduler sends it), the same command continues, and the
finished runs' records equal those of uninterrupted runs."""

import json
import os
import signal
import subprocess

import pytest
from procs import flower_processes

from fedbr_flwr.commands import sweep
from fedbr_flwr.launch import timelimit

CAMPAIGN = "experiments/campaign_table1.sh"
TINY = [
    "dataset=mnist5k",
    "num-clients=2",
    "num-rounds=4",
    "local-steps=1",
    "batch-size=8",
    "eval-every=2",
    "global-test=false",
]


def campaign_args() -> list[str]:
    """The fedbr-sweep arguments the campaign script passes (read from the script, so that they cannot drift)."""
    text = open(CAMPAIGN).read()
    line = text[text.index("exec fedbr-sweep") :].replace("\\\n", " ").splitlines()[0]
    return line.split()[2 : line.split().index("--out")]


def test_the_campaign_is_fedavg_and_fedbr_at_the_papers_protocol_three_seeds(tmp_path):
    assert campaign_args() == [
        "experiments/table1_rotmnist.yaml",
        "--only",
        "FedAvg",
        "FedBR",
        "--seeds",
        "0",
        "1",
        "2",
    ]
    jobs = sweep.plan(campaign_args()[0], [], tmp_path, ["FedAvg", "FedBR"], [0, 1, 2])
    assert [(s.run, seed, cfg["strategy"], cfg["num-rounds"]) for s, seed, cfg in jobs][:2] == [
        ("FedAvg", 0, "fedavg", 1000),
        ("FedBR", 0, "fedbr", 1000),
    ]
    assert len(jobs) == 6 and all(cfg["dataset"] == "mnist" and cfg["eval-every"] == 2 for _, _, cfg in jobs)
    env = {**os.environ, "CAMPAIGN_OUT": str(tmp_path / "c")}
    listed = subprocess.run(["bash", CAMPAIGN, "1", "--dry-run"], env=env, capture_output=True, text=True)
    assert listed.returncode == 0 and "6 runs (2 settings x 3 seeds)" in listed.stdout, listed.stderr
    assert f"FedBR seed 2: strategy=fedbr -> {tmp_path / 'c' / 'FedBR' / 'seed2'}" in listed.stdout


@pytest.mark.parametrize("given, limit", [("14", "14m"), ("530s", "530s"), ("1h30m", "1h30m")])
def test_the_campaigns_limit_is_minutes_or_a_duration(tmp_path, given, limit):
    """A plain number is minutes; a duration passes as it is (a GPU slot's last part-minute counts too)."""
    stub = tmp_path / "fedbr-sweep"
    stub.write_text('#!/bin/sh\necho "$@"\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    ran = subprocess.run(["bash", CAMPAIGN, given, "data-dir=/d"], env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split()[-4:] == ["--time-limit", limit, "engine=cohort", "data-dir=/d"]


@pytest.mark.parametrize(
    "args, tail",
    [
        (["data-dir=/d"], ["--time-limit", "14m", "engine=cohort", "data-dir=/d"]),  # MINUTES left out
        (["5", "--seeds", "3", "data-dir=/d"], ["5m", "engine=cohort", "data-dir=/d", "--seeds", "3"]),
        (["--jobs", "2"], ["--time-limit", "14m", "engine=cohort", "--jobs", "2"]),
    ],
)
def test_the_campaign_passes_settings_before_options_that_would_take_them_as_values(tmp_path, args, tail):
    """fedbr-sweep's --seeds takes every value after it: a setting after it was read as a seed."""
    stub = tmp_path / "fedbr-sweep"
    stub.write_text('#!/bin/sh\necho "$@"\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    ran = subprocess.run(["bash", CAMPAIGN, *args], env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split()[-len(tail) :] == tail


@pytest.mark.e2e
def test_the_campaign_in_pieces_ends_with_the_records_of_uninterrupted_runs(tmp_path, capsys, monkeypatch):
    """Three pieces of the campaign's command (tiny config, one seed). Each watch lets 3 rounds pass, then the next
    round does not fit (the timing rule itself is unit-tested): piece 1 stops FedAvg after round 3 (exit 75);
    piece 2 continues it to its end, starts FedBR and is sent SIGTERM after FedBR's round-2 checkpoint (exit
    143); piece 3 continues FedBR to its end (exit 0). Each line names the command that continues; no Flower
    process is left; the records equal in-process runs' that never stopped."""
    before = flower_processes()
    out = tmp_path / "campaign"
    argv = [*campaign_args()[:-2], "--out", str(out), "--time-limit", "10m", "--quiet", *TINY]
    monkeypatch.setattr(timelimit, "next_round_fits", lambda now, deadline, seconds: len(seconds) < 3)
    on_event = timelimit.RoundWatch.on_event

    def terminate_in_fedbr(watch, event):
        on_event(watch, event)
        if event.get("kind") == "checkpoint" and event.get("round") == 2 and "/FedBR/" in event["message"]:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends; the sweep's handler unwinds the run

    monkeypatch.setattr(timelimit.RoundWatch, "on_event", terminate_in_fedbr)
    codes = pieces(argv, 3, before)
    err = capsys.readouterr().err
    again = f"continue with: fedbr-sweep {' '.join(argv)}"
    assert codes == [75, 143, 0], err
    assert f"time limit reached after round 3 of 4 in FedAvg seed 0 ({out / 'FedAvg' / 'seed0'})" in err
    assert "fedbr-sweep: stopped by SIGTERM; finished runs and the last checkpoint" in err and err.count(again) == 2

    resumed = records_equal_uninterrupted_runs(argv[0], TINY, out, tmp_path)
    assert resumed == [[3], [2]]
    assert "| FedBR | 1 |" in (out / "comparison.md").read_text()


def pieces(argv, count, before):
    """The exit codes of ``count`` pieces of the same sweep command, each leaving no Flower process behind
    (SIGTERM's handler restored afterwards)."""
    handler = signal.getsignal(signal.SIGTERM)
    try:
        codes = []
        for _ in range(count):
            codes.append(sweep.main(argv))
            assert flower_processes() <= before
        return codes
    finally:
        signal.signal(signal.SIGTERM, handler)


def records_equal_uninterrupted_runs(path, overrides, out, tmp_path):
    """Check that the FedAvg and FedBR seed-0 runs in ``out`` recorded what in-process runs that never stopped
    record; the rounds after which each was resumed."""
    from fakes import in_process_federation, records_without_timing, run_rounds
    from test_golden import close_json

    resumed = []
    for setting, _, cfg in sweep.plan(path, overrides, out, ["FedAvg", "FedBR"], [0]):
        folder = out / setting.run / "seed0"
        resumed.append([r["after_round"] for r in json.loads((folder / "manifest.json").read_text())["resumed"]])
        strategy, _, proxies = in_process_federation(cfg, tmp_path / setting.run)
        run_rounds(strategy, proxies, cfg["num-rounds"])
        for name in ("rounds.jsonl", "metrics.jsonl"):
            want = records_without_timing(tmp_path / setting.run / name)
            close_json(records_without_timing(folder / name), want, f"{setting.run}/{name}", exact=False)
    return resumed


@pytest.mark.e2e
@pytest.mark.long
def test_the_campaign_with_two_runs_at_once_stops_on_sigterm_and_continues_exactly(tmp_path, capsys, monkeypatch):
    """The campaign's command with --jobs 2 (tiny config, one seed, 10 rounds): FedAvg and FedBR go at once, each
    in a simulation process of its own, each progress line naming its run. SIGTERM once both have checkpointed
    round 2 stops both (exit 143, no Flower process left); the same command continues both to their end (exit 0),
    and their records equal those of in-process runs that never stopped."""
    import threading

    before = flower_processes()
    out = tmp_path / "campaign"
    tiny = [*TINY, "num-rounds=10"]
    argv = [*campaign_args()[:-2], "--out", str(out), "--time-limit", "10m", "--jobs", "2", *tiny]
    on_event, lock, past_round_2 = timelimit.RoundWatch.on_event, threading.Lock(), set()

    def terminate_once_both_past_round_2(watch, event):
        on_event(watch, event)
        if event.get("kind") == "checkpoint" and event.get("round") == 2:
            with lock:
                past_round_2.add(id(watch))
                if len(past_round_2) == 2:
                    os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(timelimit.RoundWatch, "on_event", terminate_once_both_past_round_2)
    codes = pieces(argv, 2, before)
    captured = capsys.readouterr()
    assert codes == [143, 0], captured.err
    assert "[1/2] FedAvg seed 0: [fedbr] round 1" in captured.out and "[2/2] FedBR seed 0: [fedbr]" in captured.out
    resumed = records_equal_uninterrupted_runs(argv[0], tiny, out, tmp_path)
    assert [len(r) == 1 and 2 <= r[0] < 10 for r in resumed] == [True, True]
