import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Keep torch from oversubscribing the 2-core CI machine when tests run model code.
os.environ.setdefault("OMP_NUM_THREADS", "2")

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


@pytest.fixture(autouse=True)
def no_early_simulation_process(request, monkeypatch):
    """The fast tests call fedbr-run's ``main`` in this process, mostly to see it refuse a configuration:
    there it starts no simulation process ahead of the check (``cli.early_host``), which would import torch
    and Flower beside each test. The end-to-end tests, and tests/test_runhost.py's own, run it as users do."""
    if request.node.get_closest_marker("e2e") is None:
        from fedbr_flwr import cli

        monkeypatch.setattr(cli, "early_host", lambda args: None)
