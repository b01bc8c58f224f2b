"""The simulation process that runs a sweep's runs one after another (``fedbr_flwr.launch.simulation.serve``,
``launcher.RunHost``): its protocol, what it keeps between runs and when it gives up. The real runs are in
the end-to-end tests (test_sweep.py)."""

import io
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from procs import flower_processes

from fedbr_flwr.app import flower_adapter
from fedbr_flwr.commands import cli
from fedbr_flwr.launch import launcher, plan, simulation
from fedbr_flwr.launch.protocol import RunReply, RunRequest

EARLY_HOST = cli.early_host  # conftest.py replaces it in fast tests; these tests run it


@pytest.fixture
def own_stdout_stderr(monkeypatch):
    """``serve`` points this process's stdout and stderr (file descriptors 1 and 2, which ``sys.stdout`` and
    ``sys.stderr`` write to, as in the host) at each run's log: give them back afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)

    def write_to_descriptors():  # in the test itself: pytest sets sys.stdout and sys.stderr for each phase
        monkeypatch.setattr(sys, "stdout", open(1, "w", closefd=False))
        monkeypatch.setattr(sys, "stderr", open(2, "w", closefd=False))

    try:
        yield write_to_descriptors
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def request(tmp_path, run_id):
    folder = tmp_path / f"run{run_id}"
    folder.mkdir()
    (folder / "run_config.toml").write_text(f"seed = {run_id}\n")
    return RunRequest(
        run_config=str(folder / "run_config.toml"),
        run_id=run_id,
        supernodes=2,
        cpus=1.0,
        gpus=0.0,
        log=str(folder / "flower.log"),
        append=False,
        cwd=str(folder),
    )


def serve_runs_with(monkeypatch, fake_simulate):
    """``serve`` with each run's ``simulate`` replaced, and nothing of Ray or the imports started ahead; the
    working directory, which each run changes to its folder, is restored after the test."""
    monkeypatch.chdir(Path.cwd())
    monkeypatch.setattr(simulation, "simulate", fake_simulate)
    monkeypatch.setattr(simulation, "keep_actors_between_runs", lambda: None)
    monkeypatch.setattr(simulation, "replace_dead_actors", lambda: None)
    monkeypatch.setattr(simulation, "start_ray", lambda: None)
    monkeypatch.setattr(simulation, "import_both_sides", lambda: None)


def test_serve_runs_each_request_with_its_output_in_its_log_then_stops_after_a_failed_run(
    tmp_path, monkeypatch, own_stdout_stderr
):
    ran = []

    def fake_simulate(run_config, run_id, supernodes, cpus, gpus, clients_here):
        ran.append((run_config, run_id, supernodes, cpus, gpus, os.getcwd()))
        print(f"output of run {run_id}", flush=True)
        if run_id == 2:
            raise RuntimeError("the ServerApp broke")

    serve_runs_with(monkeypatch, fake_simulate)
    own_stdout_stderr()
    requests = [request(tmp_path, i) for i in (1, 2, 3)]
    replies = io.StringIO()
    code = simulation.serve(io.StringIO("".join(r.line() for r in requests)), replies)
    assert code == 1
    answers = [RunReply.parse(line) for line in replies.getvalue().splitlines()]
    assert answers == [
        RunReply(1, started=True),
        RunReply(1, ok=True),
        RunReply(2, started=True),
        RunReply(2, ok=False, error="RuntimeError: the ServerApp broke"),
    ]  # run 3 is not started after the failure
    assert [(r[0], r[1], r[5]) for r in ran] == [
        ({"seed": 1}, 1, str(tmp_path / "run1")),
        ({"seed": 2}, 2, str(tmp_path / "run2")),
    ]
    log1, log2 = (tmp_path / f"run{i}" / "flower.log" for i in (1, 2))
    assert "run 1 started" in log1.read_text() and "output of run 1" in log1.read_text()
    assert "output of run 2" not in log1.read_text()
    assert "output of run 2" in log2.read_text() and "RuntimeError: the ServerApp broke" in log2.read_text()


def test_serve_starts_ray_in_its_own_thread_for_a_run_whose_config_asks_for_ray_and_not_otherwise(
    tmp_path, monkeypatch, own_stdout_stderr
):
    """Where a run's clients run is its run config's ``backend`` (decided once by the run plan); the request
    does not carry it a second time, and the process reads it once, for both Ray and the run."""
    here, reads = [], []
    serve_runs_with(monkeypatch, lambda *args: here.append(args[-1]))
    started = []
    read = simulation.in_process
    monkeypatch.setattr(simulation, "in_process", lambda run_config: reads.append(1) or read(run_config))
    monkeypatch.setattr(simulation, "start_ray", lambda: started.append(threading.current_thread().name))
    monkeypatch.setattr(simulation, "ray_likely", lambda: False)  # nothing started ahead of the requests
    own_stdout_stderr()
    requests = [request(tmp_path, i) for i in (1, 2)]
    Path(requests[0].run_config).write_text('backend = "in-process"\n')
    Path(requests[1].run_config).write_text('backend = "ray"\n')
    assert "backend" not in requests[0].line()
    serve_in_process = simulation.serve(io.StringIO(requests[0].line()), io.StringIO())
    assert serve_in_process == 0 and started == []
    serve_on_ray = simulation.serve(io.StringIO(requests[1].line()), io.StringIO())
    assert serve_on_ray == 0 and started == [threading.current_thread().name]
    assert here == [True, False] and len(reads) == 2


def test_serve_reads_each_run_config_once_and_fails_a_run_whose_config_it_cannot_read(
    tmp_path, monkeypatch, own_stdout_stderr
):
    ran, reads = [], []
    serve_runs_with(monkeypatch, lambda run_config, *args: ran.append(run_config))
    read = simulation.run_config_from
    monkeypatch.setattr(simulation, "run_config_from", lambda path: reads.append(path) or read(path))
    own_stdout_stderr()
    good, bad = request(tmp_path, 1), request(tmp_path, 2)
    Path(bad.run_config).unlink()
    replies = io.StringIO()
    assert simulation.serve(io.StringIO(good.line() + bad.line()), replies) == 1
    assert ran == [{"seed": 1}] and reads.count(Path(good.run_config)) == 1
    last = [RunReply.parse(line) for line in replies.getvalue().splitlines()][-1]
    assert (last.run_id, last.ok) == (2, False) and last.error, last


def test_serve_hands_no_run_to_a_process_still_running_a_client_of_the_run_before(
    tmp_path, monkeypatch, own_stdout_stderr
):
    """Run 1 ends with a client call that never returned (its round timed out): a thread cannot be killed, so
    the process answers run 2's request with the reason and ends instead of running it."""
    from fedbr_flwr.app.inprocess import InProcessBackend, clients_running

    release, ran = threading.Event(), []

    def hung_client(message, context):
        release.wait(30)

    def fake_simulate(run_config, run_id, supernodes, cpus, gpus, clients_here):
        ran.append(run_id)
        backend = InProcessBackend({"client_resources": {"num_cpus": 1}})
        backend.build(lambda: hung_client)
        threading.Thread(target=backend.process_message, args=(None, None), daemon=True).start()
        while not clients_running():
            threading.Event().wait(0.01)

    serve_runs_with(monkeypatch, fake_simulate)
    own_stdout_stderr()
    replies = io.StringIO()
    try:
        code = simulation.serve(io.StringIO("".join(request(tmp_path, i).line() for i in (1, 2))), replies)
    finally:
        release.set()
    answers = [RunReply.parse(line) for line in replies.getvalue().splitlines()]
    assert code == 0 and ran == [1]
    assert answers[:2] == [RunReply(1, started=True), RunReply(1, ok=True)]
    assert answers[2:] == [
        RunReply(2, retired="the simulation process still runs 1 client(s) the run before gave up on (never returned)")
    ]


class FakePool:
    def __init__(self, resources, actors=2):
        self.client_resources = resources
        self.pool = [object() for _ in range(actors)]
        self.num_actors = actors
        self.terminated = False

    def terminate_all_actors(self):
        self.terminated = True


def test_the_kept_backend_reuses_the_actors_of_the_run_before_only_when_they_fit_and_answer(monkeypatch):
    from flwr.server.superlink.fleet.vce.backend import raybackend

    built = []

    def build(self, app_fn):  # Flower's: a new pool of new actors
        self.pool, self.app_fn = FakePool(self.client_resources), app_fn
        built.append(self.pool)

    monkeypatch.setattr(raybackend, "RayBackend", raybackend.RayBackend)  # restored after the test
    monkeypatch.setattr(raybackend.RayBackend, "build", build)
    answering = {"yes": True}
    monkeypatch.setattr(flower_adapter, "all_idle_and_alive", lambda pool: answering["yes"])
    flower_adapter.keep_actors_between_runs()
    kept_backend = raybackend.RayBackend

    def backend(resources):
        b = object.__new__(kept_backend)  # without Ray
        b.client_resources = resources
        return b

    first = backend({"num_cpus": 1})
    first.build("app 1")
    first.terminate()  # Flower's would terminate the actors and shut Ray down
    assert not built[0].terminated
    second = backend({"num_cpus": 1})
    second.build("app 2")
    assert second.pool is built[0] and second.app_fn == "app 2" and len(built) == 1
    third = backend({"num_cpus": 2})  # other resources: new actors, the old ones go
    third.build("app 3")
    assert len(built) == 2 and third.pool is built[1] and built[0].terminated
    answering["yes"] = False  # an actor died: new actors
    fourth = backend({"num_cpus": 2})
    fourth.build("app 4")
    assert len(built) == 3 and fourth.pool is built[2] and built[1].terminated


def test_an_actor_pool_with_an_actor_out_or_dead_is_not_reused(monkeypatch):
    import ray

    pool = FakePool({"num_cpus": 1})
    pool.pool = [type("A", (), {"__ray_ready__": type("M", (), {"remote": staticmethod(lambda: "ref")})()})()] * 2
    monkeypatch.setattr(ray, "get", lambda refs, timeout: refs)
    assert flower_adapter.all_idle_and_alive(pool)
    pool.num_actors = 3  # one is still out (its future not fetched)
    assert not flower_adapter.all_idle_and_alive(pool)
    pool.num_actors = 2

    def dead(refs, timeout):
        raise ray.exceptions.RayActorError()

    monkeypatch.setattr(ray, "get", dead)
    assert not flower_adapter.all_idle_and_alive(pool)


def test_a_request_and_a_reply_cross_as_one_line_and_anything_else_is_refused(tmp_path):
    sent = request(tmp_path, 3)
    assert RunRequest.parse(sent.line()) == sent and sent.line().count("\n") == 1
    assert RunReply.parse(RunReply(3, ok=False, error="x").line()).last
    assert not RunReply(3, started=True).last
    assert RunReply.parse('{"run_id": 3, "started": true, "later": 1}') == RunReply(3, started=True)
    for line in ("not json", "[1, 2]", '{"started": true}', '{"run_id": 3, "started": "x"}', '{"run_id": 3, "ok": 1}'):
        with pytest.raises(ValueError):
            RunReply.parse(line)


def test_serve_answers_from_several_threads_one_whole_line_at_a_time():
    replies = io.StringIO()
    threads = [
        threading.Thread(target=simulation.answer, args=(replies, RunReply(i, error="y" * 1000))) for i in range(20)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(RunReply.parse(line).run_id for line in replies.getvalue().splitlines()) == list(range(20))


def prepared(tmp_path, name, **settings):
    from fedbr_flwr.launch.plan import config_from_settings, plan_run

    base = {"num-clients": 2, "num-rounds": 1, "local-steps": 1, "batch-size": 8, "global-test": False}
    return plan_run(config_from_settings({**base, **settings, "output-dir": str(tmp_path / name)}), True)


@pytest.mark.e2e
@pytest.mark.long
def test_a_killed_or_failed_host_is_replaced_by_a_new_one_and_none_leaves_a_process(tmp_path):
    """Run 1 completes; its host is killed (SIGKILL); run 2 starts a new host and fails there (its ServerApp
    refuses its config), which ends that host too; run 3 completes in a third. Nothing is left afterwards."""
    import signal

    from procs import flower_processes

    from fedbr_flwr.launch.launcher import RunFailed, RunHost, run_flower

    before = flower_processes()
    first, second, third = (prepared(tmp_path, f"run{i}", seed=i) for i in (1, 2, 3))
    second = second.with_keys({"lr": "fast"})  # past the checks of fedbr-run: the ServerApp's own validation refuses it
    hosts = []
    with RunHost() as host:
        run_flower(first, echo="none", host=host)
        hosts.append(host.proc.pid)
        os.kill(host.proc.pid, signal.SIGKILL)
        with pytest.raises(RunFailed, match="ended as 'finished:failed': .*lr"):
            run_flower(second, echo="none", host=host)
        hosts.append(host.proc.pid)
        assert host.proc.wait(30) == 1  # a host whose run failed ends
        run_flower(third, echo="none", host=host)
        hosts.append(host.proc.pid)
        assert len(set(hosts)) == 3
    for i in (1, 3):
        assert json.loads((tmp_path / f"run{i}" / "summary.json").read_text())["last_round"] == 1
    assert "lr" in (tmp_path / "run2" / "flower.log").read_text()
    assert flower_processes() <= before


def test_fedbr_run_starts_its_simulation_process_before_checking_the_config_and_stops_it(monkeypatch, tmp_path):
    """The process a run goes to is running when fedbr-run hands it the checked run, and is
    stopped when the command ends; a refused configuration stops it too, and leaves no process."""
    monkeypatch.setattr(cli, "early_host", EARLY_HOST)
    before = flower_processes()
    handed = []

    def run_flower(run_plan, echo, superlink=False, host=None, watch=None):
        if run_plan.settings.ray_address:
            handed.append((host, None if host.proc is None else host.proc.pid, b""))
            raise launcher.RunFailed("stopped here")
        assert host is not None and host.proc is not None and host.proc.poll() is None
        handed.append((host, host.proc.pid, (Path("/proc") / str(host.proc.pid) / "cmdline").read_bytes()))
        raise launcher.RunFailed("stopped here")

    monkeypatch.setattr(cli, "run_flower", run_flower)
    assert cli.main(["num-clients=2", "num-rounds=1", f"output-dir={tmp_path / 'run'}", "--quiet"]) == 1
    host, pid, cmdline = handed[0]
    assert cmdline.endswith(b"-m\0fedbr_flwr.launch.simulation\0")
    assert host.proc is None and not Path(f"/proc/{pid}").exists()
    assert cli.main(["num-clients=2", "lr=-1", f"output-dir={tmp_path / 'refused'}"]) == 2
    assert flower_processes() == before
    monkeypatch.setattr(plan, "size_for_runtime", lambda cfg, **_: {**cfg, "ray-address": "10.0.0.1:6379"})  # joined
    assert cli.main(["num-clients=2", "num-rounds=1", f"output-dir={tmp_path / 'joined'}", "--quiet"]) == 1
    host, pid, _ = handed[1]  # stopped before the run, which joins the cluster, started
    assert host.proc is None and pid is None


def test_fedbr_run_starts_no_early_process_where_the_run_would_not_use_it(monkeypatch):
    parse = cli.build_parser().parse_intermixed_args
    for flags in (["--superlink"], ["--dry-run"]):
        assert EARLY_HOST(parse(flags)) is None
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert EARLY_HOST(parse([])) is None


def test_a_private_runtimes_workers_get_the_module_path_from_the_environment_and_a_clusters_from_the_job():
    """With a job runtime environment Ray would not hand the workers it starts with the driver to the actors."""
    private = simulation.ray_init_args({})
    assert private["address"] == "local" and "runtime_env" not in private
    joined = simulation.ray_init_args({"RAY_ADDRESS": "10.0.0.1:6379"})
    assert joined["address"] == "10.0.0.1:6379"
    assert joined["runtime_env"] == {"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}}


def test_a_dead_actor_in_the_pool_is_replaced_by_a_new_one_and_the_others_kept(monkeypatch):
    pool, (alive, dead, new) = fake_actor_pool(monkeypatch, [True, False], new_starts=True)
    assert flower_adapter.renew_dead_actors(pool) == 1
    assert pool.pool == [alive, new]


def test_a_dead_actor_whose_replacement_cannot_start_gives_its_place_to_a_live_one(monkeypatch):
    """Its node is gone with the resources a new actor needs: a new one would never start, and every message
    sent to it would wait for ever. A live actor takes its place too (the pool keeps its size, which is how many
    messages Flower's engine runs at once), so the other actors serve its clients."""
    pool, (alive, dead, new) = fake_actor_pool(monkeypatch, [True, False], new_starts=False)
    assert flower_adapter.renew_dead_actors(pool) == 1
    assert pool.pool == [alive, alive] and pool.killed == [new]
    alone, (only, _) = fake_actor_pool(monkeypatch, [False], new_starts=False)
    flower_adapter.renew_dead_actors(alone)
    assert alone.pool == [only]  # no live actor to stand in: its messages fail at once instead of waiting


def test_a_message_whose_actor_died_has_it_replaced_before_another_message_draws_from_the_pool(monkeypatch):
    """As Flower's backend does: a message draws the top actor, its result raises (the actor died), the actor is
    handed back, the error raised. Another thread drawing meanwhile (here: while the pool is being renewed) gets a
    live actor, never the dead one, which once failed an honest client's message too."""
    import ray

    pool, (alive, dead, new) = fake_actor_pool(monkeypatch, [True, False], new_starts=True)
    pool.futures = {}

    def submit(actor_fn, job):
        actor = pool.pool.pop()  # Flower's pool draws the top one
        pool.futures[job] = actor
        return job

    def fetch(future):
        if not pool.futures[future].up:
            raise ray.exceptions.RayActorError()
        pool.add_actor_back_to_pool(future)
        return future

    pool.submit, pool.fetch_result_and_return_actor_to_pool = submit, fetch
    pool.add_actor_back_to_pool = lambda future: pool.pool.append(pool.futures.pop(future))
    flower_adapter.hand_back_live_actors(pool)
    renewing, drawn = threading.Event(), {}
    checked = ray.get

    def slow_get(ref, timeout):  # the dead actor's check is slow: a second message draws meanwhile
        if ref is dead:
            renewing.set()
            time.sleep(0.3)
        return checked(ref, timeout)

    monkeypatch.setattr(ray, "get", slow_get)
    future = pool.submit(None, "crashing client")
    with pytest.raises(ray.exceptions.RayActorError):
        pool.fetch_result_and_return_actor_to_pool(future)
    second = threading.Thread(target=lambda: renewing.wait(5) and drawn.update(actor=pool.submit(None, "honest")))
    second.start()
    pool.add_actor_back_to_pool(future)  # Flower's except path, which then raises the error
    second.join(5)
    assert pool.futures["honest"] is new and pool.pool == [alive]


def fake_actor_pool(monkeypatch, alive: list[bool], new_starts: bool):
    """A Flower actor pool of fake actors (``alive``: which answer) whose new actor starts or not; ray.get and
    ray.kill act on them."""
    import ray

    class Actor:
        def __init__(self, up):
            self.up = up
            self.__ray_ready__ = type("Method", (), {"remote": lambda _: self})()

    def get(ref, timeout):
        if not ref.up:
            raise ray.exceptions.GetTimeoutError()
        return True

    actors = [Actor(up) for up in alive]
    new = Actor(new_starts)
    pool = type("Pool", (), {"pool": list(actors), "killed": [], "create_actor_fn": lambda _: new})()
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor: pool.killed.append(actor))
    return pool, (*actors, new)


def fake_host(code: str) -> launcher.RunHost:
    """A RunHost whose process is ``python -c code``, its replies followed as a real one's."""
    import subprocess

    host = launcher.RunHost()
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "bufsize": 1}
    host.proc = subprocess.Popen([sys.executable, "-c", code], **pipes)
    host.follow_replies()
    return host


def run_once_in_thread(host: launcher.RunHost, tmp_path: Path, timeout_s: float = 20) -> tuple[bool, dict]:
    """Ask ``host`` for one run in a thread: whether that thread still waits after ``timeout_s``, and what
    the run returned (``r``) or the RunFailed it raised (``error``)."""
    outcome: dict = {}

    def run_once() -> None:
        try:
            outcome["r"] = host._run_once(request(tmp_path, 7), tmp_path, "none")
        except launcher.RunFailed as exc:
            outcome["error"] = str(exc)

    waiting = threading.Thread(target=run_once)
    waiting.start()
    waiting.join(timeout=timeout_s)
    return waiting.is_alive(), outcome


# the start of a fake host that takes one run: it reads the request and answers that the run started
ANSWER_STARTED = (
    "import json, os, sys, time; run = json.loads(sys.stdin.readline())['run_id']; "
    "print(json.dumps({'run_id': run, 'started': True}), flush=True); "
)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_host_whose_replies_cannot_be_read_ends_the_wait_instead_of_hanging(tmp_path):
    """A reply that is no text (a byte no UTF-8 has) once ended the reader thread without word, and the
    sweep waited on the run forever: the wait ends, the run counted as not started, and the host is replaced.
    The reader stops without a traceback on the terminal (an exception out of its thread)."""
    host = fake_host("import sys; sys.stdin.readline(); sys.stdout.buffer.write(b'\\xff\\xfe\\n'); sys.stdout.flush()")
    alive, outcome = run_once_in_thread(host, tmp_path)
    host.close()
    assert not alive, "the wait on a host whose replies cannot be read did not end"
    assert outcome["r"] == (False, {})


# a process that takes no more runs but has not exited: its stdout closed (a SIGKILL's, a moment before the
# process can be reaped), or it answered a run with a failure and hangs on its way out
CLOSED_STDOUT = "import os, time; os.close(1); time.sleep(60)"
FAILED_RUN = (
    ANSWER_STARTED + "print(json.dumps({'run_id': run, 'ok': False, 'error': 'boom'}), flush=True); time.sleep(60)"
)


@pytest.mark.parametrize("code", [CLOSED_STDOUT, FAILED_RUN], ids=["stdout-closed", "run-failed"])
def test_a_host_that_takes_no_more_runs_is_replaced_even_before_it_exits(monkeypatch, tmp_path, code):
    """A run asked for of such a process once found it alive, and waited forever: on replies whose end the
    reader had already given to the run before, or from a process that no longer reads its requests. The next
    start replaces it, alive or not, and stops it."""
    import subprocess

    host = fake_host(code)
    old = host.proc
    if code == FAILED_RUN:
        with pytest.raises(launcher.RunFailed, match="boom"):
            host._run_once(request(tmp_path, 7), tmp_path, "none")
    assert host.no_more_runs.wait(20) and old.poll() is None
    started = []

    def spawn(command, **kwargs):
        started.append(command)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)

    monkeypatch.setattr(launcher.watchdog, "spawn", spawn)
    try:
        host.start()
        assert started and host.proc is not old
        assert old.wait(10) is not None  # the old process was stopped with all it started
    finally:
        host.close()
        old.kill()


def test_a_host_that_stops_answering_mid_run_but_does_not_exit_fails_the_run_instead_of_hanging(monkeypatch, tmp_path):
    """The run started, then the process's output ended while the process went on (a thread of it hanging):
    the run fails, saying so, once the process has had EXIT_GRACE_S to exit, and the process is stopped."""
    monkeypatch.setattr(launcher, "EXIT_GRACE_S", 0.5)
    host = fake_host(ANSWER_STARTED + "os.close(1); time.sleep(60)")
    proc = host.proc
    alive, outcome = run_once_in_thread(host, tmp_path)
    host.close()
    proc.kill()
    assert not alive, "the wait on a process that stopped answering did not end"
    assert "the simulation process stopped answering, and was stopped 0.5 s later" in outcome["error"]
    assert proc.wait(10) is not None
