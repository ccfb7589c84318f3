"""Reward functions, name resolution, and the runner's timeouts, error counting and weighted sum."""

import math
import threading
import time

import pytest

from asyncrl.config import ConfigError, RewardConfig, load_config
from asyncrl.data import Task
from asyncrl.rewards import FormatReward, OverlongPenalty, RewardRunner, exact_match, numeric_match, resolve_reward

TIMEOUT = 0.2


@pytest.fixture
def release():
    """An event hanging rewards wait on; set at teardown so no test leaves a thread stuck."""
    event = threading.Event()
    yield event
    event.set()


def wait_until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
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


def test_math_reward_checks_equivalence_off_the_main_thread():
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
    assert result.errors == result.timeouts == 0  # its own SIGALRM timeouts would raise on a worker thread


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
        ("format", "rewards.format_pattern: the format reward needs a pattern"),
    ],
)
def test_resolve_rejects_bad_names_naming_the_field(name, match):
    with pytest.raises(ValueError, match=match) as info:
        resolve_reward(name)
    assert str(info.value).startswith("rewards.")


def test_weighted_sum_and_correct_come_from_the_first_function():
    half = lambda completion, answer: 0.5  # noqa: E731
    functions = [("format", FormatReward(r"\d+")), ("exact_match", exact_match), ("half", half)]
    with RewardRunner(functions, weights=[0.1, 1.0, 2.0], timeout_s=5.0) as runner:
        result = runner.score(["19", "20", "x"], ["19", "19", "19"])
    assert result.per_function == {"format": [1.0, 1.0, 0.0], "exact_match": [1.0, 0.0, 0.0], "half": [0.5] * 3}
    assert result.rewards == pytest.approx([2.1, 1.1, 1.0])
    assert result.correct == [True, True, False]  # format is first: "20" counts as correct, "x" does not
    assert (result.errors, result.timeouts) == (0, 0)


def test_a_raising_reward_scores_zero_and_is_counted():
    def boom(completion, answer):
        if completion == "bad":
            raise RuntimeError("boom")
        return 1.0

    with RewardRunner([("boom", boom), ("exact_match", exact_match)], timeout_s=5.0) as runner:
        result = runner.score(["bad", "19", "bad"], ["19", "19", "19"])
        assert result.per_function["boom"] == [0.0, 1.0, 0.0]
        assert result.rewards == [0.0, 2.0, 0.0]
        assert (result.errors, result.timeouts) == (2, 0)
        runner.score(["bad"], ["19"])
        assert runner.counts["boom"].calls == 4
        assert runner.counts["boom"].errors == 3
        assert runner.counts["exact_match"].errors == 0


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", None, [1.0]])
def test_a_non_finite_or_non_number_score_is_an_error(value):
    with RewardRunner([("odd", lambda c, a: value)], timeout_s=5.0) as runner:
        result = runner.score(["x"], ["y"])
    assert result.rewards == [0.0] and result.errors == 1


def test_numbers_of_any_real_type_are_accepted():
    with RewardRunner([("bool", lambda c, a: c == a), ("int", lambda c, a: 2)], timeout_s=5.0) as runner:
        result = runner.score(["x"], ["x"])
    assert result.per_function == {"bool": [1.0], "int": [2.0]} and result.errors == 0


def test_hanging_reward_costs_one_timeout_for_the_batch_and_the_runner_recovers(release):
    hang = lambda completion, answer: release.wait()  # noqa: E731
    with RewardRunner([("hang", hang), ("exact_match", exact_match)], timeout_s=TIMEOUT, threads=32) as runner:
        start = time.monotonic()
        result = runner.score(["19"] * 16, ["19"] * 16)
        elapsed = time.monotonic() - start
        assert TIMEOUT <= elapsed < 3 * TIMEOUT, elapsed  # not 16 timeouts
        assert result.per_function["hang"] == [0.0] * 16
        assert result.rewards == [1.0] * 16  # exact_match still scored every completion
        assert (result.errors, result.timeouts) == (0, 16)
        assert runner.counts["hang"].timeouts == 16
        assert runner.hung_threads == 16
        release.set()  # the stuck calls return; their abandoned threads leave
        assert wait_until(lambda: runner.hung_threads == 0)
        again = runner.score(["19", "20"], ["19", "19"])
        assert again.per_function["hang"] == [1.0, 1.0]  # Event.wait returned True
        assert again.timeouts == 0


def test_mixed_batch_scores_each_completion_by_its_own_outcome(release):
    def mixed(completion, answer):
        if completion == "hang":
            release.wait()
        if completion == "raise":
            raise ValueError("no")
        if completion == "nan":
            return math.nan
        return exact_match(completion, answer)

    with RewardRunner([("mixed", mixed)], timeout_s=TIMEOUT) as runner:
        result = runner.score(["19", "hang", "raise", "nan", "20", "hang"], ["19"] * 6)
    assert result.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert result.correct == [True, False, False, False, False, False]
    assert (result.errors, result.timeouts) == (2, 2)
    assert result.item_errors == [0, 0, 1, 1, 0, 0] and result.item_timeouts == [0, 1, 0, 0, 0, 1]


def test_a_slow_call_that_finishes_in_time_is_not_a_timeout():
    def slow(completion, answer):
        time.sleep(TIMEOUT / 4)
        return 1.0

    with RewardRunner([("slow", slow)], timeout_s=TIMEOUT) as runner:
        result = runner.score(["a"] * 4, ["a"] * 4)
    assert result.rewards == [1.0] * 4 and result.timeouts == 0


def test_concurrency_is_bounded_by_threads():
    lock, running, peak = threading.Lock(), [0], [0]

    def track(completion, answer):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return 1.0

    with RewardRunner([("track", track)], timeout_s=5.0, threads=3) as runner:
        assert runner.score(["a"] * 12, ["a"] * 12).rewards == [1.0] * 12
    assert peak[0] == 3


def test_stuck_threads_are_bounded_then_scoring_fails_loudly_until_they_return(release):
    hang = lambda completion, answer: release.wait()  # noqa: E731
    with RewardRunner([("hang", hang)], timeout_s=TIMEOUT, max_hung_threads=2) as runner:
        assert runner.score(["a", "b"], ["a", "b"]).timeouts == 2
        with pytest.raises(RuntimeError, match=r"^rewards.max_hung_threads: 2 reward threads are stuck .*\(in hang\)"):
            runner.score(["a"], ["a"])
        release.set()
        assert wait_until(lambda: runner.hung_threads == 0)
        assert runner.score(["a"], ["a"]).rewards == [1.0]


def test_close_stops_idle_workers_and_refuses_more_work():
    runner = RewardRunner([("exact_match", exact_match)], timeout_s=5.0, threads=4)
    runner.score(["a"] * 4, ["a"] * 4)
    workers = [t for t in threading.enumerate() if t.name.startswith("asyncrl-reward-")]
    assert workers
    runner.close()
    runner.close()  # idempotent
    assert wait_until(lambda: not any(t.is_alive() for t in workers))
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
    ],
)
def test_runner_rejects_bad_arguments(kwargs, match):
    kwargs = {"functions": [("exact_match", exact_match)], **kwargs}
    with pytest.raises(ValueError, match=match):
        RewardRunner(kwargs.pop("functions"), **kwargs)


def test_from_config_takes_the_format_pattern_from_config_then_task():
    task = Task("t", train=[], heldout=[], format_pattern=r"\d+(,\d+)*")
    from_task = RewardRunner.from_config(RewardConfig(functions=["format"]), task)
    assert from_task.score(["1,2"], [""]).rewards == [1.0]
    configured = RewardRunner.from_config(RewardConfig(functions=["format"], format_pattern=r"[a-z]+"), task)
    assert configured.score(["1,2", "ab"], ["", ""]).rewards == [0.0, 1.0]
    with pytest.raises(ValueError, match="^rewards.format_pattern"):
        RewardRunner.from_config(RewardConfig(functions=["format"]))
    runner = RewardRunner.from_config(
        RewardConfig(functions=["exact_match", "operator:eq"], weights=[1.0, 0.5], timeout_s=2.0, threads=3)
    )
    assert (runner.names, runner.weights, runner.timeout_s, runner.threads) == (
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
    with pytest.raises(ValueError, match="^rewards.overlong_cache"):
        OverlongPenalty(20, 21)


def test_overlong_is_configured_beside_other_rewards_and_scored_on_token_counts():
    cfg = load_config(
        None, ["rewards.functions=[exact_match,overlong]", "rewards.overlong_cache=4", "rewards.weights=[1,0.5]"]
    )
    with RewardRunner.from_config(cfg.rewards, max_new_tokens=cfg.generation.max_new_tokens) as runner:
        result = runner.score(["19", "19", "x"], ["19", "19", "19"], num_tokens=[3, 14, 16])
        assert result.per_function["overlong"] == [0.0, -0.5, -1.0]
        assert result.rewards == [1.0, 0.75, -0.5] and result.correct == [True, True, False]
        with pytest.raises(ValueError, match="overlong needs num_tokens"):
            runner.score(["19"], ["19"])
    for overrides, message in [
        (["rewards.functions=[overlong]"], "rewards.overlong_cache: the overlong reward needs a cache length"),
        (["rewards.functions=[overlong]", "rewards.overlong_cache=17"], "rewards.overlong_cache: 17 is more than"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rewards.functions=[exact]", "rewards.functions: unknown reward 'exact'"),
        ("rewards.functions=[]", "rewards.functions: at least one reward function is needed"),
        ("rewards.functions=[format,format]", "rewards.functions: 'format' is listed twice"),
        ("rewards.format_pattern='('", "rewards.format_pattern: invalid regex"),
        ("rewards.threads=0", "rewards.threads"),
    ],
)
def test_config_rejects_bad_reward_settings(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(message)


def test_a_call_spinning_on_the_cpu_does_not_stall_the_caller(release):
    def spin(completion, answer):
        while not release.is_set():
            pass
        return 1.0

    with RewardRunner([("spin", spin)], timeout_s=TIMEOUT) as runner:
        start = time.monotonic()
        assert runner.score(["a"] * 4, ["a"] * 4).timeouts == 4
        assert time.monotonic() - start < 5 * TIMEOUT


def test_first_error_and_first_timeout_of_a_function_are_logged_once(release, caplog):
    def flaky(completion, answer):
        if completion == "hang":
            release.wait()
        raise KeyError(completion)

    with RewardRunner([("flaky", flaky)], timeout_s=TIMEOUT) as runner:
        runner.score(["a", "b", "hang"], ["", "", ""])
        runner.score(["c"], [""])
    messages = [r.getMessage() for r in caplog.records if r.name == "asyncrl.rewards.runner"]
    assert len(messages) == 2
    assert any(m.startswith("reward flaky: raised KeyError") for m in messages)
    assert any(m.startswith("reward flaky: a call ran past rewards.timeout_s=0.2s") for m in messages)


@pytest.mark.parametrize("name", ["exact_match", "numeric_match", "math", "format", "operator:eq"])
def test_a_pickled_runner_scores_the_same_on_its_own_threads(name):
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
    from asyncrl.generation import SamplingParams
    from asyncrl.models import build_char_tokenizer
    from asyncrl.rollout import RolloutWorker
    from asyncrl.types import Rollout

    class FixedLengths:  # a generator whose i-th response has lengths[i] tokens
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
