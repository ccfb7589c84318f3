"""RolloutLoop: admit prompts under the rollout gate, generate them on the rollout workers, commit
their groups to the buffer, and retry what failed.

It owns the work in flight: the job of every reserved slot until its group is committed, the
queue of failed batches waiting to be re-dispatched, the cursor over the workers and whether the
train split ran out. The controller hands it refills (``dispatch``), reads ``data_exhausted`` and
tells it to ``stop``; the train loop never touches a job.

Admission is gated by buffer capacity (less the slots kept for refills), the in-flight limit and
the gate that weight syncs close. Jobs are cut into batches of one target step and version, at most
``generation.batch_size // generations_per_prompt`` groups each, and handed to the workers round
robin, so under ``in_order`` a batch's composition never depends on timing. A failed batch is
retried whole (same slots and seeds) while its budget lasts, then prompt by prompt, so the prompt
that keeps failing is found and the others go on; ``runtime.on_rollout_failure`` then stops the run
or skips that prompt, within ``runtime.max_skipped_share`` of the latest prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from asyncrl.config import ConfigError, RunConfig
from asyncrl.control.buffer import ReplayBuffer
from asyncrl.control.changes import Changes
from asyncrl.control.gate import RolloutGate
from asyncrl.control.handles import RolloutHandle
from asyncrl.control.refill import DynamicSampling
from asyncrl.control.run_state import RunState
from asyncrl.control.sampler import Sampler
from asyncrl.control.watchdog import Watchdog
from asyncrl.data import Prompt, PromptLoader
from asyncrl.errors import RolloutFailedError, RunStopped
from asyncrl.metrics import StepClock
from asyncrl.types import RolloutGroup, RolloutJob

if TYPE_CHECKING:
    from asyncrl.types import RolloutBatch


class RolloutLoop:
    def __init__(
        self,
        config: RunConfig,
        *,
        workers: Sequence[RolloutHandle],
        loader: PromptLoader,
        sampler: Sampler,
        buffer: ReplayBuffer,
        gate: RolloutGate,
        refills: DynamicSampling,
        state: RunState,
        watchdog: Watchdog,
        clock: StepClock,
        check_group: Callable[[RolloutGroup], None],
    ) -> None:
        """``state``: the run's books (a finished or skipped prompt is counted there); ``clock``:
        where generation time and tokens are added up for the step record; ``check_group``: the
        integrity check of a generated group's weight versions, before it is committed."""
        self.runtime = config.runtime
        self.workers = list(workers)
        self.loader = loader
        self.sampler = sampler
        self.buffer = buffer
        self.gate = gate
        self.changes: Changes = gate.changes
        self.refills = refills
        self.state = state
        self.watchdog = watchdog
        self.clock = clock
        self.check_group = check_group
        self.groups_per_batch = max(1, config.generation.batch_size // config.step.generations_per_prompt)
        self.max_in_flight = gate.max_in_flight
        self.max_retries = config.runtime.max_rollout_retries
        self.stopping = False
        self.data_exhausted = False
        self.retry_queue: list[list[RolloutJob]] = []  # failed batches, each re-dispatched as one
        self.jobs: dict[int, RolloutJob] = {}  # reserved slot -> its job, until committed
        self.next_worker = 0
        self.tasks: asyncio.TaskGroup | None = None  # the run's: a batch's collection runs in it

    async def run(self) -> None:
        """Admit and dispatch until ``stop`` and nothing is generating any more."""
        while True:
            self.watchdog.waiting["rollout loop"] = "admission (gate closed, buffer full or in-flight limit reached)"
            await self.changes.wait_for(
                lambda: self.stopping or self.gate.admitting or (self.retry_queue and not self.gate.loading)
            )
            if self.stopping and self.gate.in_flight == 0:
                return
            if not self.gate.loading:
                self._dispatch_retries()
            if self.gate.admitting and not self.stopping:
                jobs, settled = self._admit()
                self.dispatch(jobs)
                if settled:
                    self.gate.settled()
            self.watchdog.waiting["rollout loop"] = f"a change ({self.gate.in_flight} groups generating)"
            await self.changes.next()

    def stop(self) -> None:
        """Admit nothing more; the loop ends once what is generating is in."""
        self.stopping = True
        self.changes.notify()

    def _admit(self) -> tuple[list[RolloutJob], bool]:
        """Admit and reserve until refused; True when the sampler or the data refused (settled).

        The refill budget's slots stay free for refills (``DynamicSampling.reserved_slots``)."""
        jobs: list[RolloutJob] = []
        while self.gate.in_flight + len(jobs) < self.max_in_flight:
            if self.data_exhausted or self.buffer.num_free <= self.refills.reserved_slots(self.state.step_groups):
                return jobs, True
            admission = self.sampler.admit(self.gate.version, self.buffer)
            if admission is None:
                return jobs, True
            prompt = self.loader.next()
            if prompt is None:
                self.data_exhausted = True
                self.changes.notify()
                return jobs, True
            slot_id = self.buffer.reserve(admission.start_version, admission.target_step)
            jobs.append(RolloutJob(slot_id, prompt, admission.start_version, admission.target_step))
        return jobs, False

    def dispatch(self, jobs: list[RolloutJob]) -> None:
        """Generation batches: consecutive jobs of one target step and version, at most
        ``groups_per_batch`` each, so batch composition never depends on timing."""
        batch: list[RolloutJob] = []
        for job in jobs:
            if batch and (
                len(batch) == self.groups_per_batch
                or (job.target_step, job.start_version) != (batch[0].target_step, batch[0].start_version)
            ):
                self._submit(batch)
                batch = []
            batch.append(job)
        if batch:
            self._submit(batch)

    def _submit(self, batch: list[RolloutJob], *, retried: bool = False) -> None:
        worker = self.workers[self.next_worker % len(self.workers)]
        self.next_worker += 1
        for job in batch:
            self.jobs[job.slot_id] = job
        if not retried:
            self.gate.add_in_flight(len(batch))
        # Submitted now, not when the task first runs: a later weight load queues behind it.
        future = worker.generate(batch)
        self.gate.add_running(1)
        self.tasks.create_task(self._collect(batch, future))

    async def _collect(self, batch: list[RolloutJob], future: Awaitable[RolloutBatch]) -> None:
        try:
            result: RolloutBatch = await future
        except RunStopped:  # the worker's own verdict (a reward process that cannot start): no retry helps
            raise
        except Exception as err:
            self.gate.add_running(-1)
            self._schedule_retry(batch, err)
            return
        self.gate.add_running(-1)
        committed = [job for job in batch if job.slot_id not in result.failed]
        for group in result.groups:
            self.check_group(group)
        for job, group in zip(committed, result.groups):
            self.buffer.commit(job.slot_id, group)
            del self.jobs[job.slot_id]
            self.state.finish_prompt(skipped=False, window=self.runtime.skipped_share_window)
        self.watchdog.progressed()
        self.clock.generation_s += result.seconds
        self.clock.generated_tokens += result.num_tokens
        self.gate.add_in_flight(-len(committed))
        for job in batch:  # the worker spent their retries already (an environment kept failing)
            if job.slot_id in result.failed:
                self._give_up(replace(job, retries=self.max_retries), result.failed[job.slot_id])
                self.changes.notify()

    def _schedule_retry(self, batch: list[RolloutJob], err: Exception) -> None:
        """Retry the batch whole while the budget lasts (same slots and seeds), then each prompt on
        its own, so the prompt that keeps failing is found and the others go on."""
        self.watchdog.progressed()
        if len(batch) > 1 and any(job.retries >= self.max_retries for job in batch):
            self._queue_retries([[job] for job in batch])
        elif len(batch) > 1 or batch[0].retries < self.max_retries:
            self._queue_retries([[replace(job, retries=job.retries + 1) for job in batch]])
        else:
            self._give_up(batch[0], err)
        self.changes.notify()

    def _queue_retries(self, batches: list[list[RolloutJob]]) -> None:
        """Queue batches for re-dispatch; ``self.jobs`` holds them at once, so a checkpoint saves them."""
        for batch in batches:
            self.jobs.update((job.slot_id, job) for job in batch)
        self.retry_queue.extend(batches)

    def _give_up(self, job: RolloutJob, err: Exception) -> None:
        """``on_rollout_failure``: stop, or skip the prompt and generate the next one in its slot,
        until the skipped pass ``max_skipped_share`` of the latest prompts: then it is no bad input
        but a broken environment, reward or generator, and the run stops."""
        runtime = self.runtime
        attempts = f"generation failed {job.retries + 1} times (runtime.max_rollout_retries={self.max_retries})"
        failure = f"prompt {job.prompt.uid}: {attempts}; last error: {type(err).__name__}: {err}"
        if runtime.on_rollout_failure == "stop":
            raise RolloutFailedError(failure) from err
        skipped = self.state.finish_prompt(skipped=True, window=runtime.skipped_share_window)
        if skipped > runtime.max_skipped_share * runtime.skipped_share_window:
            raise RolloutFailedError(
                f"{skipped} of the last {len(self.state.recent_prompts)} prompts were skipped, over "
                f"runtime.max_skipped_share={runtime.max_skipped_share:g} of runtime.skipped_share_window="
                f"{runtime.skipped_share_window}; the last: {failure}"
            ) from err
        refill = self.refills.is_refill(job.prompt)
        if refill:  # a refill is replaced from its own stream
            prompt = self.refills.next_prompt()
        else:
            prompt = None if self.data_exhausted else self.loader.next()
            self.data_exhausted = prompt is None
        if prompt is None:
            self.buffer.cancel(job.slot_id)
            del self.jobs[job.slot_id]
            if refill:
                self.refills.given_up()
            self.gate.add_in_flight(-1)
            return
        self._queue_retries([[replace(job, prompt=prompt, retries=0)]])

    def _dispatch_retries(self) -> None:
        """Re-dispatch failed batches; a job whose weights are gone gets a fresh slot at the current version."""
        batches, self.retry_queue = self.retry_queue, []
        for jobs in batches:
            restamped = []
            for job in jobs:
                if job.start_version != self.gate.version:
                    self.buffer.cancel(job.slot_id)
                    del self.jobs[job.slot_id]
                    slot_id = self.buffer.reserve(self.gate.version, job.target_step)
                    job = replace(job, slot_id=slot_id, start_version=self.gate.version)
                restamped.append(job)
            self._submit(restamped, retried=True)

    def state_dict(self) -> dict:
        """Whether the data ran out, and the job of every slot still reserved (plain values)."""
        pending = [self.jobs[slot.slot_id] for slot in self.buffer.reserved_slots()]
        return {"data_exhausted": self.data_exhausted, "pending": [_job_state(job) for job in pending]}

    def load_state_dict(self, state: dict, split: dict[str, Prompt]) -> None:
        """A checkpoint's pending jobs, each in a fresh slot and queued to be generated again, in
        batches as they were cut; ``split``: the run's prompts by uid, its refills' included. Call
        after the buffer is restored."""
        self.data_exhausted = state["data_exhausted"]
        pending = []
        for saved in state["pending"]:
            job = _job_from_state(saved, split)
            slot_id = self.buffer.reserve(job.start_version, job.target_step)
            self.jobs[slot_id] = pending_job = replace(job, slot_id=slot_id)
            pending.append(pending_job)
            self.gate.in_flight += 1
        for start in range(0, len(pending), self.groups_per_batch):
            self.retry_queue.append(pending[start : start + self.groups_per_batch])


def _job_state(job: RolloutJob) -> dict:
    """Plain text only: an answer object that carries more (a dataset entry) is taken back from the
    train split on resume, so a checkpoint never holds a task's own classes."""
    return {
        "prompt": {"uid": job.prompt.uid, "text": job.prompt.text, "answer": str(job.prompt.answer)},
        "start_version": job.start_version,
        "target_step": job.target_step,
        "retries": job.retries,
    }


def _job_from_state(state: dict, split: dict[str, Prompt]) -> RolloutJob:
    """The saved job with the split's own prompt (its uid is the saved one less the epoch suffix)."""
    saved = state["prompt"]
    prompt = split.get(saved["uid"].rsplit("/", 1)[0])
    if prompt is None or (prompt.text, prompt.answer) != (saved["text"], saved["answer"]):
        raise ConfigError(
            f"--resume: the checkpoint's pending prompt {saved['uid']} is not in this run's train split; "
            "resume with the data settings the checkpoint was saved with"
        )
    return RolloutJob(
        slot_id=-1,
        prompt=replace(prompt, uid=saved["uid"]),
        start_version=state["start_version"],
        target_step=state["target_step"],
        retries=state["retries"],
    )
