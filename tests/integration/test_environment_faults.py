"""Environments that hang or raise, in whole runs (docs/reliability.md): an episode past
environment.max_seconds is truncated and the run goes on; a stop exits with its one line even while
a thread never returns; an environment that raises reruns its own episode only, and a passing fault
leaves the run as it would have been.

The misbehaving environments are in tests/unruly_environments.py."""

import os
import re
import subprocess
import sys

import pytest
from helpers import SMALL, TESTS, deterministic, run
from unruly_environments import RaisesOnce, chosen

from asyncrl.cli import main
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.slow
# A warm start teaches the answer format (digits, then EOS), so turns end and environments step.
EPISODES = (
    "environment.max_turns=2",
    "environment.max_tokens=24",
    "step.max_steps=2",
    "warm_start.steps=60",
    "warm_start.lr=0.01",
)
ALWAYS = "unruly_environments:AlwaysRaises"
DEADLINE_S = 300  # far beyond any of these runs: only a process that never exits meets it


def train_cli(tmp_path, name, *overrides) -> tuple[int, str]:
    """``asyncrl train`` in a process of its own: (exit code, stderr), or a failure at the deadline."""
    args = [sys.executable, "-m", "asyncrl", "train", "--output-dir", str(tmp_path / name), *SMALL, *EPISODES]
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    process = subprocess.Popen([*args, *overrides], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = process.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        pytest.fail(f"asyncrl train did not exit within {DEADLINE_S} s; stderr: {err[-2000:]}")
    return process.returncode, err


def test_an_episode_whose_step_never_returns_is_truncated_at_max_seconds_and_the_run_finishes(tmp_path):
    code, err = train_cli(
        tmp_path,
        "run",
        "environment.name=unruly_environments:Hangs",
        "environment.max_seconds=1",
        "runtime.watchdog_s=20",
    )
    assert code == 0, err
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert sum(m["episode/timed_out"] for m in metrics) > 0


def test_a_stop_exits_with_its_one_line_error_while_a_thread_never_returns(tmp_path):
    code, err = train_cli(tmp_path, "run", "environment.name=unruly_environments:Hangs", "runtime.watchdog_s=2")
    assert code == 1, err
    assert err.startswith("error: no progress for") and err.count("\n") == 1 and "Traceback" not in err


def test_an_environment_that_raises_once_reruns_its_episode_and_the_run_equals_the_clean_one(tmp_path):
    _, clean, clean_groups = run(tmp_path, "clean", *EPISODES, "environment.name=feedback", "sampler.max_lag=0")
    RaisesOnce.stepped.clear()
    RaisesOnce.raised.clear()
    summary, flaky, flaky_groups = run(
        tmp_path, "flaky", *EPISODES, "environment.name=unruly_environments:RaisesOnce", "sampler.max_lag=0"
    )
    trained = {g["prompt_uid"] for g in flaky_groups}
    raised = [uid for uid in RaisesOnce.raised if uid in trained]
    assert raised and summary["rollout_retries"] == len(raised)  # one episode rerun per failure, nothing else
    assert deterministic(without_retries(flaky)) == deterministic(without_retries(clean))
    assert without_retries(flaky_groups) == without_retries(clean_groups)


def test_an_environment_that_keeps_raising_skips_its_prompts_alone(tmp_path):
    summary, metrics, groups = run(
        tmp_path,
        "skip",
        *EPISODES,
        f"environment.name={ALWAYS}",  # runtime.on_rollout_failure: skip, the default
        "runtime.max_skipped_share=1",  # one prompt in three fails: over the default share
    )
    assert summary["steps"] == 2 and [m["num_groups"] for m in metrics] == [4, 4]
    assert metrics[-1]["skipped_prompts"] > 0
    assert summary["rollout_retries"] == 0  # the other prompts of a failing batch were never regenerated
    assert not [g["prompt_uid"] for g in groups if chosen(g["prompt_uid"], 3)]


def test_an_environment_that_raises_for_a_few_prompts_is_contained_by_default(tmp_path):
    """One prompt in twenty fails every time: each is skipped, counted and never trained; the run ends."""
    summary, metrics, groups = run(
        tmp_path, "few", *EPISODES, f"environment.name={ALWAYS}", "environment.options.every=20", "step.max_steps=10"
    )
    assert summary["steps"] == 10 and all(m["num_groups"] == 4 for m in metrics)
    assert metrics[-1]["skipped_prompts"] >= 1
    assert not [g["prompt_uid"] for g in groups if chosen(g["prompt_uid"], 20)]


def test_an_environment_that_raises_for_every_prompt_stops_once_skips_pass_their_share(tmp_path, capsys):
    """Skipping contains a few bad inputs; a failure that is systematic still stops the run, after
    max_skipped_share x skipped_share_window prompts (10 by default), with one line and a checkpoint."""
    args = ["train", "--output-dir", str(tmp_path / "broken"), *SMALL, *EPISODES, f"environment.name={ALWAYS}"]
    code = main([*args, "environment.options.every=1"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(
        "error: 11 of the last 11 prompts were skipped, over runtime.max_skipped_share=0.1 of "
        "runtime.skipped_share_window=100; the last: prompt "
    ), err
    assert "EpisodeError: ConnectionError in the environment's step" in err and "checkpoint saved to" in err


def test_an_environment_that_keeps_raising_stops_the_run_naming_its_prompt_and_error(tmp_path, capsys):
    stop = "runtime.on_rollout_failure=stop"
    code = main(
        ["train", "--output-dir", str(tmp_path / "stop"), *SMALL, *EPISODES, f"environment.name={ALWAYS}", stop]
    )
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.match(
        r"error: prompt \S+: generation failed 3 times \(runtime.max_rollout_retries=2\); last error: ", err
    )
    assert "EpisodeError: ConnectionError in the environment's step: the sandbox of" in err
    assert "checkpoint saved to" in err


def without_retries(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if "retries" not in k} for r in records]
