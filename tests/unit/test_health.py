"""Run-health warnings: each condition that makes learning unlikely is warned about once it has held
over the window, once per run, naming the setting to change; healthy records give none."""

import pytest

from asyncrl.config import load_config
from asyncrl.control.health import CHECKS, RunHealth, run_warnings

WINDOW = 3
CONFIG = load_config(None, [f"logging.health_window={WINDOW}", "sampler.name=windowed", "sampler.max_lag=1"])


def healthy(step: int, **changes) -> dict:
    """A step record of a run that learns: mixed rewards, whole turns, no faults, weights near 1."""
    record = {
        "step": step,
        "num_groups": 16,
        "zero_variance_groups": 3,
        "accuracy": 0.4,
        "turns_cut_fraction": 0.05,
        "reward_errors": 0,
        "reward_timeouts": 0,
        "lag_mean": 0.6,
        "evicted_groups": 0,
        "is_weight_mean": 0.98,
        "mismatch_kl": 0.001,
        "episode/truncated": 0.7,  # most episodes used up their turns: whole, and no warning
        "episode/cut": 0.05,
        "episode/timed_out": 0.0,
        "episode/tool_calls": 1.0,
        "episode/tool_errors_parse": 0.1,
        "episode/tool_errors_raised": 0.0,
        "episode/tool_errors_limit": 0.9,
    }
    return {**record, **changes}


def warnings_of(records, config=CONFIG):
    return {w["warning"]: w for w in run_warnings(config, records)}


# (check, the changes that trigger it, the setting its message names)
TRIGGERS = [
    ("turns_cut", {"turns_cut_fraction": 0.9}, "generation.max_new_tokens=16"),
    ("episodes_cut", {"episode/cut": 0.8}, "environment.max_tokens=256"),
    ("zero_variance", {"zero_variance_groups": 16, "accuracy": 0.0}, "data.task.options of running_sum"),
    ("tool_failures", {"episode/tool_errors_parse": 3.0}, "environment.options.parser"),
    ("reward_failures", {"reward_timeouts": 100}, "rewards.timeout_s=5.0"),
    ("lag_pinned", {"lag_mean": 1.0, "evicted_groups": "rising"}, "sampler.max_lag=1"),
    ("importance_weights_collapsed", {"is_weight_mean": 0.2, "mismatch_kl": 0.9}, "sampler.max_lag=1"),
]


def test_every_check_has_a_trigger_here():
    assert {name for name, _, _ in TRIGGERS} == set(CHECKS)


@pytest.mark.parametrize(("name", "changes", "setting"), TRIGGERS, ids=[t[0] for t in TRIGGERS])
def test_each_warning_is_given_once_when_its_condition_holds_over_the_window(name, changes, setting):
    def bad(step):
        values = {k: (4 * step if v == "rising" else v) for k, v in changes.items()}
        return healthy(step, **values)

    health = RunHealth(CONFIG)
    given = [health.observe(bad(step)) for step in range(1, 8)]
    assert [len(g) for g in given] == [0, 0, 1, 0, 0, 0, 0]  # at the window's end, then never again
    [warning] = given[2]
    assert warning.warning == name and warning.step == WINDOW
    assert setting in warning.message, warning.message


@pytest.mark.parametrize(("name", "changes", "setting"), TRIGGERS, ids=[t[0] for t in TRIGGERS])
def test_a_condition_shorter_than_the_window_gives_no_warning(name, changes, setting):
    records = [healthy(1), healthy(2)]
    records += [healthy(3, **{k: (12 if v == "rising" else v) for k, v in changes.items()}), healthy(4), healthy(5)]
    assert warnings_of(records) == {}


def test_healthy_records_give_no_warning_and_neither_does_in_order_lag_at_its_bound():
    in_order = load_config(None, [f"logging.health_window={WINDOW}", "sampler.max_lag=1"])
    records = [healthy(step, lag_mean=1.0) for step in range(1, 30)]  # in_order trains every group at max_lag
    assert warnings_of(records, in_order) == {}


def test_episodes_out_of_time_are_told_to_raise_max_seconds():
    records = [healthy(s, **{"episode/timed_out": 0.9}) for s in range(1, 4)]
    assert "environment.max_seconds" in warnings_of(records)["episodes_cut"]["message"]


def test_the_zero_variance_warning_says_whether_the_task_is_too_hard_or_too_easy():
    too_easy = warnings_of([healthy(s, zero_variance_groups=16, accuracy=1.0) for s in range(1, 4)])
    assert "too easy: make it harder (data.task.options of running_sum)" in too_easy["zero_variance"]["message"]
    mixed = warnings_of([healthy(s, zero_variance_groups=16, accuracy=0.5) for s in range(1, 4)])
    assert "rewards.functions" in mixed["zero_variance"]["message"]


def test_a_replayed_run_does_not_repeat_what_it_said():
    records = [healthy(step, turns_cut_fraction=1.0) for step in range(1, 6)]
    health = RunHealth(CONFIG)
    assert [w.warning for w in health.replay(records[:4])] == ["turns_cut"]
    assert health.observe(records[4]) == []


def test_lag_pinned_counts_every_eviction_of_its_window_the_first_step_s_included():
    at_bound = {"lag_mean": 1.0}
    first_step_only = [healthy(step, evicted_groups=4, **at_bound) for step in range(1, 4)]
    assert "4 groups were evicted" in warnings_of(first_step_only)["lag_pinned"]["message"]
    one_step = load_config(None, ["logging.health_window=1", "sampler.name=windowed", "sampler.max_lag=1"])
    rising = [healthy(step, evicted_groups=4 * step, **at_bound) for step in range(1, 4)]
    assert warnings_of(rising, one_step)["lag_pinned"]["step"] == 1
    evicted_before = [healthy(s, evicted_groups=4) for s in range(1, 4)] + [
        healthy(s, evicted_groups=4, **at_bound) for s in range(4, 8)
    ]
    assert "lag_pinned" not in warnings_of(evicted_before)  # at the bound only once evictions had stopped
