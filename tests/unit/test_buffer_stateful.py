"""Random interleavings of the rollout and train loops against the buffer and every built-in sampler.

A model of every committed group's fate checks the buffer's books after each step, and every
selection is checked against the staleness bound its sampler promises. A planted sampler that
trains one version too stale must be caught, so these checks cannot pass vacuously.
"""

import math
from collections import Counter

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from asyncrl.control.buffer import BufferFullError, ReplayBuffer, SlotError
from asyncrl.control.sampler import Admission, InOrderSampler, WeightFifoSampler, WindowedSampler

# (prompts_per_step, max_lag, capacity beyond the sampler's requirement)
SHAPES = [(1, 0, 0), (2, 1, 0), (3, 2, 2)]
CASES = [(cls, *shape) for cls in (InOrderSampler, WeightFifoSampler, WindowedSampler) for shape in SHAPES]
MIN_TOTAL_STEPS = 10_000
MIN_STEPS_PER_CASE = math.ceil(MIN_TOTAL_STEPS / len(CASES))
# Nominally 2,500 steps per case; hypothesis ends some runs early, so the count is asserted below.
SETTINGS = settings(
    max_examples=25,
    stateful_step_count=100,
    deadline=None,
    derandomize=True,
    database=None,
)
steps_run: Counter = Counter()  # case -> rules executed, summed over examples


class LoopsMachine(RuleBasedStateMachine):
    def __init__(self, sampler_cls, prompts_per_step: int, max_lag: int, extra_capacity: int) -> None:
        super().__init__()
        self.case = (sampler_cls, prompts_per_step, max_lag, extra_capacity)
        self.p, self.max_lag = prompts_per_step, max_lag
        self.sampler = sampler_cls(prompts_per_step=prompts_per_step, max_lag=max_lag)
        self.in_order = isinstance(self.sampler, InOrderSampler)
        self.buffer = ReplayBuffer(self.sampler.required_capacity(prompts_per_step) + extra_capacity)
        self.version = 0
        self.num_admitted = 0
        # The model: where every dispatched prompt and committed group is now.
        self.in_flight: dict[int, Admission] = {}
        self.ready: dict[int, str] = {}
        self.committed: set[str] = set()
        self.taken: set[str] = set()
        self.evicted: set[str] = set()
        self.num_cancelled = 0
        self.checks = 0

    # What each sampler promises, written independently of its implementation.

    def trainable(self) -> list[int]:
        slots = self.buffer.ready_slots()
        if self.in_order:
            return [s.slot_id for s in slots if s.target_step == self.version]
        eligible = [s for s in slots if self.version - s.start_version <= self.max_lag]
        return [s.slot_id for s in sorted(eligible, key=lambda s: (s.start_version, s.slot_id))]

    def too_stale(self) -> list[int]:
        slots = self.buffer.ready_slots()
        if self.in_order:
            return [s.slot_id for s in slots if s.target_step < self.version]
        return [s.slot_id for s in slots if self.version - s.start_version > self.max_lag]

    def check_selection(self, ids: list[int], min_k: int, max_k: int) -> None:
        slots = {s.slot_id: s for s in self.buffer.ready_slots()}
        assert len(set(ids)) == len(ids) <= max_k
        for slot_id in ids:
            slot = slots[slot_id]
            lag = self.version - slot.start_version
            assert 0 <= lag <= self.max_lag, f"selected slot {slot_id} has lag {lag} > max_lag {self.max_lag}"
            if self.in_order:
                assert slot.target_step == self.version, f"selected target {slot.target_step} at step {self.version}"
        expected = self.trainable()
        assert ids == (expected[:max_k] if len(expected) >= min_k else [])

    def books(self) -> tuple:
        b = self.buffer
        return b.ready_slots(), b.reserved_slots(), b.num_reserved_total, b.num_cancelled_total, b.num_evicted

    # Rollout loop.

    @rule()
    def admit(self):
        step = self.num_admitted // self.p
        gate_closed = self.sampler.gated and step > self.version + self.max_lag
        admission = self.sampler.admit(self.version, self.buffer)
        if self.buffer.num_free == 0 or gate_closed:
            assert admission is None
            return
        assert admission == Admission(self.version, step if self.in_order else None)
        self.num_admitted += 1
        self.in_flight[self.buffer.reserve(admission.start_version, admission.target_step)] = admission

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def commit(self, data):
        slot_id = data.draw(st.sampled_from(sorted(self.in_flight)))
        group = f"group-{slot_id}"
        self.buffer.commit(slot_id, group)
        del self.in_flight[slot_id]
        self.ready[slot_id] = group
        self.committed.add(group)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), retry=st.booleans())
    def cancel(self, data, retry):
        slot_id = data.draw(st.sampled_from(sorted(self.in_flight)))
        self.buffer.cancel(slot_id)
        self.num_cancelled += 1
        admission = self.in_flight.pop(slot_id)
        if retry:  # the same prompt again, with its original stamp and no new admission
            self.in_flight[self.buffer.reserve(admission.start_version, admission.target_step)] = admission

    # Train loop.

    @rule()
    def evict(self):
        ids = self.sampler.evict(self.version, self.buffer)
        assert ids == self.too_stale()
        assert self.buffer.evict(ids) == len(ids)
        for slot_id in ids:
            self.evicted.add(self.ready.pop(slot_id))

    def take(self, ids: list[int]) -> None:
        groups = self.buffer.take(ids)
        assert groups == [self.ready[slot_id] for slot_id in ids]
        for slot_id, group in zip(ids, groups):
            assert group not in self.taken, f"{group} trained twice"
            self.taken.add(group)
            del self.ready[slot_id]

    @rule(min_k=st.integers(1, 4), extra=st.integers(0, 3))
    def select_and_take(self, min_k, extra):
        ids = self.sampler.select(self.version, self.buffer, min_k, min_k + extra)
        self.check_selection(ids, min_k, min_k + extra)
        self.take(ids)

    @rule()
    def train_step(self):
        self.evict()
        ids = self.sampler.select(self.version, self.buffer, self.p, self.p)
        self.check_selection(ids, self.p, self.p)
        if ids:
            self.take(ids)
            self.version += 1

    @rule()
    def bump_version(self):
        self.version += 1

    # Misuse: each bad request raises and changes nothing.

    @rule(data=st.data())
    def misuse(self, data):
        ready, in_flight = sorted(self.ready), sorted(self.in_flight)
        b = self.buffer
        calls = {"commit unknown": lambda: b.commit(10**6, "ghost")}
        if ready:
            calls["commit ready"] = lambda: b.commit(ready[0], "again")
            calls["cancel ready"] = lambda: b.cancel(ready[0])
            calls["take twice"] = lambda: b.take([ready[0], ready[0]])
        if in_flight:
            calls["take reserved"] = lambda: b.take([*ready, in_flight[0]])
            calls["evict reserved"] = lambda: b.evict([*ready, in_flight[0]])
        if b.num_free == 0:
            calls["reserve full"] = lambda: b.reserve(self.version)
        call = calls[data.draw(st.sampled_from(sorted(calls)))]
        before = self.books()
        with pytest.raises((SlotError, BufferFullError)):
            call()
        assert self.books() == before

    @invariant()
    def books_balance(self):
        self.checks += 1
        b = self.buffer
        assert b.num_reserved + b.num_ready <= b.capacity
        assert b.num_free == b.capacity - b.num_reserved - b.num_ready
        assert [s.slot_id for s in b.reserved_slots()] == sorted(self.in_flight)
        assert {s.slot_id: s.group for s in b.ready_slots()} == self.ready
        # Every committed group is ready, trained once, or evicted and counted: never lost.
        ready = set(self.ready.values())
        assert not (ready & self.taken or ready & self.evicted or self.taken & self.evicted)
        assert ready | self.taken | self.evicted == self.committed
        assert (b.num_committed_total, b.num_taken_total, b.num_evicted) == (
            len(self.committed),
            len(self.taken),
            len(self.evicted),
        )
        assert b.num_cancelled_total == self.num_cancelled

    @invariant()
    def selection_respects_staleness_bound(self):
        ids = self.sampler.select(self.version, self.buffer, 1, self.buffer.capacity)
        self.check_selection(ids, 1, self.buffer.capacity)

    def teardown(self):
        steps_run[self.case] += self.checks - 1  # the first check runs before any rule


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-P{c[1]}-lag{c[2]}-extra{c[3]}")
def test_random_interleavings_keep_every_invariant(case):
    run_state_machine_as_test(lambda: LoopsMachine(*case), settings=SETTINGS)
    assert steps_run[case] >= MIN_STEPS_PER_CASE  # all cases together: >= MIN_TOTAL_STEPS


class OneVersionTooStaleWindowed(WindowedSampler):
    def select(self, version, buffer, min_k, max_k):
        return super().select(version - 1, buffer, min_k, max_k)


class PreviousStepInOrder(InOrderSampler):
    def select(self, version, buffer, min_k, max_k):
        return super().select(version - 1, buffer, min_k, max_k)


@pytest.mark.parametrize("broken", [OneVersionTooStaleWindowed, PreviousStepInOrder])
def test_planted_stale_selection_is_caught(broken):
    with pytest.raises(AssertionError, match="selected"):
        run_state_machine_as_test(
            lambda: LoopsMachine(broken, 2, 1, 0), settings=settings(SETTINGS, max_examples=20, phases=[Phase.generate])
        )
