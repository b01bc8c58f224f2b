"""``backend``: where a simulation's clients run. ``in-process`` runs them in threads of the simulation process
(``fedbr_flwr.app.inprocess.InProcessBackend``, handed to Flower's engine by
``flower_adapter.choose_backend_per_run``);
``auto`` picks it where it can run. The runs themselves, against the Ray backend, are in test_e2e.py."""

import threading

import pytest
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.clientapp.client_app import ClientAppException

from fedbr_flwr.app import flower_adapter, server_app
from fedbr_flwr.app.inprocess import IN_PROCESS, InProcessBackend, worker_threads
from fedbr_flwr.commands import cli
from fedbr_flwr.core.config import RESUMABLE_KEYS
from fedbr_flwr.core.errors import ConfigError
from fedbr_flwr.launch import plan, simulation


def sized(*items, cuda=False, cpus=2):
    return plan.size_resources(plan.build_config(list(items)), cuda_available=cuda, cpu_count=cpus)


def test_auto_runs_the_clients_in_process_on_this_machines_cpus_and_on_ray_elsewhere():
    assert plan.choose_backend(sized())["backend"] == "in-process"
    assert plan.choose_backend(sized("engine=cohort"))["backend"] == "in-process"
    assert plan.choose_backend(sized(cuda=True, cpus=16))["backend"] == "ray"  # a GPU share per client
    assert plan.choose_backend(sized("device=cpu", cuda=True, cpus=16))["backend"] == "in-process"
    assert plan.choose_backend(sized(), superlink=True)["backend"] == "ray"
    assert plan.choose_backend(sized(), cluster=True)["backend"] == "ray"
    assert plan.choose_backend(sized("backend=ray"))["backend"] == "ray"


@pytest.mark.parametrize(
    "items, where, message",
    [
        ([], {"superlink": True}, "--superlink runs Flower's own simulation process"),
        ([], {"cluster": True}, "the run joins a Ray cluster"),
        (["client-gpus=0.5"], {}, "the clients use a GPU"),
    ],
)
def test_in_process_where_it_cannot_run_is_refused_with_the_reason(items, where, message):
    cfg = plan.build_config(["backend=in-process", *items])
    with pytest.raises(ConfigError, match=f"backend = in-process runs the clients in threads .*{message}"):
        plan.choose_backend(cfg, **where)


def test_fedbr_run_resolves_the_backend_and_superlink_refuses_in_process(tmp_path, capsys):
    assert cli.main(["num-clients=2", f"output-dir={tmp_path / 'a'}", "--dry-run"]) == 0
    assert "backend = 'in-process'" in capsys.readouterr().out
    assert cli.main(["num-clients=2", "backend=in-process", f"output-dir={tmp_path / 'b'}", "--superlink"]) == 2
    assert "--superlink runs Flower's own simulation process" in capsys.readouterr().err


def test_a_deployment_and_flowers_own_simulation_refuse_in_process(capsys, tmp_path, monkeypatch):
    from flwr.server.superlink.fleet.vce.backend import raybackend

    from fedbr_flwr.commands import deploy

    monkeypatch.setattr(raybackend, "RayBackend", type("FlowersOwn", (), {}))  # as in flwr-simulation

    assert deploy.main(["local", "backend=in-process", f"output-dir={tmp_path / 'run'}"]) == 2
    assert "a deployment's clients are its SuperNodes" in capsys.readouterr().err
    cfg = plan.build_config(["backend=in-process"])
    with pytest.raises(ConfigError, match="this run is Flower's"):  # no backend chosen per run in this process
        server_app.check_backend(cfg)
    server_app.check_backend(plan.build_config(["backend=ray"]))


def test_the_backend_may_change_when_a_run_resumes():
    assert "backend" in RESUMABLE_KEYS


def test_as_many_threads_as_clients_fit_in_the_cores():
    assert worker_threads({"client_resources": {"num_cpus": 1.0}}, cpus=2) == 2
    assert worker_threads({"client_resources": {"num_cpus": 2}}, cpus=16) == 8
    assert worker_threads({"client_resources": {"num_cpus": 4}}, cpus=2) == 1
    assert worker_threads({}, cpus=3) == 3


def context_with_state(value: float) -> Context:
    state = RecordDict({"meta": ConfigRecord({"rounds": value})})
    return Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=state, run_config={})


MESSAGE, REPLY = object(), object()  # the backend hands them on as they are


def test_the_client_app_runs_in_the_calling_thread_on_its_own_copy_of_the_context():
    threads = []

    def app(message, context):
        assert message is MESSAGE
        threads.append(threading.get_ident())
        context.state["meta"]["rounds"] = context.state["meta"]["rounds"] + 1
        return REPLY

    backend = InProcessBackend({"client_resources": {"num_cpus": 1}})
    backend.build(lambda: app)
    context = context_with_state(1)
    reply, updated = backend.process_message(MESSAGE, context)
    assert threads == [threading.get_ident()]
    assert reply is REPLY and updated.state["meta"]["rounds"] == 2
    assert context.state["meta"]["rounds"] == 1  # Flower's engine stores the returned one


def test_a_client_that_raises_is_reported_as_flower_reports_an_actors_error_and_leaves_the_state_as_it_was():
    def app(message, context):
        context.state["meta"]["rounds"] = 99
        raise ValueError("the client broke")

    backend = InProcessBackend({"client_resources": {"num_cpus": 1}})
    backend.build(lambda: app)
    context = context_with_state(1)
    with pytest.raises(ClientAppException, match="the client broke"):
        backend.process_message(MESSAGE, context)
    assert context.state["meta"]["rounds"] == 1


def test_flowers_engine_gets_the_in_process_backend_only_where_the_run_asks_for_it(monkeypatch):
    from flwr.server.superlink.fleet.vce.backend import raybackend

    monkeypatch.setattr(raybackend, "RayBackend", raybackend.RayBackend)  # restored after the test
    ray_backend = raybackend.RayBackend
    flower_adapter.choose_backend_per_run()
    flower_adapter.choose_backend_per_run()  # once is enough
    chosen = raybackend.RayBackend
    assert chosen.__mro__[1] is ray_backend
    backend = chosen({"client_resources": {"num_cpus": 1}, IN_PROCESS: {"on": True}})
    assert isinstance(backend, InProcessBackend) and backend.num_workers >= 1
    built = []
    monkeypatch.setattr(ray_backend, "__init__", lambda self, config: built.append(config))  # no Ray here
    backend = chosen({"client_resources": {"num_cpus": 1}, IN_PROCESS: {"on": False}})
    assert isinstance(backend, ray_backend) and len(built) == 1
    server_app.check_backend(plan.build_config(["backend=in-process"]))  # now it would run in-process


def test_the_simulation_process_starts_ray_ahead_only_where_a_run_will_likely_use_it():
    assert simulation.ray_likely({"RAY_ADDRESS": "10.0.0.1:6379"})
    assert not simulation.ray_likely({"RAY_ADDRESS": "local", "CUDA_VISIBLE_DEVICES": ""})
    assert not simulation.ray_likely({"CUDA_VISIBLE_DEVICES": "-1"})


def test_a_client_in_process_records_this_machine_as_where_it_ran_even_beside_a_ray_runtime(monkeypatch):
    import socket
    import sys
    import types

    from fedbr_flwr.app.raycluster import worker_node

    actor = {"id": None}  # the driver: a sweep's simulation process that ran a run on Ray before
    context = types.SimpleNamespace(get_node_id=lambda: "ray-node-1", get_actor_id=lambda: actor["id"])
    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    backend = InProcessBackend({"client_resources": {"num_cpus": 1}})
    backend.build(lambda: lambda message, context: worker_node())
    assert backend.process_message(MESSAGE, context_with_state(0))[0] == socket.gethostname()
    actor["id"] = "a1"  # a client in a Ray actor
    assert worker_node() == "ray-node-1"


def test_the_backend_counts_the_client_calls_that_have_not_returned():
    from fedbr_flwr.app.inprocess import clients_running

    inside, release = threading.Event(), threading.Event()

    def app(message, context):
        inside.set()
        release.wait(10)
        raise ValueError("done")

    backend = InProcessBackend({"client_resources": {"num_cpus": 1}})
    backend.build(lambda: app)
    before = clients_running()
    call = threading.Thread(target=lambda: pytest.raises(ClientAppException, backend.process_message, MESSAGE, None))
    call.start()
    assert inside.wait(10) and clients_running() == before + 1
    release.set()
    call.join(10)
    assert clients_running() == before  # also after a call that raised
