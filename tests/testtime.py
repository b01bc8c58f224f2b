"""A time limit per test, so that a test that hangs fails with every thread's stack instead of holding the
whole suite (and CI) until its own limit. conftest.py imports the hooks; ``-p testtime`` loads them elsewhere.

Each phase of a test (setup, call, teardown) may take ``FEDBR_TEST_TIME_LIMIT`` seconds (default 600; 0:
none). The long scenarios (``-m long``) have no limit. The limit is a SIGALRM in the main thread, so it stops
Python code and the blocking calls that signals interrupt (sleeps, locks, waits on processes), and a test's
``finally`` blocks and fixtures still stop what it started."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import pytest

DEFAULT_LIMIT_S = 600.0


def phase_limit(item: pytest.Item) -> float:
    if item.get_closest_marker("long") is not None:
        return 0.0
    return float(os.environ.get("FEDBR_TEST_TIME_LIMIT", DEFAULT_LIMIT_S))


@contextmanager
def time_limited(item: pytest.Item, phase: str) -> Iterator[None]:
    limit = phase_limit(item)
    if limit <= 0 or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def ran_too_long(*_: object) -> None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        pytest.fail(
            f"{phase} of {item.nodeid} ran past its {limit:g} s limit (FEDBR_TEST_TIME_LIMIT); every thread's "
            "stack is in its captured stderr",
            pytrace=False,
        )

    previous = signal.signal(signal.SIGALRM, ran_too_long)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with time_limited(item, "setup"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with time_limited(item, "the call"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with time_limited(item, "teardown"):
        yield
