"""Fuzzing the real SingleController: the buffer, every built-in sampler, one through the protocol
alone, and the slot accounting.

Fake trainer and rollout workers hold each call the way a worker thread does (one at a time, in
submission order per worker) until a seeded scheduler completes it. The scheduler decides which
worker finishes its next call, whether a generation batch fails (its jobs are then retried, some
on slots cancelled and reserved again, while other batches commit), whether a train step fails
(it is aborted and rerun), and how many event-loop turns pass before the next decision. One such
decision is one interleaving; the totals are asserted. Some runs hold prompts that always fail
to generate, which the controller skips. Some filter zero-variance groups and refill the step with
replacement prompts from their own stream, within a per-step budget; each refill must be trained
in the step it refills, with that step's weights.

After every run: each prompt the loader handed out was trained exactly once, evicted and counted,
skipped and counted, or is still ready in the buffer; no trained group breaks its sampler's lag
bound; the buffer never held more than its capacity; and the run ended. A scheduler with no call
left to complete while the controller still runs is a deadlock. Planted mistakes show that each
check can fail.

The hypothesis seed is ``FUZZ_SEED`` (override with ASYNCRL_FUZZ_SEED); a failure names it.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

from asyncrl.config import RunConfig
from asyncrl.control.buffer import ReplayBuffer
from asyncrl.control.controller import SingleController
from asyncrl.control.sampler import Admission, InOrderSampler, WeightFifoSampler, WindowedSampler
from asyncrl.data import Prompt, PromptLoader, Task
from asyncrl.errors import IntegrityStop
from asyncrl.types import EvalResult, RolloutBatch, RolloutGroup, StepData, StepReport, StepResult

FUZZ_SEED = int(os.environ.get("ASYNCRL_FUZZ_SEED", "20250611"))
MAX_YIELDS = 4  # event-loop turns let pass after a decision: 0 .. MAX_YIELDS - 1, chosen at random
IDLE_TURNS = 1_000  # turns with no pending worker call before the run counts as deadlocked
MAX_DECISIONS = 10_000  # a run is a few hundred at most; one that goes on and on never ends
RUN_TIMEOUT_S = 60.0  # wall-clock bound on one run, in case the loops spin without deadlocking


TOKENS = torch.ones(2, 2, dtype=torch.long)  # every fake group shares these read-only tensors
WEIGHTS = {"w": torch.zeros(1)}


class DispatchOrderSampler:
    """A sampler through the protocol alone, no built-in's code: admits up to capacity, trains any
    group within ``max_lag`` in dispatch order, evicts the rest."""

    name = "test_controller_fuzz:DispatchOrderSampler"
    gated = False

    def __init__(self, prompts_per_step: int, max_lag: int) -> None:
        self.max_lag = max_lag

    def admit(self, version: int, buffer: ReplayBuffer) -> Admission | None:
        return Admission(start_version=version, target_step=None) if buffer.num_free else None

    def select(self, version: int, buffer: ReplayBuffer, min_k: int, max_k: int) -> list[int]:
        fresh = [slot.slot_id for slot in buffer.ready_slots() if version - slot.start_version <= self.max_lag]
        return fresh[:max_k] if len(fresh) >= min_k else []

    def evict(self, version: int, buffer: ReplayBuffer) -> list[int]:
        return [slot.slot_id for slot in buffer.ready_slots() if version - slot.start_version > self.max_lag]

    def required_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


SAMPLERS = (InOrderSampler, WeightFifoSampler, WindowedSampler, DispatchOrderSampler)


@dataclass(frozen=True)
class Scenario:
    """One run's shape: the sampler's knobs, the loops' limits, the data and the faults."""

    prompts_per_step: int
    max_lag: int
    extra_capacity: int
    min_groups_per_chunk: int
    groups_per_batch: int
    max_in_flight: int | None
    num_workers: int
    sync_mode: str
    max_steps: int
    num_prompts: int
    epochs: int | None
    fail_rate: float
    max_retries: int
    poisoned: int  # prompts p0 .. p{poisoned - 1} always fail to generate; the run skips them
    step_fail_rate: float
    max_step_retries: int
    checkpoint_every: int | None
    eval_every: int | None
    refill_budget: int | None  # None: no filtering; else step.max_refill_groups with filtering on
    schedule_seed: int


@st.composite
def scenarios(draw) -> Scenario:
    prompts_per_step = draw(st.integers(1, 4))
    extra_capacity = draw(st.integers(0, 3))
    max_lag = draw(st.integers(0, 3))
    num_prompts = draw(st.integers(1, 40))
    return Scenario(
        prompts_per_step=prompts_per_step,
        max_lag=max_lag,
        extra_capacity=extra_capacity,
        min_groups_per_chunk=draw(st.integers(1, prompts_per_step)),
        groups_per_batch=draw(st.integers(1, 3)),
        max_in_flight=draw(st.none() | st.integers(1, prompts_per_step * (max_lag + 1) + extra_capacity)),
        num_workers=draw(st.integers(1, 3)),
        sync_mode=draw(st.sampled_from(["inflight", "drain"])),
        max_steps=draw(st.integers(1, 12)),
        num_prompts=num_prompts,
        epochs=draw(st.sampled_from([None, 1, 2])),
        fail_rate=draw(st.sampled_from([0.0, 0.1, 0.3, 0.5])),
        max_retries=draw(st.integers(1, 3)),
        poisoned=draw(st.sampled_from([0, 0, 1, 3])) * num_prompts // 8,
        step_fail_rate=draw(st.sampled_from([0.0, 0.0, 0.2, 0.5])),
        max_step_retries=draw(st.integers(1, 2)),
        checkpoint_every=draw(st.none() | st.integers(1, 3)),
        eval_every=draw(st.none() | st.integers(1, 3)),
        refill_budget=draw(st.none() | st.integers(0, 4)),
        schedule_seed=draw(st.integers(0, 2**32 - 1)),
    )


@dataclass
class Ledger:
    """Everything the fakes saw, for the checks after the run."""

    handed_out: list[str] = field(default_factory=list)
    trained: list[tuple[RolloutGroup, int]] = field(default_factory=list)  # (group, version trained at)
    aborted: list[RolloutGroup] = field(default_factory=list)  # given to a step that failed and was rerun
    evicted: list[RolloutGroup] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    failed_batches: int = 0
    failed_steps: int = 0
    peak_occupancy: int = 0


class Scheduler:
    """Holds every worker call until the fuzzer completes it; per worker in submission order."""

    def __init__(self, rng) -> None:
        self.rng = rng
        self.queues: dict[str, deque] = {}
        self.decisions = 0

    def submit(self, worker: str, call, *args) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.queues.setdefault(worker, deque()).append((future, call, args))
        return future

    async def drive(self, controller: SingleController) -> int:
        run = asyncio.ensure_future(controller.run())
        try:
            finished = await self.complete_calls(run, lambda: check_slot_accounting(controller))
            assert finished, "deadlock: the controller waits, but no worker call is pending"
        finally:
            if not run.done():
                run.cancel()
                await self.complete_calls(run, lambda: None)  # the loops' cleanup (abort_step) needs its calls
            if not run.cancelled() and run.exception() is not None:
                raise run.exception()  # the controller's own failure is the root cause
        return run.result()

    async def complete_calls(self, run: asyncio.Future, check: Callable[[], None]) -> bool:
        """Complete pending calls, one decision at a time, until ``run`` is done (True) or waits
        on nothing (False). ``check`` runs before each decision, while the loops are parked."""
        idle = 0
        while not run.done():
            busy = [worker for worker, queue in self.queues.items() if queue]
            if not busy:
                idle += 1
                if idle > IDLE_TURNS:
                    return False
                await asyncio.sleep(0)
                continue
            idle = 0
            assert self.decisions < MAX_DECISIONS, f"livelock: {MAX_DECISIONS} calls completed and the run goes on"
            check()
            future, call, args = self.queues[self.rng.choice(busy)].popleft()
            self.decisions += 1
            try:
                result = call(*args)  # a call runs even when its awaiter was cancelled, as on a thread
            except Exception as err:
                if not future.cancelled():
                    future.set_exception(err)
            else:
                if not future.cancelled():
                    future.set_result(result)
            for _ in range(self.rng.randrange(MAX_YIELDS)):
                await asyncio.sleep(0)
        return True


def check_slot_accounting(controller: SingleController) -> None:
    """Between the loops' steps: every in-flight job holds exactly one reserved slot."""
    reserved = controller.buffer.num_reserved
    assert controller.gate.in_flight == reserved == len(controller.rollouts.jobs), (
        f"slot accounting: {controller.gate.in_flight} in flight, {reserved} reserved slots, "
        f"{len(controller.rollouts.jobs)} jobs"
    )


class FakeRolloutWorker:
    """A rollout worker handle. ``generate`` checks its jobs against the loaded weights, like the
    real worker; it fails every batch holding a poisoned prompt, and any other batch when the
    fuzzer says so and each of its jobs may still be retried (so no healthy prompt is given up)."""

    loads_while_generating = False

    def __init__(self, name: str, scheduler: Scheduler, ledger: Ledger, scenario: Scenario) -> None:
        self.name = name
        self.scheduler = scheduler
        self.ledger = ledger
        self.scenario = scenario
        self.version = 0

    def generate(self, jobs) -> asyncio.Future:
        return self.scheduler.submit(self.name, self._generate, list(jobs))

    def load_weights(self, weights, version: int) -> asyncio.Future:
        return self.scheduler.submit(self.name, self._load_weights, version)

    def evaluate(self, prompts) -> asyncio.Future:
        return self.scheduler.submit(self.name, self._evaluate, len(prompts))

    def _generate(self, jobs) -> RolloutBatch:
        stale = [job.slot_id for job in jobs if job.start_version != self.version]
        if stale:
            self.ledger.violations.append(f"{self.name}: slots {stale} generated on weights {self.version}")
            raise RuntimeError("generation batch overtaken by a weight load")
        if any(is_poisoned(job.prompt.uid, self.scenario) for job in jobs):
            self.ledger.failed_batches += 1
            raise RuntimeError("poisoned prompt")
        retries_left = all(job.retries < self.scenario.max_retries for job in jobs)
        if retries_left and self.scheduler.rng.random() < self.scenario.fail_rate:
            self.ledger.failed_batches += 1
            raise RuntimeError("injected generation failure")
        groups = [fake_group(job, self.version) for job in jobs]
        return RolloutBatch(groups=groups, num_tokens=2 * len(groups), seconds=0.0)

    def _load_weights(self, version: int) -> None:
        if version < self.version:
            self.ledger.violations.append(f"{self.name}: weights went back from {self.version} to {version}")
        self.version = version

    def _evaluate(self, num_prompts: int) -> EvalResult:
        return EvalResult(num_prompts=num_prompts, accuracy=0.0, reward_mean=0.0, response_length_mean=1.0, seconds=0.0)


def is_poisoned(uid: str, scenario: Scenario) -> bool:
    return int(uid.split("/")[0].removeprefix(REFILL).removeprefix("p")) < scenario.poisoned


REFILL = "refill:"  # the uid prefix of the refill stream's prompts


def is_refill(group: RolloutGroup) -> bool:
    return group.prompt_uid.startswith(REFILL)


def is_flat(uid: str) -> bool:
    """About a third of the prompts get equal rewards: groups that filtering drops."""
    return zlib.crc32(uid.encode()) % 3 == 0


def fake_group(job, version: int) -> RolloutGroup:
    return RolloutGroup(
        prompt_uid=job.prompt.uid,
        input_ids=TOKENS,
        attention_mask=TOKENS,
        response_mask=TOKENS.float(),
        behaviour_logprobs=TOKENS.float(),
        rewards=torch.zeros(2) if is_flat(job.prompt.uid) else torch.tensor([0.0, 1.0]),
        finish_reasons=["stop", "stop"],
        start_version=job.start_version,
        end_version=version,
        target_step=job.target_step,
        retries=job.retries,
    )


class FakeTrainer:
    """A trainer handle: records which groups each finished step trained, at which version. A
    step fails in ``train_groups`` or ``finish_step`` when the fuzzer says so, while it may still
    be rerun, so the controller aborts it and reruns it on the groups it had taken."""

    def __init__(self, scheduler: Scheduler, ledger: Ledger, scenario: Scenario) -> None:
        self.scheduler = scheduler
        self.ledger = ledger
        self.scenario = scenario
        self.version = 0
        self.step_groups: list[RolloutGroup] | None = None
        self.step_failures = 0  # of the current step, over its reruns

    def begin_step(self, step: int) -> asyncio.Future:
        return self.scheduler.submit("trainer", self._begin_step, step)

    def train_groups(self, groups) -> asyncio.Future:
        return self.scheduler.submit("trainer", self._train_groups, list(groups))

    def finish_step(self) -> asyncio.Future:
        return self.scheduler.submit("trainer", self._finish_step)

    def abort_step(self) -> asyncio.Future:
        return self.scheduler.submit("trainer", self._abort_step)

    async def abandon(self) -> None:
        """Unordered, as on a runtime: nothing here runs long enough to abandon."""

    def export_weights(self) -> asyncio.Future:
        return self.scheduler.submit("trainer", lambda: (self.version, WEIGHTS))

    def save_checkpoint(self, run_dir: str, step: int, run_state: dict, keep_last: int) -> asyncio.Future:
        return self.scheduler.submit("trainer", self._save_checkpoint, run_dir, step, run_state)

    def _begin_step(self, step: int) -> None:
        if step != self.version or self.step_groups is not None:
            self.ledger.violations.append(f"trainer: begin_step({step}) at version {self.version}")
        self.step_groups = []

    def _train_groups(self, groups: list[RolloutGroup]) -> int:
        if self.step_groups is None:
            self.ledger.violations.append("trainer: train_groups outside a step")
            self.step_groups = []
        self.step_groups += groups
        self._maybe_fail()
        return len(self.step_groups)

    def _finish_step(self) -> StepReport:
        self._maybe_fail()
        groups, self.step_groups = self.step_groups or [], None
        self.ledger.trained += [(group, self.version) for group in groups]
        self.version += 1
        self.step_failures = 0
        return step_report(self.version, groups)

    def _abort_step(self) -> None:
        self.ledger.aborted += self.step_groups or []
        self.step_groups = None

    def _maybe_fail(self) -> None:
        may_rerun = self.step_failures < self.scenario.max_step_retries
        if may_rerun and self.scheduler.rng.random() < self.scenario.step_fail_rate:
            self.step_failures += 1
            self.ledger.failed_steps += 1
            raise RuntimeError("injected train step failure")

    def _save_checkpoint(self, run_dir: str, step: int, run_state: dict) -> Path:
        self.ledger.checkpoints.append(run_state)
        return Path(run_dir) / f"step-{step:06d}"


def step_report(version: int, groups: list[RolloutGroup]) -> StepReport:
    """A trainer's report of a step of ``groups``, trained at ``version - 1``."""
    result = StepResult(
        version=version,
        loss=0.0,
        grad_norm=0.0,
        lr=0.0,
        num_sequences=len(groups),
        num_tokens=len(groups),
        num_microbatches=1,
        metrics={"clip_fraction": 0.0, "is_weight_mean": 1.0, "mismatch_kl": 0.0},
    )
    data = StepData()
    for group in groups:
        data.add(group, version - 1)
    return StepReport(result=result, data=data)


class RecordingLoader(PromptLoader):
    def __init__(self, prompts: list[Prompt], epochs: int | None, ledger: Ledger) -> None:
        super().__init__(prompts, shuffle_seed=0, epochs=epochs)
        self.ledger = ledger

    def next(self) -> Prompt | None:
        prompt = super().next()
        if prompt is not None:
            self.ledger.handed_out.append(prompt.uid)
        return prompt


class CheckedBuffer(ReplayBuffer):
    """Asserts capacity and the in-flight limit on every reserve and commit; records evictions."""

    def __init__(self, capacity: int, max_in_flight: int, ledger: Ledger) -> None:
        super().__init__(capacity)
        self.max_in_flight = max_in_flight
        self.ledger = ledger

    def reserve(self, start_version: int, target_step: int | None = None) -> int:
        slot_id = super().reserve(start_version, target_step)
        self._check_occupancy()
        assert self.num_reserved <= self.max_in_flight, (
            f"in flight: {self.num_reserved} reserved slots > limit {self.max_in_flight}"
        )
        return slot_id

    def commit(self, slot_id: int, group: RolloutGroup) -> None:
        super().commit(slot_id, group)
        self._check_occupancy()

    def evict(self, slot_ids) -> int:
        slot_ids = list(slot_ids)
        groups = {slot.slot_id: slot.group for slot in self.ready_slots()}
        evicted = super().evict(slot_ids)
        self.ledger.evicted += [groups[slot_id] for slot_id in slot_ids]
        return evicted

    def _check_occupancy(self) -> None:
        occupancy = self.num_reserved + self.num_ready
        assert occupancy <= self.capacity, f"capacity: {occupancy} slots in use > {self.capacity}"
        self.ledger.peak_occupancy = max(self.ledger.peak_occupancy, occupancy)


class Sink:
    """Metrics writer and progress display in one: keeps the step records, shows nothing."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def log_step(self, record: dict) -> None:
        self.steps.append(record)

    def log_eval(self, record: dict) -> None: ...

    def log_groups(self, groups: list[dict]) -> None: ...

    def log_samples(self, records: list[dict]) -> None: ...

    def status(self, text: str) -> None: ...

    def warn(self, text: str) -> None: ...

    def update(self, record: dict) -> None: ...

    def update_eval(self, record: dict) -> None: ...


def run_config(sampler_name: str, scenario: Scenario) -> RunConfig:
    s = scenario
    return RunConfig(
        step={
            "prompts_per_step": s.prompts_per_step,
            "generations_per_prompt": 2,
            "max_steps": s.max_steps,
            "min_groups_per_chunk": s.min_groups_per_chunk,
            "filter_zero_variance": s.refill_budget is not None,
            "max_refill_groups": s.refill_budget or 0,
        },
        generation={"batch_size": 2 * s.groups_per_batch},
        sampler={"name": sampler_name, "max_lag": s.max_lag},
        runtime={
            "max_inflight_groups": s.max_in_flight,
            "max_rollout_retries": s.max_retries,
            "on_rollout_failure": "skip" if s.poisoned else "stop",
            "max_skipped_share": 1.0,  # poisoned prompts are many here: the schedule is under test, not the bound
        },
        trainer={"max_step_retries": s.max_step_retries},
        sync={"mode": s.sync_mode, "timeout_s": RUN_TIMEOUT_S},
        checkpoint={"every_steps": s.checkpoint_every},
        logging={"eval_every_steps": s.eval_every, "tensorboard": False, "progress": False},
        data={"eval_size": 2},
        integrity={"sampling": {"every_syncs": 0}},  # the fake generators hold no model to probe
    )


def fuzz_once(sampler_cls: type, scenario: Scenario, buffer_cls: type = CheckedBuffer) -> Counter:
    """Run the controller under one schedule and check every invariant; returns what it exercised."""
    config = run_config(sampler_cls.name, scenario)
    sampler = sampler_cls(scenario.prompts_per_step, scenario.max_lag)
    capacity = (
        sampler.required_capacity(scenario.prompts_per_step) + (scenario.refill_budget or 0) + scenario.extra_capacity
    )
    ledger = Ledger()
    scheduler = Scheduler(random.Random(scenario.schedule_seed))
    prompts = [Prompt(uid=f"p{i}", text=f"q{i}", answer="0") for i in range(scenario.num_prompts)]
    workers = [FakeRolloutWorker(f"rollout{i}", scheduler, ledger, scenario) for i in range(scenario.num_workers)]
    controller = SingleController(
        config,
        trainer=FakeTrainer(scheduler, ledger, scenario),
        rollout_workers=workers,
        task=Task(name="fuzz", train=prompts, heldout=prompts[:2]),
        loader=RecordingLoader(prompts, scenario.epochs, ledger),
        sampler=sampler,
        buffer=buffer_cls(capacity, scenario.max_in_flight or capacity, ledger),
        metrics=Sink(),
        progress=Sink(),
        run_dir="fuzz-run",
    )
    controller.refills.loader = RecordingLoader(controller.refills.loader.prompts, scenario.epochs, ledger)

    async def bounded_run() -> int:
        return await asyncio.wait_for(scheduler.drive(controller), RUN_TIMEOUT_S)

    steps = asyncio.run(bounded_run())
    check_run(controller, ledger, steps, scenario)
    return Counter(
        interleavings=scheduler.decisions,
        failed_batches=ledger.failed_batches,
        failed_steps=ledger.failed_steps,
        skipped_prompts=controller.skipped_prompts,
        cancelled_slots=controller.buffer.num_cancelled_total,
        evicted=len(ledger.evicted),
        data_exhausted=controller.rollouts.data_exhausted,
        refills=controller.refills.total,
    )


def check_run(controller: SingleController, ledger: Ledger, steps: int, scenario: Scenario) -> None:
    buffer, sampler = controller.buffer, controller.sampler
    assert not ledger.violations, ledger.violations
    assert steps == controller.version == controller.trainer.version
    assert steps == scenario.max_steps or controller.rollouts.data_exhausted, f"stopped at step {steps} with data left"

    # The run is quiet: nothing reserved, pending or waiting for a retry.
    assert buffer.reserved_slots() == [] and controller.gate.in_flight == 0
    assert controller.rollouts.jobs == {} and controller.rollouts.retry_queue == []

    # Every prompt handed out is trained once, evicted and counted, ready in the buffer, or (when
    # poisoned) skipped and counted. The groups of a failed step are trained when it is rerun.
    handed_out = Counter(ledger.handed_out)
    assert max(handed_out.values(), default=1) == 1, "the loader handed out a prompt twice"
    trained = Counter(group.prompt_uid for group, _ in ledger.trained)
    evicted = Counter(group.prompt_uid for group in ledger.evicted)
    ready = Counter(slot.group.prompt_uid for slot in buffer.ready_slots())
    skipped = Counter(uid for uid in ledger.handed_out if is_poisoned(uid, scenario))
    fates = trained + evicted + ready + skipped
    assert not handed_out - fates, f"lost: {sorted(handed_out - fates)} were handed out but never accounted for"
    assert not fates - handed_out, f"duplicated: {sorted(fates - handed_out)} were accounted for more than once"
    assert controller.skipped_prompts == len(skipped)
    assert controller.num_evicted == buffer.num_evicted == len(ledger.evicted)
    assert buffer.num_taken_total == len(ledger.trained)
    assert not {group.prompt_uid for group in ledger.aborted} - set(trained), "a failed step's groups were dropped"
    assert ledger.peak_occupancy <= buffer.capacity

    # No trained group breaks its sampler's lag bound. Under in_order a group of step t is
    # generated with weights max(0, t - max_lag), unless a retry was restamped onto a fresh slot.
    for group, trained_at in ledger.trained:
        lag = trained_at - group.start_version
        assert 0 <= lag <= sampler.max_lag, f"lag: {group.prompt_uid} trained at lag {lag} > max_lag {sampler.max_lag}"
        if isinstance(sampler, InOrderSampler):
            step = group.target_step
            assert step == trained_at, f"lag: {group.prompt_uid} of step {step} trained at {trained_at}"
            if buffer.num_cancelled_total == 0 and not group.prompt_uid.startswith(REFILL):
                assert group.start_version == max(0, trained_at - sampler.max_lag), f"{group.prompt_uid}: weights"

    # A refill is trained in the step it refills, with that step's weights, whatever the sampler:
    # none is trained later, evicted or left in the buffer.
    refills_trained = Counter(trained_at for group, trained_at in ledger.trained if is_refill(group))
    for group, trained_at in ledger.trained:
        if is_refill(group):
            where = (group.target_step, group.start_version)
            assert where == (trained_at, trained_at), f"refill: {group.prompt_uid} {where} trained at {trained_at}"
    left = [group.prompt_uid for group in ledger.evicted + [slot.group for slot in buffer.ready_slots()]]
    assert not [uid for uid in left if uid.startswith(REFILL)], f"refill: {left} evicted or never trained"

    # Each finished step trained a full step of groups, but for the last one when the data ran out;
    # with filtering, a step's refills keep it at prompts_per_step informative groups while its
    # budget lasts (admission leaves the budget's slots free, whatever the sampler).
    per_step = Counter(trained_at for _, trained_at in ledger.trained)
    informative = Counter(trained_at for group, trained_at in ledger.trained if not is_flat(group.prompt_uid))
    refills = {record["step"] - 1: record["refill_groups"] for record in controller.metrics.steps}
    budget = scenario.refill_budget or 0
    assert sorted(per_step) == list(range(steps))
    for step, count in per_step.items():
        assert 1 <= count <= scenario.prompts_per_step + refills[step] and refills[step] <= budget
        assert refills_trained[step] == refills[step], f"refill: step {step} trained {refills_trained[step]} refills"
        assert count >= scenario.prompts_per_step or controller.rollouts.data_exhausted, (
            f"step {step} trained {count} groups"
        )
        if scenario.refill_budget is not None and not controller.rollouts.data_exhausted:
            full = informative[step] >= scenario.prompts_per_step or refills[step] == budget
            assert full, f"refill: step {step} has {informative[step]} informative groups, {refills[step]} refills"
    assert controller.refills.total == sum(refills.values())

    assert [record["step"] for record in controller.metrics.steps] == list(range(1, steps + 1))

    # Checkpoints are taken at a quiet point: no rollout in flight, the buffer within capacity.
    for state in ledger.checkpoints:
        assert state["pending"] == [] and len(state["buffer"]["ready"]) <= buffer.capacity


def fuzz(sampler_cls: type, max_examples: int, buffer_cls: type = CheckedBuffer, shrink: bool = True) -> Counter:
    """``max_examples`` seeded runs of ``sampler_cls``; returns what they exercised, summed."""
    seen: Counter = Counter()

    @seed(FUZZ_SEED)
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
        phases=[Phase.generate, Phase.shrink] if shrink else [Phase.generate],
    )
    @given(scenario=scenarios())
    def one_run(scenario: Scenario) -> None:
        note(f"fuzz seed {FUZZ_SEED}")
        seen.update(fuzz_once(sampler_cls, scenario, buffer_cls))
        seen["runs"] += 1

    one_run()
    return seen


# (interleavings over all samplers, runs per sampler); a run averages about 55 interleavings.
SIZES = [
    pytest.param(10_000, 100, id="10k", marks=pytest.mark.slow),
    pytest.param(100_000, 1_000, id="100k", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("target, runs", SIZES)
@pytest.mark.parametrize("sampler_cls", SAMPLERS, ids=lambda cls: cls.name)
def test_random_interleavings_lose_no_group_and_keep_the_lag_bound(sampler_cls, target, runs):
    seen = fuzz(sampler_cls, runs)
    print(f"{sampler_cls.name}: {seen['interleavings']} interleavings in {seen['runs']} runs, seed {FUZZ_SEED}")
    assert seen["runs"] == runs
    assert seen["interleavings"] >= math.ceil(target / len(SAMPLERS)), f"seed {FUZZ_SEED}: too few interleavings"
    # The schedules reached what they are meant to stress: failed batches, retries on fresh slots.
    assert seen["failed_batches"] > 0 and seen["cancelled_slots"] > 0 and seen["data_exhausted"] > 0
    assert seen["failed_steps"] > 0 and seen["skipped_prompts"] > 0 and seen["refills"] > 0
    if sampler_cls is WindowedSampler:
        assert seen["evicted"] > 0


# Planted mistakes: each must make a check fail, so the checks above cannot pass vacuously.


class OneVersionTooStaleWindowed(WindowedSampler):
    """Believes the trainer is one version behind: trains groups one version past ``max_lag``."""

    def select(self, version, buffer, min_k, max_k):
        return super().select(version - 1, buffer, min_k, max_k)

    def evict(self, version, buffer):
        return super().evict(version - 1, buffer)


class DropsFirstCommit(CheckedBuffer):
    """Gives back the slot of the first committed group instead of keeping the group."""

    dropped = False

    def commit(self, slot_id, group):
        if self.dropped:
            super().commit(slot_id, group)
        else:
            self.dropped = True
            self.cancel(slot_id)


class KeepsTakenGroups(CheckedBuffer):
    """Hands groups to the trainer but keeps them ready as well."""

    def take(self, slot_ids):
        groups = {slot.slot_id: slot.group for slot in self.ready_slots()}
        return [groups[slot_id] for slot_id in slot_ids]


class ForgetsReservedSlots(CheckedBuffer):
    """Counts only ready groups as taken, so in-flight rollouts can overfill it."""

    @property
    def num_free(self) -> int:
        return self.capacity - self.num_ready


class NeverSelectsInOrder(InOrderSampler):
    """Never hands the train loop a group: a run with data left can only hang."""

    def select(self, version, buffer, min_k, max_k):
        return []


@pytest.mark.parametrize(
    "sampler_cls, buffer_cls, error, failure",
    [
        # a stale selection is caught by the run itself first: the integrity guard's staleness promise
        (OneVersionTooStaleWindowed, CheckedBuffer, IntegrityStop, "staleness broken"),
        (WindowedSampler, DropsFirstCommit, AssertionError, "lost"),
        (WindowedSampler, KeepsTakenGroups, AssertionError, "duplicated"),
        (WindowedSampler, ForgetsReservedSlots, AssertionError, "capacity"),
        (NeverSelectsInOrder, CheckedBuffer, AssertionError, "deadlock"),
    ],
    ids=["stale-selection", "dropped-commit", "kept-taken-group", "overfilled-buffer", "deadlock"],
)
def test_planted_mistakes_fail_the_checks(sampler_cls, buffer_cls, error, failure):
    with pytest.raises(error, match=failure):
        fuzz(sampler_cls, 100, buffer_cls, shrink=False)
