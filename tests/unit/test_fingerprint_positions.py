"""The fingerprint's strided positions (weights/fingerprint.py) are exact at a released model's
sizes: float32 positions stop being whole numbers past 2**24 elements, and its embedding
(49,152 x 576 = 28,311,552 elements) would read one past its end."""

import pytest
import torch

from asyncrl.weights.fingerprint import SAMPLES, positions, sample


def nearest(numel: int) -> list[int]:
    """Each sampled position as exact integers round it: i * (numel - 1) / (SAMPLES - 1), half up."""
    return [(2 * i * (numel - 1) + SAMPLES - 1) // (2 * (SAMPLES - 1)) for i in range(SAMPLES)]


@pytest.mark.parametrize("numel", [49_152 * 576, 2**24 + 1], ids=["embedding", "2**24+1"])
def test_a_tensor_past_2_to_the_24_elements_is_sampled_at_its_exact_positions(numel):
    [values] = sample({"w": torch.arange(numel, dtype=torch.int32)}).values  # each value its own position
    assert list(values) == nearest(numel)
    assert values[0] == 0 and values[-1] == numel - 1


def test_small_tensors_keep_their_positions_first_and_last_included():
    assert positions(0).tolist() == []
    assert positions(1).tolist() == [0]
    assert positions(5).tolist() == [0, 1, 2, 3, 4]
    assert positions(10_000).tolist() == nearest(10_000)
    assert positions(10_000).dtype == torch.int64
