"""The ``gpu`` marker: a test that needs CUDA runs where there is one and is skipped elsewhere,
saying why (tests/conftest.py, ``helpers.skip_gpu_tests``)."""

import pytest
import torch
from helpers import NO_CUDA, skip_gpu_tests


@pytest.mark.gpu
def test_a_test_marked_gpu_runs_only_where_cuda_is():
    assert torch.cuda.is_available()
    assert torch.ones(2, device="cuda").sum().item() == 2.0


class _Item:
    """A collected test as the hook sees it: its markers."""

    def __init__(self, *names: str) -> None:
        self.marks = [getattr(pytest.mark, name).mark for name in names]

    def get_closest_marker(self, name: str):
        return next((mark for mark in self.marks if mark.name == name), None)

    def add_marker(self, marker) -> None:
        self.marks.append(marker.mark)


@pytest.mark.parametrize("cuda", [False, True])
def test_only_tests_marked_gpu_are_skipped_and_only_without_cuda(cuda):
    items = [_Item("gpu"), _Item("slow"), _Item("slow", "gpu")]
    skip_gpu_tests(items, lambda: cuda)
    reasons = [[mark.kwargs["reason"] for mark in item.marks if mark.name == "skip"] for item in items]
    assert reasons == ([[], [], []] if cuda else [[NO_CUDA], [], [NO_CUDA]])


def test_cuda_is_not_asked_about_when_no_test_needs_it():
    skip_gpu_tests([_Item("slow"), _Item()], lambda: pytest.fail("asked about CUDA"))
