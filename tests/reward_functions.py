"""Reward functions the tests name as ``reward_functions:<name>``.

They run in reward processes, each a fresh interpreter that imports this module: it imports
nothing heavy (no torch), so a reward process starts in a fraction of a second, also when a test
makes many calls time out and their processes are replaced.
"""

import itertools
import os
import signal
import time

from asyncrl.rewards.functions import exact_match

_reward_calls = itertools.count(1)
EXIT_AT_CALL = 50  # in a batch of weights version 1: after evaluation 0 (8 calls) and 4 batches of version 0


def raising_reward(completion: str, answer: str) -> float:
    raise ValueError("this reward always fails")


def hanging_reward(completion: str, answer: str) -> float:
    time.sleep(0.3)  # past the 0.1 s timeout, its process is killed at the timeout
    return 1.0


def constant_zero(completion: str, answer: str) -> float:
    return 0.0


def constant_one(completion: str, answer: str) -> float:
    return 1.0


def even_answers_score_even_lengths(completion: str, answer: str) -> float:
    """Groups of odd answers all score 0 (filtered); the others vary with the completion's length."""
    return float(answer[-1] in "02468" and len(completion) % 2 == 0)


def digits(completion: str, answer: str) -> float:
    return float(sum(c.isdigit() for c in completion))


def exit_once(completion: str, answer: str) -> float:
    """exact_match, except that the rollout actor is killed at its EXIT_AT_CALL-th reward call while
    the session's marker file exists; the first to rename the marker kills, so it happens once. The
    call runs in the actor's reward process (one, so it sees all the actor's calls in order), whose
    parent is the actor."""
    if next(_reward_calls) >= EXIT_AT_CALL:
        _kill_the_actor_if_marked()
    return exact_match(completion, answer)


def exit_when_marked(completion: str, answer: str) -> float:
    """exit_once at the first reward call after the marker file is written: a test kills the actor
    in the middle of the batch it chooses, where ``ray.kill`` may land before or after it."""
    _kill_the_actor_if_marked()
    return exact_match(completion, answer)


def _kill_the_actor_if_marked() -> None:
    marker = os.environ.get("ASYNCRL_TEST_EXIT_MARKER")
    if not marker:
        return
    try:
        os.rename(marker, f"{marker}.used")
    except FileNotFoundError:
        return
    os.kill(os.getppid(), signal.SIGKILL)
