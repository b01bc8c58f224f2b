"""fedbr-run input handling: every bad input stops before Flower starts, with one clear message."""

import json
import re

import pytest

from fedbr_flwr.commands import cli
from fedbr_flwr.core.config import ConfigError
from fedbr_flwr.launch import plan


def run_cli(capsys, *args):
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_unknown_key_is_one_clear_error(capsys, tmp_path):
    code, _, err = run_cli(capsys, "num-round=3", f"output-dir={tmp_path}")
    assert code == 2
    assert "unknown config key 'num-round'" in err and "num-rounds" in err
    assert "Traceback" not in err


def test_wrong_type_in_yaml(capsys, tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("lr: fast\n")
    code, _, err = run_cli(capsys, str(exp))
    assert code == 2 and "'lr' must be float" in err


def test_malformed_yaml(capsys, tmp_path):
    exp = tmp_path / "bad.yaml"
    exp.write_text("lr: [0.1\n")
    code, _, err = run_cli(capsys, str(exp))
    assert code == 2 and "not valid YAML" in err


def test_a_huge_batch_stops_before_anything_is_written(capsys, tmp_path):
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "batch-size=1e9", f"output-dir={out}")
    assert code == 2 and "exceeds the 4500 training images" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "settings, message",
    [
        (["attack=sign-flip", "attack-clients=20"], "attack-clients = 20 attackers, but the run has 10 clients"),
        (["aggregation=krum", "byzantine-clients=5"], "at least 13 clients a round, but 10 are sampled"),
        (["aggregation=trimmed-mean", "trim-fraction=0.05"], "of the 10 clients sampled a round"),
    ],
)
def test_what_depends_on_the_client_count_is_checked_with_the_count_fedbr_run_starts(
    capsys, tmp_path, settings, message
):
    """With num-clients unset (0: one per SuperNode), these stopped only inside the started run (exit 1)."""
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, *settings, f"output-dir={out}")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_missing_dataset_names_the_path(capsys, tmp_path):
    missing = tmp_path / "nowhere"
    code, _, err = run_cli(
        capsys, "dataset=mnist", f"data-dir={missing}", "download=never", f"output-dir={tmp_path / 'o'}"
    )
    assert code == 2
    assert str(missing) in err and "data-dir" in err and "FEDBR_DATA_DIR" in err


def test_gpu_share_without_cuda_is_refused():
    cfg = plan.build_config(["client-gpus=0.5"])
    with pytest.raises(ConfigError, match="no CUDA"):
        plan.size_resources(cfg, cuda_available=False, cpu_count=2)


def test_cohort_step_graph_without_cuda_is_refused_before_anything_starts():
    cfg = plan.build_config(["engine=cohort", "cohort-step=graph"])
    with pytest.raises(ConfigError, match="cohort-step=graph replays CUDA graphs but torch sees no CUDA device"):
        plan.size_resources(cfg, cuda_available=False, cpu_count=2)
    assert plan.size_resources(cfg, cuda_available=True, cpu_count=16)["cohorts"] == 1  # one GPU: one cohort


def test_gpu_fraction_is_chosen_when_cuda_is_present():
    cfg = plan.size_resources(plan.build_config(["num-clients=10"]), cuda_available=True, cpu_count=16)
    assert cfg["client-gpus"] == pytest.approx(0.25)
    cfg = plan.size_resources(plan.build_config(["num-clients=2"]), cuda_available=True, cpu_count=16)
    assert cfg["client-gpus"] == pytest.approx(0.5)
    cfg = plan.size_resources(plan.build_config(["device=cpu"]), cuda_available=True, cpu_count=16)
    assert cfg["client-gpus"] == 0.0


def test_a_run_plan_is_made_once_read_only_and_changed_only_into_a_new_plan(tmp_path):
    out = tmp_path / "run"
    clients = plan.plan_run(plan.build_config(["num-clients=3", f"output-dir={out}"]), overwrite=False)
    assert (clients.supernodes, clients.out_dir, clients.settings.backend) == (3, out, "in-process")
    with pytest.raises(TypeError):
        clients.config["lr"] = 1.0  # type: ignore[index]
    stopped = clients.with_keys({"checkpoint-every": 1})
    assert stopped.settings.checkpoint_every == stopped.config["checkpoint-every"] == 1
    assert clients.settings.checkpoint_every != 1
    cohorts = plan.plan_run(
        plan.build_config(["engine=cohort", "cohorts=2", "num-clients=6", f"output-dir={tmp_path / 'c'}"]), False
    )
    assert cohorts.supernodes == 2


def test_too_many_cpus_per_client_is_refused():
    with pytest.raises(ConfigError, match="cores"):
        plan.size_resources(plan.build_config(["client-cpus=64"]), cuda_available=False, cpu_count=2)


def test_dry_run_resolves_absolute_paths_and_sizes(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys, "--dry-run", "seed=3", "output-dir=rel/out")
    assert code == 0
    assert f"output-dir = '{tmp_path / 'rel' / 'out'}'" in out
    assert "num-clients = 10" in out  # 0 = one per SuperNode; fedbr-run starts 10
    assert "seed = 3" in out


def test_later_items_override_earlier(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("lr: 0.1\nseed: 1\n")
    b.write_text("lr: 0.2\n")
    cfg = plan.build_config([str(a), str(b), "seed=5"])
    assert cfg["lr"] == 0.2 and cfg["seed"] == 5


def test_a_value_ending_in_yaml_is_an_override_and_a_file_with_an_equals_sign_an_experiment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plan.settings_from(["wandb-project=runs.yaml"]) == {"wandb-project": "runs.yaml"}
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "lr=0.1.yaml").write_text("lr: 0.1\n")
    (tmp_path / "seed=2.yml").write_text("seed: 2\n")
    assert plan.settings_from(["runs/lr=0.1.yaml", "seed=2.yml"]) == {"lr": 0.1, "seed": 2}


def test_existing_run_is_not_overwritten(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 2}) + "\n")
    code, _, err = run_cli(capsys, f"output-dir={tmp_path}")
    assert code == 2 and "--overwrite" in err


@pytest.mark.parametrize("flag", ["--list", "--write-docs", "--write-pyproject"])
def test_list_with_settings_is_refused_rather_than_leaving_them_unread(capsys, monkeypatch, flag):
    monkeypatch.setattr(cli, "write_pyproject", lambda: pytest.fail("rewrote pyproject.toml"))
    monkeypatch.setattr(cli, "write_configuration_page", lambda: pytest.fail("rewrote the configuration page"))
    code, out, err = run_cli(capsys, flag, "lr=abc")
    assert (
        code == 2
        and out == ""
        and err == f"fedbr-run: error: {flag} takes no settings or experiment files (got 'lr=abc')\n"
    )


def test_quiet_and_verbose_together_are_refused_rather_than_one_ignored(capsys, tmp_path):
    small = ["model=lenet", "num-clients=2", "num-rounds=1", "local-steps=1"]  # what ran, one of them ignored
    code, out, err = run_cli(capsys, "--quiet", "--verbose", *small, f"output-dir={tmp_path / 'run'}")
    assert code == 2 and out == ""
    assert err == "fedbr-run: error: --quiet and --verbose contradict each other: give one\n"
    assert not list(tmp_path.iterdir())


def test_list_shows_strategies_and_keys(capsys):
    code, out, _ = run_cli(capsys, "--list")
    assert code == 0 and "fedavg" in out and "local-steps" in out
    assert "  fedcm = fedavg + fedcm: FedCM: FedAvg + client-level momentum" in out
    assert "fedbr keys (strategy=fedbr):\n  fedbr-lambda (1.0)" in out and "mixup-alpha (0.2)" in out


@pytest.mark.parametrize(
    "files, says, not_says",
    [
        # what `fedbr-deploy local --supernodes 0` used to leave: empty line files and no checkpoint
        (
            {"metrics.jsonl": "", "rounds.jsonl": ""},
            "empty files of a run that stopped before its first round",
            "--resume",
        ),
        ({"rounds.jsonl": '{"round": 1}\n'}, "without a checkpoint, so it cannot be resumed", "--resume"),
        ({"metrics.jsonl": '{"round": 5}\n', "checkpoint.npz": "x"}, "`fedbr-run --resume", None),
        # a folder of other work: a run removed its offsets.npz and rewrote its manifest.json without a word
        ({"manifest.json": '{"name": "my app"}', "offsets.npz": "x"}, "holds manifest.json, offsets.npz", "--resume"),
    ],
)
def test_a_used_folder_offers_resume_only_when_there_is_a_checkpoint(capsys, tmp_path, files, says, not_says):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    code, _, err = run_cli(capsys, f"output-dir={tmp_path}", "--dry-run")
    assert code == 2 and says in err and "--overwrite" in err
    assert not_says is None or not_says not in err
    assert run_cli(capsys, f"output-dir={tmp_path}", "--dry-run", "--overwrite")[0] == 0


@pytest.mark.parametrize(
    "role, holder",
    [("launcher", "the command that started it"), ("writer", "its ServerApp, which writes the run files")],
)
def test_a_folder_locked_by_a_live_process_is_refused_and_a_dead_ones_lock_is_not(capsys, tmp_path, role, holder):
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "checkpoint.npz").write_text("not read: the lock is checked first")
    holding = (
        "import sys, time\nfrom pathlib import Path\nfrom fedbr_flwr.runfiles import runlock\n"
        f"with runlock.hold(Path(sys.argv[1]), role={role!r}):\n"
        "    print('held', flush=True)\n    time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", holding, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(cli.__file__).resolve().parent.parent,
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        for args in (["--resume", str(tmp_path)], [f"output-dir={tmp_path}", "--overwrite", "--dry-run"]):
            code, _, err = run_cli(capsys, *args)
            assert code == 2
            assert f"{tmp_path} is in use by a live run: pid {proc.pid} ({holder})" in err, err
    finally:
        proc.kill()
        proc.wait()
    # its lock file stays, but a dead process holds no lock
    assert run_cli(capsys, f"output-dir={tmp_path}", "--overwrite", "--dry-run")[0] == 0


def test_the_loser_of_two_runs_started_at_once_into_one_folder_exits_2(capsys, tmp_path, monkeypatch):
    """Both pass the checks, then the other run takes the folder first: the launch refuses with exit 2 (bad
    input: the folder is taken), before any Flower process starts."""
    import subprocess
    import sys
    from pathlib import Path

    from fedbr_flwr.launch import launcher

    holding = (
        "import sys, time\nfrom pathlib import Path\nfrom fedbr_flwr.runfiles import runlock\n"
        "with runlock.hold(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(120)\n"
    )
    prepare = plan.prepare
    holder: list[subprocess.Popen] = []

    def prepare_then_lose_the_race(cfg, overwrite):
        cfg = prepare(cfg, overwrite)
        proc = subprocess.Popen([sys.executable, "-c", holding, cfg["output-dir"]], stdout=subprocess.PIPE, text=True)
        holder.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return cfg

    monkeypatch.setattr(plan, "prepare", prepare_then_lose_the_race)
    monkeypatch.setattr(launcher, "simulate_run", lambda *a: pytest.fail("Flower started"))
    try:
        code, _, err = run_cli(capsys, f"output-dir={tmp_path / 'run'}", "num-clients=2")
        assert code == 2, err
        assert f"{Path(tmp_path / 'run')} is in use by a live run: pid {holder[0].pid}" in err, err
    finally:
        for proc in holder:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "items, message",
    [
        (["lr={[1]: 2}"], "config key 'lr' must be float"),  # TypeError: unhashable type: 'list'
        (["lr=!!float abc"], "config key 'lr' must be float"),  # ValueError from YAML's float constructor
        (["output-dir=2024-13-01"], None),  # a date YAML could not build: the text is the folder's name
        (["git-commit=abc\x01"], "holds a control character"),  # an invalid run_config.toml, and its folder
        (["data-dir=/tmp/d\udcff"], "bytes that are not UTF-8"),  # an argument's undecodable byte
        (["output-dir=~nosuchuser_fedbr/x"], "the home folder of an unknown user"),
        (["--resume", "~nosuchuser_fedbr/x"], "the home folder of an unknown user"),
        (["--resume", "x\udcff"], "bytes that are not UTF-8"),
        (["--resume", ""], "--resume needs the folder of the run to continue"),  # ignored: a new run started
    ],
    ids=[
        "unhashable",
        "float-tag",
        "date",
        "control",
        "not-utf8",
        "user",
        "resume-user",
        "resume-utf8",
        "resume-empty",
    ],
)
def test_a_value_no_run_can_take_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch, items, message):
    """Each raised a traceback (exit 1), or wrote the run's folder before failing, or was ignored."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, *items, "--dry-run")
    if message is None:
        assert code == 0 and "2024-13-01" in out
        return
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "command, args, message",
    [
        ("fedbr-run", ["--bogus"], "fedbr-run: error: unrecognized arguments: --bogus (see fedbr-run --help)"),
        ("fedbr-run", ["--resume"], "argument --resume: expected one argument"),
        ("fedbr-sweep", ["experiments/quickstart.yaml", "--seeds", "abc"], "argument --seeds: invalid seed 'abc'"),
        ("fedbr-deploy", ["bogus"], "argument command: invalid choice: 'bogus'"),
        ("fedbr-bench", ["--bogus"], "fedbr-bench: error: unrecognized arguments: --bogus"),
        # an abbreviation went into a report's command as written, to mean something else to a later parser
        ("fedbr-sweep", ["experiments/quickstart.yaml", "--table"], "unrecognized arguments: --table (see"),
        ("fedbr-run", ["--dry"], "fedbr-run: error: unrecognized arguments: --dry (see fedbr-run --help)"),
        # argparse also named the optional overrides as required
        ("fedbr-sweep", ["--out", "x"], "fedbr-sweep: error: the following arguments are required: file (see"),
    ],
)
def test_a_flag_argparse_refuses_is_one_line_and_exit_2(capsys, command, args, message):
    """argparse printed the whole usage before its error: 3 to 6 lines."""
    from fedbr_flwr import bench
    from fedbr_flwr.commands import deploy, sweep

    main = {"fedbr-run": cli.main, "fedbr-sweep": sweep.main, "fedbr-deploy": deploy.main, "fedbr-bench": bench.main}
    with pytest.raises(SystemExit) as stop:
        main[command](args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_the_later_of_two_spellings_of_a_key_wins(capsys, tmp_path):
    """num_rounds=3 num-rounds=4 num_rounds=5 ran 4 rounds: the first spelling kept its place in the dict."""
    code, out, _ = run_cli(capsys, "num_rounds=3", "num-rounds=4", "num_rounds=5", "--dry-run")
    assert code == 0 and re.search(r"num-rounds\s*=?\s*5\b", out), out


@pytest.mark.parametrize("command", ["fedbr-run", "fedbr-run --resume", "fedbr-sweep"])
def test_an_over_long_path_is_one_line_and_exit_2(capsys, tmp_path, command):
    from fedbr_flwr.commands import sweep

    long_path = str(tmp_path / ("a" * 5000))
    if command == "fedbr-run":
        code, _, err = run_cli(capsys, f"output-dir={long_path}", "--dry-run")
    elif command == "fedbr-run --resume":
        code, _, err = run_cli(capsys, "--resume", long_path)
    else:
        code = sweep.main(["experiments/quickstart.yaml", "--out", long_path, "--dry-run"])
        err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is too long for this system" in err, err
    assert len(err) < 400 and not list(tmp_path.iterdir())


def test_a_path_is_too_long_only_past_the_system_s_limits(monkeypatch):
    """A name may have NAME_MAX bytes; PATH_MAX counts the closing NUL, so a path may have PATH_MAX - 1."""
    from pathlib import Path

    from fedbr_flwr.runfiles import run_io

    monkeypatch.setattr(run_io.os, "pathconf", lambda path, name: {"PC_NAME_MAX": 8, "PC_PATH_MAX": 32}[name])
    run_io.check_path_length(Path("/" + "a" * 8))
    run_io.check_path_length(Path("/" + "abcdefg/" * 3 + "abcdef"))  # 31 bytes
    for too_long in ("/" + "a" * 9, "/" + "abcdefg/" * 3 + "abcdefg"):
        with pytest.raises(ConfigError, match="is too long for this system"):
            run_io.check_path_length(Path(too_long))


@pytest.mark.parametrize(
    "command", [["fedbr-sweep", "experiments/quickstart.yaml", "--dry-run"], ["fedbr-run", "--list"]]
)
def test_a_command_whose_reader_left_stops_without_a_traceback(command):
    """`fedbr-sweep x.yaml --dry-run | head -1` printed a BrokenPipeError traceback when head had gone."""
    import os
    import subprocess
    from pathlib import Path

    read, write = os.pipe()
    os.close(read)  # the reader left before the first line: every write fails
    try:
        proc = subprocess.run(
            command, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, cwd=Path(__file__).parents[1]
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_broken_pipe_that_is_not_standard_output_still_raises():
    from fedbr_flwr.core.errors import quiet_when_its_reader_leaves

    @quiet_when_its_reader_leaves
    def main() -> int:
        raise BrokenPipeError("a child's stdin")

    with pytest.raises(BrokenPipeError):
        main()


TINY = ("num-clients=2", "num-rounds=1", "local-steps=1", "batch-size=8")  # a short run where the check is missed


def test_a_backbone_with_batchnorm_stops_before_the_run_starts(capsys, tmp_path, monkeypatch):
    """It stopped in the started run's first client (exit 1, after the run's folder was written)."""
    from torch import nn

    from fedbr_flwr.core.model import MODELS, ModelInfo

    bn = ModelInfo(8, lambda c, s: nn.Sequential(nn.Flatten(), nn.Linear(c * s * s, 8), nn.BatchNorm1d(8)))
    monkeypatch.setitem(MODELS, "mlp-bn", bn)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "model=mlp-bn", *TINY, f"output-dir={out}")
    assert code == 2 and err.count("\n") == 1 and "model 'mlp-bn' has BatchNorm (2)" in err, err
    assert not out.exists()


def test_a_client_metric_named_as_a_record_field_stops_before_the_run_starts(capsys, tmp_path, monkeypatch):
    """It stopped at the run's first evaluation (exit 1), with its training rounds spent."""
    from fedbr_flwr.runfiles import metrics

    monkeypatch.setitem(metrics.CLIENT_METRICS, "global_worst_acc", metrics.CLIENT_METRICS["mean_acc"])
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, *TINY, f"output-dir={out}")
    assert code == 2 and err.count("\n") == 1 and "client metric(s) global_worst_acc have the name" in err, err
    assert not out.exists()


def test_ctrl_c_in_the_checks_before_a_run_is_one_line_and_exit_130(capsys, monkeypatch):
    """Ctrl-C as fedbr-run checked its config or fetched its data ended with a KeyboardInterrupt traceback."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "plan_run", interrupted)
    monkeypatch.setattr(cli, "early_host", lambda args: None)
    try:
        code, _, err = run_cli(capsys, "num-rounds=1")
    except KeyboardInterrupt:
        pytest.fail("the interrupt left fedbr-run")
    assert code == 130 and err == "fedbr-run: interrupted before the run started\n"
