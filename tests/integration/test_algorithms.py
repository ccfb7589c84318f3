"""The algorithm seam: a user algorithm trains a run, the informative flag is the algorithm's and
survives checkpoints, and a bad ``algorithm.name`` is one error naming the field."""

import math
import re
import sys

import pytest
import torch
from helpers import ROOT, run

from asyncrl.algorithms import build_algorithm
from asyncrl.algorithms.grpo import GRPO, token_loss
from asyncrl.config import LossConfig, load_config
from asyncrl.types import RolloutGroup

DOC = ROOT / "docs" / "plugins.md"

# Beside the documented example: a variant that counts its loss calls, and one that judges every
# group informative, equal rewards included.
EXTRA = """

calls = []


class Counted(Reinforce):
    def token_loss(self, inputs):
        calls.append(inputs.logprobs.shape[0])
        return super().token_loss(inputs)


class EveryGroupCounts(Reinforce):
    def informative(self, rewards):
        return True
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    section = DOC.read_text().split("## Algorithm")[1]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_algorithms.py").write_text(example + EXTRA)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_algorithms", None)


@pytest.mark.slow
def test_the_documented_user_algorithm_trains_a_short_run(tmp_path, user_module):
    summary, metrics, _ = run(tmp_path, "run", "algorithm.name=my_algorithms:Counted", "grpo.max_steps=2")
    import my_algorithms

    assert summary["steps"] == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    assert sum(my_algorithms.calls) == 2 * 16  # every sequence of both steps went through its loss
    assert metrics[0]["is_weight_min"] == metrics[0]["is_weight_max"] == 1.0  # no weight given: 1


@pytest.mark.slow
def test_the_algorithm_decides_which_groups_are_informative(tmp_path, user_module):
    # every reward is 1, so GRPO's test would filter all four groups; this algorithm keeps them
    settings = ["rewards.functions=[reward_functions:constant_one]", "grpo.filter_zero_variance=true"]
    _, metrics, _ = run(tmp_path, "run", "algorithm.name=my_algorithms:EveryGroupCounts", *settings, "grpo.max_steps=1")
    assert metrics[0]["num_filtered_groups"] == 0 and metrics[0]["num_updates"] == 1


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ppo", "algorithm.name: unknown algorithm 'ppo'; built-ins are grpo"),
        ("my_algorithms:Missing", "algorithm.name: cannot load 'my_algorithms:Missing'"),
        ("my_algorithms:calls", "algorithm.name: 'my_algorithms:calls' is not callable"),
        ("math:floor", "algorithm.name: 'math:floor' raised on the run config (TypeError"),
    ],
)
def test_bad_algorithm_names_are_one_line_errors(user_module, name, message):
    with pytest.raises(ValueError) as err:
        build_algorithm(load_config(None, [f"algorithm.name={name}"]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_grpo_is_the_default_algorithm_and_reads_the_loss_section_as_it_is():
    config = load_config(None, ["loss.ratio_level=sequence", "grpo.scale_by_std=false"])
    algorithm = build_algorithm(config)
    assert isinstance(algorithm, GRPO) and algorithm.options is config.loss and not algorithm.scale_by_std


def test_the_behaviour_clip_is_part_of_the_token_loss():
    # ratio to the generator, exp(-0.5 - -1) = e^0.5 > 1.28 with A = 1: clipped; mismatch_kl is
    # the generator against the current policy, not against the proximal logprobs
    logprobs, proximal, behaviour = torch.tensor([[-0.5]]), torch.tensor([[-0.5]]), torch.tensor([[-1.0]])
    cfg = LossConfig(clip_against="behaviour")
    loss, metrics = token_loss(logprobs, proximal + 3, behaviour, torch.tensor([[1.0]]), cfg=cfg, is_mode="none")
    assert metrics["ratio"].item() == pytest.approx(math.exp(0.5)) and metrics["clip"].item() == 1.0
    assert loss.item() == pytest.approx(-1.28) and metrics["is_weight"].item() == 1.0
    d = -0.5 - -1.0
    assert metrics["mismatch_kl"].item() == pytest.approx(math.exp(d) - 1 - d)


def test_a_group_keeps_its_informative_flag_through_a_checkpoint_and_older_ones_get_grpos():
    group = RolloutGroup(
        prompt_uid="p",
        input_ids=torch.ones(2, 3, dtype=torch.long),
        attention_mask=torch.ones(2, 3, dtype=torch.long),
        response_mask=torch.ones(2, 3),
        behaviour_logprobs=torch.zeros(2, 3),
        rewards=torch.tensor([1.0, 1.0]),
        finish_reasons=["stop", "stop"],
        start_version=0,
        end_version=0,
        informative=True,  # an algorithm that learns from equal rewards too
    )
    state = group.state_dict()
    assert RolloutGroup.from_state_dict(state).informative is True
    del state["informative"]  # a checkpoint written before groups carried the flag
    assert RolloutGroup.from_state_dict(state).informative is False
    state["rewards"] = torch.tensor([0.0, 1.0])
    assert RolloutGroup.from_state_dict(state).informative is True
