"""fedbr-sweep: the plan of runs, its errors, resuming (no processes), plus one short real sweep. Its
tables, plots and results page: test_report.py."""

import json
import re
import shutil

import pytest

from fedbr_flwr import sweep
from fedbr_flwr.config import ConfigError

SWEEP = """
num-clients: 2
num-rounds: 1
local-steps: 1
batch-size: 8
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
    assert [(n, s) for n, s, _ in jobs] == [("FedAvg", 0), ("FedBR no max", 0), ("FedAvg", 1), ("FedBR no max", 1)]
    cfg = dict(jobs[1][2])
    assert cfg["num-rounds"] == 3 and cfg["local-steps"] == 4 and cfg["strategy"] == "fedbr"
    assert cfg["fedbr-max-step"] is False and cfg["seed"] == 0
    assert cfg["output-dir"] == str(tmp_path / "out" / "FedBR_no_max" / "seed0")
    only = sweep.plan(write(tmp_path), [], tmp_path / "out", ["FedAvg"], seeds=[5])
    assert [(n, s) for n, s, _ in only] == [("FedAvg", 5)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("num-rounds: 1\n", "needs a 'sweep' block"),
        ("sweep:\n  runs: {A: {strategy: nope}}\n", "run 'A' \\(seed 0\\): unknown strategy 'nope'"),
        ("sweep:\n  seeds: 3\n  runs: {A: {}}\n", "must be a list"),
        ("sweep:\n  runs: {A: {}}\n  seed: [1]\n", "unknown key"),
        ("sweep:\n  title: [a]\n  runs: {A: {}}\n", "'sweep.title' must be a string"),
        ("sweep:\n  runs: {'a b': {}, 'a/b': {}}\n", "must differ"),
        ("sweep:\n  runs: {A: {strategy: fedavg, fedbr-mu: 2.0}}\n", r"belongs to fedbr \(strategy=fedbr\)"),
    ],
)
def test_bad_sweep_files_stop_before_any_run(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        sweep.plan(write(tmp_path, text), [], tmp_path / "out", None)


def test_only_with_an_unknown_name_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown runs: Nope"):
        sweep.plan(write(tmp_path), [], tmp_path / "out", ["Nope"])


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


def test_a_sweep_runs_each_job_in_order_then_keeps_them(tmp_path, capsys, monkeypatch):
    """The loop over several jobs, each Flower run replaced by the files of a finished one (a real one: below).
    Every run is handed the one simulation process the sweep keeps (``launcher.RunHost``), closed at the end."""
    ran, hosts = [], []

    def finished_run(cfg, supernodes, out_dir, echo, host):
        ran.append((cfg["strategy"], cfg["seed"], supernodes, echo, out_dir))
        hosts.append(host)
        fake_run(out_dir, cfg, [0.3, 0.5], last_round=cfg["num-rounds"])

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


def records(folder):
    """A run's per-round records without the fields that measure the machine (time, memory, Ray's node ids)."""
    timed = ("seconds", "time", "elapsed", "wall", "rss", "nodes")
    lines = [json.loads(x) for f in ("metrics.jsonl", "rounds.jsonl") for x in (folder / f).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in lines]


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["auto", "ray"])
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
}


def planned_configs(path, tmp_path):
    from pathlib import Path

    from fedbr_flwr.config import load_yaml, validate

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
