import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Keep torch from oversubscribing the 2-core CI machine when tests run model code: under pytest-xdist
# (`-n auto`, one worker per core) each worker takes one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")

from testtime import pytest_runtest_call, pytest_runtest_setup, pytest_runtest_teardown  # noqa: E402, F401

import golden  # noqa: E402, F401  (pins torch's CPU kernels to those the golden files were recorded with)

# Full MNIST for the tests that compare against recorded hashes (tests/test_download.py): the folder in
# FEDBR_TEST_DATA, else the machine's shared copy next to the repository when there is one.
_SHARED_DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"
if not os.environ.get("FEDBR_TEST_DATA") and (_SHARED_DATASETS / "MNIST" / "raw").is_dir():
    os.environ["FEDBR_TEST_DATA"] = str(_SHARED_DATASETS)

# No test reads or downloads into the user's own data folder: the default one is an empty folder of
# this session (tests that want data set data-dir, FEDBR_DATA_DIR or FEDBR_TEST_DATA themselves).
_EMPTY_DATA = tempfile.mkdtemp(prefix="fedbr-test-data-")
atexit.register(shutil.rmtree, _EMPTY_DATA, ignore_errors=True)
os.environ["FEDBR_DATA_DIR"] = _EMPTY_DATA


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """A long scenario is an end-to-end test too, so `-m "not e2e"` never runs one among the fast tests."""
    for item in items:
        if item.get_closest_marker("long") is not None and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (each holds torch and the test datasets, about 1 GB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))


@pytest.fixture(autouse=True)
def same_random_state_in_any_order():
    """Each test starts from the same global RNG state: under pytest-xdist a worker runs a different sequence of
    tests each time, so a test that draws from torch's RNG without seeding it (a client's initial weights, drawn
    as the server would after seeding) would otherwise see a state left by whichever tests ran before it."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def no_early_simulation_process(request, monkeypatch):
    """The fast tests call fedbr-run's ``main`` in this process, mostly to see it refuse a configuration:
    there it starts no simulation process ahead of the check (``cli.early_host``), which would import torch
    and Flower beside each test. The end-to-end tests, and tests/test_runhost.py's own, run it as users do."""
    if request.node.get_closest_marker("e2e") is None:
        from fedbr_flwr.commands import cli

        monkeypatch.setattr(cli, "early_host", lambda args: None)


_SERVER_TEST_RESULTS: dict[str, dict] = {}


def _digest(tensors) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(str((tuple(t.shape), t.dtype)).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(autouse=True)
def server_tests_evaluated_once_per_model(request, monkeypatch):
    """The server's tests (``global-test``: the test split once per angle, through the paper's CNN) take most of
    the seconds of the runs that have them, and several tests evaluate the very same model: a golden case and
    the same case on the cohort engine, a run and its resumed copy. The figures are a pure function of the
    module's state and the test tensors, so within one session each such pair is evaluated once; any bit of a
    weight that differs is a new key and a new evaluation."""
    if request.node.get_closest_marker("e2e") is not None:
        return
    from fedbr_flwr.app import strategy as flower

    run = flower.run_server_tests

    def once(tests, module):
        data = [t for x, y in [*tests.global_copies.values(), *tests.extra_local] for t in (x, y)]
        key = "/".join(
            (
                type(module).__qualname__,
                str(sorted(tests.global_copies)),
                str(len(tests.extra_local)),
                _digest(module.state_dict().values()),
                _digest(data),
            )
        )
        if key not in _SERVER_TEST_RESULTS:
            _SERVER_TEST_RESULTS[key] = run(tests, module)
        return dict(_SERVER_TEST_RESULTS[key])

    monkeypatch.setattr(flower, "run_server_tests", once)
