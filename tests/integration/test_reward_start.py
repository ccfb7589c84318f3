"""A reward process that never starts stops the run at ``rewards.startup_timeout_s``, killed, with
one line naming the reward, and ``close`` never waits for it.

``blocking_reward`` blocks forever at import in a reward process, as a module waiting at import for
a lock, a server or a device would; the run's own process imports it at once.
"""

import os
import threading
from pathlib import Path

import pytest
from helpers import SMALL, error

from asyncrl.rewards import RewardRunner, resolve_reward
from asyncrl.rewards.runner import RewardStartError

BLOCKING = "blocking_reward:never_loads"


def reward_children() -> set[int]:
    """Process ids of this process's live reward processes."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes()
        except (OSError, NotADirectoryError):  # not a process, or it ended while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"asyncrl.rewards.worker" in argv:
            pids.add(int(entry.name))
    return pids


def blocking_runner(startup_timeout_s: float) -> RewardRunner:
    return RewardRunner([(BLOCKING, resolve_reward(BLOCKING))], processes=2, startup_timeout_s=startup_timeout_s)


@pytest.mark.timeout(120)
def test_a_reward_that_blocks_at_import_stops_scoring_at_the_deadline_and_its_process_is_killed():
    runner = blocking_runner(5.0)  # ample for the interpreter to come up on a loaded machine
    with pytest.raises(RewardStartError) as caught:
        runner.score(["1", "2"], ["1", "2"])
    assert str(caught.value) == (
        "rewards.functions: a reward process did not start within rewards.startup_timeout_s=5s: "
        f"loading '{BLOCKING}' never finished (does its module block at import?); it was killed"
    )
    assert caught.value.exit_code == 2
    assert len(reward_children()) == 1  # the other process, still starting: close() stops it
    runner.close()
    assert reward_children() == set()


@pytest.mark.timeout(120)
def test_close_does_not_wait_for_a_starting_process(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked"
    monkeypatch.setenv("BLOCKING_REWARD_MARKER", str(blocked))
    runner = blocking_runner(600.0)
    raised = []

    def score() -> None:
        try:
            runner.score(["1"], ["1"])
        except RuntimeError as err:
            raised.append(err)

    scoring = threading.Thread(target=score)
    scoring.start()
    while not blocked.exists():  # the process blocks at import: it will send nothing more
        assert scoring.is_alive()
        threading.Event().wait(0.05)
    closing = threading.Thread(target=runner.close)
    closing.start()
    closing.join(60)  # a tenth of the start deadline, which close() would otherwise wait out
    assert not closing.is_alive()
    scoring.join(60)
    assert [str(err) for err in raised] == ["RewardRunner.score: the runner was closed while scoring"]
    assert reward_children() == set()


def test_startup_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"rewards.startup_timeout_s: must be a positive number of seconds, got 0"):
        blocking_runner(0.0)


@pytest.mark.timeout(300)
def test_a_run_whose_reward_never_starts_exits_with_code_2_naming_it(tmp_path, capsys):
    message = error(
        capsys,
        "train",
        "--output-dir",
        str(tmp_path / "run"),
        *SMALL,
        f"rewards.functions=[{BLOCKING}]",
        "rewards.startup_timeout_s=5",
    )
    assert message.startswith(
        "rewards.functions: a reward process did not start within rewards.startup_timeout_s=5s: "
        f"loading '{BLOCKING}' never finished"
    ), message
    assert reward_children() == set()
