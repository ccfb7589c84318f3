"""The algorithm seam: a user algorithm trains a run, the informative flag is the algorithm's and
survives checkpoints, and a bad ``algorithm.name`` is one error naming the field."""

import math
import re
import sys

import pytest
import torch
from helpers import ROOT, run

from asyncrl.algorithms import MetricKeys, Scoring, build_algorithm
from asyncrl.algorithms.grpo import GRPO, GRPOOptions, token_loss
from asyncrl.config import load_config
from asyncrl.tools.verify import verify
from asyncrl.types import RolloutGroup

DOC = ROOT / "docs" / "plugins.md"

# Beside the documented example: a variant that counts its loss calls, and one that judges every
# group informative, equal rewards included.
EXTRA = """

calls = []
built = []


class Counted(Reinforce):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        built.append(self)

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
    summary, metrics, _ = run(tmp_path, "run", "algorithm.name=my_algorithms:Counted", "step.max_steps=2")
    import my_algorithms

    assert summary["steps"] == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    assert sum(my_algorithms.calls) == 2 * 16  # every sequence of both steps went through its loss
    assert len(my_algorithms.built) == 1  # built once: the trainer and the rollout worker share it
    assert (
        "is_weight_mean" not in metrics[0] and "reinforce_kl" not in metrics[0]
    )  # GRPO's metrics are not forced on it


@pytest.mark.slow
def test_the_documented_algorithms_own_option_reaches_its_loss_and_its_declared_metric_is_reported(
    tmp_path, user_module
):
    _, metrics, _ = run(
        tmp_path, "run", "algorithm.name=my_algorithms:Reinforce", "algorithm.options.kl_coef=0.05", "step.max_steps=2"
    )
    kls = [m["reinforce_kl"] for m in metrics]
    assert kls[0] == pytest.approx(0.0, abs=1e-9)  # the first step's policy is the reference
    assert kls[1] != 0.0 and math.isfinite(kls[1])  # after one update it has moved away from it
    assert "kl" not in metrics[0]  # the trainer reports what the algorithm declares, under its keys


def test_the_documented_algorithm_passes_verify_split_and_on_ranks_and_a_planted_mistake_fails(user_module):
    options = {"kl_coef": 0.05}
    for result in verify(
        ("token-mean", "seq-mean-token-mean"), micro_batches=3, algorithm="my_algorithms:Reinforce", options=options
    ):
        assert result.passed, result
    planted = verify(
        ("token-mean",),
        micro_batches=3,
        algorithm="my_algorithms:Reinforce",
        options=options,
        plant="per-microbatch-mean",
    )
    assert not planted[0].passed


def test_an_algorithm_whose_loss_returns_an_undeclared_metric_stops_the_step(user_module):
    import my_algorithms

    class Undeclared(my_algorithms.Reinforce):
        def token_loss(self, inputs):
            loss, _ = super().token_loss(inputs)
            return loss, {"surprise": loss.detach()}

    my_algorithms.Undeclared = Undeclared
    with pytest.raises(ValueError, match=r"returned the metrics \['surprise'\], but it declares \[\]"):
        verify(("token-mean",), micro_batches=2, algorithm="my_algorithms:Undeclared")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.options.kl_coef=-1"], "algorithm.options.kl_coef: Input should be greater than or equal to 0"),
        (
            ["algorithm.options.beta=1"],
            "algorithm.options.beta: unknown option of 'my_algorithms:Reinforce' (its options: kl_coef)",
        ),
    ],
)
def test_a_bad_option_of_a_user_algorithm_is_one_line_naming_it(user_module, overrides, message):
    with pytest.raises(ValueError) as err:
        build_algorithm(load_config(None, ["algorithm.name=my_algorithms:Reinforce", *overrides]))
    assert str(err.value) == message


@pytest.mark.slow
def test_the_algorithm_decides_which_groups_are_informative(tmp_path, user_module):
    # every reward is 1, so GRPO's test would filter all four groups; this algorithm keeps them
    settings = ["rewards.functions=[reward_functions:constant_one]", "step.filter_zero_variance=true"]
    _, metrics, _ = run(tmp_path, "run", "algorithm.name=my_algorithms:EveryGroupCounts", *settings, "step.max_steps=1")
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


def test_grpo_is_the_default_algorithm_and_reads_its_options():
    config = load_config(None, ["algorithm.options.ratio_level=sequence", "algorithm.options.scale_by_std=false"])
    algorithm = build_algorithm(config)
    assert isinstance(algorithm, GRPO) and algorithm.options == GRPOOptions(ratio_level="sequence", scale_by_std=False)
    assert algorithm.scoring == Scoring() and set(algorithm.metrics) == {"clip", "is_weight", "ratio", "mismatch_kl"}
    with_kl = build_algorithm(
        load_config(None, ["algorithm.options.kl_coef=0.1", "algorithm.options.entropy_coef=0.1"])
    )
    assert with_kl.scoring == Scoring(reference=True, entropy=True) and with_kl.metrics["kl"] == MetricKeys("kl")


def grpo_error(overrides) -> str:
    with pytest.raises(ValueError) as err:
        build_algorithm(load_config(None, overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_grpos_options_are_checked_against_each_other_and_the_run():
    assert grpo_error(["algorithm.options.is_low=3", "algorithm.options.is_high=2"]).startswith(
        "algorithm.options.is_low: "
    )
    message = grpo_error(["algorithm.options.clip_against=behaviour", "step.num_epochs=2"])
    assert message.startswith("algorithm.options.clip_against: behaviour takes one update per step")
    message = grpo_error(["algorithm.options.clip_against=behaviour", "algorithm.options.importance_sampling=tis"])
    assert message.startswith("algorithm.options.importance_sampling: tis")
    message = grpo_error(["algorithm.options.ratio_level=sequence", "algorithm.options.importance_sampling=icepop"])
    assert message.startswith("algorithm.options.importance_sampling: icepop drops single tokens")
    behaviour = build_algorithm(load_config(None, ["algorithm.options.clip_against=behaviour", "sampler.max_lag=2"]))
    assert behaviour.importance_sampling == "none"  # auto: the ratio to the behaviour policy is the weight
    assert build_algorithm(load_config(None, ["sampler.max_lag=2"])).importance_sampling == "tis"


def test_the_behaviour_clip_is_part_of_the_token_loss():
    # ratio to the generator, exp(-0.5 - -1) = e^0.5 > 1.28 with A = 1: clipped; mismatch_kl is
    # the generator against the current policy, not against the proximal logprobs
    logprobs, proximal, behaviour = torch.tensor([[-0.5]]), torch.tensor([[-0.5]]), torch.tensor([[-1.0]])
    cfg = GRPOOptions(clip_against="behaviour")
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
