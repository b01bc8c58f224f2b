"""A real deployment on 127.0.0.1 (SuperLink, SuperNodes, workers; insecure and TLS + SuperNode auth),
a client killed mid-round, and a run killed and resumed. Every process started is stopped, also when a
test fails."""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from procs import descendants

from fedbr_flwr.commands import deploy
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.launch.launcher import _alive, stop_tree, submit_run
from fedbr_flwr.launch.plan import prepare
from fedbr_flwr.runfiles.checkpoint import load_checkpoint
from fedbr_flwr.runfiles.metrics import read_jsonl

from fakes import records_without_timing


def small_run(out, **overrides):
    cfg = validate(
        {
            "strategy": "fedavg",
            "num-clients": 2,
            "num-rounds": 2,
            "local-steps": 3,
            "eval-every": 2,
            "model": "cnn-small",
            "output-dir": str(out),
            **overrides,
        }
    )
    return prepare(cfg, overwrite=False)


def all_pids(deployment):
    return [pid for proc in deployment.procs.values() for pid in [proc.pid, *descendants(proc.pid)]]


def kill_now(proc):
    """SIGKILL a process and its children at once: a crash, not a shutdown."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.e2e
@pytest.mark.parametrize(
    "tls, caller_fails",
    [
        pytest.param(False, False, id="insecure"),
        pytest.param(True, True, id="tls-and-auth-then-the-caller-fails", marks=pytest.mark.long),
    ],
)
def test_two_rounds_of_fedavg_on_a_superlink_and_two_supernodes(tmp_path, tls, caller_fails):
    """Every process the deployment started is stopped when the caller's block ends, and when it raises
    (here after its run, so that the run's own processes are there to stop too)."""
    out = tmp_path / "run"
    cfg = small_run(out)
    with pytest.raises(RuntimeError, match="caller failed") if caller_fails else contextlib.nullcontext():
        with deploy.local_deployment(out, 2, tls=tls, auth=tls) as dep:
            pids = all_pids(dep)
            submit_run(cfg, dep.env, deploy.CONNECTION, out, echo="none")
            pids += all_pids(dep)
            if caller_fails:
                raise RuntimeError("caller failed")
    if caller_fails:
        time.sleep(0.5)
    assert pids and not [pid for pid in pids if _alive(pid)]
    rounds, evals = read_jsonl(out / "rounds.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [r["clients"] for r in rounds] == [2, 2] and all(r["failures"] == 0 for r in rounds)
    assert [e["round"] for e in evals] == [2] and (out / "summary.md").exists()
    commands = {name: " ".join(c) for name, c in dep.commands.items()}
    assert sorted(commands) == ["superlink", "supernode-0", "supernode-1", "worker-0", "worker-1"]
    if tls:  # TLS everywhere, and only the registered node keys were let in
        assert not [c for c in commands.values() if "--insecure" in c]
        assert "--enable-supernode-auth" in commands["superlink"] and "--ssl-certfile" in commands["superlink"]
        assert all("--auth-supernode-private-key" in commands[f"supernode-{i}"] for i in range(2))
    else:
        assert "--insecure" in commands["superlink"]


@pytest.mark.e2e
@pytest.mark.long
def test_a_client_killed_mid_round_is_recorded_and_the_run_completes(tmp_path):
    out = tmp_path / "run"
    # a healthy client's round takes a few seconds here; the killed one is given up on after round-timeout
    cfg = small_run(out, **{"local-steps": 20, "round-timeout": 20.0})
    outcome = {}
    with deploy.local_deployment(out, 2) as dep:
        runner = threading.Thread(
            target=lambda: outcome.update(status=submit_run(cfg, dep.env, deploy.CONNECTION, out, echo="none")),
            daemon=True,
        )
        runner.start()
        deadline = time.time() + 240
        while not read_jsonl(out / "rounds.jsonl"):
            assert time.time() < deadline and runner.is_alive(), "round 1 never finished"
            time.sleep(0.2)
        time.sleep(1.0)  # round 2's fit is under way
        kill_now(dep.procs["supernode-1"])
        kill_now(dep.procs["worker-1"])
        runner.join(timeout=240)
        assert not runner.is_alive(), "the run did not finish after a client was killed"
    assert outcome["status"]["status"] == "finished:completed"
    round2 = read_jsonl(out / "rounds.jsonl")[1]
    assert round2["round"] == 2 and round2["clients"] == 1 and round2["failures"] == 1
    assert round2["failed_clients"] == [1] and round2["errors"]
    final = read_jsonl(out / "metrics.jsonl")[-1]
    assert final["round"] == 2 and final["eval_failures"] == 1 and list(final["per_client_acc"]) == ["0"]
    assert (out / "summary.md").exists()


@pytest.mark.e2e
def test_a_killed_run_resumed_from_its_checkpoint_ends_like_an_uninterrupted_one(tmp_path):
    # killed at its first checkpoint (round 2), so that two of the four rounds run after the resume; a round takes
    # seconds here, so the kill lands well before the run could end (checked below)
    settings = [
        "num-rounds=4",
        "checkpoint-every=2",
        "eval-every=2",
        "local-steps=4",
        "num-clients=3",
        "global-test=false",
        "model=cnn-small",
        "--quiet",
    ]
    run = [sys.executable, "-m", "fedbr_flwr.commands.cli", *settings]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    subprocess.run([*run, f"output-dir={straight}"], check=True, timeout=600)

    proc = subprocess.Popen([*run, f"output-dir={stopped}"], start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (stopped / "checkpoint.npz").exists():
            assert time.time() < deadline and proc.poll() is None, "no checkpoint before the run ended"
            time.sleep(0.1)
        kill_now(proc)
    finally:
        stop_tree(proc)
    assert not (stopped / "summary.md").exists()  # it really was cut short
    resumed_from = load_checkpoint(stopped)[1]["round"]
    assert resumed_from < 4

    subprocess.run([*run[:3], "--resume", str(stopped), "--quiet"], check=True, timeout=600)

    for name in ("metrics.jsonl", "rounds.jsonl"):
        assert records_without_timing(stopped / name) == records_without_timing(straight / name)
    manifest = json.loads((stopped / "manifest.json").read_text())
    assert [r["after_round"] for r in manifest["resumed"]] == [resumed_from]


NODE = ["supernode", "--insecure", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--superlink", "127.0.0.1:8000"], "give --certs DIR"),
        (["superlink", "--insecure", "--auth"], "SuperNode authentication needs TLS"),
        (["run", "--superlink", "127.0.0.1:8000", "--certs", "/nonexistent"], "lacks ca.crt"),
        (["local", "num-clients=3", "--supernodes", "2"], "num-clients = 3 but --supernodes 2"),
        (["run", "--superlink", "127.0.0.1", "--insecure"], "--superlink '127.0.0.1': give the SuperLink as HOST:PORT"),
        (["register", "--superlink", ":8000", "--insecure"], "give the SuperLink as HOST:PORT"),
        (["superlink", "--insecure", "--port", "70000"], "--port 70000: give a TCP port, 1 to 65535"),
        (
            ["supernode", "--insecure", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1"]
            + ["--gpu", "cuda:0"],
            "--gpu 'cuda:0': give a CUDA device index",
        ),
        (["certs", "/dev/null"], "certs folder /dev/null cannot be used: it is a file, not a folder"),
        (["register", "--superlink", "127.0.0.1:1", "--certs", "keys", "--insecure"], "--insecure (no TLS), not both"),
        (["certs", "keys", "--host", ""], "--host '': give the SuperLink's IP address or DNS name, without a port"),
        (["certs", "keys", "--host", "10.0.0.1:8000"], "--host '10.0.0.1:8000': give the SuperLink's IP address"),
        (["certs", "keys", "--host", "not a host!"], "--host 'not a host!': give"),
        # these raised a traceback, or started Flower, which exited with the reason only in its log
        (["superlink", "--insecure", "--state-dir", "/dev/null"], "--state-dir /dev/null cannot be used: it is a file"),
        (NODE + ["--state-dir", "/dev/null/x"], "--state-dir /dev/null/x cannot be made: /dev/null in its path"),
        (["superlink", "--insecure", "--host", "not_a_host"], "--host 'not_a_host': give the address to listen on"),
        (NODE + ["--auth-key", "nokey"], "--auth-key nokey: no such file"),
        (["run", "--superlink", "http://127.0.0.1:8000", "--insecure"], "as HOST:PORT (no http://)"),
        (["register", "--superlink", "127.0.0.1:1", "--insecure", "nosuch.pub"], "public key nosuch.pub: no such"),
    ],
)
def test_deploy_command_errors_are_one_clear_message(capsys, monkeypatch, tmp_path, args, message):
    monkeypatch.chdir(tmp_path)  # where the state and run folders would go by default
    assert deploy.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_node_key_of_the_wrong_kind_or_without_tls_is_one_line_before_flower_starts(tmp_path, capsys, no_process):
    """Flower exited with codes 302 and 303 (its log saying why), and `register` blamed TLS for a private key."""
    assert deploy.main(["certs", str(tmp_path / "k"), "--supernodes", "1"]) == 0
    private, public = tmp_path / "k" / "supernode-0", tmp_path / "k" / "supernode-0.pub"
    node = ["supernode", "--certs", str(tmp_path / "k"), "--superlink", "h:1", "--partition-id", "0"]
    for args, message in (
        (node + ["--num-partitions", "1", "--auth-key", str(public)], "not a private key (give supernode-N, not"),
        ([*NODE, "--auth-key", str(private)], "--auth-key: SuperNode authentication needs TLS"),
        (["register", "--superlink", "h:1", "--insecure", str(private)], "not an OpenSSH public key"),
    ):
        capsys.readouterr()
        assert deploy.main(args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_certificates_name_the_hosts_and_node_keys_are_openssh(tmp_path):
    from cryptography import x509

    keys = deploy.make_certificates(tmp_path, ["127.0.0.1", "link.example"], 2)
    cert = x509.load_pem_x509_certificate((tmp_path / deploy.SERVER_CERT).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["link.example"]
    assert [k.name for k in keys] == ["supernode-0", "supernode-1"]
    assert keys[0].with_name("supernode-0.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    assert oct(keys[0].stat().st_mode & 0o777) == "0o600"
    with pytest.raises(ConfigError, match="lacks"):
        deploy.check_certs(tmp_path / "nothing", server=True)


def test_certs_refuse_to_replace_a_ca_and_take_a_long_host_name(tmp_path, capsys):
    from cryptography import x509

    long_name = "node-" + "x" * 50 + ".rack-17.cluster.example.org"  # longer than a common name may be
    assert deploy.main(["certs", str(tmp_path / "keys"), "--host", long_name, "--supernodes", "1"]) == 0
    ca = (tmp_path / "keys" / deploy.CA).read_bytes()
    cert = x509.load_pem_x509_certificate((tmp_path / "keys" / deploy.SERVER_CERT).read_bytes())
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    ) == [long_name]
    capsys.readouterr()
    assert deploy.main(["certs", str(tmp_path / "keys"), "--supernodes", "1"]) == 2  # the nodes trust this CA
    assert "already holds a CA (ca.crt)" in capsys.readouterr().err
    assert (tmp_path / "keys" / deploy.CA).read_bytes() == ca


@pytest.mark.parametrize("stop_works, earlier_piece", [(True, False), (False, False), (True, True)])
def test_a_stopped_deploy_run_stops_its_run_on_the_superlink_and_says_so(
    tmp_path, capsys, monkeypatch, stop_works, earlier_piece
):
    """SIGTERM (a scheduler, `timeout`) or Ctrl-C on `fedbr-deploy run`: the run it submitted must not go on
    alone on the SuperLink, holding its folder; `flwr stop` is sent for the run id Flower's log names after
    this command started (a resumed run's log holds its earlier pieces' too)."""
    calls = []
    if earlier_piece:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "flower.log").write_text("🎊 Successfully started run 1111\nround 1\n")

    def submitted_then_signalled(cfg, env, connection, out, echo):
        out.mkdir(parents=True, exist_ok=True)  # as submit_run makes it
        with open(out / "flower.log", "a") as log:
            log.write("Loading project...\n🎊 Successfully started run 4242\nround 1\n")
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the run is followed
        time.sleep(5)

    def flwr(command, real=subprocess.run, **kwargs):
        if Path(command[0]).name != "flwr":
            return real(command, **kwargs)  # git, for the manifest
        calls.append(command[1:])
        return subprocess.CompletedProcess(command, 0 if stop_works else 1, "", "" if stop_works else "unreachable\n")

    monkeypatch.setattr(deploy, "submit_run", submitted_then_signalled)
    monkeypatch.setattr(deploy.subprocess, "run", flwr)
    out, handler = tmp_path / "run", signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: pytest.fail("fedbr-deploy run left SIGTERM to its default"))
    try:
        code = deploy.main(["run", "--superlink", "127.0.0.1:1", "--insecure", f"output-dir={out}", "num-clients=2"])
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert code == 143 and calls == [["stop", "4242", deploy.CONNECTION]]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedbr-deploy: stopped by SIGTERM; run 4242 ")
    assert ("was stopped on the SuperLink" in err[0]) == stop_works
    assert err[0].endswith(f"--resume {out}` on a machine that sees {out}")  # the checkpoint is read there
    if not stop_works:
        assert "may still run on the SuperLink: `flwr stop 4242` failed (unreachable)" in err[0]


def test_a_deploy_run_into_a_folder_holding_a_run_names_its_own_way_to_start_again(tmp_path, capsys, no_process):
    """fedbr-deploy takes no --overwrite: the refusal said to start it again with `fedbr-run --overwrite`."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"round": 1}\n')
    (out / "checkpoint.npz").write_bytes(b"")
    assert deploy.main(["run", "--superlink", "127.0.0.1:1", "--insecure", f"output-dir={out}", "num-clients=2"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "`overwrite=true` for fedbr-deploy" in err and err.count("\n") == 1


def test_a_run_for_a_superlink_on_another_machine_leaves_its_folder_and_data_to_that_machine(
    tmp_path, capsys, monkeypatch
):
    """output-dir is a path on the SuperLink's machine (its ServerApp writes and checks it). Checked on the
    submitting machine, a folder this one cannot make refused the run, and one made for the check was left."""
    submitted = []
    monkeypatch.setattr(deploy, "submit_run", lambda cfg, env, connection, out, echo: submitted.append(out))
    blocked = "/dev/null/runs/x"  # no folder can be made here
    args = ["run", "--superlink", "10.0.0.1:8000", "--insecure", f"output-dir={blocked}", "num-clients=2"]
    assert deploy.main(args) == 0 and submitted == [Path(blocked)]
    assert "the run's files are on the SuperLink's machine" in capsys.readouterr().out
    args[2] = "127.0.0.1:8000"  # this machine: checked here, before Flower is asked
    assert deploy.main(args) == 2 and len(submitted) == 1
    assert "output-dir /dev/null/runs/x cannot be made" in capsys.readouterr().err
    assert [deploy.on_this_machine(a) for a in ("localhost:9093", "[::1]:9093", "10.0.0.1:8000")] == [1, 1, 0]


def test_registering_again_skips_the_keys_the_superlink_has_and_registers_the_rest(tmp_path, capsys, monkeypatch):
    keys = tmp_path / "keys"
    assert deploy.main(["certs", str(keys), "--supernodes", "3"]) == 0
    registered = {"supernode-0.pub"}  # from an earlier `register`, before supernode-1 and -2 were added

    def flwr(command, real=subprocess.run, **kwargs):
        if command[1:3] != ["supernode", "register"]:
            return real(command, **kwargs)
        name = Path(command[3]).name
        if name == "supernode-2.pub" and "broken" in registered:
            # Flower's words in its frame
            box = "╭─ Error ───╮\n│ Connection to the SuperLink is │\n│ unavailable. │\n╰───────────╯\n"
            return subprocess.CompletedProcess(command, 1, "", box)
        if name in registered:
            return subprocess.CompletedProcess(command, 1, "", "❌ Public key already in use. [code: 23]\n")
        registered.add(name)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(deploy.subprocess, "run", flwr)
    capsys.readouterr()
    assert deploy.main(["register", "--superlink", "127.0.0.1:1", "--certs", str(keys)]) == 0
    out = capsys.readouterr().out
    assert "registered 2 SuperNode key(s); 1 the SuperLink had already: supernode-0.pub" in out
    assert registered == {"supernode-0.pub", "supernode-1.pub", "supernode-2.pub"}
    registered.discard("supernode-2.pub")
    registered.add("broken")  # any other failure still stops, with Flower's words
    assert deploy.main(["register", "--superlink", "127.0.0.1:1", "--certs", str(keys)]) == 1
    err = capsys.readouterr().err  # one line: Flower's words out of their frame, then how we connected
    assert err.count("\n") == 1 and "failed: Error Connection to the SuperLink is unavailable. [connected" in err
    assert f"connected with TLS (the CA in {keys})" in err
    args = ["register", "--superlink", "127.0.0.1:1", "--insecure", str(keys / "supernode-2.pub")]
    assert deploy.main(args) == 1
    assert "[connected without TLS (--insecure): the SuperLink must have been" in capsys.readouterr().err


def test_round_seconds_reads_the_fit_phase_after_discovery_and_the_wall_time_per_round(tmp_path):
    (tmp_path / "rounds.jsonl").write_text(
        "".join(json.dumps({"round": r, "seconds": s}) + "\n" for r, s in [(1, 30.0), (2, 2.0), (3, 4.0), (4, 3.0)])
    )
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"round": 4, "wall_time": 50.0}) + "\n")
    assert deploy.round_seconds(tmp_path) == {"fit_s_per_round": 3.0, "wall_s_per_round": 12.5}


def test_node_config_quotes_strings_only():
    assert deploy.node_config_string({"partition-id": 1, "data-dir": "/d"}) == 'partition-id=1 data-dir="/d"'


def test_supernode_data_dir_overrides_the_runs_and_gpu_pins_the_worker(tmp_path, monkeypatch):
    from flwr.common import RecordDict

    from fedbr_flwr.app.node import build_client

    with pytest.raises(ConfigError, match="/node/own/data"):  # the node's folder is the one read
        build_client(
            {"dataset": "mnist", "data-dir": "/run/data", "num-clients": 2},
            {"partition-id": 0, "num-partitions": 2, "data-dir": "/node/own/data"},
            RecordDict(),
        )

    seen = {}

    class Running:
        def poll(self):
            return None

    def start(name, command, env=None):
        seen["env"] = env
        Path(command[-1]).touch()  # the worker's socket appears
        return Running()

    dep = deploy.Deployment(deploy.process_env(tmp_path / "home"), tmp_path)
    monkeypatch.setattr(dep, "start", start)
    deploy.start_worker(dep, "worker-0", tmp_path / "w.sock", "3")
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "3"


@pytest.mark.e2e
@pytest.mark.long
def test_sigkill_of_fedbr_deploy_local_stops_every_process_and_removes_its_temporary_home(tmp_path):
    """SIGKILL of `fedbr-deploy local`'s process group after round 1: the SuperLink, SuperNodes, workers and
    all they started die within seconds, no port listens, the run folder stops growing, and the temporary
    folder with the Flower home, certificates and worker sockets is removed."""
    import re

    import procs

    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "fedbr_flwr.commands.deploy",
        "local",
        "--supernodes",
        "2",
        "num-rounds=200",
        "local-steps=2",
        "batch-size=8",
        f"output-dir={out}",
    ]
    with procs.command_at_first_round(command) as (proc, printed, snapshot):
        home = Path(re.search(r"--address (\S+)/worker-0\.sock", "".join(printed)).group(1))
        ports = procs.listening(snapshot)
        assert home.is_dir() and len(ports) >= 3 and len(snapshot) > 8
        procs.kill_and_check_nothing_is_left(proc, snapshot, ports, out)
        assert not home.exists()


@pytest.fixture
def no_process(monkeypatch):
    """Starting a process (a worker, a SuperNode, a local deployment) fails the test: the command must stop
    before that."""

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(deploy.Deployment, "start", refuse)
    monkeypatch.setattr(deploy, "local_deployment", refuse)


def test_resuming_a_local_deployment_with_another_supernode_count_stops_before_any_process(
    tmp_path, capsys, no_process
):
    from fedbr_flwr.runfiles.checkpoint import save_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    cfg = validate({"num-clients": 2, "num-rounds": 4, "output-dir": str(run)})
    save_checkpoint(run, {"global/w": np.ones(3, np.float32)}, {"round": 2, "config": cfg})
    (run / "rounds.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    (run / "metrics.jsonl").write_text('{"round": 2}\n')
    assert deploy.main(["local", "--supernodes", "3", "--resume", str(run)]) == 2
    said = capsys.readouterr()
    assert "has num-clients = 2: resume it with --supernodes 2" in said.err
    assert said.out.startswith(f"fedbr-deploy: resuming {run.resolve()} after round 2")  # not fedbr-run's name


def test_compare_stops_on_what_a_deployment_cannot_run_before_the_simulation(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("fedbr_flwr.commands.cli.main", lambda argv: pytest.fail("the simulation ran first"))
    assert deploy.main(["compare", "engine=cohort", "--out", str(tmp_path / "cmp")]) == 2
    assert "engine=cohort runs in simulation only" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert deploy.main(["compare", "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == (
        f"fedbr-deploy: error: --out {tmp_path / 'file'} cannot be used: it is a file, not a folder; pick another "
        "--out or move the file\n"
    )


def test_every_option_of_every_deploy_command_says_what_it_does():
    parser = deploy.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sub in commands.choices.items():
        assert [a.option_strings or a.dest for a in sub._actions if not a.help] == [], name


@pytest.mark.parametrize(
    "args, message",
    [
        (["local", "--supernodes", "0"], "--supernodes 0: a run needs at least one SuperNode"),
        (["local", "--supernodes", "-2"], "--supernodes -2: a run needs at least one SuperNode"),
        (
            ["supernode", "--insecure", "--superlink", "127.0.0.1:9", "--partition-id", "5", "--num-partitions", "2"],
            "--partition-id 5 --num-partitions 2: need num-partitions >= 1 and 0 <= partition-id < num-partitions",
        ),
        (
            ["supernode", "--insecure", "--superlink", "127.0.0.1:9", "--partition-id", "-1", "--num-partitions", "2"],
            "0 <= partition-id < num-partitions",
        ),
        (
            ["supernode", "--insecure", "--superlink", "127.0.0.1:9", "--partition-id", "0", "--num-partitions", "0"],
            "need num-partitions >= 1",
        ),
    ],
)
def test_impossible_node_counts_stop_before_any_process_starts(tmp_path, capsys, no_process, args, message):
    args = [*args, f"output-dir={tmp_path / 'run'}"] if args[0] == "local" else [*args, "--state-dir", str(tmp_path)]
    assert deploy.main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_supernode_port_in_use_stops_before_any_process_starts(tmp_path, capsys, no_process):
    """Two SuperNodes on one machine with the default --port: Flower's SuperNode said only 'SuperNode Runtime HTTP
    API failed to start', its log why."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        node = ["supernode", "--insecure", "--superlink", "127.0.0.1:9", "--partition-id", "0", "--num-partitions", "2"]
        assert deploy.main([*node, "--port", port, "--state-dir", str(tmp_path / "sn")]) == 2
    err = capsys.readouterr().err
    assert f"--port {port} is in use on this machine" in err and err.count("\n") == 1
    assert not (tmp_path / "sn").exists()


def test_certs_for_a_negative_number_of_supernodes_is_refused_and_writes_nothing(tmp_path, capsys):
    assert deploy.main(["certs", str(tmp_path / "keys"), "--supernodes", "-1"]) == 2
    assert "--supernodes -1" in capsys.readouterr().err
    assert not (tmp_path / "keys").exists()


@contextmanager
def local_server(answer):
    """A server on 127.0.0.1 calling ``answer(conn)`` on each connection in a thread; yields its HOST:PORT
    and closes it on exit."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                try:
                    answer(conn)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


@pytest.fixture
def tls_server(tmp_path):
    """A TLS server with a certificate from `fedbr-deploy certs`."""
    import ssl

    certs = tmp_path / "server-certs"
    deploy.make_certificates(certs, ["127.0.0.1"], 0)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs / deploy.SERVER_CERT, certs / deploy.SERVER_KEY)

    def handshake(conn):
        with context.wrap_socket(conn, server_side=True) as tls:
            tls.recv(1)

    with local_server(handshake) as address:
        yield address


@pytest.fixture
def plain_server():
    """A plaintext server that answers anything with an HTTP error."""

    def refuse(conn):
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    with local_server(refuse) as address:
        yield address


def test_an_insecure_supernode_for_a_tls_superlink_says_to_give_the_certificates(
    tmp_path, capsys, no_process, tls_server
):
    code = deploy.main(
        [
            "supernode",
            "--insecure",
            "--superlink",
            tls_server,
            "--partition-id",
            "0",
            "--num-partitions",
            "1",
            "--state-dir",
            str(tmp_path / "node"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"the SuperLink at {tls_server} speaks TLS, but this SuperNode was started with --insecure" in err
    assert "--certs DIR" in err and "--root-certificates" in err


def test_repeated_connection_failures_in_a_supernode_log_give_a_hint(tmp_path, tls_server, plain_server):
    def fail(times):
        with open(log, "a") as f:
            f.write("WARNING : Connection attempt failed, retrying in 1.2 seconds\n" * times)

    log = tmp_path / "supernode-0.log"
    log.write_text("WARNING : Connection attempt failed, retrying in 1.2 seconds\n" * 5)  # an earlier SuperNode's
    watch = deploy.ConnectionWatch(log, tls_server, tls=False)
    fail(2)
    assert watch() is None  # two failures: too early to tell
    fail(1)
    assert "speaks TLS, but this SuperNode was started with --insecure" in watch()
    fail(3)
    assert watch() is None  # said once
    for superlink, tls, says in [
        (plain_server, True, "does not answer TLS (started with --insecure?)"),
        ("127.0.0.1:9", False, "keeps failing to connect to the SuperLink at 127.0.0.1:9"),
    ]:
        watch = deploy.ConnectionWatch(log, superlink, tls)
        fail(3)
        assert says in watch()
    assert deploy.speaks_tls(tls_server) is True and deploy.speaks_tls(plain_server) is False


def test_a_supernode_with_another_ca_is_told_the_superlinks_certificate_is_not_accepted(tmp_path, tls_server):
    """The SuperLink's certificate is checked against the SuperNode's ca.crt as Flower would check it: the CA
    it was made with passes, another one is named with the reason and what to do."""
    other = tmp_path / "other-certs"
    deploy.make_certificates(other, ["127.0.0.1"], 0)
    assert deploy.tls_mismatch(tls_server, True, tmp_path / "server-certs" / deploy.CA) is None
    said = deploy.tls_mismatch(tls_server, True, other / deploy.CA)
    assert f"the SuperLink at {tls_server} presents a certificate that {other / deploy.CA} does not accept" in said
    assert "(certificate signature failure)" in said and "fedbr-deploy certs" in said


def test_an_expired_or_not_yet_valid_certificate_is_warned_about(tmp_path, capsys, monkeypatch):
    import datetime

    certs = tmp_path / "certs"
    deploy.make_certificates(certs, ["127.0.0.1"], 0, days=30)
    now = datetime.datetime.now(datetime.timezone.utc)
    assert deploy.certificate_problem(certs / deploy.SERVER_CERT, now) is None
    later = deploy.certificate_problem(certs / deploy.SERVER_CERT, now + datetime.timedelta(days=31))
    assert "expired on" in later and "SuperNodes will refuse it" in later and f"fedbr-deploy certs {certs}" in later
    earlier = deploy.certificate_problem(certs / deploy.SERVER_CERT, now - datetime.timedelta(days=1))
    assert "is valid only from" in earlier and "clock" in earlier
    # the SuperLink's command warns before it starts anything
    monkeypatch.setattr(deploy, "certificate_problem", lambda path, now=None: f"{path.name} expired")
    args = deploy.build_parser().parse_args(["superlink", "--certs", str(certs), "--state-dir", str(tmp_path / "s")])
    assert deploy._certs_arg(args, server=True) == certs.resolve()
    err = capsys.readouterr().err
    assert "fedbr-deploy: warning: ca.crt expired" in err and "fedbr-deploy: warning: server.pem expired" in err


@pytest.mark.e2e
@pytest.mark.long
def test_a_tampering_supernode_of_a_real_deployment_is_refused_and_the_run_completes(tmp_path, monkeypatch):
    """Three SuperNodes on 127.0.0.1, the second one's worker tampering with every reply (int64 updates, an
    accuracy of 5.0): each round refuses its update and its evaluation with the reason, averages the other two,
    and the run completes."""
    out = tmp_path / "run"
    cfg = small_run(out, **{"num-clients": 3, "eval-every": 1})
    hostile, honest = Path(__file__).with_name("hostile_worker.py"), deploy.worker_command

    def worker_command(address):
        return (
            [sys.executable, str(hostile), "--address", str(address)]
            if address.name == "worker-1.sock"
            else honest(address)
        )

    monkeypatch.setattr(deploy, "worker_command", worker_command)
    with deploy.local_deployment(out, 3) as dep:
        assert str(hostile) in " ".join(dep.commands["worker-1"])
        submit_run(cfg, dep.env, deploy.CONNECTION, out, echo="none")
    rounds, evals = read_jsonl(out / "rounds.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in rounds] == [1, 2] and [e["round"] for e in evals] == [1, 2]
    for record in rounds:
        assert [r["partition"] for r in record["rejected"]] == [1] and record["clients"] == 2
        assert "has dtype int64, expected float32" in record["rejected"][0]["reason"]
    for record in evals:
        assert [r["partition"] for r in record["eval_rejected"]] == [1] and record["clients_evaluated"] == 2
        assert "reports accuracy 5.0, outside [0, 1]" in record["eval_rejected"][0]["reason"]
        assert 0 <= record["mean_acc"] <= 1


@pytest.mark.e2e
@pytest.mark.long
def test_one_attacking_supernode_under_the_median_gives_the_simulations_accuracy(tmp_path):
    """Three SuperNodes on 127.0.0.1, the third sending its update x -10 (attack=sign-flip), aggregation=median:
    the deployment records the attacker, ends where the same run in one process ends, and near the honest run
    (test_robust.py shows the mean collapsing under the same attack)."""
    from test_robust import FED, federated

    fed = {**FED, "num-clients": 3}  # each SuperNode is a process of its own: the fewest a median outvotes one in
    attacked = {"attack": "sign-flip", "attack-ids": "2", "aggregation": "median"}
    honest, _, _ = federated(tmp_path / "honest", num_clients=3)
    simulated, _, _ = federated(tmp_path / "simulated", num_clients=3, **attacked)
    out = tmp_path / "run"
    cfg = prepare(validate({**fed, **attacked, "output-dir": str(out)}), overwrite=False)
    with deploy.local_deployment(out, fed["num-clients"]) as dep:
        submit_run(cfg, dep.env, deploy.CONNECTION, out, echo="none")
    rounds, evals = read_jsonl(out / "rounds.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert all(r["attackers"] == [2] and r["aggregation"] == {"rule": "median"} for r in rounds)
    assert len(rounds) == fed["num-rounds"] and all(r["clients"] == fed["num-clients"] for r in rounds)
    deployed = evals[-1]["global_acc"]
    assert deployed == pytest.approx(simulated, abs=0.02) and deployed > honest - 0.07, (deployed, simulated, honest)


def test_a_flower_process_that_exits_is_named_with_the_error_its_log_ends_on(tmp_path, capsys):
    """An unregistered key, a port in use: the SuperNode exited with code and reason in its log only."""
    said = "\x1b[91mERROR \x1b[0m:   Exit Code 305: the SuperNode's public key is not registered"
    dep = deploy.Deployment(dict(os.environ), tmp_path)
    dep.start("supernode-0", [sys.executable, "-c", f"print({said!r}); print('INFO : bye'); raise SystemExit(1)"])
    signal_handler = signal.getsignal(signal.SIGTERM)
    try:
        assert deploy._foreground(dep) == 1
    finally:
        signal.signal(signal.SIGTERM, signal_handler)
    err = capsys.readouterr().err.strip()
    assert err == (
        f"fedbr-deploy: supernode-0 exited: ERROR :   Exit Code 305: the SuperNode's public key is not registered; "
        f"see {tmp_path}"
    )


def test_a_local_deployment_stopped_by_sigterm_says_how_to_continue_and_marks_its_run_stopped(
    tmp_path, capsys, monkeypatch
):
    """It had no handler: SIGTERM killed it and left only the watchdog's line, and the run read as failed."""
    from fedbr_flwr.runfiles.progress import PROGRESS_FILE, stopped_on_purpose

    stopped = []

    @contextmanager
    def deployment(out, *args):
        try:
            yield SimpleNamespace(env={})
        finally:
            stopped.append(True)  # its processes are stopped as the signal unwinds

    def submitted_then_signalled(cfg, env, connection, out, echo):
        (out / PROGRESS_FILE).write_text(json.dumps({"kind": "round", "round": 1, "message": "round 1"}) + "\n")
        (out / "checkpoint.npz").touch()  # round 1's
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(deploy, "local_deployment", deployment)
    monkeypatch.setattr(deploy, "submit_run", submitted_then_signalled)
    out, handler = tmp_path / "run", signal.getsignal(signal.SIGTERM)
    try:
        code = deploy.main(["local", "--supernodes", "2", "num-clients=2", f"output-dir={out}"])
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert code == 143 and stopped == [True] and stopped_on_purpose(out)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"fedbr-deploy: stopped by SIGTERM; its processes stopped; continue with `fedbr-deploy local --supernodes 2 "
        f"--resume {out}`"
    ]
