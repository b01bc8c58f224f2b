"""Simulations on a running Ray cluster (``ray-address``): which runtime a run uses, a cluster that does not
answer, where each client's work ran; and, end to end, a two-node cluster on 127.0.0.1 (a head and a second
node, each a `ray start --block` process with one core) that a run spreads its cohorts over, with the same
metrics as on a private runtime, which a run leaves running, and which a run without the setting ignores."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedbr_flwr.app import raycluster
from fedbr_flwr.app.routing import Answer, placement
from fedbr_flwr.commands import cli
from fedbr_flwr.core.errors import ConfigError
from fedbr_flwr.launch import plan
from fedbr_flwr.launch.launcher import free_port
from fedbr_flwr.server.recording import round_record
from fedbr_flwr.server.updates import ClientUpdate

# ---------------------------------------------------------------- which runtime, fast


def test_the_setting_then_ray_address_then_a_private_runtime():
    assert raycluster.requested_address("", {}) is None
    assert raycluster.requested_address("", {"RAY_ADDRESS": "10.0.0.5:6379"}) == "10.0.0.5:6379"
    assert raycluster.requested_address("auto", {"RAY_ADDRESS": "10.0.0.5:6379"}) == "auto"
    assert raycluster.requested_address("local", {"RAY_ADDRESS": "10.0.0.5:6379"}) is None
    assert raycluster.requested_address("", {"RAY_ADDRESS": "local"}) is None


def test_flower_is_told_to_start_a_private_runtime_unless_the_run_joins_one():
    """Left unset, RAY_ADDRESS would let Ray join any cluster `ray start` left on this machine."""
    assert raycluster.ray_environment(None) == {"RAY_ADDRESS": "local"}
    assert raycluster.ray_environment("127.0.0.1:6390") == {"RAY_ADDRESS": "127.0.0.1:6390"}


def closed_port() -> int:
    return free_port()  # free: nothing listens there


def test_a_cluster_that_does_not_answer_is_one_line_within_seconds():
    port = closed_port()
    start = time.monotonic()
    refused = rf"no Ray cluster answers at [\d.]+:{port} \(connection refused\).*ray start --head"
    with pytest.raises(ConfigError, match=refused):
        raycluster.describe(f"127.0.0.1:{port}", timeout_s=1.0)
    assert time.monotonic() - start < 5


def test_a_malformed_address_is_refused():
    with pytest.raises(ConfigError, match="ray-address"):
        raycluster.check_answers("not an address", timeout_s=0.5)


def test_fedbr_run_on_a_silent_cluster_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["num-clients=2", "num-rounds=1", f"ray-address=127.0.0.1:{closed_port()}", f"output-dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no Ray cluster answers" in err[0], err
    assert not out.exists()


def test_cohorts_count_the_cluster_and_no_client_asks_for_more_than_a_node_has():
    cfg = plan.build_config(["engine=cohort", "num-clients=10"])
    two_nodes = plan.size_resources(cfg, cuda_available=False, cpu_count=2, node_cpus=1)
    assert two_nodes["cohorts"] == 2 and two_nodes["client-cpus"] == 1
    uneven = plan.size_resources(
        plan.build_config(["engine=cohort", "num-clients=10", "cohorts=2"]), False, cpu_count=12, node_cpus=4
    )
    assert uneven["client-cpus"] == 4  # 6 each would fit no node
    with pytest.raises(ConfigError, match="the cluster's largest node has 1 cores"):
        plan.size_resources(plan.build_config(["client-cpus=2"]), cuda_available=False, cpu_count=2, node_cpus=1)


# ---------------------------------------------------------------- where the work ran


def test_a_round_records_the_node_each_client_ran_on_and_refuses_unreadable_names():
    answers = [
        Answer(0, {}, 1, node="node-a"),
        Answer(1, {}, 1, node="node-b"),
        Answer(2, {}, 1, node="node-a"),
        Answer(3, {}, 1, node=None),
    ]
    assert placement(answers) == {"node-a": [0, 2], "node-b": [1], "unknown": [3]}
    updates = [ClientUpdate(pid, {}, 1, {"peak-rss-mb": 100.0 + pid}) for pid in range(4)]
    record = round_record(1, updates, 0, [], [], [], False, 0.1, 0, 0, {}, placement(answers))
    assert record["nodes"]["node-a"] == [0, 2]
    assert record["node_peak_rss_mb"] == {"node-a": 102.0, "node-b": 101.0, "unknown": 103.0}
    assert record["client_peak_rss_mb"] == 103.0
    assert raycluster.reported_node("x" * 10_000_000) is None
    assert raycluster.reported_node(7) is None and raycluster.reported_node("a\nb") is None
    assert raycluster.reported_node("5f3c") == "5f3c"


def test_both_engines_name_the_node_in_a_fit_reply(tmp_path):
    """Outside Ray (in this process) the node is the host name; the server reads it and drops it from the metrics."""
    from fakes import in_process_federation, run_rounds

    cfg = plan.build_config(["num-clients=2", "num-rounds=1", "local-steps=1", "global-test=false"])
    strategy, _, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy, proxies, 1)
    (record,) = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert record["nodes"] == {socket.gethostname(): [0, 1]}
    assert "node" not in record["train"]


# ---------------------------------------------------------------- a two-node cluster on 127.0.0.1


def ray_bin() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def start_node(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [ray_bin(), "start", "--block", "--num-cpus=1", "--object-store-memory=100000000", *args]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_node(proc: subprocess.Popen) -> None:
    """SIGKILL the node: its `ray start` process and every process of its session (raylet, workers)."""
    from procs import stop_all, tree

    pids = tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    stop_all(pids)
    proc.wait(timeout=10)


def alive_nodes(address: str) -> list[str]:
    """The node ids of the cluster's alive nodes, asked from a separate process (a driver of its own)."""
    code = (
        "import ray, json; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
        "print(json.dumps(sorted(n['NodeID'] for n in ray.nodes() if n['Alive'])))" % address
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


CLUSTER_FILE = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # where `ray start` leaves its address


@pytest.fixture(scope="module")
def two_nodes():
    """A head and a second node, one core each, started as a user would (Ray's default folders, so that the head
    leaves its address where Ray looks for one); killed at the end, also on failure."""
    temp = Path(tempfile.mkdtemp(prefix="fedbr-ray-cluster-"))
    port = free_port()
    address = f"127.0.0.1:{port}"
    nodes = []
    try:
        nodes.append(start_node(["--head", f"--port={port}", "--include-dashboard=false"], temp / "head.log"))
        deadline = time.time() + 60
        while time.time() < deadline and not raycluster.answers(address):
            assert nodes[0].poll() is None, (temp / "head.log").read_text()[-2000:]
            time.sleep(0.5)
        nodes.append(start_node([f"--address={address}"], temp / "node.log"))
        deadline = time.time() + 90
        while len(ids := alive_nodes(address)) < 2:
            assert time.time() < deadline, (temp / "node.log").read_text()[-2000:]
            assert nodes[1].poll() is None, (temp / "node.log").read_text()[-2000:]
            time.sleep(1)
        yield address, ids, nodes
    finally:
        for proc in reversed(nodes):
            stop_node(proc)
        if CLUSTER_FILE.is_file() and CLUSTER_FILE.read_text().strip().endswith(f":{port}"):
            CLUSTER_FILE.unlink()  # `ray stop` would remove it: no later ray.init() should look for this cluster
        shutil.rmtree(temp, ignore_errors=True)


RUN = [
    "strategy=fedbr",
    "num-clients=4",
    "num-rounds=3",
    "local-steps=2",
    "batch-size=8",
    "eval-every=1",
    "global-test=false",
    "model=cnn-small",
    "engine=cohort",
    "--quiet",
]


def rounds_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.long
def test_cohorts_spread_over_both_nodes_equal_a_private_run_and_leave_the_cluster_running(tmp_path, two_nodes):
    """cohorts=0 on the joined cluster makes one cohort per node's core (2); the fits of each round run on
    both nodes, as rounds.jsonl records; the metrics equal those of the same two cohorts on a private
    runtime (the cohort engine's equality rule); the cluster outlives the run."""
    from fakes import records_without_timing
    from test_golden import close_json

    address, node_ids, _ = two_nodes
    joined, private = tmp_path / "joined", tmp_path / "private"
    assert cli.main([*RUN, f"ray-address={address}", f"output-dir={joined}"]) == 0
    manifest = json.loads((joined / "manifest.json").read_text())
    port = address.rsplit(":", 1)[1]  # Ray resolves 127.0.0.1 to this machine's address
    assert manifest["config"]["ray-address"].endswith(f":{port}") and manifest["config"]["cohorts"] == 2
    used = {node for record in rounds_of(joined) for node in record["nodes"]}
    assert used == set(node_ids), (used, node_ids)
    assert alive_nodes(address) == node_ids  # the run disconnected; it did not stop the cluster

    assert cli.main([*RUN, "cohorts=2", "client-cpus=1", f"output-dir={private}"]) == 0
    assert not {node for record in rounds_of(private) for node in record["nodes"]} & set(node_ids)
    for name in ("rounds.jsonl", "metrics.jsonl"):
        close_json(records_without_timing(joined / name), records_without_timing(private / name), name, exact=False)


@pytest.mark.e2e
@pytest.mark.long
def test_a_run_without_the_setting_does_not_join_the_cluster_ray_start_left(tmp_path, two_nodes, monkeypatch):
    """Ray itself would join the newest cluster `ray start` left on this machine (its address file): fedbr-run
    starts a private runtime unless told otherwise."""
    address, node_ids, _ = two_nodes
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "run"
    assert cli.main(["num-clients=2", "num-rounds=1", "local-steps=1", "--quiet", f"output-dir={out}"]) == 0
    assert not {node for record in rounds_of(out) for node in record["nodes"]} & set(node_ids)


def test_a_resumed_run_runs_where_the_resume_command_says(tmp_path, monkeypatch):
    """The checkpoint's cluster may be gone: --resume does not take ray-address from it."""
    from fedbr_flwr.core.config import validate
    from fedbr_flwr.runfiles.checkpoint import save_checkpoint

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    save_checkpoint(tmp_path, {}, {"round": 2, "config": validate({"num-rounds": 4, "ray-address": "10.0.0.5:6379"})})
    (tmp_path / "rounds.jsonl").write_text('{"round": 1}\n{"round": 2}\n')  # what the run wrote up to it
    (tmp_path / "metrics.jsonl").write_text('{"round": 2}\n')
    assert plan.resume_config(tmp_path, [])["ray-address"] == ""
    assert plan.resume_config(tmp_path, ["ray-address=auto"])["ray-address"] == "auto"


@pytest.mark.e2e
@pytest.mark.long
def test_a_node_that_dies_mid_run_fails_its_clients_and_the_run_goes_on(tmp_path, two_nodes):
    """The second node is killed (its `ray start` and every process of its session) after round 2: its cohort's
    clients are recorded as failed in the round it died in (if their message was on it), with one line naming
    Ray's reason; its dead actor's place in the pool goes to the head's, so from then on the head serves both
    cohorts to the last round, every client training; the head lives on. Runs last: it leaves the cluster one
    node short."""
    address, node_ids, nodes = two_nodes
    out = tmp_path / "run"
    command = [sys.executable, "-m", "fedbr_flwr.commands.cli", *RUN[:-1], "num-rounds=5", f"ray-address={address}"]
    proc = subprocess.Popen(
        [*command, f"output-dir={out}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        printed = []
        for line in proc.stdout:
            printed.append(line)
            if "round 2/5" in line:
                stop_node(nodes[1])
        assert proc.wait(timeout=300) == 0, "".join(printed[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
    rounds = rounds_of(out)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5] and rounds[0]["clients"] == 4
    # the round under way when the node died may fail its cohort (if its message was on the node by then)
    failed = [r for r in rounds[2:] if r.get("failed_clients")]
    assert len(failed) <= 1 and all(len(r["failed_clients"]) == 2 for r in failed), rounds
    assert all("\n" not in e and "Actor" in e for r in failed for e in r["errors"]), failed
    after = rounds[3:]
    assert all(r["clients"] == 4 and not r.get("failed_clients") for r in after), after
    assert {node for r in after for node in r["nodes"]} == {alive_nodes(address)[0]}
