"""The suite's time limit per test (tests/testtime.py): a test that hangs fails alone, and the suite goes on."""

import os
import subprocess
import sys
from pathlib import Path

HANGING_TESTS = """
import time
import pytest

@pytest.fixture
def slow_to_stop():
    yield
    time.sleep(60)

def test_hangs():
    try:
        time.sleep(60)
    except Exception:  # what a test that swallows errors would do: the limit still ends it
        pass

def test_hangs_in_teardown(slow_to_stop):
    pass

@pytest.mark.long
def test_long_has_no_limit():
    time.sleep(1.5)

def test_after_them():
    pass
"""


def test_a_hanging_test_fails_with_its_phase_and_the_others_run(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANGING_TESTS)
    env = {**os.environ, "FEDBR_TEST_TIME_LIMIT": "1", "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "testtime", "-p", "no:cacheprovider", "-o", "markers=long: x"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    out = done.stdout
    assert done.returncode == 1, out
    assert "1 failed, 3 passed, 1 error" in out
    assert "the call of test_hang.py::test_hangs ran past its 1 s limit" in out
    assert "teardown of test_hang.py::test_hangs_in_teardown ran past its 1 s limit" in out
    assert "Captured stderr call" in out and "in test_hangs\n" in out  # each thread's stack, in its report
