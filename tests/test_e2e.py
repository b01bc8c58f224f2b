"""End to end through Flower's simulation (in a process of its own, in the simulation process the tests
share, or through `flwr run` on a private local SuperLink). Every process a test starts is stopped by the
launcher, also when the run fails; the tests check that nothing is left behind."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import flower_processes

from fedbr_flwr.commands import cli, report
from fedbr_flwr.core.config import validate
from fedbr_flwr.launch import plan
from fedbr_flwr.launch.launcher import RunFailed, RunHost, run_flower
from fedbr_flwr.launch.protocol import RunPlan
from fedbr_flwr.launch.timelimit import EXIT_TIME_LIMIT
from fedbr_flwr.runfiles.metrics import read_jsonl

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def shared_host(tmp_path_factory):
    """One simulation process (``launcher.RunHost``, what a sweep runs its runs in) for the runs of the tests
    that need no process, Ray runtime or plugins of their own; stopped with all it started at the end."""
    with RunHost() as host:
        yield host


class Borrowed:
    """The shared simulation process as fedbr-run's own early one (``cli.early_host``), which it must not stop."""

    def __init__(self, host: RunHost):
        self.host = host

    def __getattr__(self, name):
        return getattr(self.host, name)

    def close(self) -> None:
        pass


@pytest.fixture
def on_shared_host(shared_host, tmp_path_factory, monkeypatch):
    """``fedbr-run`` (``cli.main``) in this test runs its run in the shared simulation process, warmed up by a
    first one-round run before the test (again after a run that ended it), so that the processes the test
    counts before its run are those that stay."""
    monkeypatch.setattr(cli, "early_host", lambda args: Borrowed(shared_host))
    if shared_host.proc is None or shared_host.proc.poll() is not None:
        warm = tmp_path_factory.mktemp("warm-up")
        assert (
            cli.main(
                ["num-clients=2", "num-rounds=1", "local-steps=1", "model=cnn-small", f"output-dir={warm}", "--quiet"]
            )
            == 0
        )


@pytest.mark.parametrize("launch", [[], ["--superlink"]], ids=["simulation-process", "flwr-run-on-a-superlink"])
def test_two_rounds_two_clients_write_the_run_files(tmp_path, capsys, launch):
    """Both ways fedbr-run starts Flower (its simulation entry point in one process; `flwr run` on a SuperLink,
    as a Flower user would) write the same complete run files and leave no process behind."""
    before = flower_processes()
    out = tmp_path / "run"
    code = cli.main(
        [
            "num-clients=2",
            "num-rounds=2",
            "local-steps=2",
            "batch-size=16",
            "eval-every=1",
            "model=cnn-small",
            f"output-dir={out}",
            "--quiet",
            *launch,
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "mean local-test acc" in printed  # the summary table

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [1, 2]
    for r in lines:
        assert set(r["per_client_acc"]) == {"0", "1"}
        assert r["worst_acc"] <= r["mean_acc"] and 0 <= r["global_acc"] <= 1 and r["wall_time"] > 0
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2] and all(r["clients"] == 2 for r in rounds)

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["num-clients"] == 2 and manifest["seed"] == 0
    assert len(manifest["partition_hash"]) == 16 and manifest["packages"]["flwr"] == "1.41.0"
    assert manifest["git_commit"] and manifest["code_hash"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluations"] == 2 and summary["last_round"] == 2
    assert (out / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(np.load(out / "partition.npz").files) == ["test_0", "test_1", "train_0", "train_1"]
    assert flower_processes() <= before


@pytest.mark.long
def test_a_superlink_run_stops_at_its_time_limit_and_resumes_to_what_an_unstopped_run_gives(tmp_path, capsys):
    """`--time-limit` with `--superlink`: the launcher stops Flower after the checkpoint of the last round that
    fits, exits 75 and leaves no process; `--resume` continues through a SuperLink to the records that a run
    never stopped writes."""
    before = flower_processes()
    tiny = ["num-clients=2", "local-steps=2", "batch-size=16", "eval-every=10", "model=cnn-small", "global-test=false"]
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    code = cli.main(  # a limit past a slow 2-core machine's start-up of the SuperLink and its nodes (over 25 s)
        [*tiny, "num-rounds=100000", f"output-dir={stopped}", "--time-limit", "60s", "--quiet", "--superlink"]
    )
    assert code == EXIT_TIME_LIMIT, capsys.readouterr().err
    done = [r["round"] for r in read_jsonl(stopped / "rounds.jsonl")]
    assert done == list(range(1, len(done) + 1)) and done
    assert flower_processes() <= before
    end = len(done) + 3
    code = cli.main(["--resume", str(stopped), f"num-rounds={end}", "--quiet", "--superlink"])
    assert code == 0, capsys.readouterr().err
    assert cli.main([*tiny, f"num-rounds={end}", f"output-dir={whole}", "--quiet"]) == 0
    for name, keys in (("rounds.jsonl", ("round", "train")), ("metrics.jsonl", ("round", "loss", "per_client_acc"))):
        got, want = ([{k: r[k] for k in keys} for r in read_jsonl(out / name)] for out in (stopped, whole))
        assert got == want and got[-1]["round"] == end
    assert flower_processes() <= before


def test_failed_run_raises_with_the_reason_and_leaves_no_process(tmp_path):
    before = flower_processes()
    # 3 clients configured, but only 2 SuperNodes started: the clients refuse, the run fails.
    cfg = validate({"num-clients": 3, "num-rounds": 1, "local-steps": 1, "output-dir": str(tmp_path)})
    with pytest.raises(RunFailed, match="finished:failed"):
        run_flower(dataclasses.replace(RunPlan.of(cfg), supernodes=2), echo="none")
    assert "num-supernodes=3" in (tmp_path / "flower.log").read_text()
    assert flower_processes() <= before


@pytest.mark.parametrize(
    "extra",
    [
        # RSM sent once, to each client the first time it is sampled; with seed 0 client 1 is sampled in
        # rounds 1 and 2, so round 2 trains from the copy it kept in its context.state
        ["fraction-fit=0.5", "num-rounds=3"],
        # the mixture refreshed every round, and two components through Flower's messages: FedCM's Delta (a
        # server component's arrays beside FedBR's) and Mixup (local only)
        ["pseudo-data=mixture", "pseudo-refresh=every-round", "fedbr-with=fedcm,mixup", "num-rounds=2"],
    ],
)
def test_fedbr_run_completes_and_records_its_terms(tmp_path, extra, on_shared_host):
    before = flower_processes()
    out = tmp_path / "run"
    code = cli.main(
        [
            "strategy=fedbr",
            "num-clients=2",
            "local-steps=2",
            "batch-size=8",
            "eval-every=1",
            "model=cnn-small",
            f"output-dir={out}",
            "--quiet",
            *extra,
        ]
    )
    assert code == 0
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1)) and len(rounds) >= 2
    assert all({"ce", "balance", "con", "con-max", "loss"} <= set(r["train"]) for r in rounds)
    assert all(r["failures"] == 0 and r["clients"] >= 1 and np.isfinite(r["train"]["loss"]) for r in rounds)
    pseudo = np.load(out / "pseudo_data.npz")
    assert pseudo["x"].shape == (8, 1, 28, 28) and int(pseudo["version"]) == (
        len(rounds) if "mixture" in extra[0] else 1
    )
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in metrics] == [r["round"] for r in rounds]
    assert json.loads((out / "manifest.json").read_text())["config"]["strategy"] == "fedbr"
    assert (out / "summary.md").exists() and (out / "convergence.png").exists()
    assert flower_processes() <= before


@pytest.mark.parametrize(
    "classes_each, dh, mode",
    [
        (10, 0.0, "nn"),  # both clients hold every class
        pytest.param(5, 1.0, "none", marks=pytest.mark.long),  # two disjoint halves of the classes
    ],
)
def test_distrans_run_completes_at_two_dh_levels(tmp_path, classes_each, dh, mode, on_shared_host):
    before = flower_processes()
    out = tmp_path / "run"
    code = cli.main(
        [
            "strategy=distrans",
            "num-clients=2",
            "num-rounds=2",
            "local-steps=2",
            "batch-size=8",
            "eval-every=1",
            "partition=classes",
            f"classes-per-client={classes_each}",
            "rotate=false",
            f"output-dir={out}",
            "--quiet",
        ]
    )
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["distrans"] == {"dh": dh, "offset_agg": mode, "distrans_agg_setting": "auto"}
    assert manifest["distributional_heterogeneity"] == dh
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["failures"] for r in rounds] == [0, 0]
    assert all(r["train"]["offset-rms-change"] > 0 for r in rounds)
    # round 2 starts from the offset each client kept in its context.state (none) or was sent (nn)
    assert [r["train"]["offset-fresh"] for r in rounds] == [1.0, 0.0]
    assert all(("offset-nn-loss-before" in r.get("server", {})) == (mode == "nn") for r in rounds)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in metrics] == [1, 2] and all(0 <= r["pooled_acc"] <= 1 for r in metrics)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pooled_acc_best5"] is not None
    offsets = np.load(out / "offsets.npz")
    assert sorted(offsets.files) == (["next_0", "next_1"] if mode == "nn" else []) + ["returned_0", "returned_1"]
    assert offsets["returned_0"].shape == (1, 28, 28)
    assert (out / "summary.md").exists() and (out / "convergence.png").exists()
    assert flower_processes() <= before


# The baselines with a Flower path of their own: their own server side (scaffold, fedmix, vhl, groupdro),
# arrays of their own in the messages (scaffold's c, dann's discriminator, fedmix's and vhl's broadcast data)
# or per-client state kept between rounds (moon, scaffold). Not here: fedprox, feddecorr, fedntd, mixup and
# fedcm, which are FedAvg's client plus a component on FedAvg's strategy. Through Flower that is FedAvg's path
# (test_two_rounds_two_clients_write_the_run_files) with components built from the run config in Flower's
# processes (the fedbr-with runs of test_fedbr_run_completes_and_records_its_terms: mixup, and fedcm, whose
# server part sends its Delta through the same round_arrays hook as scaffold's c); what each computes is
# pinned by the golden runs (test_golden.py), which build the clients on the simulation's own path.
BASELINES = {"scaffold": {}, "moon": {}, "fedmix": {}, "vhl": {"vhl-size": 40}, "groupdro": {}, "dann": {}}


def test_every_baseline_completes_a_flower_run(tmp_path, on_shared_host):
    """One sweep of the six, in one simulation process (a process each took 31 s, most of it start-up)."""
    from fedbr_flwr.commands import sweep

    before = flower_processes()
    runs = "".join(f"    {name}: {json.dumps({'strategy': name, **extra})}\n" for name, extra in BASELINES.items())
    settings = "num-clients: 2\nnum-rounds: 2\nlocal-steps: 2\nbatch-size: 8\neval-every: 1\nmodel: cnn-small\n"
    (tmp_path / "baselines.yaml").write_text(f"{settings}sweep:\n  seeds: [0]\n  runs:\n{runs}")
    assert sweep.main([str(tmp_path / "baselines.yaml"), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    for strategy in BASELINES:
        out = tmp_path / "out" / strategy / "seed0"
        rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rounds] == [1, 2], strategy
        assert all(r["clients"] == 2 and r["failures"] == 0 and np.isfinite(r["train"]["loss"]) for r in rounds)
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in metrics] == [1, 2] and all(0 <= r["global_acc"] <= 1 for r in metrics)
        if strategy == "scaffold":  # the server's control variate moved, from the clients' returned changes
            assert rounds[-1]["server"]["control-norm"] > 0
        if strategy == "groupdro":
            assert sum(v for k, v in rounds[-1]["server"].items() if k.startswith("p-")) == pytest.approx(1.0)
        if strategy in ("fedmix", "vhl"):
            assert (out / f"{strategy}_data.npz").exists()
        assert json.loads((out / "manifest.json").read_text())["config"]["strategy"] == strategy
    assert flower_processes() <= before


DIVERGING_CLIENT = '''"""Test only: FedAvg whose client 1 diverges (every model array it returns is NaN)."""
import numpy as np

from clients.fedavg import FedAvgClient
from fedbr_flwr.core.registry import register_client


@register_client("diverging-client-1")
class DivergingClient(FedAvgClient):
    def finish_fit(self, step, stats, seconds):  # what both cohort steps (loop and vmap) return through
        named, n, metrics = super().finish_fit(step, stats, seconds)
        if self.pid == 1:
            named = {k: np.full_like(v, np.nan) if k.startswith("model/") else v for k, v in named.items()}
        return named, n, metrics
'''


HANGING_CLIENT = '''"""Test only: FedAvg whose client 1 never returns from its round-2 fit."""
import threading

from clients.fedavg import FedAvgClient
from fedbr_flwr.core.registry import register_client


@register_client("hanging-client-1")
class HangingClient(FedAvgClient):
    def fit(self, arrays, config):
        if self.pid == 1 and int(config["server-round"]) == 2:
            threading.Event().wait()
        return super().fit(arrays, config)
'''


CRASHING_CLIENT = '''"""Test only: FedAvg whose client 0's process dies in its round-2 fit (as in a segfault)."""
import os

from clients.fedavg import FedAvgClient
from fedbr_flwr.core.registry import register_client


@register_client("crashing-client-0")
class CrashingClient(FedAvgClient):
    def fit(self, arrays, config):
        if self.pid == 0 and int(config["server-round"]) == 2:
            os._exit(1)
        return super().fit(arrays, config)
'''


@pytest.fixture
def crashing_client(tmp_path, monkeypatch):
    """An algorithm whose client 0's process dies in round 2 (``plugin_algorithm``)."""
    yield from plugin_algorithm(tmp_path, monkeypatch, "crashing", CRASHING_CLIENT)


@pytest.fixture
def diverging_client(tmp_path, monkeypatch):
    """An algorithm with a diverging client (``plugin_algorithm``)."""
    yield from plugin_algorithm(tmp_path, monkeypatch, "diverging", DIVERGING_CLIENT)


@pytest.fixture
def hanging_client(tmp_path, monkeypatch):
    """An algorithm whose client 1 hangs in round 2 (``plugin_algorithm``)."""
    yield from plugin_algorithm(tmp_path, monkeypatch, "hanging", HANGING_CLIENT)


def plugin_algorithm(tmp_path, monkeypatch, module: str, source: str):
    """The algorithm in ``source``, found by the registry in this process and in every process Flower starts (a
    ``sitecustomize`` on their PYTHONPATH adds it to ``clients``); removed afterwards."""
    import os

    import clients
    from fedbr_flwr.core import registry

    plugins = tmp_path / "plugins"  # its folder must not be named clients (that would shadow our package)
    (plugins / "more-clients").mkdir(parents=True)
    (plugins / "more-clients" / f"{module}.py").write_text(source)
    more = str(plugins / "more-clients")
    (plugins / "sitecustomize.py").write_text(f"import clients\nclients.__path__.append({more!r})\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")])))
    registry.load_all()
    saved = dict(registry.CLIENTS)
    clients.__path__.append(str(plugins / "more-clients"))
    registry._loaded = False
    try:
        registry.load_all()
        yield
    finally:
        clients.__path__.remove(str(plugins / "more-clients"))
        registry.CLIENTS.clear()
        registry.CLIENTS.update(saved)
        sys.modules.pop(f"clients.{module}", None)
        registry._loaded = True


def test_on_ray_a_crashed_client_process_loses_only_its_own_message(tmp_path, crashing_client):
    """Client 0's actor process dies in round 2. Flower's Ray backend put the dead actor back into its pool, so
    from round 3 on honest client 1 failed too, evaluations were partial and the summary rested on round 1; the
    dead actor is replaced now, and every later round has both clients."""
    out = tmp_path / "run"
    settings = {"num-clients": 2, "num-rounds": 3, "local-steps": 1, "batch-size": 8, "eval-every": 1}
    settings["model"] = "cnn-small"
    code = cli.main(
        [f"{k}={v}" for k, v in settings.items()]
        + ["strategy=crashing-client-0", "backend=ray", "global-test=false", f"output-dir={out}"]
    )
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert code == 0 and [r["clients"] for r in rounds] == [2, 1, 2], rounds
    assert rounds[1]["failed_clients"] == [0]
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["clients_evaluated"] for e in evals if e["round"] == 3] == [2]
    assert json.loads((out / "summary.json").read_text())["final_round"] == 3


@pytest.mark.long
def test_a_run_that_leaves_a_client_hanging_hands_the_next_run_a_new_process(tmp_path, capsys, hanging_client):
    """Run B's client 1 never returns from round 2; the round times out and B completes without it, but its thread
    cannot be stopped. The next run does not start in that process (it would share its cores with the spinning
    thread): it says so in one line and runs in a new one."""
    from fedbr_flwr.launch.plan import config_from_settings, plan_run

    def prepared(name, **settings):
        base = {"num-clients": 2, "local-steps": 1, "batch-size": 8, "global-test": False, "eval-every": 1}
        cfg = config_from_settings({**base, **settings, "output-dir": str(tmp_path / name), "backend": "in-process"})
        return plan_run(cfg, True)

    before = flower_processes()
    runs = {
        "b": prepared("b", strategy="hanging-client-1", **{"num-rounds": 2, "round-timeout": 3}),
        "c": prepared("c", **{"num-rounds": 1}),
    }
    with RunHost() as host:
        run_flower(runs["b"], echo="none", host=host)
        b_process = host.proc.pid
        capsys.readouterr()
        run_flower(runs["c"], echo="none", host=host)
        assert host.proc.pid != b_process
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedbr:")]
    assert len(said) == 1 and re.fullmatch(  # client 1's fit, and its final evaluation waiting for it
        r"fedbr: the simulation process still runs [12] client\(s\) the run before gave up on \(never returned\): "
        r"this run starts in a new one",
        said[0],
    ), said
    rounds = [json.loads(line) for line in (tmp_path / "b" / "rounds.jsonl").read_text().splitlines()]
    assert rounds[1]["failed_clients"] == [1] and "timed out" in rounds[1]["errors"][0]
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["last_round"] == 1
    assert flower_processes() <= before


def test_a_killed_cohort_run_resumes_rejects_a_nan_member_and_equals_the_client_engine(tmp_path, diverging_client):
    """engine=cohort through fedbr-run: two cohorts (clients 0, 2 and client 1), client 1 answers NaN every
    round. The run (its clients in the simulation process: backend auto) is stopped (SIGTERM) after its round-2
    checkpoint: it exits with 143 and leaves no Flower process. Resumed on Ray with the cohorts' clients stepped
    together (cohort-step=vmap), its lines must equal those of the same federation with one client per node,
    driven in-process."""
    from fakes import in_process_federation, records_without_timing, run_rounds
    from test_golden import close_json

    before = flower_processes()
    out = tmp_path / "run"
    settings = [
        "strategy=diverging-client-1",
        "model=cnn-small",
        "num-clients=3",
        "num-rounds=4",
        "local-steps=2",
        "batch-size=8",
        "eval-every=1",
        "checkpoint-every=2",
        "global-test=false",
    ]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedbr_flwr.commands.cli",
            *settings,
            "engine=cohort",
            "cohorts=2",
            "client-cpus=1",
            f"output-dir={out}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        printed = []
        for line in proc.stdout:
            printed.append(line)
            if "round 2: checkpoint saved" in line:
                break
        assert "round 2: checkpoint saved" in printed[-1], "".join(printed[-30:])
        assert flower_processes() - before, "the run should have started Flower processes"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and flower_processes() <= before
    # paused, whether or not round 3 was recorded before the stop: fedbr-run wrote it last in the events
    assert report.seed_result(out) == (None, "paused after round 2 of 4 (resumes from its checkpoint)")
    assert cli.main(["--resume", str(out), "cohort-step=vmap", "backend=ray", "--quiet"]) == 0
    assert flower_processes() <= before

    rounds = records_without_timing(out / "rounds.jsonl")
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    assert all(r["clients"] == 2 and [x["partition"] for x in r["rejected"]] == [1] for r in rounds)  # 2 averaged
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["engine"] == "cohort" and [r["after_round"] for r in manifest["resumed"]] == [2]
    assert manifest["config"]["cohort-step"] == "auto" and manifest["resumed"][0]["config"]["cohort-step"] == "vmap"
    assert manifest["config"]["backend"] == "in-process" and manifest["resumed"][0]["config"]["backend"] == "ray"

    cfg = plan.build_config(settings)
    strategy, _, proxies = in_process_federation(cfg, tmp_path / "clients")
    run_rounds(strategy, proxies, 4)
    for name in ("rounds.jsonl", "metrics.jsonl"):
        want = records_without_timing(tmp_path / "clients" / name)
        close_json(records_without_timing(out / name), want, name, exact=False)


@pytest.mark.parametrize("backend", ["in-process", "ray"])
def test_sigkill_of_fedbr_run_stops_the_whole_stack_and_a_live_run_locks_its_folder(tmp_path, capsys, backend):
    """SIGKILL (no cleanup code runs) of fedbr-run's process group after round 1: within seconds no process it
    started is left, no port listens, the run folder stops growing and its temporary FLWR_HOME is gone. While
    it ran, a second fedbr-run on its folder (--overwrite, --resume) was refused naming the folder and pid.
    With the clients in the simulation process, the command, its watchdog and that process are all there is."""
    import procs

    before = flower_processes()
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "fedbr_flwr.commands.cli",
        "num-clients=2",
        "num-rounds=200",
        "local-steps=2",
        "batch-size=8",
        "model=cnn-small",
        f"backend={backend}",
        "device=cpu",  # in-process runs on CPUs (a GPU machine would give the clients GPU shares)
        f"output-dir={out}",
    ]
    with procs.command_at_first_round(command) as (proc, _, snapshot):
        ports = procs.listening(snapshot)
        homes = {home for p in snapshot if "fedbr-flwr-home-" in (home := _flwr_home(p))}
        assert homes and (ports and len(snapshot) > 5 if backend == "ray" else len(snapshot) == 3), snapshot
        # the ServerApp, which writes the run files, holds the writer's lock
        assert int((out / ".fedbr-writer.lock").read_text()) in snapshot

        for args in (["--overwrite", f"output-dir={out}", "num-clients=2", "--dry-run"], ["--resume", str(out)]):
            assert cli.main(args) == 2, args
            err = capsys.readouterr().err
            assert f"{out} is in use by a live run: pid {proc.pid}" in err, err

        procs.kill_and_check_nothing_is_left(proc, snapshot, ports, out)
        assert not [h for h in homes if Path(h).exists()]
    assert flower_processes() <= before
    # the dead run's locks do not block: the folder may be overwritten now
    assert cli.main(["--overwrite", f"output-dir={out}", "num-clients=2", "--dry-run"]) == 0


@pytest.mark.parametrize("backend", ["in-process", pytest.param("ray", marks=pytest.mark.long)])
def test_ctrl_c_stops_fedbr_run_with_exit_130_and_leaves_no_process(tmp_path, backend):
    """Ctrl-C (SIGINT to the terminal's foreground process group) after round 1: fedbr-run says it was
    interrupted, exits 130 without a traceback, and within seconds none of its processes lives."""
    import procs

    out = tmp_path / "run"
    command = [sys.executable, "-m", "fedbr_flwr.commands.cli", "num-clients=2", "num-rounds=200", "local-steps=2"]
    command += [f"backend={backend}", "device=cpu", "model=cnn-small"]
    with procs.command_at_first_round([*command, f"output-dir={out}"]) as (proc, _, snapshot):
        ports = procs.listening(snapshot)
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, rest
        assert "interrupted; Flower processes stopped" in rest and "Traceback" not in rest, rest
        left, still_open = procs.wait_gone(snapshot, ports, timeout_s=10)
        assert not left and not still_open, (left, still_open)


def test_the_clients_in_the_simulation_process_give_the_ray_backends_numbers_bit_for_bit(tmp_path, on_shared_host):
    """The same FedBR run on two cohorts (two clients training at once: two threads of the simulation process,
    or two Ray actors) with each backend: the same lines to the last bit. Where the clients ran is recorded: this
    machine's host name in-process, the Ray node on Ray."""
    import socket

    from fedbr_flwr.runfiles.metrics import read_jsonl

    from fakes import records_without_timing

    settings = ["strategy=fedbr", "num-clients=4", "num-rounds=2", "local-steps=2", "batch-size=8", "eval-every=1"]
    settings += ["engine=cohort", "cohorts=2", "client-cpus=1", "device=cpu", "model=cnn-small", "--quiet"]
    for backend in ("in-process", "ray"):
        assert cli.main([*settings, f"backend={backend}", f"output-dir={tmp_path / backend}"]) == 0
    for name in ("rounds.jsonl", "metrics.jsonl"):
        lines = {b: records_without_timing(tmp_path / b / name) for b in ("in-process", "ray")}
        assert lines["in-process"] == lines["ray"], name
    nodes = {b: [r["nodes"] for r in read_jsonl(tmp_path / b / "rounds.jsonl")] for b in ("in-process", "ray")}
    assert nodes["in-process"][0] == {socket.gethostname(): [0, 1, 2, 3]}
    assert list(nodes["ray"][0]) != [socket.gethostname()] and list(nodes["ray"][0].values()) == [[0, 1, 2, 3]]


def _flwr_home(pid: int) -> str:
    """The FLWR_HOME a process runs with ('' when none or gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ""
    return next((v.split("=", 1)[1] for v in environ if v.startswith("FLWR_HOME=")), "")
