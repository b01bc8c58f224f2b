"""fedbr-sweep: the plan of runs, its errors, resuming (no processes), plus one short real sweep. Its
tables, plots and results page: test_report.py."""

import contextlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedbr_flwr.commands import sweep
from fedbr_flwr.core.config import ConfigError

SWEEP = """
num-clients: 2
num-rounds: 1
local-steps: 1
batch-size: 8
model: cnn-small
sweep:
  seeds: [0, 1]
  runs:
    FedAvg: {strategy: fedavg}
    FedBR no max: {strategy: fedbr, fedbr-max-step: false}
"""


def write(tmp_path, text=SWEEP):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return str(path)


def test_plan_orders_settings_file_then_command_line_then_run_then_seed(tmp_path):
    jobs = sweep.plan(write(tmp_path), ["num-rounds=3", "local-steps=4"], tmp_path / "out", None)
    assert [(n.label, s) for n, s, _ in jobs] == [
        ("FedAvg", 0),
        ("FedBR no max", 0),
        ("FedAvg", 1),
        ("FedBR no max", 1),
    ]
    cfg = dict(jobs[1][2])
    assert cfg["num-rounds"] == 3 and cfg["local-steps"] == 4 and cfg["strategy"] == "fedbr"
    assert cfg["fedbr-max-step"] is False and cfg["seed"] == 0
    assert cfg["output-dir"] == str(tmp_path / "out" / "FedBR_no_max" / "seed0")
    only = sweep.plan(write(tmp_path), [], tmp_path / "out", ["FedAvg"], seeds=[5])
    assert [(n.label, s) for n, s, _ in only] == [("FedAvg", 5)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("num-rounds: 1\n", "needs a 'sweep' block"),
        ("sweep:\n  runs: {A: {strategy: nope}}\n", "run 'A' \\(seed 0\\): unknown strategy 'nope'"),
        ("sweep:\n  seeds: 3\n  runs: {A: {}}\n", "must be a list"),
        ("sweep:\n  seeds: [0, 1, 0]\n  runs: {A: {}}\n", r"seed\(s\) 0 given twice in \[0, 1, 0\]"),
        ("sweep:\n  runs: {A: {}}\n  seed: [1]\n", "unknown key"),
        ("sweep:\n  title: [a]\n  runs: {A: {}}\n", "'sweep.title' must be a string"),
        ("sweep:\n  runs: {'a b': {}, 'a/b': {}}\n", "must differ"),
        ("sweep:\n  runs: {comparison.csv: {}}\n", "run name 'comparison.csv' is a file the sweep writes"),
        ("sweep:\n  runs: {'..': {}}\n", "must differ"),  # its folder would be beside --out, not in it
        ("sweep:\n  runs: {A: {seed: 3}}\n", "seed in run 'A' would be ignored: .* use sweep.seeds or --seeds"),
        ("sweep:\n  runs: {A: {output_dir: x}}\n", "output-dir in run 'A' would be ignored: .* use --out"),
        ("sweep:\n  runs: {A: {strategy: fedavg, fedbr-mu: 2.0}}\n", r"belongs to fedbr \(strategy=fedbr\)"),
    ],
)
def test_bad_sweep_files_stop_before_any_run(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        sweep.plan(write(tmp_path, text), [], tmp_path / "out", None)


def test_only_with_an_unknown_name_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown runs: Nope"):
        sweep.plan(write(tmp_path), [], tmp_path / "out", ["Nope"])


@pytest.mark.parametrize("options", [["--only", "FedAvg", "lr=0.3"], ["--seeds", "1", "lr=0.3"]])
def test_settings_typed_after_only_or_seeds_are_settings_of_every_run(tmp_path, monkeypatch, options):
    ran = runs_that_finish(monkeypatch)
    assert sweep.main([write(tmp_path), "--out", str(tmp_path / "out"), "--quiet", *options]) == 0
    assert ran and {c["lr"] for c in ran} == {0.3}


@pytest.mark.parametrize(
    "options, message",
    [(["--seeds", "lr=0.3"], "--seeds names no seed: lr=0.3"), (["--seeds", "0", "one"], "invalid seed 'one'")],
)
def test_seeds_that_are_not_seeds_stop_with_one_line(tmp_path, capsys, options, message):
    with pytest.raises(SystemExit) if "invalid" in message else contextlib.nullcontext():
        assert sweep.main([write(tmp_path), "--out", str(tmp_path / "out"), *options]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not (tmp_path / "out").exists()


def fake_run(folder, cfg, accs, target=0.5, last_round=None):
    folder.mkdir(parents=True, exist_ok=True)
    history = [{"round": 2 * (i + 1), "mean_acc": a, "worst_acc": a / 2} for i, a in enumerate(accs)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    (folder / "manifest.json").write_text(json.dumps({"config": cfg}))
    reached = next((r["round"] for r in history if r["mean_acc"] >= target), None)
    (folder / "summary.json").write_text(
        json.dumps(
            {
                "mean_acc_best5": max(accs),
                "worst_acc_best5": max(accs) / 2,
                "final_mean_acc": accs[-1],
                "rounds_to_target": reached,
                "target_acc": target,
                "wall_time_s": 10.0,
                "last_round": last_round or history[-1]["round"],
            }
        )
    )


def test_finished_runs_are_kept_and_a_different_one_is_refused(tmp_path):
    (name, seed, cfg), *_ = sweep.plan(write(tmp_path), [], tmp_path / "out", None)
    folder = tmp_path / "out" / "FedAvg" / "seed0"
    assert not sweep.finished_with_same_config(cfg)
    fake_run(folder, {**cfg, "git-commit": "other"}, [0.1], last_round=0)  # stopped before its last round
    assert not sweep.finished_with_same_config(cfg)
    (folder / "summary.json").write_text(json.dumps({"last_round": cfg["num-rounds"]}))
    assert sweep.finished_with_same_config(cfg)
    (folder / "manifest.json").write_text(json.dumps({"config": {**cfg, "lr": 0.5}}))
    with pytest.raises(ConfigError, match="different settings \\(lr\\)"):
        sweep.finished_with_same_config(cfg)


def test_a_finished_run_is_continued_to_more_rounds_but_never_replaced_by_fewer(tmp_path):
    (name, seed, cfg), *_ = sweep.plan(write(tmp_path), ["num-rounds=4"], tmp_path / "out", None)
    folder = tmp_path / "out" / "FedAvg" / "seed0"
    fake_run(folder, cfg, [0.1], last_round=4)
    assert sweep.finished_with_same_config(cfg)
    assert not sweep.finished_with_same_config({**cfg, "num-rounds": 6})  # continued from its checkpoint
    with pytest.raises(ConfigError, match="different settings \\(num-rounds\\)"):
        sweep.finished_with_same_config({**cfg, "num-rounds": 2})
    (folder / "summary.json").write_text('{"last_round": 4')  # damaged: started again, with a line saying so
    assert not sweep.finished_with_same_config(cfg)


def test_a_run_resumed_to_more_rounds_is_finished_at_its_new_count(tmp_path):
    """The manifest keeps its start's config (num-rounds 4) and adds the resumed piece's (6): read from the start,
    a run trained on to round 6 was never finished, so the same sweep command run again stopped on it, and the
    table called it paused after round 6 of 4."""
    from fedbr_flwr.commands import report

    (name, seed, cfg), *_ = sweep.plan(write(tmp_path), ["num-rounds=4"], tmp_path / "out", None)
    folder = tmp_path / "out" / "FedAvg" / "seed0"
    fake_run(folder, cfg, [0.1, 0.2, 0.3], last_round=6)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["resumed"] = [{"after_round": 4, "config": {**cfg, "num-rounds": 6, "resume": True}}]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert sweep.finished_with_same_config({**cfg, "num-rounds": 6})
    assert report.stored_settings(folder).num_rounds == 6
    with pytest.raises(ConfigError, match="different settings \\(num-rounds\\)"):
        sweep.finished_with_same_config(cfg)  # fewer rounds than it has: never replaced


def runs_that_finish(monkeypatch) -> list[dict]:
    """Runs of a sweep that write a finished run's files at once; the configs of those started, in order."""
    ran = []

    def finished_run(plan, echo, host, watch=None):
        ran.append(dict(plan.config))
        fake_run(plan.out_dir, dict(plan.config), [0.1], last_round=plan.config["num-rounds"])

    monkeypatch.setattr(sweep, "run_flower", finished_run)
    return ran


def test_a_conflicting_finished_run_stops_the_sweep_before_any_run_and_a_kept_failure_still_fails(
    tmp_path, capsys, monkeypatch
):
    ran = runs_that_finish(monkeypatch)
    path, out = write(tmp_path), tmp_path / "out"
    *_, (_, _, last) = sweep.plan(path, [], out.resolve(), None)  # FedBR seed 1: the sweep's last run
    fake_run(Path(last["output-dir"]), {**last, "lr": 0.5}, [0.1], last_round=last["num-rounds"])
    assert sweep.main([path, "--out", str(out), "--quiet"]) == 2
    assert not ran and "different settings (lr)" in capsys.readouterr().err
    shutil.rmtree(out)
    assert sweep.main([path, "--out", str(out), "--quiet", "--only", "FedAvg", "--seeds", "0"]) == 0
    summary = out / "FedAvg" / "seed0" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "rounds_trained": 0}))  # no round trained
    assert sweep.main([path, "--out", str(out), "--quiet", "--only", "FedAvg", "--seeds", "0"]) == 1
    assert [c["strategy"] for c in ran] == ["fedavg"] and "no round trained" in capsys.readouterr().err


def test_an_unfinished_run_of_other_settings_stops_the_sweep_before_any_run(tmp_path, capsys, monkeypatch):
    """A run stopped before its end (a checkpoint, no summary) with lr = 0.05 was started again under lr = 0.1:
    its metrics and checkpoint replaced, with one line on stderr; a finished one was already refused."""
    from fedbr_flwr.runfiles.checkpoint import save_checkpoint

    ran = runs_that_finish(monkeypatch)
    path, out = write(tmp_path), tmp_path / "out"
    *_, (_, _, last) = sweep.plan(path, [], out.resolve(), None)  # the sweep's last run
    folder = Path(last["output-dir"])
    fake_run(folder, {**last, "lr": 0.5}, [0.1], last_round=1)
    (folder / "summary.json").unlink()
    save_checkpoint(folder, {"w": np.zeros(1, np.float32)}, {"round": 1, "config": {**last, "lr": 0.5}})
    kept = (folder / "metrics.jsonl").read_bytes()
    assert sweep.main([path, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not ran and len(err) == 1 and "holds an unfinished run that this one cannot continue" in err[0]
    assert "lr = 0.5 in the checkpoint" in err[0] and (folder / "metrics.jsonl").read_bytes() == kept


def test_a_run_with_damaged_files_is_started_again_with_one_line_saying_so(tmp_path, capsys, monkeypatch):
    ran = runs_that_finish(monkeypatch)
    path, out = write(tmp_path), tmp_path / "out"
    (_, _, cfg), *_ = sweep.plan(path, [], out.resolve(), ["FedAvg"], [0])
    fake_run(Path(cfg["output-dir"]), cfg, [0.1], last_round=cfg["num-rounds"])
    (out / "FedAvg" / "seed0" / "summary.json").write_text('{"last_round": 1')  # torn
    assert sweep.main([path, "--out", str(out), "--quiet", "--only", "FedAvg", "--seeds", "0"]) == 0
    said = capsys.readouterr()
    assert [c["seed"] for c in ran] == [0] and (said.out + said.err).count("is damaged; starting it again") == 1


def test_dry_run_with_table_only_is_refused_rather_than_the_table_left_unwritten(tmp_path, capsys):
    out = tmp_path / "out"
    fake_run(out / "FedAvg" / "seed0", {}, [0.5])
    assert sweep.main([write(tmp_path), "--out", str(out), "--dry-run", "--table-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedbr-sweep: error: --dry-run writes nothing and --table-only writes the table: give one"]
    assert not (out / "comparison.md").exists()


def test_table_only_without_the_sweeps_runs_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "typo"
    assert sweep.main([write(tmp_path), "--out", str(out), "--table-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no run of this sweep: run it first" in err[0] and not out.exists()


def test_a_table_over_a_damaged_summary_names_it_instead_of_a_traceback(tmp_path, capsys):
    path, out = write(tmp_path), tmp_path / "out"
    for *_, cfg in sweep.plan(path, [], out.resolve(), None):
        fake_run(Path(cfg["output-dir"]), cfg, [0.3], last_round=cfg["num-rounds"])
    (out / "FedAvg" / "seed1" / "summary.json").write_text('{"last_round": 1')  # torn
    (out / "FedBR_no_max" / "seed1" / "summary.json").write_text("[1]")  # not an object
    assert sweep.main([path, "--out", str(out), "--table-only"]) == 0
    table = (out / "comparison.md").read_text()
    assert table.count("seed 1 failed: its summary.json, manifest.json or rounds.jsonl is damaged") == 2


def test_a_table_reads_run_files_a_crash_cut_short_and_names_a_damaged_one(tmp_path, capsys):
    """A last line cut short, which a crash leaves and a resume drops, raised JSONDecodeError out of --table-only."""
    path, out = write(tmp_path), tmp_path / "out"
    for *_, cfg in sweep.plan(path, [], out.resolve(), None):
        fake_run(Path(cfg["output-dir"]), cfg, [0.3, 0.4], last_round=cfg["num-rounds"])
        rounds = "".join(json.dumps({"round": r}) + "\n" for r in range(1, cfg["num-rounds"] + 1))
        (Path(cfg["output-dir"]) / "rounds.jsonl").write_text(rounds)
    for name in ("metrics.jsonl", "rounds.jsonl"):
        cut = out / "FedAvg" / "seed0" / name
        cut.write_text(cut.read_text() + '{"round": 9, "mean_')  # cut short: no newline
    rounds = out / "FedAvg" / "seed1" / "rounds.jsonl"
    rounds.write_text("not json\n" + rounds.read_text())  # damaged before its end
    assert sweep.main([path, "--out", str(out), "--table-only"]) == 0
    table = (out / "comparison.md").read_text()
    assert "seed 0 failed" not in table and table.count("failed: its summary.json, manifest.json or rounds") == 1


def test_a_table_of_some_seeds_says_which_other_seeds_its_out_holds(tmp_path, capsys):
    """Seeds 1 and 2 continued into the --out of seed 0: the table covers the seeds asked for, and one line says
    how to get the table of all three; a seed folder without a finished run is not counted."""
    path, out = write(tmp_path), tmp_path / "out"
    for *_, cfg in sweep.plan(path, [], out.resolve(), None, seeds=[0, 1, 2]):
        fake_run(Path(cfg["output-dir"]), cfg, [0.3], last_round=cfg["num-rounds"])
    (out / "FedAvg" / "seed7").mkdir()
    assert sweep.main([path, "--out", str(out), "--seeds", "1", "2", "--table-only"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"fedbr-sweep: the comparison covers seed(s) 1, 2; {out.resolve()} also holds runs of seed(s) 0: for one "
        "table of all, run it again with --seeds 0 1 2 --table-only"
    ]
    assert "| FedAvg | 2 |" in (out / "comparison.md").read_text()
    assert sweep.main([path, "--out", str(out), "--seeds", "0", "1", "2", "--table-only"]) == 0
    assert capsys.readouterr().err == ""


def test_a_finished_run_is_kept_where_only_the_data_folder_or_the_engine_changed(tmp_path):
    """A campaign continued on another machine (its data elsewhere) or on another engine keeps its finished runs,
    as a resumed run may change these keys; the learning rate still makes it another run."""
    (name, seed, cfg), *_ = sweep.plan(write(tmp_path), [], tmp_path / "out", None)
    fake_run(tmp_path / "out" / "FedAvg" / "seed0", cfg, [0.1], last_round=cfg["num-rounds"])
    moved = {**cfg, "data-dir": "/elsewhere", "engine": "cohort", "cohort-step": "loop", "backend": "ray"}
    moved.update({"client-gpus": 0.5, "ray-address": "10.0.0.1:6379", "checkpoint-every": 3, "tracking": "wandb"})
    assert moved["engine"] != cfg["engine"] and sweep.finished_with_same_config(moved)
    with pytest.raises(ConfigError, match="different settings \\(lr\\)"):
        sweep.finished_with_same_config({**moved, "lr": 0.5})


def test_a_run_finished_before_a_key_existed_is_kept_where_the_key_is_at_its_default(tmp_path):
    """A sweep continued after an upgrade that added keys keeps its finished runs: they ran as the new keys'
    defaults do. A new key set to another value is a different run."""
    (name, seed, cfg), *_ = sweep.plan(write(tmp_path), [], tmp_path / "out", None)
    folder = tmp_path / "out" / "FedAvg" / "seed0"
    older = {k: v for k, v in cfg.items() if k not in ("server-test-every", "groupdro-mixup")}
    fake_run(folder, older, [0.1], last_round=cfg["num-rounds"])
    assert sweep.finished_with_same_config(cfg)
    with pytest.raises(ConfigError, match="different settings \\(server-test-every\\)"):
        sweep.finished_with_same_config({**cfg, "server-test-every": 4})


def test_a_sweep_runs_each_job_in_order_then_keeps_them(tmp_path, capsys, monkeypatch):
    """The loop over several jobs, each Flower run replaced by the files of a finished one (a real one: below).
    Every run is handed the one simulation process the sweep keeps (``launcher.RunHost``), closed at the end."""
    ran, hosts = [], []

    def finished_run(plan, echo, host, watch=None):
        cfg = dict(plan.config)
        ran.append((cfg["strategy"], cfg["seed"], plan.supernodes, echo, plan.out_dir))
        hosts.append(host)
        fake_run(plan.out_dir, cfg, [0.3, 0.5], last_round=cfg["num-rounds"])

    closed = []
    monkeypatch.setattr(sweep.RunHost, "close", lambda self: closed.append(self))
    monkeypatch.setattr(sweep, "run_flower", finished_run)
    path = write(tmp_path)
    out = tmp_path / "out"
    assert sweep.main([path, "--out", str(out), "--quiet"]) == 0
    assert [r[:4] for r in ran] == [
        ("fedavg", 0, 2, "none"),
        ("fedbr", 0, 2, "none"),
        ("fedavg", 1, 2, "none"),
        ("fedbr", 1, 2, "none"),
    ]
    assert [r[4] for r in ran] == [
        out.resolve() / name / f"seed{seed}" for seed in (0, 1) for name in ("FedAvg", "FedBR_no_max")
    ]
    table = (out / "comparison.md").read_text()
    assert "| FedAvg | 2 |" in table and "| FedBR no max | 2 |" in table
    assert len(set(map(id, hosts))) == 1 and isinstance(hosts[0], sweep.RunHost) and closed == hosts[:1]
    capsys.readouterr()
    assert sweep.main([path, "--out", str(out), "--quiet"]) == 0  # nothing left to run
    assert len(ran) == 4 and capsys.readouterr().out.count("already finished") == 4
    shutil.rmtree(out)
    assert sweep.main([path, "--out", str(out), "--quiet", "--isolated"]) == 0
    assert hosts[4:] == [None] * 4  # each run a process of its own


def test_a_later_runs_missing_dataset_stops_the_sweep_before_any_run(tmp_path, capsys, monkeypatch):
    """It was found when that run started, after the runs before it, and stopped the sweep there (with --jobs,
    halting the run in progress without a word)."""
    monkeypatch.setattr(sweep, "run_flower", lambda *a, **k: pytest.fail("a run started"))
    text = SWEEP.replace(
        "    FedBR no max: {strategy: fedbr, fedbr-max-step: false}\n",
        f"    Full: {{dataset: mnist, data-dir: '{tmp_path / 'none'}', download: never}}\n",
    )
    assert sweep.main([write(tmp_path, text), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedbr-sweep: error: Full seed 0: ") and "mnist" in err[0]
    assert not (tmp_path / "out" / "FedAvg").exists()


def test_a_run_that_cannot_start_fails_alone_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    """A ConfigError found only as a run starts (its folder taken by a live run, say) is that run's failure, as
    the docs promise for a failed run: the others run, and the sweep exits 1 naming it."""
    plan_run, ran = sweep.plan_run, []

    def taken_for_fedavg_seed_1(cfg, overwrite):
        if cfg["strategy"] == "fedavg" and cfg["seed"] == 1:
            raise ConfigError(f"{cfg['output-dir']} is in use by a live run")
        return plan_run(cfg, overwrite)

    def finished_run(plan, echo, host, watch=None):
        ran.append((plan.config["strategy"], plan.config["seed"]))
        fake_run(plan.out_dir, dict(plan.config), [0.3, 0.5], last_round=plan.config["num-rounds"])

    monkeypatch.setattr(sweep, "plan_run", taken_for_fedavg_seed_1)
    monkeypatch.setattr(sweep, "run_flower", finished_run)
    monkeypatch.setattr(sweep, "shared_host", lambda jobs: __import__("contextlib").nullcontext(None))
    assert sweep.main([write(tmp_path), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    assert ran == [("fedavg", 0), ("fedbr", 0), ("fedbr", 1)]
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("FedAvg seed 1 failed: " + str(tmp_path / "out" / "FedAvg" / "seed1") + " is in use by a live run")
    )


def records(folder):
    """A run's per-round records without the fields that measure the machine (time, memory, Ray's node ids)."""
    timed = ("seconds", "time", "elapsed", "wall", "rss", "nodes")
    lines = [json.loads(x) for f in ("metrics.jsonl", "rounds.jsonl") for x in (folder / f).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in lines]


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["auto", pytest.param("ray", marks=pytest.mark.long)])
def test_a_real_sweep_runs_in_one_process_equals_isolated_runs_then_keeps_them(tmp_path, capsys, backend):
    """Two real jobs (each one Flower run; the loop over more: test_a_sweep_runs_each_job_in_order_then_keeps_them)
    run one after another in one simulation process (the clients in it, or on Ray: the second run on the first's
    Ray runtime and client processes), and record exactly what each records in a process of its own
    (--isolated); run again, both are found finished with the same settings and kept."""
    path = write(tmp_path, SWEEP.replace("[0, 1]", "[0]"))
    out, isolated = tmp_path / "out", tmp_path / "isolated"
    where = [f"backend={backend}", "device=cpu"]  # auto: in-process on CPUs
    assert sweep.main([path, *where, "--out", str(out), "--quiet"]) == 0
    assert sweep.main([path, *where, "--out", str(isolated), "--quiet", "--isolated"]) == 0
    processes = {}
    for name in ("FedAvg", "FedBR_no_max"):
        assert records(out / name / "seed0") == records(isolated / name / "seed0")
        for folder in (out, isolated):
            started = re.search(
                r"run \d+ started in process (\d+)", (folder / name / "seed0" / "flower.log").read_text()
            )
            processes.setdefault(folder, set()).add(started.group(1) if started else None)
    assert len(processes[out]) == 1 and None not in processes[out]
    assert len(processes[isolated]) == 2
    assert "| FedBR no max | 1 |" in (out / "comparison.md").read_text()
    manifest = json.loads((out / "FedAvg" / "seed0" / "manifest.json").read_text())
    assert manifest["config"]["backend"] == ("in-process" if backend == "auto" else "ray")
    capsys.readouterr()
    assert sweep.main([path, *where, "--out", str(out), "--quiet"]) == 0  # nothing left to run
    assert capsys.readouterr().out.count("already finished") == 2


def test_table_only_titles_the_comparison_with_the_command_line_overrides(tmp_path):
    path = write(tmp_path)
    out = tmp_path / "out"
    for name in ("FedAvg", "FedBR_no_max"):
        fake_run(out / name / "seed0", {}, [0.3, 0.5])
    assert sweep.main([path, "lr=0.1", "--seeds", "0", "--out", str(out), "--table-only"]) == 0
    assert (out / "comparison.md").read_text().startswith("### s lr=0.1\n")


# Each paper table's protocol (FedBR paper, Appendix A; DisTrans paper, Section 5): the keys every run of
# its GPU-sized file must hold. RotatedMNIST rotates client i by 15*i degrees; CIFAR10 rotates every client
# (angle prior q ~ Dir(1.0)) except in Table 9 ("Clean CIFAR10"); the DisTrans tables do not rotate.
ROTATED_MNIST = {
    "dataset": "mnist",
    "num-clients": 10,
    "partition": "fedbr",
    "alpha": 0.1,
    "rotate": True,
    "model": "cnn",
    "num-rounds": 1000,
    "local-steps": 50,
    "batch-size": 64,
    "lr": 0.001,
    "momentum": 0.0,
}
ROTATED_CIFAR10 = {
    **ROTATED_MNIST,
    "dataset": "cifar10",
    "model": "vgg11",
    "batch-size": 32,
    "lr": 0.01,
}
DISTRANS_MNIST = {
    "dataset": "mnist",
    "num-clients": 10,
    "partition": "classes",
    "rotate": False,
    "batch-size": 64,
    "lr": 0.005,
    "distrans-alpha": 0.3,
    "distrans-offset-lr": 0.001,
}
PAPER_PROTOCOL = {
    "experiments/fedavg_rotmnist.yaml": ROTATED_MNIST,
    "experiments/table1_rotmnist.yaml": ROTATED_MNIST,
    "experiments/table4_rotmnist.yaml": ROTATED_MNIST,
    "experiments/table13_rotmnist.yaml": ROTATED_MNIST,
    "experiments/table2_cifar10.yaml": ROTATED_CIFAR10,
    "experiments/table3_cifar10.yaml": ROTATED_CIFAR10,
    "experiments/distrans_table1_mnist.yaml": DISTRANS_MNIST,
    "experiments/distrans_table4_mnist.yaml": DISTRANS_MNIST,
}
# the CPU-sized files keep their table's data setting (the split and the rotation), at a smaller budget
DATA_SETTING = ("num-clients", "partition", "rotate")
CPU_SIZED = {
    "experiments/fedavg_rotmnist5k.yaml": ROTATED_MNIST,
    "experiments/quickstart.yaml": ROTATED_MNIST,
    "experiments/table1_rotmnist5k.yaml": ROTATED_MNIST,
    "experiments/table3_rotmnist5k.yaml": ROTATED_MNIST,
    "experiments/table4_rotmnist5k.yaml": ROTATED_MNIST,
    "experiments/baselines_rotmnist5k.yaml": ROTATED_MNIST,
    "experiments/feddyn_rotmnist5k.yaml": ROTATED_MNIST,
    "experiments/distrans_table1_mnist5k.yaml": DISTRANS_MNIST,
    "experiments/distrans_table4_mnist5k.yaml": DISTRANS_MNIST,
    "experiments/regimes_rotmnist5k.yaml": ROTATED_MNIST,
    "experiments/regimes_distrans_mnist5k.yaml": DISTRANS_MNIST,
    "experiments/robust_rotmnist5k.yaml": ROTATED_MNIST,
}


def planned_configs(path, tmp_path):
    from pathlib import Path

    from fedbr_flwr.core.config import load_yaml, validate

    full = Path(__file__).resolve().parents[1] / path
    if "sweep" not in load_yaml(full):
        return [validate(load_yaml(full))]
    return [cfg for _, _, cfg in sweep.plan(str(full), [], tmp_path, None, seeds=[0])]


def test_every_experiment_file_is_checked_against_its_papers_protocol():
    from pathlib import Path

    files = {f"experiments/{p.name}" for p in (Path(__file__).resolve().parents[1] / "experiments").glob("*.yaml")}
    assert files == set(PAPER_PROTOCOL) | set(CPU_SIZED)


@pytest.mark.parametrize("path", sorted(PAPER_PROTOCOL))
def test_the_gpu_sized_experiment_files_follow_their_papers_protocol(path, tmp_path):
    protocol = PAPER_PROTOCOL[path]
    for cfg in planned_configs(path, tmp_path):
        differ = {k: (cfg[k], v) for k, v in protocol.items() if k in cfg and cfg[k] != v}
        assert not differ, f"{path} ({cfg['strategy']}): (file, paper) {differ}"


@pytest.mark.parametrize("path", sorted(CPU_SIZED))
def test_the_cpu_sized_experiment_files_keep_their_tables_data_setting(path, tmp_path):
    for cfg in planned_configs(path, tmp_path):
        assert {k: cfg[k] for k in DATA_SETTING} == {k: CPU_SIZED[path][k] for k in DATA_SETTING}, path


def test_the_papers_cifar10_experiment_files_rotate_every_client(tmp_path):
    """FedBR paper, Appendix A: each CIFAR10 client rotates its images by an angle prior q ~ Dir(1.0); only
    Table 9 ("Clean CIFAR10", not covered here) does not."""
    for path in ("experiments/table2_cifar10.yaml", "experiments/table3_cifar10.yaml"):
        assert all(cfg["dataset"] == "cifar10" and cfg["rotate"] for cfg in planned_configs(path, tmp_path)), path


@pytest.mark.parametrize("path", ["experiments/table2_cifar10.yaml", "experiments/table3_cifar10.yaml"])
def test_fedbr_on_cifar10_uses_the_papers_lambda(path, tmp_path):
    """FedBR paper, Appendix A: lambda = 0.1 on CIFAR10 (1.0 on MNIST and CIFAR100)."""
    from pathlib import Path

    jobs = sweep.plan(str(Path(__file__).resolve().parents[1] / path), [], tmp_path, None, seeds=[0])
    fedbr = [cfg for _, _, cfg in jobs if cfg["strategy"] == "fedbr"]
    assert fedbr and all(cfg["dataset"] == "cifar10" and cfg["fedbr-lambda"] == 0.1 for cfg in fedbr)


GRID = """
num-clients: 2
num-rounds: 1
local-steps: 1
batch-size: 8
sweep:
  seeds: [0, 1]
  runs:
    FedAvg: {strategy: fedavg}
    FedBR: {strategy: fedbr}
  grid:
    lr: [0.01, 1e-3]
    local_steps: [1, 2]
"""


def test_a_grid_crosses_every_run_with_every_cell_and_seed_in_a_folder_per_cell(tmp_path):
    jobs = sweep.plan(write(tmp_path, GRID), ["num-rounds=3"], tmp_path / "out", None)
    assert len(jobs) == 2 * 2 * 2 * 2
    assert [(n.label, s) for n, s, _ in jobs[:4]] == [
        ("FedAvg lr=0.01,local-steps=1", 0),
        ("FedBR lr=0.01,local-steps=1", 0),
        ("FedAvg lr=0.01,local-steps=2", 0),
        ("FedBR lr=0.01,local-steps=2", 0),
    ]
    setting, seed, cfg = jobs[6]  # FedAvg, lr 1e-3 (read as 0.001), 2 local steps, seed 0
    assert (setting.run, setting.cell, seed) == ("FedAvg", (("lr", 0.001), ("local-steps", 2)), 0)
    assert cfg["lr"] == 0.001 and cfg["local-steps"] == 2 and cfg["num-rounds"] == 3 and cfg["strategy"] == "fedavg"
    assert cfg["output-dir"] == str(tmp_path / "out" / "FedAvg" / "local-steps=2,lr=0.001" / "seed0")  # key order
    assert len({cfg["output-dir"] for _, _, cfg in jobs}) == len(jobs)
    assert [s for _, s, _ in jobs] == [0] * 8 + [1] * 8


def test_a_grid_key_of_an_algorithm_a_run_does_not_use_is_not_crossed_with_it(tmp_path):
    text = GRID.replace("FedBR: {strategy: fedbr}", "DisTrans: {strategy: distrans}").replace(
        "local_steps: [1, 2]", "distrans-offset-lr: [0.001, 0.01, 0.1]\n    classes-per-client: [6, 2]"
    )
    text = text.replace("num-clients: 2", "num-clients: 2\npartition: classes")
    jobs = sweep.plan(write(tmp_path, text), [], tmp_path, None)
    labels = [n.label for n, s, _ in jobs if s == 0]
    assert labels.count("FedAvg lr=0.01,classes-per-client=6") == 1
    assert [x for x in labels if x.startswith("FedAvg")] == [
        f"FedAvg lr={lr},classes-per-client={c}" for lr in (0.01, 0.001) for c in (6, 2)
    ]
    assert len([x for x in labels if x.startswith("DisTrans")]) == 2 * 3 * 2
    assert "DisTrans lr=0.001,distrans-offset-lr=0.1,classes-per-client=2" in labels
    baseline = sweep.plan(write(tmp_path, text), [], tmp_path, ["FedAvg"])  # the baseline of the grid alone
    assert [n.label for n, s, _ in baseline if s == 0] == [x for x in labels if x.startswith("FedAvg")]


@pytest.mark.parametrize(
    "grid, message",
    [
        ("lrr: [0.1]", "unknown config key 'lrr'. Did you mean 'lr'\\?"),
        ("lr: [0.1, -1]", "run 'FedAvg' in cell lr=-1 \\(seed 0\\): config key 'lr' = -1.0 must be"),
        ("lr: []", "'sweep.grid.lr' must be a non-empty list"),
        ("lr: 0.1", "'sweep.grid.lr' must be a non-empty list"),
        ("lr: [0.1, {lr: 0.2}]", "all be values of one key, or all set the same keys"),
        ("budget: [{local-steps: 1, num-rounds: 2}, {local-steps: 2}]", "or all set the same keys"),
        ("budget: [{local-steps: 1, num-roundz: 2}]", "Did you mean 'num-rounds'\\?"),
        ("seed: [1, 2]", "key 'seed' is set by the sweep"),
        ("lr: [0.001, 1e-3]", "would share a run folder \\(lr=0.001, lr=1e-3\\)"),
        ("fedbr-mu: [0.1, 1]", "apply to none of the runs FedAvg"),
        ("local-steps: [1]\n    local_steps: [2]", "key 'local-steps' is listed twice"),
    ],
)
def test_bad_grids_stop_before_any_run(tmp_path, grid, message):
    text = SWEEP.replace("    FedBR no max: {strategy: fedbr, fedbr-max-step: false}\n", "") + f"  grid:\n    {grid}\n"
    with pytest.raises(ConfigError, match=message):
        sweep.plan(write(tmp_path, text), [], tmp_path / "out", None)


def test_a_grid_key_set_on_the_command_line_or_by_a_run_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="the command line sets lr, a factor of the grid"):
        sweep.plan(write(tmp_path, GRID), ["lr=0.5"], tmp_path / "out", None)
    text = GRID.replace("{strategy: fedbr}", "{strategy: fedbr, local-steps: 5}")
    with pytest.raises(ConfigError, match="run 'FedBR' sets local-steps, a factor of the grid"):
        sweep.plan(write(tmp_path, text), [], tmp_path / "out", None)


def test_seed_or_output_dir_on_a_sweeps_command_line_is_an_error_not_ignored(tmp_path):
    with pytest.raises(ConfigError, match="seed on the command line would be ignored"):
        sweep.plan(write(tmp_path), ["seed=3"], tmp_path / "out", None)
    with pytest.raises(ConfigError, match="output-dir on the command line would be ignored: .* use --out"):
        sweep.plan(write(tmp_path), ["output_dir=elsewhere"], tmp_path / "out", None)
    with pytest.raises(ConfigError, match="output-dir in .* would be ignored: .* use --out"):  # was ignored
        sweep.plan(write(tmp_path, "output-dir: /tmp/elsewhere\n" + GRID), [], tmp_path / "out", None)
    with pytest.raises(ConfigError, match="resume on the command line would be ignored: .* continues each unfinished"):
        sweep.plan(write(tmp_path), ["resume=true"], tmp_path / "out", None)  # every run failed: no checkpoint


@pytest.mark.parametrize(
    "decide, message",
    [
        ("{method: FedBR, baseline: FedAvgg}", "'sweep.decide'.baseline must name one of the runs"),
        ("{method: FedBR, baseline: FedBR}", "method and baseline are the same run"),
        ("{method: FedBR, baseline: FedAvg, metrics: [mean_acc]}", "Did you mean 'mean_acc_best5'\\?"),
        ("{method: FedBR, baseline: FedAvg, spread: -1}", "spread must be a number of standard deviations >= 0"),
        ("{method: FedBR, baseline: FedAvg, margin: 1}", "unknown key\\(s\\) margin"),
        ("{method: FedBR, baseline: FedAvg, metrics: [[x]]}", "unknown metric \\['x'\\]"),  # raised TypeError
        ("{method: [FedBR], baseline: FedAvg}", "'sweep.decide'.method must name one of the runs"),
    ],
)
def test_bad_decision_rules_stop_before_any_run(tmp_path, decide, message):
    with pytest.raises(ConfigError, match=message):
        sweep.plan(write(tmp_path, GRID + f"  decide: {decide}\n"), [], tmp_path / "out", None)


def test_a_rule_whose_baseline_is_crossed_with_a_key_its_method_is_not_stops_before_any_run(tmp_path):
    """It decided 0 of 0 cells, without a word: no FedAvg cell has one DisTrans cell to compare with."""
    text = GRID.replace("FedBR: {strategy: fedbr}", "DisTrans: {strategy: distrans}").replace(
        "local_steps: [1, 2]", "distrans-offset-lr: [0.001, 0.01]"
    )
    with pytest.raises(ConfigError, match="the baseline DisTrans is crossed with grid key\\(s\\) distrans-offset-lr"):
        sweep.plan(write(tmp_path, text + "  decide: {method: FedAvg, baseline: DisTrans}\n"), [], tmp_path, None)
    jobs = sweep.plan(write(tmp_path, text + "  decide: {method: DisTrans, baseline: FedAvg}\n"), [], tmp_path, None)
    assert len(jobs) == 2 * (2 + 2 * 2)


def test_a_rule_on_the_global_test_stops_before_runs_that_never_run_it(tmp_path):
    """Their summaries never hold global_acc_best5: every cell stayed "incomplete" however long they ran."""
    rule = "  decide: {method: FedBR, baseline: FedAvg, metrics: [mean_acc_best5, global_acc_best5]}\n"
    with pytest.raises(ConfigError, match="global_acc_best5, .*FedAvg, FedBR run\\(s\\) without it"):
        sweep.plan(write(tmp_path, GRID + rule), ["global-test=false"], tmp_path / "out", None)
    assert sweep.plan(write(tmp_path, GRID + rule), [], tmp_path / "out", None)


def test_a_table_of_only_one_side_of_the_rule_has_no_decisions(tmp_path, capsys):
    """--only FedAvg: the rule's method ran in no cell; the table said "0 of 0 cells" where it said nothing."""
    out = tmp_path / "out"
    path = write(tmp_path, GRID + "  decide: {method: FedBR, baseline: FedAvg}\n")
    for setting, seed, cfg in sweep.plan(path, [], out, ["FedAvg"]):
        fake_run(setting.folder(out, seed), cfg, [0.3, 0.5], last_round=cfg["num-rounds"])
    assert sweep.main([path, "--out", str(out), "--only", "FedAvg", "--table-only"]) == 0
    assert "against" not in (out / "comparison.md").read_text() and not (out / "decisions.png").exists()


@pytest.mark.parametrize("dry_run", [True, False])
def test_what_this_machine_cannot_run_stops_the_sweep_before_its_folder(tmp_path, capsys, dry_run):
    """device=cuda on a machine without CUDA stopped only the first run, after the sweep's lock file was written,
    and --dry-run passed it."""
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out"
    for setting in ("device=cuda", f"client-cpus={(os.cpu_count() or 1) + 1}"):
        code = sweep.main([write(tmp_path), setting, "--out", str(out), *(["--dry-run"] if dry_run else [])])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "FedAvg seed 0: " in err, err
        assert not out.exists()
    code = sweep.main([write(tmp_path), "device=cuda", "--out", str(out), "--table-only"])  # runs made elsewhere
    assert code == 2 and "holds no run of this sweep" in capsys.readouterr().err


def test_a_bad_grid_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert sweep.main([write(tmp_path, GRID.replace("local_steps", "local_stepz")), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Did you mean 'local-steps'?" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "where, message",
    [
        (["--out", "{tmp}/taken"], "--out {tmp}/taken cannot be used: it is a file, not a folder"),
        (["--out", "{tmp}/taken/out"], "in its path is a file, not a folder; pick another --out"),
        (["--out", "{tmp}/out", "--report", "{tmp}"], "--report {tmp} is a folder: give the markdown page"),
        # these stopped only after the runs, the second with a traceback
        (["--out", "{tmp}/out", "--report", "{tmp}/taken/page.md"], "--report's folder {tmp}/taken cannot be used"),
        (["--out", "{tmp}/out", "--report", "{tmp}/latin1.md"], "--report {tmp}/latin1.md is not UTF-8 text"),
    ],
    ids=["out-is-a-file", "out-under-a-file", "report-is-a-folder", "report-under-a-file", "report-not-utf8"],
)
def test_a_file_in_the_way_stops_a_sweep_before_its_runs(tmp_path, capsys, monkeypatch, where, message):
    (tmp_path / "taken").write_text("a file where a folder should be")
    (tmp_path / "latin1.md").write_bytes("# Résultats\n".encode("latin-1"))
    monkeypatch.setattr(sweep, "run_all", lambda *a: pytest.fail("the runs started"))
    argv = [write(tmp_path), *(w.format(tmp=tmp_path) for w in where), "--quiet"]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(tmp=tmp_path) in err
    assert not (tmp_path / "out").exists()


def test_dry_run_lists_every_run_of_a_grid(tmp_path, capsys):
    out = tmp_path / "out"
    assert sweep.main([write(tmp_path, GRID), "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 17 and lines[-1] == "16 runs (8 settings x 2 seeds)"
    folder = out / "FedAvg" / "local-steps=1,lr=0.01" / "seed0"
    assert lines[0] == f"FedAvg lr=0.01,local-steps=1 seed 0: strategy=fedavg local-steps=1 lr=0.01 -> {folder}"
    assert not out.exists()


def test_dry_run_shows_what_each_run_sets_that_the_others_do_not(tmp_path, capsys):
    """It showed only each run's strategy: "FedBR no max" read as FedBR. A key of FedBR's is not shown for
    FedAvg, which ignores it."""
    assert sweep.main([write(tmp_path), "--out", str(tmp_path / "out"), "--dry-run", "--seeds", "0"]) == 0
    lines = [line.split(" -> ")[0] for line in capsys.readouterr().out.splitlines()]
    assert lines[:2] == ["FedAvg seed 0: strategy=fedavg", "FedBR no max seed 0: strategy=fedbr fedbr-max-step=false"]


def test_a_grid_sweep_runs_each_cell_once_then_keeps_them(tmp_path, capsys, monkeypatch):
    """The grid's runs, each Flower run replaced by the files of a finished one; run again, every one is kept, and
    the comparison has one row per run and cell with the factors as columns."""
    ran = []

    def finished_run(plan, echo, host, watch=None):
        cfg = dict(plan.config)
        ran.append(plan.out_dir)
        accs = [0.1, 0.3 + cfg["lr"] * 10 + cfg["local-steps"] / 10]
        fake_run(plan.out_dir, cfg, accs, last_round=cfg["num-rounds"])

    monkeypatch.setattr(sweep.RunHost, "close", lambda self: None)
    monkeypatch.setattr(sweep, "run_flower", finished_run)
    path, out = write(tmp_path, GRID), tmp_path / "out"
    assert sweep.main([path, "--out", str(out), "--quiet", "--seeds", "0"]) == 0
    assert len(ran) == 8 and len(set(ran)) == 8
    assert (out / "FedBR" / "local-steps=2,lr=0.001" / "seed0" / "summary.json").exists()
    table = (out / "comparison.md").read_text().splitlines()
    assert table[4].startswith("| run | lr | local-steps | seeds | mean acc, best 5 (%) |")
    assert any(line.startswith("| FedAvg | 0.01 | 1 | 1 | 50.00 |") for line in table)
    assert any(line.startswith("| FedBR | 0.001 | 2 | 1 | 51.00 |") for line in table)
    capsys.readouterr()
    assert sweep.main([path, "--out", str(out), "--quiet", "--seeds", "0"]) == 0
    assert len(ran) == 8 and capsys.readouterr().out.count("already finished") == 8


def test_a_factor_of_mappings_moves_several_keys_together(tmp_path):
    budget = "budget: [{local-steps: 1, num-rounds: 4}, {local-steps: 2, num-rounds: 2}]"
    text = GRID.replace("local_steps: [1, 2]", budget)
    jobs = sweep.plan(write(tmp_path, text), [], tmp_path / "out", None, seeds=[0])
    assert [n.label for n, _, _ in jobs if n.run == "FedAvg"] == [
        "FedAvg lr=0.01,local-steps=1,num-rounds=4",
        "FedAvg lr=0.01,local-steps=2,num-rounds=2",
        "FedAvg lr=0.001,local-steps=1,num-rounds=4",
        "FedAvg lr=0.001,local-steps=2,num-rounds=2",
    ]
    assert all(cfg["local-steps"] * cfg["num-rounds"] == 4 for _, _, cfg in jobs)
    assert jobs[-1][2]["output-dir"].endswith("FedBR/local-steps=2,lr=0.001,num-rounds=2/seed0")


def test_the_regime_studies_plan_the_grids_their_comments_describe(tmp_path):
    """experiments/regimes_*.yaml (issue 43): the runs, cells and rules their comments fix before their runs."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "experiments"
    jobs = sweep.plan(str(root / "regimes_rotmnist5k.yaml"), [], tmp_path, None)
    assert len(jobs) == 72 and {s for _, s, _ in jobs} == {0, 1, 2}
    cfgs = [cfg for _, _, cfg in jobs]
    assert {c["model"] for c in cfgs} == {"lenet", "lenet-nonorm"} and {c["lr"] for c in cfgs} == {0.005, 0.016, 0.05}
    assert {c["local-steps"] for c in cfgs} == {10, 50} and {c["local-steps"] * c["num-rounds"] for c in cfgs} == {400}
    assert {c["strategy"] for c in cfgs} == {"fedavg", "fedbr"}
    rule = sweep.load_sweep(str(root / "regimes_rotmnist5k.yaml")).rule
    assert rule == sweep.Rule("FedBR", "FedAvg", ("mean_acc_best5", "worst_acc_best5", "rounds_to_target"), 1.0)
    jobs = sweep.plan(str(root / "regimes_distrans_mnist5k.yaml"), [], tmp_path, None)
    assert len(jobs) == 3 * (2 + 2 * 3)
    assert {c["distrans-offset-lr"] for _, _, c in jobs if c["strategy"] == "distrans"} == {0.001, 0.03, 1.0}


def test_a_second_sweep_into_the_same_out_stops_at_once_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """While one fedbr-sweep runs into --out (here: another process holding its lock), a second one stops with
    one line naming the holder, exit 2, before any run: it neither aborts in the middle at a locked run folder
    nor records the other's runs as failed."""
    import subprocess
    import sys

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom fedbr_flwr.runfiles import runlock\n"
         "with runlock.hold(sys.argv[1], 'sweep'):\n"
         "    print('held', flush=True)\n    sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(sweep, "run_flower", lambda *a, **k: pytest.fail("a run was started"))
        assert sweep.main([write(tmp_path, GRID), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"in use by another fedbr-sweep: pid {holder.pid} holds" in err[0]
        assert sorted(p.name for p in out.iterdir()) == [".fedbr-sweep.lock"]
    finally:
        holder.communicate("", timeout=30)


class RunsAtOnce:
    """A stand-in for ``run_flower`` in sweeps with --jobs: each run waits until two runs have been in progress at
    once (``hold``: until its watch stops it, as the launcher's loop would), then stops at the time limit after
    round ``stop_at[seed]`` or writes a finished run's files. It records which runs were in progress at once and
    the host and watch each was handed."""

    def __init__(self, stop_at=None, hold=False):
        import threading

        self.lock, self.hold, self.stop_at = threading.Lock(), hold, stop_at or {}
        self.running, self.most, self.hosts, self.watches, self.ran = set(), 0, {}, {}, []

    def __call__(self, plan, echo, host, watch=None):
        import time

        cfg = dict(plan.config)
        key = (cfg["strategy"], cfg["seed"])
        with self.lock:
            self.running.add(key)
            self.most = max(self.most, len(self.running))
            self.hosts[key], self.watches[key] = host, watch
            self.ran.append(key)
        try:
            if callable(echo):
                echo("[fedbr] round 1: a progress line")
            give_up = time.monotonic() + 20  # a sweep that never stops its runs fails rather than hangs
            while self.hold or self.most < 2:
                if watch.stop.is_set():
                    raise sweep.TimeLimitReached(watch.saved_round)
                assert time.monotonic() < give_up, f"run {key} was never stopped"
                time.sleep(0.01)
            if cfg["seed"] in self.stop_at:
                raise sweep.TimeLimitReached(self.stop_at[cfg["seed"]])
            fake_run(plan.out_dir, cfg, [0.3, 0.5], last_round=cfg["num-rounds"])
        finally:
            with self.lock:
                self.running.discard(key)


FOUR_SEEDS = SWEEP.replace("[0, 1]", "[0, 1, 2, 3]").replace(
    "    FedBR no max: {strategy: fedbr, fedbr-max-step: false}\n", ""
)


def test_a_sweep_with_jobs_runs_that_many_at_once_each_in_a_process_of_its_own(tmp_path, capsys, monkeypatch):
    """--jobs 2 over four runs: two go at once, each worker hands its runs one simulation process of its own
    (closed at the end), every run's progress line names it, and the table and the statuses are those of the
    sweep's order; run again, every run is kept."""
    fake, closed = RunsAtOnce(), []
    monkeypatch.setattr(sweep.RunHost, "close", lambda self: closed.append(self))
    monkeypatch.setattr(sweep, "run_flower", fake)
    path, out = write(tmp_path, FOUR_SEEDS), tmp_path / "out"
    assert sweep.main([path, "--out", str(out), "--jobs", "2"]) == 0
    assert fake.most == 2 and sorted(fake.ran) == [("fedavg", s) for s in range(4)]
    hosts = set(map(id, fake.hosts.values()))
    assert len(hosts) == 2 and sorted(map(id, closed)) == sorted(hosts)
    printed = capsys.readouterr().out
    assert "[2/4] FedAvg seed 1: [fedbr] round 1: a progress line" in printed
    assert printed.count(": ok\n") == 4 and "| FedAvg | 4 |" in (out / "comparison.md").read_text()
    assert sweep.main([path, "--out", str(out), "--jobs", "2"]) == 0
    assert len(fake.ran) == 4 and capsys.readouterr().out.count("already finished") == 4


def test_runs_at_once_stop_at_the_time_limit_start_no_other_and_each_says_where(tmp_path, capsys, monkeypatch):
    """Seeds 0 and 1 go at once and each stops at the time limit (after rounds 3 and 5); seeds 2 and 3 never
    start. One line per stopped run, in the sweep's order, exit 75."""
    fake = RunsAtOnce(stop_at={0: 3, 1: 5})
    monkeypatch.setattr(sweep, "run_flower", fake)
    monkeypatch.setattr(sweep, "shared_host", lambda jobs: __import__("contextlib").nullcontext(None))
    path, out = write(tmp_path, FOUR_SEEDS), tmp_path / "out"
    argv = [path, "--out", str(out), "--jobs", "2", "--time-limit", "1h", "--quiet"]
    assert sweep.main(argv) == 75
    assert sorted(fake.ran) == [("fedavg", 0), ("fedavg", 1)]
    err = capsys.readouterr().err.strip().splitlines()
    folder = out.resolve() / "FedAvg"
    assert err == [
        f"fedbr-sweep: time limit reached after round {r} of 1 in FedAvg seed {s} ({folder / f'seed{s}'}) "
        f"(checkpoint saved); continue with: fedbr-sweep {' '.join(argv)}"
        for s, r in ((0, 3), (1, 5))
    ]


def test_sigterm_stops_every_run_in_progress_at_once_and_starts_no_other(tmp_path, capsys, monkeypatch):
    """SIGTERM reaches the main thread while two runs go at once: both are stopped through their watches (the
    launcher then stops their processes), the other two never start, and the sweep exits 143."""
    import os
    import signal
    import threading

    fake = RunsAtOnce(hold=True)
    monkeypatch.setattr(sweep, "run_flower", fake)
    monkeypatch.setattr(sweep, "shared_host", lambda jobs: __import__("contextlib").nullcontext(None))

    def terminate_when_both_run():
        while len(fake.running) < 2:
            threading.Event().wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_both_run, daemon=True).start()
    handler = signal.getsignal(signal.SIGTERM)
    try:
        code = sweep.main([write(tmp_path, FOUR_SEEDS), "--out", str(tmp_path / "out"), "--jobs", "2", "--quiet"])
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert code == 143 and sorted(fake.ran) == [("fedavg", 0), ("fedavg", 1)] and not fake.running
    assert all(w.stop.is_set() for w in fake.watches.values())
    assert "stopped by SIGTERM" in capsys.readouterr().err


def test_an_error_in_one_of_the_runs_at_once_stops_the_others_and_exits_2(tmp_path, capsys, monkeypatch):
    """Seed 1's folder holds a finished run of other settings (a ConfigError in its worker; one there before
    the sweep stops it before any run, but another process may write it meanwhile): the run in progress beside
    it is stopped, no other starts, and the sweep stops with that one line, exit 2."""
    import threading
    import time

    fake, check = RunsAtOnce(hold=True), sweep.finished_with_same_config

    def after_seed_0_started(cfg, say_damaged=True):
        if threading.current_thread() is threading.main_thread():
            return False  # the check before the runs: the folder is written only after it
        while cfg["seed"] == 1 and not fake.running:
            time.sleep(0.01)
        return check(cfg, say_damaged)

    monkeypatch.setattr(sweep, "run_flower", fake)
    monkeypatch.setattr(sweep, "finished_with_same_config", after_seed_0_started)
    monkeypatch.setattr(sweep, "shared_host", lambda jobs: __import__("contextlib").nullcontext(None))
    path, out = write(tmp_path, FOUR_SEEDS), tmp_path / "out"
    (_, _, cfg) = sweep.plan(path, [], out.resolve(), None)[1]
    fake_run(out / "FedAvg" / "seed1", {**cfg, "lr": 0.5}, [0.3])
    (out / "FedAvg" / "seed1" / "summary.json").write_text(json.dumps({"last_round": cfg["num-rounds"]}))
    assert sweep.main([path, "--out", str(out), "--jobs", "2", "--quiet"]) == 2
    assert fake.ran == [("fedavg", 0)] and fake.watches[("fedavg", 0)].stop.is_set()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a finished run with different settings (lr)" in err[0]


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_jobs_below_one_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, jobs):
    out = tmp_path / "out"
    assert sweep.main([write(tmp_path), "--out", str(out), "--jobs", jobs]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedbr-sweep: error: --jobs {jobs}: give how many runs may go at once, 1 or more"]
    assert not out.exists()


def test_a_backbone_with_batchnorm_stops_the_sweep_before_any_run(tmp_path, capsys, monkeypatch):
    """Each run failed in its first client (exit 1 for the sweep, a folder per run)."""
    from torch import nn

    from fedbr_flwr.core.model import MODELS, ModelInfo

    bn = ModelInfo(8, lambda c, s: nn.Sequential(nn.Flatten(), nn.Linear(c * s * s, 8), nn.BatchNorm1d(8)))
    monkeypatch.setitem(MODELS, "mlp-bn", bn)
    ran = runs_that_finish(monkeypatch)
    out = tmp_path / "out"
    assert sweep.main([write(tmp_path, SWEEP.replace("cnn-small", "mlp-bn")), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FedAvg seed 0: model 'mlp-bn' has BatchNorm (2)" in err[0], err
    assert not ran and not out.exists()


@pytest.mark.parametrize("stop, code", [(KeyboardInterrupt, 130), (SystemExit(143), 143)])
def test_a_sweep_stopped_as_it_writes_its_table_says_how_to_continue(tmp_path, capsys, monkeypatch, stop, code):
    """Ctrl-C in the second its table takes (its plot) ended the sweep with a traceback, SIGTERM with exit 143 and
    no line: now each gives its exit code and the line with the command that writes the table."""
    path = write(tmp_path)
    out = tmp_path / "out"
    monkeypatch.setattr(sweep, "run_all", lambda *a, **k: {})

    def stopped(*args, **kwargs):
        raise stop

    monkeypatch.setattr(sweep, "write_comparison", stopped)
    try:
        got = sweep.main([path, "--out", str(out), "--quiet"])
    except BaseException as exc:  # noqa: BLE001 - a Ctrl-C out of the test would stop pytest itself
        pytest.fail(f"the stop came out of the sweep: {exc!r}")
    assert got == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"continue with: fedbr-sweep {path} --out {out} --quiet" in err, err
