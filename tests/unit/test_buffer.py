"""ReplayBuffer: slot accounting, dispatch order, and errors raised before any side effect."""

import dataclasses
import subprocess
import sys

import pytest

from asyncrl.control.buffer import BufferFullError, ReplayBuffer, SlotError
from asyncrl.types import Rollout, RolloutGroup


def books(buffer: ReplayBuffer) -> tuple:
    """Everything observable about a buffer, to show that a failed call changed nothing."""
    return (
        buffer.ready_slots(),
        buffer.reserved_slots(),
        buffer.num_reserved_total,
        buffer.num_committed_total,
        buffer.num_cancelled_total,
        buffer.num_taken_total,
        buffer.num_evicted,
    )


def filled(capacity: int, n_ready: int, n_reserved: int = 0) -> tuple[ReplayBuffer, list[int]]:
    """A buffer whose first ``n_ready`` slots hold the groups "g0", "g1", ..."""
    buffer = ReplayBuffer(capacity)
    ids = [buffer.reserve(start_version=i, target_step=i) for i in range(n_ready + n_reserved)]
    for i in ids[:n_ready]:
        buffer.commit(i, f"g{i}")
    return buffer, ids


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity)


def test_reserve_hands_out_increasing_ids_and_counts_against_capacity():
    buffer = ReplayBuffer(3)
    ids = [buffer.reserve(0), buffer.reserve(1, target_step=4)]
    assert ids == sorted(set(ids))
    assert (buffer.capacity, buffer.num_reserved, buffer.num_ready, buffer.num_free) == (3, 2, 0, 1)
    assert [(s.slot_id, s.start_version, s.target_step, s.group) for s in buffer.reserved_slots()] == [
        (ids[0], 0, None, None),
        (ids[1], 1, 4, None),
    ]
    assert buffer.num_reserved_total == 2


def test_reserve_on_a_full_buffer_raises_and_changes_nothing():
    buffer, _ = filled(2, n_ready=1, n_reserved=1)
    before = books(buffer)
    with pytest.raises(BufferFullError) as info:
        buffer.reserve(0)
    assert isinstance(info.value, RuntimeError)
    assert books(buffer) == before


def test_commit_makes_a_slot_ready_and_keeps_dispatch_order():
    buffer = ReplayBuffer(3)
    first, second = buffer.reserve(5, target_step=7), buffer.reserve(6)
    buffer.commit(second, "late")
    buffer.commit(first, "early")
    assert [(s.slot_id, s.group, s.start_version, s.target_step) for s in buffer.ready_slots()] == [
        (first, "early", 5, 7),
        (second, "late", 6, None),
    ]
    assert (buffer.num_reserved, buffer.num_ready, buffer.num_free, buffer.num_committed_total) == (0, 2, 1, 2)


def test_slot_metadata_comes_from_reserve_not_from_the_group():
    group = RolloutGroup.from_rollouts(
        "p0", [Rollout([1, 2], [3], [-0.5], "stop", reward=1.0)], pad_id=0, start_version=9, target_step=9
    )
    buffer = ReplayBuffer(1)
    slot_id = buffer.reserve(2, target_step=3)
    buffer.commit(slot_id, group)
    (slot,) = buffer.ready_slots()
    assert (slot.start_version, slot.target_step) == (2, 3)
    assert buffer.take([slot_id]) == [group]


def test_slots_are_read_only():
    buffer, _ = filled(1, n_ready=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        buffer.ready_slots()[0].group = "other"


@pytest.mark.parametrize("case", ["unknown", "cancelled", "committed", "taken"])
def test_commit_to_a_slot_that_is_not_reserved_raises_before_any_side_effect(case):
    buffer, (ready_id, reserved_id) = filled(3, n_ready=1, n_reserved=1)
    slot_id = {"unknown": 99, "cancelled": reserved_id, "committed": ready_id, "taken": ready_id}[case]
    if case == "cancelled":
        buffer.cancel(reserved_id)
    if case == "taken":
        buffer.take([ready_id])
    before = books(buffer)
    with pytest.raises(SlotError) as info:
        buffer.commit(slot_id, "new")
    assert isinstance(info.value, KeyError)
    assert f"slot {slot_id}" in str(info.value)
    assert books(buffer) == before


def test_cancel_releases_the_slot_and_its_capacity():
    buffer, (slot_id,) = filled(1, n_ready=0, n_reserved=1)
    buffer.cancel(slot_id)
    assert (buffer.num_reserved, buffer.num_free, buffer.num_cancelled_total) == (0, 1, 1)
    assert buffer.reserve(0) > slot_id


@pytest.mark.parametrize("case", ["unknown", "ready", "cancelled twice"])
def test_cancel_of_a_slot_that_is_not_reserved_raises(case):
    buffer, (ready_id, reserved_id) = filled(2, n_ready=1, n_reserved=1)
    slot_id = {"unknown": 99, "ready": ready_id, "cancelled twice": reserved_id}[case]
    if case == "cancelled twice":
        buffer.cancel(reserved_id)
    before = books(buffer)
    with pytest.raises(SlotError):
        buffer.cancel(slot_id)
    assert books(buffer) == before


def test_take_returns_groups_in_the_order_given_and_removes_them_once():
    buffer, ids = filled(4, n_ready=3)
    assert buffer.take([ids[2], ids[0]]) == ["g2", "g0"]
    assert [s.slot_id for s in buffer.ready_slots()] == [ids[1]]
    assert (buffer.num_taken_total, buffer.num_free) == (2, 3)
    with pytest.raises(SlotError):
        buffer.take([ids[0]])


@pytest.mark.parametrize("method", ["take", "evict"])
@pytest.mark.parametrize("case", ["reserved", "unknown", "duplicate"])
def test_take_and_evict_accept_only_ready_slots_and_validate_the_whole_request_first(method, case):
    buffer, (a, b, reserved_id) = filled(3, n_ready=2, n_reserved=1)
    request = {"reserved": [a, reserved_id], "unknown": [a, 99], "duplicate": [a, b, a]}[case]
    before = books(buffer)
    with pytest.raises(SlotError):
        getattr(buffer, method)(request)
    assert books(buffer) == before


def test_evict_removes_ready_groups_and_counts_them():
    buffer, ids = filled(4, n_ready=3, n_reserved=1)
    assert buffer.evict([ids[1], ids[0]]) == 2
    assert buffer.evict([]) == 0
    assert [s.slot_id for s in buffer.ready_slots()] == [ids[2]]
    assert [s.slot_id for s in buffer.reserved_slots()] == [ids[3]]
    assert (buffer.num_evicted, buffer.num_taken_total, buffer.num_free) == (2, 0, 2)


def test_state_dict_round_trips_ready_groups_and_counters_but_not_in_flight_slots():
    buffer, ids = filled(5, n_ready=3, n_reserved=2)
    buffer.take([ids[0]])
    buffer.evict([ids[1]])
    buffer.cancel(ids[4])
    state = buffer.state_dict()

    resumed = ReplayBuffer(5)
    resumed.load_state_dict(state)
    assert [(s.slot_id, s.start_version, s.target_step, s.group) for s in resumed.ready_slots()] == [
        (ids[2], 2, 2, "g2")
    ]
    assert resumed.reserved_slots() == []
    # ids[3] was in flight: it is dispatched again after resume, so it is not counted as reserved.
    assert (resumed.num_reserved_total, resumed.num_committed_total, resumed.num_cancelled_total) == (4, 3, 1)
    assert (resumed.num_taken_total, resumed.num_evicted) == (1, 1)
    assert resumed.reserve(0) > max(ids)
    assert resumed.state_dict()["ready"] == state["ready"]


def test_state_dict_holds_only_plain_python_besides_the_groups():
    buffer, _ = filled(3, n_ready=2, n_reserved=1)
    state = buffer.state_dict()
    for entry in state["ready"]:
        entry.pop("group")

    def plain(value) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return value is None or type(value) in (int, str)

    assert plain(state)


def test_load_state_dict_replaces_contents_and_rejects_more_groups_than_capacity():
    state = filled(3, n_ready=3)[0].state_dict()
    with pytest.raises(ValueError, match="capacity 2"):
        ReplayBuffer(2).load_state_dict(state)
    target, _ = filled(3, n_ready=1, n_reserved=1)
    target.load_state_dict(state)
    assert [s.group for s in target.ready_slots()] == ["g0", "g1", "g2"]
    assert target.num_reserved == 0


def test_buffer_and_sampler_import_without_torch():
    code = "import sys; sys.modules['torch'] = None; import asyncrl.control.buffer, asyncrl.control.sampler"
    subprocess.run([sys.executable, "-c", code], check=True)
