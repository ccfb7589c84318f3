"""``asyncrl verify --lora``: a LoRA policy's split and parallel steps equal its monolithic step,
and each planted LoRA mistake fails the check."""

import pytest
from helpers import error

from asyncrl.cli import main
from asyncrl.tools.verify import LORA_PLANTS, check_layout, verify


def test_a_split_lora_step_equals_the_monolithic_one_in_float64():
    for comparison in verify(lora=True):
        assert comparison.passed, comparison
        assert comparison.worst_error[0] < 1e-12


@pytest.mark.parametrize("plant", LORA_PLANTS)
def test_each_planted_lora_mistake_fails_the_check(plant):
    [comparison] = verify(("token-mean",), lora=True, plant=plant)
    assert not comparison.passed
    assert comparison.worst_error[0] > 1e-3


def test_a_lora_plant_without_lora_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="--plant: lora-base-trainable is a mistake of a LoRA policy; it needs --lora"):
        check_layout(1, 1, 4, ["lora-base-trainable"])


@pytest.mark.slow
def test_lora_steps_on_dp_and_cp_ranks_equal_the_monolithic_one():
    comparisons = verify(("token-mean", "seq-mean-token-mean"), lora=True, dp=2, cp=2)
    comparisons += verify(("token-mean",), lora=True, dp=2, wrap="ddp")
    assert all(c.passed for c in comparisons), comparisons
    [planted] = verify(("token-mean",), lora=True, dp=2, wrap="ddp", plant="lora-base-trainable")
    assert not planted.passed


@pytest.mark.slow
def test_verify_lora_on_the_command_line_passes_and_each_plant_fails(capsys):
    assert main(["verify", "--lora", "--mode", "token-mean"]) == 0
    for plant in LORA_PLANTS:
        assert main(["verify", "--lora", "--mode", "token-mean", "--plant", plant]) == 1
    assert "it needs --lora" in error(capsys, "verify", "--mode", "token-mean", "--plant", "lora-double-scaling")
