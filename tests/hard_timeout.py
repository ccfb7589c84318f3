"""A per-test deadline that fires whatever the test's code does with signals.

pytest-timeout's default method raises from a SIGALRM handler, which never runs while the
signal is blocked or its handler replaced (Ray and vLLM's libraries touch signals), or while the
main thread waits in C code that does not return to the interpreter. Behind it, this plugin arms
faulthandler's watchdog, a C thread that needs neither the signal nor the interpreter lock: at the
test's timeout plus ``ASYNCRL_TEST_TIMEOUT_GRACE_S`` (default 60 s) it prints every thread's stack
to the terminal and ends the session with exit code 1. A stuck test then fails the run in
minutes instead of holding it until CI's own limit.

Loaded for every run by ``-p hard_timeout`` in pytest's ``addopts`` (``tests/`` is on
``pythonpath``).
"""

from __future__ import annotations

import faulthandler
import os

import pytest

# The terminal's stderr, taken before pytest captures file descriptor 2 for the tests: a dump
# written into a test's capture would be lost with the process.
_TERMINAL = os.fdopen(os.dup(2), "w")


def _deadline(item: pytest.Item) -> float | None:
    marker = item.get_closest_marker("timeout")
    timeout = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
    if not timeout or float(timeout) <= 0:
        return None
    return float(timeout) + float(os.environ.get("ASYNCRL_TEST_TIMEOUT_GRACE_S", "60"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    deadline = _deadline(item)
    if deadline is not None:
        faulthandler.dump_traceback_later(deadline, exit=True, file=_TERMINAL)
    try:
        yield
    finally:
        if deadline is not None:
            faulthandler.cancel_dump_traceback_later()
