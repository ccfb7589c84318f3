"""Staleness samplers: admission gates, what each trains and evicts, resume, and name resolution."""

import pytest

from asyncrl.control.buffer import ReplayBuffer
from asyncrl.control.sampler import (
    Admission,
    InOrderSampler,
    Sampler,
    WeightFifoSampler,
    WindowedSampler,
    build_sampler,
    resolve_sampler,
)

SAMPLERS = [InOrderSampler, WeightFifoSampler, WindowedSampler]


def dispatch(sampler, buffer: ReplayBuffer, version: int, n: int, commit: bool = True) -> list[int]:
    """Admit and reserve ``n`` prompts at ``version``; commit a group named after each slot."""
    ids = []
    for _ in range(n):
        admission = sampler.admit(version, buffer)
        assert admission is not None
        slot_id = buffer.reserve(admission.start_version, admission.target_step)
        if commit:
            buffer.commit(slot_id, f"g{slot_id}")
        ids.append(slot_id)
    return ids


def ready_group(buffer: ReplayBuffer, start_version: int, target_step: int | None = None) -> int:
    slot_id = buffer.reserve(start_version, target_step)
    buffer.commit(slot_id, f"g{slot_id}")
    return slot_id


@pytest.mark.parametrize("cls", SAMPLERS)
def test_constructor_validates_its_knobs(cls):
    with pytest.raises(ValueError, match="prompts_per_step"):
        cls(prompts_per_step=0, max_lag=1)
    with pytest.raises(ValueError, match="max_lag"):
        cls(prompts_per_step=1, max_lag=-1)


@pytest.mark.parametrize(
    "cls, gated, capacity", [(InOrderSampler, True, 12), (WeightFifoSampler, True, 12), (WindowedSampler, False, 4)]
)
def test_gate_and_required_capacity(cls, gated, capacity):
    sampler = cls(prompts_per_step=4, max_lag=2)
    assert isinstance(sampler, Sampler)
    assert sampler.gated is gated
    assert sampler.required_capacity(4) == capacity


def test_in_order_stamps_target_step_by_dispatch_index_and_gates_at_max_lag():
    sampler, buffer = InOrderSampler(prompts_per_step=2, max_lag=1), ReplayBuffer(8)
    admissions = [sampler.admit(0, buffer) for _ in range(4)]
    assert admissions == [Admission(0, 0), Admission(0, 0), Admission(0, 1), Admission(0, 1)]
    assert sampler.admit(0, buffer) is None  # target step 2 > version 0 + max_lag 1
    assert sampler.admit(1, buffer) == Admission(start_version=1, target_step=2)


@pytest.mark.parametrize("cls", [InOrderSampler, WeightFifoSampler])
def test_gated_samplers_admit_at_most_max_lag_versions_ahead(cls):
    sampler, buffer = cls(prompts_per_step=2, max_lag=1), ReplayBuffer(100)
    dispatch(sampler, buffer, version=0, n=4)
    assert sampler.admit(0, buffer) is None
    dispatch(sampler, buffer, version=1, n=2)
    assert sampler.admit(1, buffer) is None


def test_windowed_admits_until_the_buffer_is_full_and_stamps_no_target():
    sampler, buffer = WindowedSampler(prompts_per_step=1, max_lag=0), ReplayBuffer(5)
    dispatch(sampler, buffer, version=0, n=5)
    assert {s.target_step for s in buffer.ready_slots()} == {None}
    assert sampler.admit(0, buffer) is None


@pytest.mark.parametrize("cls", SAMPLERS)
def test_no_admission_on_a_full_buffer_and_a_refusal_consumes_nothing(cls):
    sampler, buffer = cls(prompts_per_step=2, max_lag=1), ReplayBuffer(1)
    (slot_id,) = dispatch(sampler, buffer, version=0, n=1, commit=False)
    assert sampler.admit(0, buffer) is None
    buffer.cancel(slot_id)
    assert sampler.admit(0, buffer) == Admission(0, 0 if cls is InOrderSampler else None)


def test_in_order_trains_exactly_the_groups_targeted_at_this_step():
    sampler, buffer = InOrderSampler(prompts_per_step=2, max_lag=1), ReplayBuffer(4)
    step0, step1 = dispatch(sampler, buffer, 0, 2), dispatch(sampler, buffer, 0, 2)
    assert sampler.select(0, buffer, min_k=2, max_k=2) == step0
    assert sampler.select(1, buffer, min_k=2, max_k=2) == step1
    assert sampler.select(2, buffer, min_k=1, max_k=2) == []


def test_select_waits_for_min_k_caps_at_max_k_and_removes_nothing():
    sampler, buffer = InOrderSampler(prompts_per_step=3, max_lag=0), ReplayBuffer(3)
    ids = dispatch(sampler, buffer, 0, 3, commit=False)
    buffer.commit(ids[2], "g2")
    buffer.commit(ids[0], "g0")
    assert sampler.select(0, buffer, min_k=3, max_k=3) == []
    assert sampler.select(0, buffer, min_k=2, max_k=3) == [ids[0], ids[2]]  # dispatch order
    assert sampler.select(0, buffer, min_k=1, max_k=1) == [ids[0]]
    assert buffer.num_ready == 2


@pytest.mark.parametrize("min_k, max_k", [(0, 1), (2, 1)])
def test_select_rejects_bad_bounds(min_k, max_k):
    with pytest.raises(ValueError, match="min_k"):
        WindowedSampler(1, 0).select(0, ReplayBuffer(1), min_k, max_k)


def test_in_order_evicts_only_groups_whose_target_step_has_passed():
    sampler, buffer = InOrderSampler(prompts_per_step=1, max_lag=2), ReplayBuffer(3)
    ids = dispatch(sampler, buffer, 0, 3)
    assert sampler.evict(0, buffer) == []
    assert sampler.evict(2, buffer) == ids[:2]
    assert buffer.num_ready == 3  # evict only names slots


@pytest.mark.parametrize("cls", [WeightFifoSampler, WindowedSampler])
def test_lag_samplers_train_oldest_weights_first_within_max_lag(cls):
    sampler, buffer = cls(prompts_per_step=2, max_lag=1), ReplayBuffer(10)
    newer, older_a, too_old, older_b = (ready_group(buffer, version) for version in (4, 3, 2, 3))
    assert sampler.select(4, buffer, min_k=1, max_k=10) == [older_a, older_b, newer]
    assert sampler.select(4, buffer, min_k=1, max_k=2) == [older_a, older_b]
    assert sampler.select(4, buffer, min_k=4, max_k=10) == []
    assert sampler.evict(4, buffer) == [too_old]


@pytest.mark.parametrize("cls", [WeightFifoSampler, WindowedSampler])
def test_max_lag_zero_trains_only_current_weights(cls):
    sampler, buffer = cls(prompts_per_step=1, max_lag=0), ReplayBuffer(4)
    stale, fresh = ready_group(buffer, 0), ready_group(buffer, 1)
    assert sampler.select(1, buffer, min_k=1, max_k=4) == [fresh]
    assert sampler.evict(1, buffer) == [stale]


def test_in_order_with_max_lag_zero_is_synchronous_grpo():
    p = 3
    sampler, buffer = InOrderSampler(prompts_per_step=p, max_lag=0), ReplayBuffer(p)
    for version in range(4):
        ids = dispatch(sampler, buffer, version, p)
        assert sampler.admit(version, buffer) is None
        assert sampler.evict(version, buffer) == []
        assert sampler.select(version, buffer, min_k=p, max_k=p) == ids
        assert all(s.start_version == version for s in buffer.ready_slots())
        buffer.take(ids)


@pytest.mark.parametrize("max_lag", [1, 2])
def test_in_order_generates_step_t_with_weights_t_minus_max_lag(max_lag):
    p = 2
    sampler, buffer = InOrderSampler(prompts_per_step=p, max_lag=max_lag), ReplayBuffer(p * (max_lag + 1))
    for version in range(6):
        while (admission := sampler.admit(version, buffer)) is not None:  # gate must close before a sync
            buffer.commit(buffer.reserve(admission.start_version, admission.target_step), "g")
        trained = sampler.select(version, buffer, min_k=p, max_k=p)
        assert {s.start_version for s in buffer.ready_slots() if s.slot_id in trained} == {max(0, version - max_lag)}
        buffer.take(trained)


def test_a_cancelled_rollout_retried_with_its_old_stamp_is_trained_at_its_step():
    sampler, buffer = InOrderSampler(prompts_per_step=2, max_lag=0), ReplayBuffer(2)
    kept, failed = dispatch(sampler, buffer, 0, 2, commit=False)
    (old,) = [s for s in buffer.reserved_slots() if s.slot_id == failed]
    buffer.cancel(failed)
    retried = buffer.reserve(old.start_version, old.target_step)
    buffer.commit(retried, "retried")
    buffer.commit(kept, "kept")
    assert sampler.select(0, buffer, min_k=2, max_k=2) == [kept, retried]
    assert sampler.admit(0, buffer) is None


@pytest.mark.parametrize("cls", SAMPLERS)
def test_state_dict_resumes_the_admission_sequence(cls):
    sampler, buffer = cls(prompts_per_step=2, max_lag=1), ReplayBuffer(100)
    dispatch(sampler, buffer, 0, 3)
    resumed = cls(prompts_per_step=2, max_lag=1)
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.state_dict() == sampler.state_dict()
    expected = [sampler.admit(0, buffer), sampler.admit(0, buffer)]  # in_order: step 1, then the gate
    assert [resumed.admit(0, buffer), resumed.admit(0, buffer)] == expected


def test_resume_with_another_step_size_is_refused():
    state = InOrderSampler(prompts_per_step=2, max_lag=1).state_dict()
    with pytest.raises(ValueError, match="prompts_per_step"):
        InOrderSampler(prompts_per_step=4, max_lag=1).load_state_dict(state)


@pytest.mark.parametrize("cls", SAMPLERS)
def test_builtin_names_resolve(cls):
    assert resolve_sampler(cls.name) is cls
    sampler = build_sampler(cls.name, prompts_per_step=3, max_lag=2)
    assert type(sampler) is cls and (sampler.prompts_per_step, sampler.max_lag) == (3, 2)


CUSTOM_MODULE = """
from asyncrl.control.sampler import WindowedSampler

class Newest(WindowedSampler):
    pass

class Partial:
    gated = False
    def admit(self, version, buffer): ...
    def select(self, version, buffer, min_k, max_k): ...

not_a_class = 3
"""


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_samplers.py").write_text(CUSTOM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_samplers"


def test_custom_sampler_resolves_from_module_and_class(custom_module):
    cls = resolve_sampler(f"{custom_module}:Newest")
    assert cls.__name__ == "Newest"
    assert isinstance(build_sampler(f"{custom_module}:Newest", 2, 1), Sampler)


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "fifo",
            "sampler.name: unknown sampler 'fifo'; built-ins are in_order, weight_fifo, windowed, or give package.module:attr",
        ),
        ("no_such_module:X", "sampler.name: cannot load 'no_such_module:X' (ModuleNotFoundError"),
        (":X", "sampler.name: cannot load ':X'"),
        ("my_samplers:Missing", "sampler.name: cannot load 'my_samplers:Missing' (AttributeError"),
        ("my_samplers:not_a_class", "sampler.name: 'my_samplers:not_a_class' is not a class"),
        (
            "my_samplers:Partial",
            "sampler.name: 'my_samplers:Partial' does not implement the Sampler protocol; "
            "missing evict, required_capacity, state_dict, load_state_dict",
        ),
    ],
)
def test_bad_sampler_names_give_one_line_errors(custom_module, name, message):
    with pytest.raises(ValueError) as info:
        resolve_sampler(name)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)
