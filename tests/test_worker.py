"""The SuperNode's long-lived client worker: one client object per run, reused across messages, with
Flower's context.state carried to it and back."""

import threading

import numpy as np
import pytest
from flwr.common import Context, RecordDict

from fedbr_flwr.app import payload
from fedbr_flwr.app.client_app import WorkerClient
from fedbr_flwr.launch.worker import RUNS_KEPT, Worker
from fedbr_flwr.runfiles.run_io import code_hash

RUN_CONFIG = {"strategy": "scaffold", "num-clients": 2, "local-steps": 2, "batch-size": 8}


def request(method, *args, run_id=1, pid=0, state=None, code=None):
    return {
        "code": code or code_hash(),
        "run_id": run_id,
        "run_config": RUN_CONFIG,
        "node_config": {"partition-id": pid, "num-partitions": 2},
        "state": state if state is not None else RecordDict(),
        "method": method,
        "args": args,
    }


def test_worker_reuses_a_runs_client_and_forgets_old_runs():
    worker = Worker()
    worker.handle(request("get_properties", {}))
    [first] = worker.clients.clients.values()
    worker.handle(request("get_properties", {}))
    assert list(worker.clients.clients.values()) == [first]  # model and data built once per run
    for run in range(2, 3 + RUNS_KEPT):
        worker.handle(request("get_properties", {}, run_id=run))
    assert sorted({run for run, _, _ in worker.clients.clients}) == list(range(3, 3 + RUNS_KEPT))


def test_worker_refuses_a_run_of_other_code():
    with pytest.raises(RuntimeError, match="restart the worker"):
        Worker().handle(request("get_properties", {}, code="0123456789abcdef"))


def test_client_app_forwards_to_the_worker_and_gets_flowers_state_back(tmp_path):
    address = str(tmp_path / "w.sock")
    threading.Thread(target=Worker().serve, args=(address,), daemon=True).start()
    for _ in range(100):
        if (tmp_path / "w.sock").exists():
            break
        threading.Event().wait(0.05)
    context = Context(
        run_id=7,
        node_id=1,
        node_config={"partition-id": 1, "num-partitions": 2},
        state=RecordDict(),
        run_config=RUN_CONFIG,
    )
    client = WorkerClient(address, context)
    assert client.get_properties({})["partition-id"] == 1
    weights = payload.from_list(client.get_parameters({}))
    control = {k.replace("model/", "control/"): np.zeros_like(w) for k, w in weights.items()}
    returned, n, metrics = client.fit(payload.to_list({**weights, **control}), {"server-round": 1})
    assert n > 0 and metrics["partition-id"] == 1 and len(payload.from_list(returned)) == 2 * len(weights)
    # SCAFFOLD's c_i came back into Flower's node state, pending until the server says it used the update
    assert "pending/scaffold-control" in context.state and "scaffold-control" not in context.state
    client.fit(payload.to_list({**weights, **control}), {"server-round": 2, "update-used": 1})
    assert "scaffold-control" in context.state
    # the server did not use round 2's update: the worker drops its pending state, and so does Flower's copy
    client.evaluate(payload.to_list(weights), {"server-round": 2, "update-used": 1})
    assert "scaffold-control" in context.state and not [k for k in context.state if k.startswith("pending")]


def test_a_node_with_a_worker_hands_its_messages_to_it(tmp_path, monkeypatch):
    from flwr.common import GetPropertiesIns

    from fedbr_flwr.app import client_app

    monkeypatch.setattr(client_app, "client_cache", lambda: pytest.fail("the node built a client of its own"))
    address = str(tmp_path / "none.sock")
    context = Context(run_id=1, node_id=1, node_config={"worker": address}, state=RecordDict(), run_config={})
    with pytest.raises(RuntimeError, match=f"no fedbr worker answers at {address}"):
        client_app.client_fn(context).get_properties(GetPropertiesIns({}))


@pytest.mark.parametrize(
    "run_config, node, message",
    [
        ({}, {}, "this SuperNode has no 'partition-id' in its node config"),
        ({}, {"partition-id": 0}, "num-clients is 0 and the SuperNode has no num-partitions"),
        (
            {"num-clients": 3},
            {"partition-id": 0, "num-partitions": 2},
            "num-clients = 3 but this SuperNode was told num-partitions = 2",
        ),
    ],
)
def test_a_node_config_that_does_not_fit_the_run_is_one_clear_error(run_config, node, message):
    """Flower's own --node-config (plain flower-supernode): no traceback from deep in the data loading."""
    import re

    from fedbr_flwr.app.node import build_client
    from fedbr_flwr.core.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        build_client(run_config, node, RecordDict())


def test_a_node_of_a_run_without_num_clients_splits_the_data_by_its_num_partitions():
    from fedbr_flwr.app.node import build_client

    run_config = {k: v for k, v in RUN_CONFIG.items() if k != "num-clients"}
    client = build_client(run_config, {"partition-id": 1, "num-partitions": 3}, RecordDict())
    assert client.algorithm.cfg["num-clients"] == 3 and client.algorithm.data.partition_id == 1


def test_client_app_without_a_worker_says_how_to_start_one(tmp_path):
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(RuntimeError, match="no fedbr worker answers at .*start it with `fedbr-worker"):
        WorkerClient(str(tmp_path / "none.sock"), context).get_properties({})


def test_the_code_hash_covers_the_projects_sources_and_moves_with_them(tmp_path):
    """After the modules moved into one folder per layer it hashed no file (sha256 of nothing, e3b0c442...): every
    version had the same hash, and a worker ran a run of another version without a word."""
    import hashlib
    import shutil

    from fedbr_flwr.runfiles.run_io import CODE_PACKAGES, PROJECT_ROOT

    assert all((PROJECT_ROOT / pkg / "__init__.py").is_file() for pkg in CODE_PACKAGES)
    assert code_hash() != hashlib.sha256().hexdigest()[:16]
    for pkg in CODE_PACKAGES:
        shutil.copytree(PROJECT_ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert code_hash(tmp_path) == code_hash()
    with open(tmp_path / "clients" / "fedbr.py", "a") as f:
        f.write("# changed\n")
    assert code_hash(tmp_path) != code_hash()
