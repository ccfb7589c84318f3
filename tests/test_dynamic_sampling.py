"""Zero-variance filtering end to end: steps with nothing to learn, refill, resume."""

import pytest
from test_train import deterministic, run


def constant_zero(completion: str, answer: str) -> float:
    return 0.0


def constant_one(completion: str, answer: str) -> float:
    return 1.0


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["constant_zero", "constant_one"])
def test_a_run_where_every_group_is_filtered_completes_and_resumes(tmp_path, reward):
    settings = ["grpo.filter_zero_variance=true", f"rewards.functions=[test_dynamic_sampling:{reward}]"]
    summary, metrics, _ = run(tmp_path, "run", *settings, "grpo.max_steps=2", "checkpoint.every_steps=1")
    assert summary["steps"] == 2
    assert [m["num_updates"] for m in metrics] == [0, 0]
    assert [m["empty_steps"] for m in metrics] == [1, 2]
    assert [m["num_filtered_groups"] for m in metrics] == [4, 4] and metrics[0]["loss"] is None
    summary, resumed, _ = run(tmp_path, "run", *settings, "grpo.max_steps=3", resume=tmp_path / "run")
    assert summary["steps"] == 3 and resumed[-1]["empty_steps"] == 3


def even_answers_score_even_lengths(completion: str, answer: str) -> float:
    """Groups of odd answers all score 0 (filtered); the others vary with the completion's length."""
    return float(answer[-1] in "02468" and len(completion) % 2 == 0)


@pytest.mark.slow
def test_refill_keeps_every_step_at_prompts_per_step_informative_groups_reproducibly(tmp_path):
    settings = [
        "grpo.filter_zero_variance=true",
        "grpo.max_refill_groups=32",
        "rewards.functions=[test_dynamic_sampling:even_answers_score_even_lengths]",
        "grpo.max_steps=3",
    ]
    _, metrics, groups = run(tmp_path, "a", *settings)
    assert [m["num_informative_groups"] for m in metrics] == [4, 4, 4]
    assert sum(m["refill_groups"] for m in metrics) == metrics[-1]["refill_groups_total"] > 0
    assert all(m["num_groups"] == 4 + m["refill_groups"] for m in metrics)
    assert all(g["lag"] <= 1 for g in groups)
    _, again, groups_again = run(tmp_path, "b", *settings)
    assert deterministic(again) == deterministic(metrics) and groups_again == groups
