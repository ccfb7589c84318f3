"""Reward functions, name resolution, and the runner's reward processes: timeouts that kill,
error counting and the weighted sum.

The runner pickles its functions into fresh processes, so the rewards used here are module-level
functions, which travel as their import path.
"""

import math
import operator
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, RewardConfig, load_config
from asyncrl.data import Task
from asyncrl.parts import check_parts
from asyncrl.rewards import FormatReward, OverlongPenalty, RewardRunner, exact_match, numeric_match, resolve_reward
from asyncrl.rewards import processes as processes_module
from asyncrl.rewards import runner as runner_module

TIMEOUT = 0.5
ODD_VALUES = {"nan": math.nan, "inf": math.inf, "text": "1.0", "none": None, "list": [1.0]}
WORKER_CODE = b"from asyncrl.rewards.worker import main; main()"
USER_REWARDS = """
import re
import zlib


def backtrack(completion, answer):
    \"\"\"exact_match, but on about a third of the completions a regex first backtracks for minutes
    in C, holding the interpreter lock all along, the way sympy does raising a huge power.\"\"\"
    if zlib.crc32(completion.encode()) % 3 == 0:
        re.fullmatch(r"(a+)+b", "a" * 32)
    return float(completion.strip() == answer.strip())
"""


def half(completion, answer):
    return 0.5


def two(completion, answer):
    return 2


def odd_value(completion, answer):
    return ODD_VALUES[completion]


def boom(completion, answer):
    if completion == "bad":
        raise RuntimeError("boom")
    return 1.0


def hang(completion, answer):
    time.sleep(3600)


def mixed(completion, answer):
    if completion == "hang":
        hang(completion, answer)
    if completion == "raise":
        raise ValueError("no")
    if completion == "nan":
        return math.nan
    if completion == "exit":
        os._exit(3)
    return exact_match(completion, answer)


def slow(completion, answer):
    """Slow enough that the runner sees the calls of a chunk finish one by one."""
    time.sleep(TIMEOUT / 10)
    return 1.0


def process_id(completion, answer):
    return os.getpid()


def spin(completion, answer):
    while True:
        pass


def flaky(completion, answer):
    if completion == "hang":
        hang(completion, answer)
    raise KeyError(completion)


def reward_processes(parent: int) -> set[int]:
    """Process ids of the live reward processes that process ``parent`` started."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # the process ended while we looked
                continue
            if len(argv) > 4 and argv[2] == WORKER_CODE and argv[4] == str(parent).encode():
                pids.add(int(entry.name))
    return pids


def all_gone(pids: set[int], parent: int, seconds: float = 30.0) -> bool:
    """Whether every one of ``pids`` has exited within ``seconds``."""
    deadline = time.monotonic() + seconds
    while pids & reward_processes(parent):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize(
    "completion, answer, score",
    [("19", "19", 1.0), (" 19\n", "19", 1.0), ("19.0", "19", 0.0), ("1 9", "19", 0.0), ("", "19", 0.0)],
)
def test_exact_match_compares_stripped_strings(completion, answer, score):
    assert exact_match(completion, answer) == score


@pytest.mark.parametrize(
    "completion, answer, score",
    [
        ("19", "19", 1.0),
        ("19.0", "19", 1.0),
        (" 19 ", "19", 1.0),
        ("+19", "19.00", 1.0),
        ("-3", "-3", 1.0),
        ("1.9e1", "19", 1.0),
        ("18.9999999999", "19", 0.0),
        ("20", "19", 0.0),
        ("nineteen", "19", 0.0),
        ("19 apples", "19", 0.0),
        ("nan", "nan", 0.0),
        ("inf", "inf", 0.0),
        ("19", "3,11,19", 0.0),
        ("1e99999999999999999999999", "1", 0.0),
        ("", "", 0.0),
    ],
)
def test_numeric_match_parses_numbers(completion, answer, score):
    assert numeric_match(completion, answer) == score


def test_FormatReward_matches_the_whole_stripped_completion():
    integer = FormatReward(r"-?\d+")
    assert integer(" -12\n", "anything") == 1.0
    assert integer("12 apples", "12") == 0.0
    assert integer("x12", "12") == 0.0


def test_math_reward_checks_equivalence_in_a_reward_process():
    math_reward = resolve_reward("math")
    cases = [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("$19$", "19", 1.0),
        ("18", "19", 0.0),
        ("", "19", 0.0),
    ]
    with RewardRunner([("math", math_reward)], timeout_s=30.0) as runner:
        result = runner.score([c for c, _, _ in cases], [a for _, a, _ in cases])
    assert result.per_function["math"] == [s for _, _, s in cases]
    assert result.errors == result.timeouts == 0


def test_resolve_builtins_and_custom_paths():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("numeric_match") is numeric_match
    assert resolve_reward("format", format_pattern=r"\d+")("7", "") == 1.0
    custom = resolve_reward("operator:eq")
    assert custom("a", "a") and not custom("a", "b")


@pytest.mark.parametrize(
    "name, match",
    [
        ("exact", "unknown reward 'exact'"),
        ("no_such_module_xyz:fn", "cannot load 'no_such_module_xyz:fn'"),
        ("operator:no_such_fn", "cannot load 'operator:no_such_fn'"),
        ("math:pi", "'math:pi' is not callable"),
        ("operator:not_", "'operator:not_' must accept \\(completion, answer\\)"),
        ("format", "rewards.options.format.pattern: the format reward needs a pattern"),
    ],
)
def test_resolve_rejects_bad_names_naming_the_field(name, match):
    with pytest.raises(ValueError, match=match) as info:
        resolve_reward(name)
    assert str(info.value).startswith("rewards.")


def test_weighted_sum_and_correct_come_from_the_first_function():
    functions = [("format", FormatReward(r"\d+")), ("exact_match", exact_match), ("half", half)]
    with RewardRunner(functions, weights=[0.1, 1.0, 2.0], timeout_s=5.0) as runner:
        result = runner.score(["19", "20", "x"], ["19", "19", "19"])
    assert result.per_function == {"format": [1.0, 1.0, 0.0], "exact_match": [1.0, 0.0, 0.0], "half": [0.5] * 3}
    assert result.rewards == pytest.approx([2.1, 1.1, 1.0])
    assert result.correct == [True, True, False]  # format is first: "20" counts as correct, "x" does not
    assert (result.errors, result.timeouts) == (0, 0)


def test_a_raising_reward_scores_zero_and_is_counted():
    with RewardRunner([("boom", boom), ("exact_match", exact_match)], timeout_s=5.0) as runner:
        result = runner.score(["bad", "19", "bad"], ["19", "19", "19"])
        assert result.per_function["boom"] == [0.0, 1.0, 0.0]
        assert result.rewards == [0.0, 2.0, 0.0]
        assert (result.errors, result.timeouts) == (2, 0)
        runner.score(["bad"], ["19"])
        assert runner.counts["boom"].calls == 4
        assert runner.counts["boom"].errors == 3
        assert runner.counts["exact_match"].errors == 0


def test_a_non_finite_or_non_number_score_is_an_error():
    with RewardRunner([("odd", odd_value)], timeout_s=5.0) as runner:
        result = runner.score(list(ODD_VALUES), [""] * len(ODD_VALUES))
    assert result.rewards == [0.0] * len(ODD_VALUES) and result.errors == len(ODD_VALUES)


def test_numbers_of_any_real_type_are_accepted():
    with RewardRunner([("bool", operator.eq), ("int", two)], timeout_s=5.0) as runner:
        result = runner.score(["x"], ["x"])
    assert result.per_function == {"bool": [1.0], "int": [2.0]} and result.errors == 0


@pytest.mark.timeout(120)
def test_a_hanging_call_is_killed_with_its_process_and_the_calls_behind_it_are_scored():
    with RewardRunner([("mixed", mixed), ("exact_match", exact_match)], timeout_s=TIMEOUT, processes=1) as runner:
        result = runner.score(["19", "hang", "19", "20", "19"], ["19"] * 5)  # one process: one chunk, in order
        (killed,) = reward_processes(os.getpid())
        assert result.per_function["mixed"] == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert result.per_function["exact_match"] == [1.0, 0.0, 1.0, 0.0, 1.0]  # handed out after "hang"
        assert result.item_timeouts == [0, 1, 0, 0, 0] and result.errors == 0
        assert runner.counts["mixed"].timeouts == 1
        again = runner.score(["hang", "19"], ["19", "19"])
        assert again.per_function["mixed"] == [0.0, 1.0] and again.timeouts == 1
        assert killed not in reward_processes(os.getpid())


@pytest.mark.timeout(120)
def test_mixed_batch_scores_each_completion_by_its_own_outcome():
    with RewardRunner([("mixed", mixed)], timeout_s=TIMEOUT, processes=2) as runner:
        result = runner.score(["19", "hang", "raise", "nan", "20", "hang", "exit", "19"], ["19"] * 8)
    assert result.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert result.correct == [True, False, False, False, False, False, False, True]
    assert (result.errors, result.timeouts) == (3, 2)
    assert result.item_errors == [0, 0, 1, 1, 0, 0, 1, 0] and result.item_timeouts == [0, 1, 0, 0, 0, 1, 0, 0]


@pytest.mark.timeout(120)
def test_a_call_holding_the_interpreter_lock_is_killed_at_its_timeout():
    """math-verify on a tower of powers: sympy computes 9^(9^9) in C without ever releasing the
    lock, so no thread of this process could run until it finishes (hours)."""
    with RewardRunner([("math", resolve_reward("math"))], timeout_s=2.0) as runner:
        result = runner.score(["$9^{9^{9^{9}}}$", "$19$", "20"], ["19", "19", "19"])
        assert result.per_function["math"] == [0.0, 1.0, 0.0]
        assert result.item_timeouts == [1, 0, 0] and result.errors == 0
        assert runner.score(["$19$"], ["19"]).rewards == [1.0]


class MessageClock:
    """The runner's clock, moved on by 0.6 timeouts by each message a reward process delivers
    (wrapped into its end of the pipe): the runner then sees every call take that long, however
    fast or slow the machine runs it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def pipe(self, pipe):
        def ticking_pipe(*args, **kwargs):
            ours, theirs = pipe(*args, **kwargs)
            return Ticking(ours, self), theirs

        return ticking_pipe


class Ticking:
    def __init__(self, connection, clock: MessageClock) -> None:
        self.connection, self.clock = connection, clock

    def __getattr__(self, name):
        return getattr(self.connection, name)

    def recv(self):
        message = self.connection.recv()
        self.clock.now += 0.6 * TIMEOUT
        return message


def test_calls_that_finish_in_time_are_not_timeouts_however_long_their_batch(monkeypatch):
    """One process runs 20 calls, each 0.6 timeouts long on the runner's clock: together they take
    twelve timeouts, so none is a timeout only if the timeout counts from each call's own start."""
    clock = MessageClock()
    monkeypatch.setattr(runner_module, "time", clock)
    monkeypatch.setattr(processes_module, "time", clock)  # where a reward process's start is timed
    monkeypatch.setattr(runner_module.multiprocessing, "Pipe", clock.pipe(runner_module.multiprocessing.Pipe))
    with RewardRunner([("slow", slow)], timeout_s=TIMEOUT, processes=1) as runner:
        result = runner.score(["a"] * 20, ["a"] * 20)
    assert result.rewards == [1.0] * 20 and result.timeouts == 0
    assert clock.now >= 12 * TIMEOUT  # the batch took twelve timeouts


def test_calls_run_in_at_most_processes_processes_that_stay_for_the_next_batch():
    with RewardRunner([("pid", process_id)], timeout_s=5.0, processes=3) as runner:
        first = set(runner.score(["a"] * 12, ["a"] * 12).rewards)
        assert os.getpid() not in first and 1 <= len(first) <= 3
        assert first <= reward_processes(os.getpid()) and len(reward_processes(os.getpid())) == 3
        assert set(runner.score(["a"] * 12, ["a"] * 12).rewards) <= reward_processes(os.getpid())


def test_a_reward_process_that_died_while_idle_is_replaced():
    with RewardRunner([("exact_match", exact_match)], timeout_s=5.0, processes=1) as runner:
        before = reward_processes(os.getpid())
        runner.score(["a"] * 4, ["a"] * 4)  # one process, so it has started and scored them
        dead = reward_processes(os.getpid()) - before
        (pid,) = dead
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # not yet reaped
            assert time.monotonic() < deadline, "the killed reward process was not a zombie within 30 s"
            time.sleep(0.01)
        result = runner.score(["a", "b"] * 4, ["a"] * 8)
        assert result.rewards == [1.0, 0.0] * 4 and result.errors == result.timeouts == 0
        assert not dead & reward_processes(os.getpid())


def test_close_stops_the_processes_and_refuses_more_work():
    before = reward_processes(os.getpid())
    runner = RewardRunner([("exact_match", exact_match)], timeout_s=5.0, processes=2)
    assert reward_processes(os.getpid()) == before  # started on the first batch, not before
    runner.score(["a"] * 4, ["a"] * 4)
    started = reward_processes(os.getpid()) - before
    assert len(started) == 2
    runner.close()
    runner.close()  # idempotent
    assert not started & reward_processes(os.getpid())
    with pytest.raises(RuntimeError, match="closed"):
        runner.score(["a"], ["a"])


def test_empty_batch_and_length_mismatch():
    with RewardRunner([("exact_match", exact_match)], timeout_s=5.0) as runner:
        empty = runner.score([], [])
        assert (empty.rewards, empty.correct, empty.per_function) == ([], [], {"exact_match": []})
        with pytest.raises(ValueError, match="2 completions for 1 answers"):
            runner.score(["a", "b"], ["a"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"functions": []}, "rewards.functions: at least one"),
        ({"functions": [("a", exact_match), ("a", exact_match)]}, "rewards.functions: names must be unique"),
        ({"weights": [1.0, 2.0]}, "rewards.weights: 2 weights for 1 functions"),
        ({"weights": [math.inf]}, "rewards.weights: must be finite"),
        ({"timeout_s": 0.0}, "rewards.timeout_s"),
        ({"processes": 0}, "rewards.processes"),
        ({"functions": [("half", lambda c, a: 0.5)]}, "rewards.functions: 'half' cannot be sent to a reward process"),
    ],
)
def test_runner_rejects_bad_arguments(kwargs, match):
    kwargs = {"functions": [("exact_match", exact_match)], **kwargs}
    with pytest.raises(ValueError, match=match):
        RewardRunner(kwargs.pop("functions"), **kwargs)


def test_from_config_takes_the_format_pattern_from_its_options_then_the_task():
    task = Task("t", train=[], heldout=[], format_pattern=r"\d+(,\d+)*")
    from_task = RewardRunner.from_config(RewardConfig(functions=["format"]), task)
    assert from_task.score(["1,2"], [""]).rewards == [1.0]
    own = RewardConfig(functions=["format"], options={"format": {"pattern": r"[a-z]+"}})
    configured = RewardRunner.from_config(own, task)
    assert configured.score(["1,2", "ab"], ["", ""]).rewards == [0.0, 1.0]
    with pytest.raises(ValueError, match="^rewards.options.format.pattern"):
        RewardRunner.from_config(RewardConfig(functions=["format"]))
    runner = RewardRunner.from_config(
        RewardConfig(functions=["exact_match", "operator:eq"], weights=[1.0, 0.5], timeout_s=2.0, processes=3)
    )
    assert (runner.names, runner.weights, runner.timeout_s, runner.processes) == (
        ["exact_match", "operator:eq"],
        [1.0, 0.5],
        2.0,
        3,
    )
    for r in (from_task, configured, runner):
        r.close()


def test_overlong_penalty_is_zero_then_falls_linearly_to_minus_one_at_the_limit():
    # L_max = 20, L_cache = 4: 0 up to 16 tokens, -(n - 16) / 4 up to 20, -1 beyond
    penalty = OverlongPenalty(20, 4)
    lengths = [0, 16, 17, 18, 20, 25]
    assert [penalty("", "", num_tokens=n) for n in lengths] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="^rewards.options.overlong.cache"):
        OverlongPenalty(20, 21)


def test_overlong_is_configured_beside_other_rewards_and_scored_on_token_counts():
    cfg = load_config(
        None,
        ["rewards.functions=[exact_match,overlong]", "rewards.options.overlong.cache=4", "rewards.weights=[1,0.5]"],
    )
    with RewardRunner.from_config(cfg.rewards, max_new_tokens=cfg.generation.max_new_tokens) as runner:
        result = runner.score(["19", "19", "x"], ["19", "19", "19"], num_tokens=[3, 14, 16])
        assert result.per_function["overlong"] == [0.0, -0.5, -1.0]
        assert result.rewards == [1.0, 0.75, -0.5] and result.correct == [True, True, False]
        with pytest.raises(ValueError, match="overlong needs num_tokens"):
            runner.score(["19"], ["19"])
    with pytest.raises(ValueError) as info:  # the options are checked where the run checks its parts
        check_parts(load_config(None, ["rewards.functions=[overlong]"]))
    assert str(info.value) == "rewards.options.overlong.cache: required by 'overlong'"
    too_long = load_config(None, ["rewards.functions=[overlong]", "rewards.options.overlong.cache=17"])
    with pytest.raises(ValueError, match="^rewards.options.overlong.cache: 17 must be between 1 and generation"):
        RewardRunner.from_config(too_long.rewards, max_new_tokens=too_long.generation.max_new_tokens)
    with pytest.raises(ConfigError, match="^rewards.overlong_cache: moved to rewards.options.overlong.cache"):
        load_config(None, ["rewards.overlong_cache=4"])
    bad_regex = load_config(None, ["rewards.functions=[format]", "rewards.options.format.pattern=("])
    with pytest.raises(ValueError, match=r"^rewards.options.format.pattern: invalid regex \(missing \)"):
        check_parts(bad_regex)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rewards.functions=[exact]", "rewards.functions: unknown reward 'exact'"),
        ("rewards.functions=[]", "rewards.functions: at least one reward function is needed"),
        ("rewards.functions=[format,format]", "rewards.functions: 'format' is listed twice"),
        ("rewards.format_pattern=x", "rewards.format_pattern: moved to rewards.options.format.pattern"),
        ("rewards.processes=0", "rewards.processes"),
        ("rewards.threads=32", "rewards.threads: unknown key"),
        ("rewards.max_hung_threads=64", "rewards.max_hung_threads: unknown key"),
    ],
)
def test_config_rejects_bad_reward_settings(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(message)


@pytest.mark.timeout(120)
def test_a_call_spinning_on_the_cpu_is_killed():
    with RewardRunner([("spin", spin)], timeout_s=TIMEOUT, processes=4) as runner:
        assert runner.score(["a"] * 4, ["a"] * 4).timeouts == 4


@pytest.mark.timeout(120)
def test_first_error_and_first_timeout_of_a_function_are_logged_once(caplog):
    with RewardRunner([("flaky", flaky)], timeout_s=TIMEOUT) as runner:
        runner.score(["a", "b", "hang"], ["", "", ""])
        runner.score(["c"], [""])
    messages = [r.getMessage() for r in caplog.records if r.name == "asyncrl.rewards.runner"]
    assert len(messages) == 2
    assert any(m.startswith("reward flaky: raised KeyError") for m in messages)
    assert any(m.startswith(f"reward flaky: a call ran past rewards.timeout_s={TIMEOUT}s") for m in messages)


@pytest.mark.parametrize("name", ["exact_match", "numeric_match", "math", "format", "operator:eq"])
def test_a_pickled_runner_scores_the_same_in_its_own_processes(name):
    import pickle

    runner = RewardRunner([(name, resolve_reward(name, format_pattern=r"\d+"))], weights=[2.0], timeout_s=30.0)
    runner.score(["19"], ["19"])
    copy = pickle.loads(pickle.dumps(runner))
    assert copy.counts == runner.counts and copy.weights == [2.0] and copy.timeout_s == 30.0
    assert copy.score(["19", "x"], ["19", "19"]) == runner.score(["19", "x"], ["19", "19"])
    runner.close()
    assert copy.score(["19"], ["19"]).rewards == [2.0]  # independent of the closed original
    copy.close()


def test_the_rollout_worker_scores_the_overlong_penalty_on_response_token_counts():
    from asyncrl.data import Prompt
    from asyncrl.generation import GeneratorBase, SamplingParams
    from asyncrl.models import build_char_tokenizer
    from asyncrl.rollout import RolloutWorker
    from asyncrl.types import Rollout

    class FixedLengths(GeneratorBase):  # a generator whose i-th response has lengths[i] tokens
        version = 0

        def generate(self, requests, sampling):
            return [Rollout(r.prompt_ids, [5] * n, [0.0] * n, "stop") for r, n in zip(requests, [2, 7, 8])]

    runner = RewardRunner([("overlong", OverlongPenalty(8, 4))])
    tokenizer = build_char_tokenizer()
    worker = RolloutWorker(
        FixedLengths(), runner, tokenizer, run_seed=0, group_size=1, sampling=SamplingParams(max_new_tokens=8)
    )
    with runner:
        result = worker.evaluate([Prompt(str(i), "1+1=", "2") for i in range(3)])
    assert result.reward_mean == pytest.approx((0.0 - 0.75 - 1.0) / 3)


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A user's reward module, importable by name here and so in the reward processes."""
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_whose_reward_holds_the_interpreter_lock_finishes_its_steps(tmp_path, user_rewards):
    from helpers import run

    before = reward_processes(os.getpid())
    summary, metrics, _ = run(
        tmp_path,
        "gil",
        "step.max_steps=2",
        "rewards.functions=[user_rewards:backtrack]",
        "rewards.timeout_s=0.5",
        "runtime.watchdog_s=30",
    )
    assert summary["steps"] == 2 and len(metrics) == 2
    assert summary["reward_timeouts"] == sum(m["reward_timeouts"] for m in metrics) > 0
    assert reward_processes(os.getpid()) <= before  # the run stopped its own


@pytest.mark.slow
def test_a_stalled_run_leaves_no_reward_processes(tmp_path):
    from helpers import run

    from asyncrl.errors import StallError

    before = reward_processes(os.getpid())
    with pytest.raises(StallError):  # the first batch is scored, then generation hangs
        run(tmp_path, "stall", "faults.hang_generate_calls=[2]", "faults.hang_s=4", "runtime.watchdog_s=1")
    assert reward_processes(os.getpid()) <= before


@pytest.mark.slow
def test_sigterm_leaves_no_reward_processes(tmp_path):
    from helpers import SMALL

    args = ["train", "--output-dir", str(tmp_path / "run"), *SMALL, "step.max_steps=100000"]
    process = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *args], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (workers := reward_processes(process.pid)):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert all_gone(workers, process.pid)
