"""Zero-variance filtering end to end: steps with nothing to learn, refill, resume."""

import json

import pytest
from helpers import SMALL, deterministic, run

from asyncrl.config import load_config
from asyncrl.data import build_task
from asyncrl.models import build_tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["constant_zero", "constant_one"])
def test_a_run_where_every_group_is_filtered_completes_and_resumes(tmp_path, reward):
    settings = ["step.filter_zero_variance=true", f"rewards.functions=[reward_functions:{reward}]"]
    summary, metrics, _ = run(tmp_path, "run", *settings, "step.max_steps=2", "checkpoint.every_steps=1")
    assert summary["steps"] == 2
    assert [m["num_updates"] for m in metrics] == [0, 0]
    assert [m["empty_steps"] for m in metrics] == [1, 2]
    assert [m["num_filtered_groups"] for m in metrics] == [4, 4] and metrics[0]["loss"] is None
    summary, resumed, _ = run(tmp_path, "run", *settings, "step.max_steps=3", resume=tmp_path / "run")
    assert summary["steps"] == 3 and resumed[-1]["empty_steps"] == 3


@pytest.mark.slow
def test_refill_keeps_every_step_at_prompts_per_step_informative_groups_reproducibly(tmp_path):
    settings = [
        "step.filter_zero_variance=true",
        "step.max_refill_groups=32",
        "rewards.functions=[reward_functions:even_answers_score_even_lengths]",
        "step.max_steps=3",
    ]
    _, metrics, groups = run(tmp_path, "a", *settings)
    assert [m["num_informative_groups"] for m in metrics] == [4, 4, 4]
    assert sum(m["refill_groups"] for m in metrics) == metrics[-1]["refill_groups_total"] > 0
    assert all(m["num_groups"] == 4 + m["refill_groups"] for m in metrics)
    assert all(g["lag"] <= 1 for g in groups)
    _, again, groups_again = run(tmp_path, "b", *settings)
    assert deterministic(again) == deterministic(metrics) and groups_again == groups


@pytest.mark.slow
def test_refill_works_under_the_windowed_sampler(tmp_path):
    """The windowed sampler admits up to capacity; the refill budget's slots stay free for refills."""
    settings = [
        "sampler.name=windowed",
        "step.filter_zero_variance=true",
        "step.max_refill_groups=32",
        "rewards.functions=[reward_functions:even_answers_score_even_lengths]",
        "step.max_steps=3",
    ]
    _, metrics, _ = run(tmp_path, "windowed", *settings)
    assert all(m["num_informative_groups"] == 4 for m in metrics)
    assert all(m["refill_groups"] > 0 for m in metrics if m["num_filtered_groups"] > 0)
    assert metrics[-1]["refill_groups_total"] > 0


@pytest.mark.slow
def test_refills_given_up_after_their_stream_runs_out_do_not_hold_up_the_step(tmp_path):
    """Every refill prompt fails and is skipped; once the refill stream is used up, the step stops
    waiting for the refills it cancels and closes on the groups it has."""
    settings = [
        "data.task.options.num_problems=24",
        "data.eval_size=8",
        "data.epochs=1",
        "step.filter_zero_variance=true",
        "step.max_refill_groups=8",
        "rewards.functions=[reward_functions:constant_zero]",
        "runtime.on_rollout_failure=skip",
        "runtime.max_skipped_share=1",  # every refill fails by design: no share of skips stops this run
        "runtime.max_rollout_retries=0",
        "runtime.watchdog_s=120",
        "step.max_steps=2",
    ]
    config = load_config(None, [*SMALL, *settings])
    train_prompts = build_task(config.data, build_tokenizer(config)).train
    every_refill = json.dumps([f"refill:{prompt.uid}" for prompt in train_prompts])
    summary, metrics, _ = run(tmp_path, "run", *settings, f"faults.failing_prompts={every_refill}")
    assert summary["steps"] == 2
    assert metrics[-1]["skipped_prompts"] == len(train_prompts)
    assert [m["refill_groups"] for m in metrics] == [0, 0] and [m["num_groups"] for m in metrics] == [4, 4]


@pytest.mark.slow
@pytest.mark.parametrize("max_lag", [0, 1, 2])
@pytest.mark.parametrize("sampler", ["weight_fifo", "windowed"])
def test_refills_are_trained_in_the_step_they_refill_under_every_sampler(tmp_path, sampler, max_lag):
    """Not a later step's regular groups: a refill is trained in its own step, with its weights,
    and none is evicted; admissions hold no more groups than without refill, so a step's end
    evicts at most prompts_per_step groups (windowed, max_lag 0)."""
    settings = [
        f"sampler.name={sampler}",
        f"sampler.max_lag={max_lag}",
        "step.filter_zero_variance=true",
        "step.max_refill_groups=32",
        "rewards.functions=[reward_functions:even_answers_score_even_lengths]",
    ]
    _, metrics, groups = run(tmp_path, "run", *settings)
    refills = [g for g in groups if g["prompt_uid"].startswith("refill:")]
    assert [sum(g["step"] == m["step"] for g in refills) for m in metrics] == [m["refill_groups"] for m in metrics]
    assert all(g["lag"] == 0 and g["target_step"] == g["trained_at"] for g in refills)
    assert len(refills) == metrics[-1]["refill_groups_total"] > 0
    assert all(m["num_informative_groups"] == 4 or m["refill_groups"] == 32 for m in metrics)
    assert metrics[-1]["evicted_groups"] <= 4 * len(metrics)
