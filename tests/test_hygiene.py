"""The shared pieces the algorithm layer stands on: named seed streams, the one npz codec, named
payloads in Flower's lists, the structured progress channel, and the one client cache with its one
eviction rule."""

from __future__ import annotations

import gc
import json
import weakref

import numpy as np
import pytest
from flwr.common import RecordDict

from fedbr_flwr.app import payload
from fedbr_flwr.app.node import ClientCache
from fedbr_flwr.core import seeds
from fedbr_flwr.runfiles import codec
from fedbr_flwr.runfiles.progress import Follower, LogFollower, Progress, read_events

# ---------------------------------------------------------------- seed streams


def test_every_stream_has_its_own_salt_and_the_derivations_are_pinned():
    salts = [s for s in (*seeds.NUMPY_STREAMS.values(), *seeds.TORCH_STREAMS.values()) if s is not None]
    assert len(set(seeds.NUMPY_STREAMS.values())) == len(seeds.NUMPY_STREAMS)
    assert len(set(seeds.TORCH_STREAMS.values())) == len(seeds.TORCH_STREAMS)
    assert not set(seeds.NUMPY_STREAMS.values()) & set(s for s in seeds.TORCH_STREAMS.values() if s), salts
    # the derivations recorded runs depend on (the golden files hold whole runs; these pin single draws)
    assert seeds.seed("batches", 7, 3, 1) == seeds.hash_seed(7, 3, 1)
    assert seeds.seed("fedbr-steps", 7, 3, 1) == seeds.hash_seed(7, 3, 1, 102)
    assert seeds.seed("fedbr-mixup", 7, 3, 1) == seeds.hash_seed(7, 3, 1, 102) + 1
    assert seeds.rng("client-sampling", 7, 3).integers(1 << 30) == np.random.default_rng([7, 6, 3]).integers(1 << 30)
    assert seeds.seed("mixup", 7, 3, 1) != seeds.seed("fedbr-mixup", 7, 3, 1)
    with pytest.raises(KeyError):
        seeds.seed("no-such-stream", 0)


# ---------------------------------------------------------------- the codec


def test_the_codec_round_trips_named_arrays_without_pickle(tmp_path):
    arrays = {"model/w": np.arange(6, dtype=np.float32).reshape(2, 3), "version": np.array(3)}
    back = codec.decode(codec.encode(arrays))
    assert list(back) == list(arrays) and all(np.array_equal(back[k], arrays[k]) for k in arrays)
    path = codec.write(tmp_path / "x.npz", arrays, compressed=True)
    assert [p.name for p in tmp_path.iterdir()] == ["x.npz"]  # nothing half-written left beside it
    assert np.array_equal(codec.read(path)["model/w"], arrays["model/w"])
    with pytest.raises(ValueError):  # object arrays would need pickle: refused on reading
        codec.decode(codec.encode({"o": np.array([{"a": 1}], dtype=object)}))


# A process that imports only the codec: np.load waits while another thread is inside a parse, and 4 threads
# decoding among reference cycles (whose finalizers, run by the GC inside a parse, make CPython switch threads
# there) at the finest thread switching raise nothing. Without the guard, the wait fails at once and the
# decoding raises about one "AST constructor recursion depth mismatch" per run on CPython 3.11.
DECODING_IN_THREADS = """
import sys, threading
import numpy as np
from fedbr_flwr.runfiles import codec

payload = codec.encode({"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
done = threading.Event()
with codec._ast_lock:
    threading.Thread(target=lambda: (codec.decode(payload), done.set())).start()
    waited = not done.wait(0.3)
assert done.wait(5) and waited, "a decode did not wait for another thread's parse"

class Cycle:
    def __del__(self):
        sum(range(100))

def decode_among_cycles(errors):
    for _ in range(3000):
        try:
            codec.decode(payload)
        except SystemError as exc:
            errors.append(exc)
        for _ in range(10):
            a, b = Cycle(), Cycle()
            a.other, b.other = b, a

sys.setswitchinterval(1e-6)
errors = []
threads = [threading.Thread(target=decode_among_cycles, args=(errors,)) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
assert errors == [], errors
"""


def test_importing_the_codec_lets_threads_decode_arrays_without_the_ast_race():
    """CPython 3.11's AST converter keeps its recursion depth per interpreter, and numpy parses each array
    header with ast: the server's parallel requests for the clients' state lost one client's state from a
    checkpoint, and a resumed run then differed from an uninterrupted one."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", DECODING_IN_THREADS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------- named payloads


def test_named_arrays_ride_in_flowers_lists_and_bad_lists_are_refused():
    arrays = {"model/w": np.ones((2, 2), np.float32), "offset": np.zeros(3, np.float32)}
    wire = payload.to_list(arrays)
    assert wire[0].dtype == np.uint8 and len(wire) == 3
    assert list(payload.from_list(wire)) == list(arrays)
    assert list(payload.from_parameters(payload.to_parameters(arrays))) == list(arrays)
    parts = payload.Serialised.of({"model/w": arrays["model/w"]}) + payload.Serialised.of({"offset": arrays["offset"]})
    assert list(payload.from_parameters(parts.to_parameters())) == ["model/w", "offset"]
    with pytest.raises(payload.PayloadError, match="named twice"):
        parts + payload.Serialised.of({"offset": arrays["offset"]})
    with pytest.raises(payload.PayloadError, match="does not name"):
        payload.from_list([np.ones(3, np.float32), np.ones(2)])
    with pytest.raises(payload.PayloadError, match="1 names for 2 arrays"):
        payload.from_list([np.frombuffer(json.dumps(["a"]).encode(), np.uint8), *wire[1:]])


# ---------------------------------------------------------------- the progress channel


def test_progress_events_are_json_lines_and_the_follower_prints_only_new_complete_ones(tmp_path):
    progress = Progress(tmp_path)
    progress.emit("round", "round 1/2 | loss 2.3000", round=1)
    printed = []
    with Follower(progress.path, printed.append, poll_s=0.01) as follower:  # started after the first event
        progress.emit("eval", "eval round 2 | mean acc 12.00%", round=2)
        with open(progress.path, "a") as f:
            f.write('{"kind": "info", "mess')  # a line being written
        follower._drain()
        assert printed == ["[fedbr] eval round 2 | mean acc 12.00%"]  # not the half line
        with open(progress.path, "a") as f:
            f.write('age": "its end came"}\n{"not json\n')  # its end; then a line nobody can read
    assert printed == ["[fedbr] eval round 2 | mean acc 12.00%", "[fedbr] its end came"]
    events, offset = read_events(progress.path)
    assert [(e["kind"], e.get("round")) for e in events] == [("round", 1), ("eval", 2), ("info", None)]
    assert offset == progress.path.stat().st_size
    Progress(tmp_path, resumed=True).emit("info", "resumed")  # a resumed run appends
    assert [e["message"] for e in read_events(progress.path)[0]][2:] == ["its end came", "resumed"]
    restarted = []
    with Follower(progress.path, restarted.append, poll_s=0.01):
        Progress(tmp_path).emit("start", "3 clients found")  # a new run in the folder starts the file again
    assert restarted == ["[fedbr] 3 clients found"]
    assert [e["message"] for e in read_events(progress.path)[0]] == ["3 clients found"]


def test_a_follower_prints_an_event_once_however_often_it_looks(tmp_path):
    progress = Progress(tmp_path)
    printed = []
    follower = Follower(progress.path, printed.append)
    progress.emit("round", "round 1/2 | loss 2.3000", round=1)
    for _ in range(3):
        follower._drain()
    assert printed == ["[fedbr] round 1/2 | loss 2.3000"]


def test_the_log_follower_prints_each_new_complete_line_and_starts_again_with_a_new_log(tmp_path):
    """``--verbose`` for a run whose simulation process writes flower.log itself: the lines written after the
    follower started, whole, and a log started again (a new run in the folder) from its beginning."""
    log = tmp_path / "flower.log"
    log.write_text("an older run's line\n")
    printed = []
    with LogFollower(log, printed.append, poll_s=0.01) as follower:
        with open(log, "a") as f:
            f.write("INFO :      Starting Flower ServerApp\nhalf a li")
        follower._drain()
        assert printed == ["INFO :      Starting Flower ServerApp"]
        with open(log, "a") as f:
            f.write("ne\n")
    assert printed == ["INFO :      Starting Flower ServerApp", "half a line"]
    again = []
    with LogFollower(log, again.append, poll_s=0.01):
        log.write_text("new\n")  # truncated and written again: shorter than the offset
    assert again == ["new"]


# ---------------------------------------------------------------- the client cache


def test_the_one_client_cache_drops_an_old_runs_clients_with_their_data_and_models():
    cache = ClientCache(runs_kept=1)
    node = {"partition-id": 0, "num-partitions": 2}
    config = {"num-clients": 2, "local-steps": 1, "batch-size": 4, "device": "cpu"}
    old = cache.get(1, config, node, RecordDict())
    data, model = weakref.ref(old.algorithm.data.x_train), weakref.ref(old.algorithm.model)
    assert cache.get(1, config, node, RecordDict()) is old
    del old
    cache.get(2, config, node, RecordDict())  # a new run: the old run's client goes, and all it held
    gc.collect()
    assert data() is None and model() is None
    assert {run for run, _, _ in cache.clients} == {2}


def test_two_threads_dropping_the_old_runs_clients_at_once_do_not_race(monkeypatch):
    """The in-process backend builds a run's clients in threads, and each new client drops the old run's: a
    second thread dropping them while the first is half-way must not make the first raise (a KeyError once
    failed a sweep's run). The first pauses at its first removal until the second is done (or 1 s passed)."""
    import threading

    from fedbr_flwr.app import node

    first_paused, second_done = threading.Event(), threading.Event()

    class PausingDict(dict):
        def __delitem__(self, key):
            if threading.current_thread().name == "first" and not first_paused.is_set():
                first_paused.set()
                second_done.wait(timeout=1.0)
            super().__delitem__(key)

    cache = ClientCache(runs_kept=1)
    cache.clients = PausingDict({(1, pid, "old"): object() for pid in range(3)})  # the run before's clients
    monkeypatch.setattr(node, "build_client", lambda *args: type("Client", (), {"use_state": lambda s, _: None})())
    errors = []

    def get(pid):
        try:
            cache.get(2, {"lr": 0.1}, {"partition-id": pid}, RecordDict())
        except Exception as exc:
            errors.append(exc)
        finally:
            if pid == 1:
                second_done.set()

    first = threading.Thread(target=get, args=(0,), name="first")
    first.start()
    first_paused.wait(timeout=5)
    second = threading.Thread(target=get, args=(1,), name="second")
    second.start()
    for t in (first, second):
        t.join(timeout=10)
    assert not errors, errors
    assert sorted(run_pid[:2] for run_pid in cache.clients) == [(2, 0), (2, 1)]


def test_a_run_reports_its_rounds_and_end_as_events_and_the_table_once(tmp_path):
    from fedbr_flwr.core.config import validate
    from fedbr_flwr.runfiles.run_io import RunRecorder

    recorder = RunRecorder(validate({"num-rounds": 1}), tmp_path)
    recorder.log_round({"round": 1, "train": {"loss": 2.5}, "seconds": 0.5})
    recorder.log_eval({"round": 1, "mean_acc": 0.25, "worst_acc": 0.0, "loss": 2.0, "global_acc": None})
    recorder.finalize()
    events, _ = read_events(tmp_path / "progress.jsonl")
    assert [(e["kind"], e.get("round")) for e in events] == [("round", 1), ("eval", 1), ("summary", None)]
    assert events[0]["message"] == "round 1/1 | loss 2.5000 | 0.50 s/round"
    assert events[-1]["message"] == f"run files in {tmp_path}"  # the table is printed once, from summary.md
    assert "mean local-test acc" in (tmp_path / "summary.md").read_text()
