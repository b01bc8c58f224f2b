import atexit
import os
import shutil
import tempfile
from pathlib import Path

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
