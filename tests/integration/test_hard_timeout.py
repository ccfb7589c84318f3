"""A test that blocks past its timeout ends the session even when SIGALRM, pytest-timeout's way
of interrupting it, can never be delivered (tests/hard_timeout.py)."""

import subprocess
import sys

import pytest
from helpers import TESTS

STUCK = """
import signal
import time

import pytest


@pytest.mark.timeout(1)
def test_stuck_with_the_alarm_blocked():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)
"""


@pytest.mark.slow
def test_a_test_stuck_with_its_alarm_blocked_is_ended_at_its_deadline(tmp_path):
    (tmp_path / "test_stuck.py").write_text(STUCK)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "hard_timeout", "test_stuck.py"]
    env = {"PYTHONPATH": str(TESTS), "ASYNCRL_TEST_TIMEOUT_GRACE_S": "2", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Timeout (0:00:03)!" in done.stderr
    assert "test_stuck_with_the_alarm_blocked" in done.stderr  # the stuck test's frame is in the dump
