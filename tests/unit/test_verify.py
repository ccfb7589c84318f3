"""Split step == monolithic step (docs/loss.md), with its planted-mistake twins that must fail."""

import pytest
import torch

from asyncrl.cli import main
from asyncrl.models import build_tiny_model
from asyncrl.tools.verify import Case, random_batch, uneven_split, verify, verify_parallel
from asyncrl.trainer.normalization import AGG_MODES

SEQUENCE = {"ratio_level": "sequence"}  # grpo's sequence ratio (GSPO)


@pytest.mark.parametrize("micro_batches", [2, 4, 16])
def test_float64_split_matches_monolithic_within_1e9_for_every_mode(micro_batches):
    results = verify(AGG_MODES, micro_batches=micro_batches, dtype="float64")
    assert [r.mode for r in results] == list(AGG_MODES)
    for r in results:
        assert r.passed, r
        assert r.worst_error[0] <= 1e-9, (r.mode, r.worst_error)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_float64_parity_holds_for_other_models_and_batches(seed):
    for r in verify(AGG_MODES, micro_batches=3, dtype="float64", seed=seed):
        assert r.passed and r.worst_error[0] <= 1e-9, (seed, r.mode, r.worst_error)


def test_float32_split_matches_monolithic_within_tolerance():
    for r in verify(AGG_MODES, micro_batches=4, dtype="float32"):
        assert r.passed, r
        assert r.loss_error <= 1e-5


def test_planted_per_microbatch_mean_fails_every_mode():
    for r in verify(AGG_MODES, micro_batches=4, dtype="float64", plant="per-microbatch-mean"):
        assert not r.passed, r.mode
        assert r.worst_error[0] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("updates", [2, 4])
def test_several_updates_match_the_monolithic_updates_and_their_planted_mistakes_fail(updates):
    for r in verify(AGG_MODES, micro_batches=2, updates=updates):
        assert r.passed and r.worst_error[0] <= 1e-9, (updates, r.mode, r.worst_error)
    for plant in ("whole-step-normalizer", "recompute-proximal") if updates == 2 else ():
        for r in verify(("token-mean", "seq-mean-token-mean"), micro_batches=2, updates=updates, plant=plant):
            assert not r.passed and r.worst_error[0] > 1e-3, (plant, r.mode, r.worst_error)


def test_batch_exercises_clipping_importance_weights_and_ragged_lengths():
    model = build_tiny_model(48, seed=0, dtype=torch.float64, hidden_size=64, num_layers=2, intermediate_size=128)
    batch = random_batch(model, num_groups=4, group_size=4, vocab_size=48, seed=0)
    assert len(set(batch.response_lengths.tolist())) > 4
    assert len(set(batch.attention_mask.sum(1).tolist())) > 4
    ratio = torch.exp(batch.behaviour_logprobs - batch.prox_logprobs)[batch.response_mask > 0]
    assert (ratio > 1.28).any() and (ratio < 0.8).any()


def test_uneven_split_partitions_every_row_once():
    model = build_tiny_model(48, seed=0, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64)
    batch = random_batch(model, num_groups=4, group_size=4, vocab_size=48, seed=3)
    parts = uneven_split(batch, 5, torch.Generator().manual_seed(0))
    assert len(parts) == 5 and sum(len(p) for p in parts) == 16
    assert len({len(p) for p in parts}) > 1
    assert sum(p.num_response_tokens for p in parts) == batch.num_response_tokens
    with pytest.raises(ValueError, match="--micro-batches"):
        uneven_split(batch, 17, torch.Generator())


def test_cli_verify_passes_and_planted_mistake_exits_nonzero(capsys):
    assert main(["verify", "--micro-batches", "3", "--mode", "token-mean", "--mode", "seq-mean-token-sum"]) == 0
    out = capsys.readouterr().out
    assert "token-mean" in out and "seq-mean-token-sum" in out and "seq-mean-token-mean" not in out
    assert out.strip().splitlines()[-1].startswith("worst relative error:")
    assert out.strip().endswith("PASS")
    assert main(["verify", "--mode", "token-mean", "--plant", "per-microbatch-mean"]) == 1
    assert capsys.readouterr().out.strip().endswith("FAIL")


def test_sequence_ratio_split_matches_monolithic_within_1e9():
    for r in verify(("token-mean", "seq-mean-token-mean"), micro_batches=3, options=SEQUENCE):
        assert r.passed and r.worst_error[0] <= 1e-9, (r.mode, r.worst_error)


@pytest.mark.slow
def test_sequence_ratio_split_over_two_updates_matches_monolithic_within_1e9():
    for r in verify(AGG_MODES, micro_batches=3, updates=2, options=SEQUENCE):
        assert r.passed and r.worst_error[0] <= 1e-9, (r.mode, r.worst_error)


@pytest.mark.slow
@pytest.mark.parametrize("updates", [1, 2])
def test_sequence_ratio_over_dp_and_cp_ranks_matches_and_a_per_shard_mean_fails(updates):
    modes = ("token-mean", "seq-mean-token-mean")
    cases = [Case(mode, options=SEQUENCE) for mode in modes]
    cases += [Case(mode, plant="cp-shard-mean", options=SEQUENCE) for mode in modes]
    for r in verify_parallel(cases, dp=2, cp=2, micro_batches=2, updates=updates):
        if r.case.plant is None:
            assert r.passed and r.worst_error[0] <= 1e-9, (updates, r.case, r.worst_error)
        else:
            assert not r.passed and r.worst_error[0] > 1e-3, (updates, r.case, r.worst_error)


def test_cp_shard_mean_plant_needs_the_sequence_ratio():
    with pytest.raises(ValueError, match="--plant: cp-shard-mean .* --option ratio_level=sequence"):
        verify(("token-mean",), cp=2, plant="cp-shard-mean")
