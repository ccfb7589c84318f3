"""Zero-variance filtering end to end: steps with nothing to learn, refill, resume."""

import pytest

from asyncrl.controller import SingleController
from test_train import run


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
