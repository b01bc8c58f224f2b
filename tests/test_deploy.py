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
        (["register", "--superlink", "127.0.0.1:1", "--insecure"], "no public keys given and --insecure names no"),
        (["run", "--superlink", "127.0.0.1:0", "--insecure"], "--superlink '127.0.0.1:0': give the SuperLink as"),
        (["local", "backend=in-process"], "backend = in-process runs simulated clients in one process"),
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
    addresses = ("localhost:9093", "[::1]:9093", "0.0.0.0:8000", "10.0.0.1:8000")
    assert [deploy.on_this_machine(a) for a in addresses] == [1, 1, 1, 0]


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
        (
            ["supernode", "--insecure", "--superlink", "127.0.0.1:9", "--partition-id", "2", "--num-partitions", "2"],
            "--partition-id 2 --num-partitions 2: need",
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


# ---------------------------------------------------------------- what each part does, without Flower running


def test_flower_commands_carry_the_security_and_database_they_were_given(tmp_path):
    """Without --enable-supernode-auth a SuperLink lets in any node; a SuperNode without its key or with
    --insecure is refused; and the SuperLink's database is its state-dir's, the one a restart reads."""
    env = deploy.process_env(tmp_path / "home")
    certs, state, key = tmp_path / "certs", tmp_path / "state", tmp_path / "k"

    def value(command, flag):
        return command[command.index(flag) + 1]

    link = deploy.superlink_command(env, "0.0.0.0", 8000, certs, True, state)
    assert [value(link, f) for f in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile")] == [
        str(certs / name) for name in (deploy.CA, deploy.SERVER_CERT, deploy.SERVER_KEY)
    ]
    assert "--enable-supernode-auth" in link and "--insecure" not in link
    assert [value(link, f) for f in ("--host", "--port", "--database")] == [
        "0.0.0.0",
        "8000",
        str(state / "superlink.db"),
    ]
    plain = deploy.superlink_command(env, "127.0.0.1", 9, None, False, state)
    assert "--insecure" in plain and not [a for a in plain if a.startswith("--ssl") or a == "--enable-supernode-auth"]

    node = deploy.supernode_command(env, "10.0.0.1:8000", 9094, certs, {"partition-id": 1, "data-dir": "/d"}, key)
    assert value(node, "--root-certificates") == str(certs / deploy.CA) and "--insecure" not in node
    assert value(node, "--auth-supernode-private-key") == str(key)
    assert [value(node, f) for f in ("--superlink", "--port", "--node-config")] == [
        "10.0.0.1:8000",
        "9094",
        'partition-id=1 data-dir="/d"',
    ]
    plain = deploy.supernode_command(env, "h:1", 9094, None, {}, None)
    assert "--insecure" in plain and "--root-certificates" not in plain and "--auth-supernode-private-key" not in plain


def test_the_flower_connection_trusts_the_ca_it_was_given(tmp_path):
    """`flwr run` and `flwr supernode register` connect through it: TLS with the CA, or --insecure."""
    deploy.write_connection(tmp_path / "tls", "10.0.0.1:8000", tmp_path / "certs")
    text = (tmp_path / "tls" / "config.toml").read_text()
    assert 'address = "10.0.0.1:8000"' in text and f'default = "{deploy.CONNECTION}"' in text
    assert f'root-certificates = "{(tmp_path / "certs" / deploy.CA).resolve()}"' in text and "insecure" not in text
    deploy.write_connection(tmp_path / "plain", "127.0.0.1:1", None)
    text = (tmp_path / "plain" / "config.toml").read_text()
    assert "insecure = true" in text and "root-certificates" not in text


def test_deployment_processes_poll_for_messages_quickly_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", raising=False)
    assert deploy.process_env(tmp_path)["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == deploy.TASK_POLL_INTERVAL_S
    monkeypatch.setenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "2")
    assert deploy.process_env(tmp_path)["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "2"


def test_a_deployment_stops_every_process_newest_first(tmp_path, monkeypatch):
    """SuperNodes and workers go before the SuperLink they talk to, and none is left out."""
    stopped = []
    monkeypatch.setattr(deploy, "stop_tree", stopped.append)
    dep = deploy.Deployment({}, tmp_path)
    dep.procs = {"superlink": "L", "worker-0": "W0", "supernode-0": "N0", "worker-1": "W1", "supernode-1": "N1"}
    dep.stop()
    assert stopped == ["N1", "W1", "N0", "W0", "L"] and dep.procs == {}


class FakeProc:
    """A started process as Deployment sees it: running until ``exit_code`` is set."""

    def __init__(self, name, exit_code=None):
        self.name, self.exit_code, self.since = name, exit_code, time.time()

    def poll(self):
        assert time.time() - self.since < 10, f"{self.name} was waited for past its deadline"
        return self.exit_code


def test_a_worker_that_exits_or_never_makes_its_socket_stops_the_start_naming_its_log(tmp_path, monkeypatch):
    from fedbr_flwr.launch.launcher import RunFailed

    monkeypatch.setattr(deploy, "NODE_START_TIMEOUT_S", 3)
    dep = deploy.Deployment({}, tmp_path)
    for exit_code, at_most_s in ((1, 1.0), (None, 5.0)):  # it exits at once; it runs on without a socket
        monkeypatch.setattr(dep, "start", lambda name, command, env=None, code=exit_code: FakeProc(name, code))
        start = time.time()
        with pytest.raises(RunFailed, match=f"worker-0 did not start; see {tmp_path / 'worker-0.log'}"):
            deploy.start_worker(dep, "worker-0", tmp_path / "w.sock", None)
        assert time.time() - start < at_most_s


@pytest.fixture
def fake_processes(monkeypatch):
    """Deployment.start records each process (a worker's socket appears at once) and stop_tree the order in
    which they are stopped; the SuperLink is healthy at once and registration records its keys."""
    stopped, registered = [], []

    def start(self, name, command, env=None):
        self.commands[name] = command
        if name.startswith("worker-"):
            Path(command[-1]).touch()
        self.procs[name] = FakeProc(name)
        return self.procs[name]

    monkeypatch.setattr(deploy.Deployment, "start", start)
    monkeypatch.setattr(deploy, "stop_tree", lambda proc: stopped.append(proc.name))
    monkeypatch.setattr(deploy, "wait_healthy", lambda *args, **kwargs: None)
    monkeypatch.setattr(deploy, "register_supernodes", lambda env, keys: registered.extend(keys) or [])
    return SimpleNamespace(stopped=stopped, registered=registered)


def test_a_local_deployment_gives_each_supernode_its_partition_and_key_and_stops_all_on_failure(
    tmp_path, fake_processes
):
    with pytest.raises(RuntimeError, match="caller failed"):
        with deploy.local_deployment(tmp_path, 2, auth=True) as dep:
            link = dep.commands["superlink"]
            home = Path(link[link.index("--database") + 1]).parent
            raise RuntimeError("caller failed")
    assert list(dep.commands) == ["superlink", "worker-0", "supernode-0", "worker-1", "supernode-1"]
    assert fake_processes.registered == [home / "certs" / f"supernode-{i}.pub" for i in range(2)]
    for i in range(2):
        node = dep.commands[f"supernode-{i}"]
        assert node[node.index("--auth-supernode-private-key") + 1] == str(home / "certs" / f"supernode-{i}")
        assert (
            node[node.index("--node-config") + 1]
            == f'partition-id={i} num-partitions=2 worker="{home}/worker-{i}.sock"'
        )
    assert fake_processes.stopped == ["supernode-1", "worker-1", "supernode-0", "worker-0", "superlink"]
    assert not home.exists()  # its certificates, keys and sockets with it


def test_a_local_deployment_whose_superlink_never_gets_healthy_stops_it(tmp_path, fake_processes, monkeypatch):
    from fedbr_flwr.launch.launcher import RunFailed

    def unhealthy(*args, **kwargs):
        raise RunFailed("the SuperLink exited")

    monkeypatch.setattr(deploy, "wait_healthy", unhealthy)
    with pytest.raises(RunFailed, match="the SuperLink exited"):
        with deploy.local_deployment(tmp_path, 2, tls=True):
            pytest.fail("the block ran without a SuperLink")
    assert fake_processes.stopped == ["superlink"]


def test_round_seconds_takes_the_median_and_reads_a_one_round_run(tmp_path):
    """The median, not the mean: one slow round (a straggler, a checkpoint) must not move the figure."""
    rounds = [(1, 30.0), (2, 1.0), (3, 2.0), (4, 9.0)]
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps({"round": r, "seconds": s}) + "\n" for r, s in rounds))
    evals = [{"round": 2, "wall_time": 20.0}, {"round": 4, "wall_time": 48.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    assert deploy.round_seconds(tmp_path) == {"fit_s_per_round": 2.0, "wall_s_per_round": 12.0}
    (tmp_path / "rounds.jsonl").write_text(json.dumps({"round": 1, "seconds": 7.0}) + "\n")
    (tmp_path / "metrics.jsonl").unlink()
    seconds = deploy.round_seconds(tmp_path)
    assert seconds["fit_s_per_round"] == 7.0 and np.isnan(seconds["wall_s_per_round"])


def test_a_local_runs_num_clients_is_its_supernode_count():
    from fedbr_flwr.core.config import common

    assert common(deploy.new_run_config(["num-rounds=1"], 3)).num_clients == 3
    assert common(deploy.new_run_config(["num-rounds=1", "num-clients=3"], 3)).num_clients == 3


def test_ctrl_c_and_sigterm_stop_with_their_codes_and_any_other_exit_goes_on():
    assert deploy.stop_of(KeyboardInterrupt()) == ("interrupted", 130)
    assert deploy.stop_of(SystemExit(143)) == ("stopped by SIGTERM", 143)
    with pytest.raises(SystemExit) as exc:
        deploy.stop_of(SystemExit(3))
    assert exc.value.code == 3


def test_a_probe_blames_tls_only_when_the_two_sides_differ(tls_server, plain_server):
    assert deploy.tls_mismatch(plain_server, False) is None
    assert deploy.tls_mismatch(tls_server, True) is None
    assert "does not answer TLS" in deploy.tls_mismatch(plain_server, True)
    assert "speaks TLS, but this SuperNode was started with --insecure" in deploy.tls_mismatch(tls_server, False)


def test_each_hint_waits_for_that_many_more_failures_and_probes_only_then(tmp_path, monkeypatch):
    """The probe connects to the SuperLink: after a hint it waits for FAILURES_BEFORE_HINT new failures again."""
    probes = []
    monkeypatch.setattr(deploy, "tls_mismatch", lambda *args: probes.append(args) or f"hint {len(probes)}")
    log = tmp_path / "supernode-0.log"
    log.write_text("")
    watch = deploy.ConnectionWatch(log, "127.0.0.1:9", tls=False)

    def fail(times):
        with open(log, "a") as f:
            f.write("WARNING : Connection attempt failed, retrying in 1.2 seconds\n" * times)
        return watch()

    assert fail(deploy.FAILURES_BEFORE_HINT) == "hint 1"
    assert fail(0) is None and fail(deploy.FAILURES_BEFORE_HINT - 1) is None and len(probes) == 1
    assert fail(1) == "hint 2"


def test_foreground_stops_every_process_when_one_exits_and_on_ctrl_c(tmp_path, monkeypatch):
    """The processes left running when one exits, or when Ctrl-C arrives, are stopped before it returns."""
    started = []

    def deployment(*others):
        dep = deploy.Deployment(dict(os.environ), tmp_path)
        started.append(dep.start("superlink", [sys.executable, "-c", "import time; time.sleep(120)"]))
        for name in others:
            started.append(dep.start(name, [sys.executable, "-c", "raise SystemExit(3)"]))
        return dep

    handler = signal.getsignal(signal.SIGTERM)
    try:
        dep = deployment("supernode-0")
        assert deploy._foreground(dep) == 1
        assert dep.procs == {} and all(p.poll() is not None for p in started)

        def interrupt(seconds):
            raise KeyboardInterrupt

        dep = deployment()
        monkeypatch.setattr(deploy, "time", SimpleNamespace(time=time.time, sleep=interrupt))
        assert deploy._foreground(dep) == 130
        assert dep.procs == {} and all(p.poll() is not None for p in started)
    finally:
        signal.signal(signal.SIGTERM, handler)
        for proc in started:
            if proc.poll() is None:
                stop_tree(proc, grace_s=1)


def supernode_args(tmp_path, superlink, certs=None, *more):
    from fedbr_flwr.launch.launcher import free_port

    security = ["--certs", str(certs)] if certs else ["--insecure"]
    return [
        "supernode",
        *security,
        "--superlink",
        superlink,
        "--partition-id",
        "1",
        "--num-partitions",
        "2",
        "--port",
        str(free_port()),
        "--state-dir",
        str(tmp_path / "state"),
        *more,
    ]


def test_a_supernode_gets_its_data_dir_gpu_and_key_and_a_probe_of_a_tls_node_only_warns(
    tmp_path, capsys, monkeypatch, fake_processes, plain_server
):
    """With --certs, a SuperLink that does not answer TLS may be restarted with it: a warning, and the node starts."""
    envs = {}
    real_start = deploy.Deployment.start

    def start(self, name, command, env=None):
        envs[name] = env
        return real_start(self, name, command, env)

    monkeypatch.setattr(deploy.Deployment, "start", start)
    monkeypatch.setattr(deploy, "_foreground", lambda dep, hint=None: (envs.update(dep=dep), 0)[1])
    certs = tmp_path / "certs"
    deploy.make_certificates(certs, ["127.0.0.1"], 2)
    more = ["--data-dir", "data", "--gpu", "3", "--auth-key", str(certs / "supernode-1")]
    monkeypatch.chdir(tmp_path)
    assert deploy.main(supernode_args(tmp_path, plain_server, certs, *more)) == 0
    assert "fedbr-deploy: warning: the SuperLink at" in capsys.readouterr().err
    dep = envs["dep"]
    node = dep.commands["supernode-1"]
    here = tmp_path.resolve()
    sock = here / "state" / "worker-1.sock"
    assert list(dep.commands) == ["worker-1", "supernode-1"]
    assert node[node.index("--node-config") + 1] == (
        f'partition-id=1 num-partitions=2 data-dir="{here / "data"}" worker="{sock}"'
    )
    assert node[node.index("--auth-supernode-private-key") + 1] == str(here / "certs" / "supernode-1")
    assert envs["worker-1"]["CUDA_VISIBLE_DEVICES"] == envs["supernode-1"]["CUDA_VISIBLE_DEVICES"] == "3"


def test_a_supernode_that_fails_to_start_stops_its_worker(tmp_path, monkeypatch, fake_processes):
    real_start = deploy.Deployment.start

    def start(self, name, command, env=None):
        if name.startswith("supernode-"):
            raise FileNotFoundError("flower-supernode")
        return real_start(self, name, command, env)

    monkeypatch.setattr(deploy.Deployment, "start", start)
    with pytest.raises(FileNotFoundError):
        deploy.main(supernode_args(tmp_path, "127.0.0.1:9"))
    assert fake_processes.stopped == ["worker-1"]


def test_certs_without_node_keys_is_the_default(tmp_path, capsys):
    """--supernodes 0 (no --auth): only the CA and the SuperLink's certificate."""
    assert deploy.main(["certs", str(tmp_path / "keys")]) == 0
    assert "and 0 SuperNode key pair(s)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == [deploy.CA, deploy.SERVER_KEY, deploy.SERVER_CERT]


def test_a_superlink_needs_its_own_certificate_and_key_not_only_the_ca(tmp_path, capsys, no_process):
    """The folder a SuperNode machine is given (its ca.crt) does not start a SuperLink."""
    certs = tmp_path / "certs"
    deploy.make_certificates(certs, ["127.0.0.1"], 0)
    (certs / deploy.SERVER_KEY).unlink()
    assert deploy.main(["superlink", "--certs", str(certs), "--state-dir", str(tmp_path / "state")]) == 2
    err = capsys.readouterr().err
    assert f"{certs} lacks server.key" in err and err.count("\n") == 1
    assert not (tmp_path / "state").exists()


def write_run_records(out, seconds, wall):
    out.mkdir(parents=True, exist_ok=True)
    (out / "rounds.jsonl").write_text("".join(json.dumps({"round": r, "seconds": seconds}) + "\n" for r in (1, 2)))
    (out / "metrics.jsonl").write_text(json.dumps({"round": 2, "wall_time": wall}) + "\n")


def test_compare_prints_each_paths_seconds_and_stops_where_the_simulation_fails(tmp_path, capsys, monkeypatch):
    """The three paths in order, each with its own runs' figures; an earlier comparison's deployment folders
    are replaced; a failed simulation is the comparison's exit code, with no deployment started."""
    base = tmp_path / "cmp"
    simulated, deployed = [], []

    def simulation(argv):
        simulated.append(argv)
        write_run_records(Path(next(a for a in argv if a.startswith("output-dir=")).split("=", 1)[1]), 1.0, 4.0)
        return 0

    @contextmanager
    def local(out, supernodes, workers=True):
        deployed.append((out.name, supernodes, workers))
        yield SimpleNamespace(env={})

    def submit(cfg, env, connection, out, echo):
        write_run_records(out, 2.0 if deployed[-1][2] else 3.0, 10.0 if deployed[-1][2] else 12.0)

    monkeypatch.setattr("fedbr_flwr.commands.cli.main", simulation)
    monkeypatch.setattr(deploy, "local_deployment", local)
    monkeypatch.setattr(deploy, "submit_run", submit)
    write_run_records(base / "deployment-with-worker", 9.0, 9.0)  # an earlier comparison's run
    assert deploy.main(["compare", "num-rounds=2", "--supernodes", "3", "--out", str(base)]) == 0
    assert deployed == [("deployment-with-worker", 3, True), ("deployment-no-worker", 3, False)]
    assert capsys.readouterr().out.splitlines()[-3:] == [
        "| simulation | 1.00 | 2.00 |",
        "| deployment + worker | 2.00 | 5.00 |",
        "| deployment, no worker | 3.00 | 6.00 |",
    ]
    monkeypatch.setattr("fedbr_flwr.commands.cli.main", lambda argv: 1)
    deployed.clear()
    assert deploy.main(["compare", "num-rounds=2", "--out", str(base)]) == 1 and deployed == []


def test_ports_gpus_and_host_names_at_their_limits(tmp_path):
    def check(*args):
        deploy.check_arguments(deploy.build_parser().parse_args([*args, "--state-dir", str(tmp_path / "s")]))

    node = ["supernode", "--insecure", "--superlink", "h:65535", "--partition-id", "0", "--num-partitions", "2"]
    check(*node, "--port", "65535", "--gpu", "0,1")  # every limit it may reach: no error
    check("superlink", "--insecure", "--port", "1")
    with pytest.raises(ConfigError, match="--port 0: give a TCP port"):
        check("superlink", "--insecure", "--port", "0")
    with pytest.raises(ConfigError, match="give the SuperLink as HOST:PORT"):
        check(*node[:3], "h:0", *node[4:])
    name = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])  # 253 characters, labels of at most 63
    assert deploy.is_host(name) and deploy.is_host("a" * 63) and deploy.is_host("a-1.example")
    assert not deploy.is_host(name + "d") and not deploy.is_host("a" * 64)
    assert not deploy.is_host("-a.example") and not deploy.is_host("a-.example")


def test_a_port_left_in_time_wait_by_a_closed_connection_is_free(tmp_path):
    """A SuperNode restarted on its --port: the connections of the one before linger in TIME_WAIT, which its
    server may bind over; refusing the port then would stop the restart for no reason."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server's side closes first: its port is left in TIME_WAIT
        client.recv(1)
        client.close()
    assert deploy.port_in_use(port) is False


def test_ctrl_c_in_any_command_is_one_line_and_exit_code_130(tmp_path, capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(deploy, "cmd_certs", interrupted)
    assert deploy.main(["certs", str(tmp_path / "keys")]) == 130
    assert capsys.readouterr().err == "fedbr-deploy: interrupted; every process it started was stopped\n"


def test_compare_refuses_a_num_clients_other_than_its_supernodes(tmp_path, capsys, monkeypatch):
    """It replaced an experiment's num-clients with --supernodes without a word, so that the three runs it timed
    were of another federation than the one asked for; `local` refuses the same mismatch."""
    monkeypatch.setattr("fedbr_flwr.commands.cli.main", lambda argv: pytest.fail("the simulation ran"))
    assert deploy.main(["compare", "num-clients=10", "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert "num-clients = 10 but --supernodes 2: drop num-clients or make them equal" in err and err.count("\n") == 1
    assert not (tmp_path / "cmp").exists()
