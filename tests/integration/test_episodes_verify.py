"""The loss stays exact with multi-turn masks: verify's batch holds episode rows whose observation
tokens are masked inside the response, the split step matches the monolithic one on them (one
process, and dp x cp ranks), and a twin that trains the observations fails."""

import pytest
import torch

from asyncrl.models import build_tiny_model
from asyncrl.tools.verify import Case, random_batch, verify, verify_parallel
from asyncrl.trainer.normalization import AGG_MODES


def test_every_other_row_of_the_batch_has_an_observation_inside_its_response():
    model = build_tiny_model(48, seed=0, dtype=torch.float64, hidden_size=64, num_layers=2, intermediate_size=128)
    batch = random_batch(model, num_groups=4, group_size=4, vocab_size=48, seed=0)
    mask = batch.response_mask
    first = mask.argmax(1)
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    spans = (last - first + 1).tolist()
    holes = [int((mask[i, first[i] : last[i] + 1] == 0).sum()) for i in range(len(batch))]
    assert all(h > 0 for h, span in zip(holes[::2], spans[::2]) if span >= 5) and not any(holes[1::2])
    assert sum(h > 0 for h in holes) >= 4
    assert batch.response_lengths.tolist() == mask.sum(1).long().tolist()
    assert bool((batch.behaviour_logprobs[mask == 0] == 0).all())


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_masked_rows_split_match_monolithic_and_training_the_observations_fails(ratio_level):
    for r in verify(AGG_MODES, micro_batches=3, dtype="float64", options={"ratio_level": ratio_level}):
        assert r.passed and r.worst_error[0] <= 1e-9, (r.mode, r.worst_error)
    for r in verify(
        AGG_MODES, micro_batches=3, dtype="float64", options={"ratio_level": ratio_level}, plant="observation-trained"
    ):
        assert not r.passed and r.worst_error[0] > 1e-3, (r.mode, r.worst_error)


@pytest.mark.slow
def test_masked_rows_over_dp_and_cp_ranks_match_and_training_the_observations_fails():
    modes = ("token-mean", "seq-mean-token-mean")
    cases = [Case(mode) for mode in modes] + [Case(mode, plant="observation-trained") for mode in modes]
    for r in verify_parallel(cases, dp=2, cp=2, micro_batches=2):
        if r.case.plant is None:
            assert r.passed and r.worst_error[0] <= 1e-9, (r.case, r.worst_error)
        else:
            assert not r.passed and r.worst_error[0] > 1e-3, (r.case, r.worst_error)
