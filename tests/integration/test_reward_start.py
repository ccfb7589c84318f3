"""A reward process that never starts stops the run at ``rewards.startup_timeout_s``, killed, with
one line naming the reward, and ``close`` never waits for it; a tool process, at
``environment.startup_timeout_s``. The config check loads a user's reward or environment module in
a process of its own under the same deadline, so ``asyncrl config`` and ``asyncrl train`` never
hang on a module that blocks at import: they exit with code 2 and one line naming it.

``blocking_reward`` blocks forever at import in a fresh process (and in every process with
``BLOCKING_REWARD_EVERYWHERE`` set), as a module waiting at import for a lock, a server or a device
would; this test process imports it at once.
"""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import SMALL, error

from asyncrl.environments.tools import ToolBox, ToolStartError
from asyncrl.rewards import RewardRunner, resolve_reward
from asyncrl.rewards.runner import RewardStartError

TESTS = Path(__file__).parent.parent

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


def asyncrl(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """The command in a process of its own, where ``blocking_reward`` blocks too if it is imported:
    a command that waits on it ends at the subprocess timeout, and the test fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path]), "BLOCKING_REWARD_EVERYWHERE": "1"}
    command = [sys.executable, "-m", "asyncrl", *argv]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    return result.stderr.removeprefix("error: ").rstrip("\n")


COMMANDS = {"config": ["config"], "train": ["train", "--output-dir", "run", *SMALL]}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", COMMANDS)
def test_a_reward_module_that_blocks_at_import_is_one_line_and_code_2_at_the_start_deadline(tmp_path, command):
    overrides = [f"rewards.functions=[exact_match, {BLOCKING}]", "rewards.startup_timeout_s=5"]
    assert one_line(asyncrl(tmp_path, *COMMANDS[command], *overrides)) == (
        "rewards.functions: a reward process did not start within rewards.startup_timeout_s=5s: "
        f"loading '{BLOCKING}' never finished (does its module block at import?); it was killed"
    )
    assert not (tmp_path / "run").exists()  # stopped before the run began


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", COMMANDS)
def test_an_environment_module_that_blocks_at_import_is_one_line_and_code_2_at_the_start_deadline(tmp_path, command):
    environment = "blocking_reward:NeverLoads"
    overrides = [f"environment.name={environment}", "environment.startup_timeout_s=5", "data.chat_template=false"]
    assert one_line(asyncrl(tmp_path, *COMMANDS[command], *overrides)) == (
        "environment.name: a process loading the environment did not start within "
        f"environment.startup_timeout_s=5s: loading '{environment}' never finished (does its module block at "
        "import?); it was killed"
    )


PARTS_LOADED_ELSEWHERE = {  # part -> (its name's field, its deadline's field, the process in messages)
    "sampler": ("sampler.name", "sampler.startup_timeout_s", "a process loading the sampler"),
    "task": ("data.task.name", "data.task.startup_timeout_s", "a process loading the task"),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("part", PARTS_LOADED_ELSEWHERE)
def test_a_sampler_or_task_module_that_blocks_at_import_is_one_line_and_code_2_at_its_deadline(tmp_path, part, command):
    """The config check loads a user's sampler or task in a fresh process first, as it does a
    reward's or an environment's: the command's own process never imports a module that blocks."""
    name, deadline, process = PARTS_LOADED_ELSEWHERE[part]
    spec = "blocking_reward:NeverLoads"
    assert one_line(asyncrl(tmp_path, *COMMANDS[command], f"{name}={spec}", f"{deadline}=5")) == (
        f"{name}: {process} did not start within {deadline}=5s: loading '{spec}' never finished (does its "
        "module block at import?); it was killed"
    )
    assert not (tmp_path / "run").exists()


def test_an_environment_that_reads_another_task_s_prompts_is_refused_at_the_config_check(tmp_path):
    result = asyncrl(tmp_path, "config", "environment.name=search", "data.task.name=arithmetic")
    assert one_line(result) == (
        "data.task.name: environment 'search' reads the prompts of the 'search' task, not 'arithmetic' "
        "(set data.task.name=search)"
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tool_process_that_never_starts_stops_at_the_configured_deadline():
    from blocking_reward import echo

    with ToolBox([echo], startup_timeout_s=3.0) as box, pytest.raises(ToolStartError) as caught:
        box.call("echo", {"text": "hi"})
    assert str(caught.value) == (
        "environment: a tool process did not start within environment.startup_timeout_s=3s: loading the tools "
        "blocking_reward:echo never finished (does its module block at import?); it was killed"
    )
    assert caught.value.exit_code == 2
