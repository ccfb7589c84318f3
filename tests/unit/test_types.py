"""The data contract: tensorization of rollouts, batch assembly, slicing that keeps full counts."""

import pickle

import pytest
import torch

from asyncrl.types import Rollout, RolloutGroup, TrainBatch


def group(
    uid: str, prompt: list[int], responses: list[list[int]], rewards: list[float], version: int = 0
) -> RolloutGroup:
    rollouts = [
        Rollout(prompt_ids=prompt, response_ids=r, logprobs=[-0.5] * len(r), finish_reason="stop", reward=w)
        for r, w in zip(responses, rewards)
    ]
    return RolloutGroup.from_rollouts(uid, rollouts, pad_id=0, start_version=version, target_step=version)


def test_group_is_right_padded_with_aligned_masks():
    g = group("a", [5, 6], [[7], [8, 9, 10]], [1.0, 0.0])
    assert g.input_ids.tolist() == [[5, 6, 7, 0, 0], [5, 6, 8, 9, 10]]
    assert g.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert g.response_mask.tolist() == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert g.behaviour_logprobs.tolist() == [[0, 0, -0.5, 0, 0], [0, 0, -0.5, -0.5, -0.5]]
    assert g.rewards.tolist() == [1.0, 0.0]
    assert g.finish_reasons == ["stop", "stop"]
    assert g.end_version == g.start_version == 0 and g.size == 2


def test_contract_violations_are_rejected():
    with pytest.raises(ValueError, match="Rollout.logprobs"):
        Rollout(prompt_ids=[1], response_ids=[2, 3], logprobs=[0.0], finish_reason="stop")
    with pytest.raises(ValueError, match="Rollout.prompt_ids"):
        Rollout(prompt_ids=[], response_ids=[2], logprobs=[0.0], finish_reason="stop")
    g = group("a", [5], [[7]], [1.0])
    with pytest.raises(ValueError, match="RolloutGroup.rewards"):
        RolloutGroup(**{**g.__dict__, "rewards": torch.zeros(3)})
    with pytest.raises(ValueError, match="RolloutGroup.end_version"):
        RolloutGroup(**{**g.__dict__, "start_version": 2, "end_version": 1})
    with pytest.raises(ValueError, match="TrainBatch.advantages"):
        TrainBatch.from_groups([g], [torch.zeros(1)]).map_tensors(lambda n, t: t[:0] if n == "advantages" else t)


def test_batch_from_groups_pads_to_the_widest_group_and_counts():
    a = group("a", [5, 6], [[7], [8, 9]], [1.0, 0.0], version=3)
    b = group("b", [1], [[2, 3, 4, 5, 6]], [0.5], version=4)
    batch = TrainBatch.from_groups([a, b], [torch.tensor([1.0, -1.0]), torch.tensor([0.0])])
    assert batch.input_ids.shape == (3, 6)
    assert batch.response_lengths.tolist() == [1, 2, 5]
    assert batch.versions.tolist() == [3, 3, 4]
    assert batch.advantages.tolist() == [1.0, -1.0, 0.0]
    assert batch.num_sequences == 3 and batch.num_response_tokens == 8
    with pytest.raises(ValueError, match="2 groups but 1 advantage rows"):
        TrainBatch.from_groups([a, b], [torch.zeros(2)])


def test_slices_trim_padding_but_keep_full_sequence_lengths():
    a = group("a", [5, 6], [[7], [8, 9]], [1.0, 0.0])
    b = group("b", [1], [[2, 3, 4, 5, 6]], [0.5])
    batch = TrainBatch.from_groups([a, b], [torch.zeros(2), torch.zeros(1)])
    first, second = batch.split([2, 1])
    assert first.input_ids.shape == (2, 4) and second.input_ids.shape == (1, 6)
    assert [len(m) for m in batch.micro_batches(2)] == [2, 1]
    picked = batch.select([2, 0])
    assert picked.response_lengths.tolist() == [5, 1]
    with pytest.raises(ValueError, match="do not partition"):
        batch.split([2, 2])


def test_to_casts_only_floating_tensors():
    batch = TrainBatch.from_groups([group("a", [5], [[7, 8]], [1.0])], [torch.zeros(1)])
    moved = batch.to("cpu", torch.float64)
    assert moved.response_mask.dtype == torch.float64 and moved.advantages.dtype == torch.float64
    assert moved.input_ids.dtype == torch.long and moved.response_lengths.dtype == torch.long


def test_trim_keeps_every_real_token_even_with_left_padding():
    batch = TrainBatch(
        input_ids=torch.tensor([[0, 0, 5, 6, 7, 0], [5, 6, 7, 0, 0, 0]]),
        attention_mask=torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]),
        response_mask=torch.tensor([[0, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.float32),
        behaviour_logprobs=torch.zeros(2, 6),
        advantages=torch.zeros(2),
        response_lengths=torch.tensor([2, 2]),
    )
    trimmed = batch.trim()
    assert trimmed.input_ids.tolist() == [[0, 0, 5, 6, 7], [5, 6, 7, 0, 0]]
    assert trimmed.num_response_tokens == 4
    assert batch.select([1]).input_ids.tolist() == [[5, 6, 7]]


def test_group_state_survives_a_weights_only_checkpoint(tmp_path):
    g = group("uid-7", [5, 6], [[7], [8, 9]], [1.0, 0.0], version=2)
    torch.save({"groups": [g.state_dict()]}, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    restored = RolloutGroup.from_state_dict(loaded["groups"][0])
    assert restored.prompt_uid == "uid-7" and restored.target_step == 2 and restored.finish_reasons == ["stop", "stop"]
    assert torch.equal(restored.input_ids, g.input_ids) and torch.equal(restored.rewards, g.rewards)
    torch.save({"groups": [g]}, tmp_path / "objects.pt")
    with pytest.raises(pickle.UnpicklingError):  # why the state dict exists: objects are refused
        torch.load(tmp_path / "objects.pt", weights_only=True)


def test_concat_restores_a_split_batch_and_rejects_mixed_optional_fields():
    a = group("a", [5, 6], [[7], [8, 9]], [1.0, 0.0])
    b = group("b", [1], [[2, 3, 4, 5, 6]], [0.5])
    batch = TrainBatch.from_groups([a, b], [torch.tensor([1.0, -1.0]), torch.tensor([0.5])])
    parts = batch.split([1, 2])
    assert parts[0].input_ids.shape[1] < batch.input_ids.shape[1]  # the slice was trimmed
    joined = TrainBatch.concat(parts)
    for name in (
        "input_ids",
        "attention_mask",
        "response_mask",
        "behaviour_logprobs",
        "advantages",
        "response_lengths",
    ):
        assert torch.equal(getattr(joined, name), getattr(batch, name)), name
    parts[1].ref_logprobs = torch.zeros_like(parts[1].behaviour_logprobs)
    with pytest.raises(ValueError, match="ref_logprobs is set in some batches only"):
        TrainBatch.concat(parts)


def test_group_carries_correctness_and_fault_counts_through_its_state_dict():
    g = group("a", [5], [[7], [8]], [1.0, 0.0])
    g = RolloutGroup(**{**g.__dict__, "correct": torch.tensor([1.0, 0.0]), "reward_timeouts": 1, "retries": 2})
    restored = RolloutGroup.from_state_dict(g.state_dict())
    assert restored.correct.tolist() == [1.0, 0.0] and restored.reward_timeouts == 1 and restored.retries == 2
    with pytest.raises(ValueError, match="RolloutGroup.correct"):
        RolloutGroup(**{**g.__dict__, "correct": torch.zeros(3)})
