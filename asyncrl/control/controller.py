"""SingleController: asynchronous GRPO in one file.

Who waits for whom (every wait is on ``Changes``, or on a handle call the loop awaited):

    rollout loop                  buffer      train loop                     weight sync (the train
                                                                             loop awaits it)
    wait: gate open, room,                    wait: ready groups of step V,
          in-flight limit                           a chunk at least
    reserve ------------------->  slot
    generate (RolloutHandle)
    commit -------------------->  group ----> take, train_groups, finish_step
                                              (TrainerHandle) -------------> close the gate: wait
    admits what the sampler still allows <---------------------------------  for the rollout loop
    under V, then settles -------------------------------------------------> to settle (drain: and
                                                                             nothing in flight), no
                                                                             batch generating;
                                                                             export, load weights
    admits again under V + 1 <---------------------------------------------- open the gate (V + 1)

Three loops share one event loop and touch only metadata; workers do the heavy lifting behind
awaited handles (threads on the local runtime, actors on Ray):

- rollout loop: ``sampler.admit`` -> ``buffer.reserve`` -> generate on a RolloutWorker ->
  ``buffer.commit``. Admission is gated by buffer capacity, the in-flight limit and the rollout
  gate that weight syncs close. A failed generation batch is retried, slots kept, within a budget.
- train loop: ``sampler.evict`` -> ``sampler.select`` chunks of at least ``min_groups_per_chunk``
  groups, streamed into the trainer while stragglers still generate -> advantages, micro-batches,
  the split step -> weight sync. Then evaluation and checkpoints at their cadence.
- weight sync (``weights.WeightSync``): gate closed, weights exported once, loaded by version.

A group's lag when trained is ``V - start_version``; the sampler bounds it. Under ``in_order``
every decision above is a function of the version alone, never of timing: that is what makes a
run reproducible, and a resumed run identical to an uninterrupted one.

Faults end in one of two ways (docs/reliability.md). What can be retried is retried within a
budget: a generation batch, an evaluation, a train step (aborted first, then rerun on the groups
it had taken).
Otherwise the run stops with a ``RunStopped`` error; when the trainer is known to be healthy it
first writes a checkpoint that holds everything committed, including the groups of the aborted
step, so nothing is lost and ``--resume`` continues. A watchdog stops a run that makes no progress.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrl.config import ConfigError, RunConfig, dump_config
from asyncrl.control.buffer import ReplayBuffer
from asyncrl.control.changes import Changes
from asyncrl.control.gate import RolloutGate
from asyncrl.control.handles import RolloutHandle, TrainerHandle
from asyncrl.control.health import RunHealth
from asyncrl.control.interrupts import Interrupts
from asyncrl.control.refill import DynamicSampling
from asyncrl.control.run_state import RunState
from asyncrl.control.sampler import Sampler
from asyncrl.control.watchdog import Watchdog
from asyncrl.data import Prompt, PromptLoader, Task
from asyncrl.errors import (
    EvaluationFailedError,
    IntegrityStop,
    NonFiniteStepsError,
    RolloutFailedError,
    RunInterrupted,
    RunStopped,
    SyncTimedOut,
    TrainStepError,
    WeightLoadFailedError,
)
from asyncrl.integrity import IntegrityGuard
from asyncrl.integrity.sync_checks import SyncChecks
from asyncrl.metrics import StepClock, episode_keys, step_record
from asyncrl.samples import spread
from asyncrl.types import RolloutGroup, RolloutJob
from asyncrl.weights.sync import SyncReport, SyncTimeoutError, WeightLoadError, WeightSync

if TYPE_CHECKING:
    from asyncrl.types import RolloutBatch, StepReport

T = TypeVar("T")
STATE_VERSION = 2
ABORT_TIMEOUT_S = 60.0  # a trainer too stuck to abort its step within this is left behind


class SingleController:
    def __init__(
        self,
        config: RunConfig,
        *,
        trainer: TrainerHandle,
        rollout_workers: Sequence[RolloutHandle],
        task: Task,
        loader: PromptLoader,
        sampler: Sampler,
        buffer: ReplayBuffer,
        metrics: Any,
        progress: Any,
        run_dir: str | Path,
    ) -> None:
        if not rollout_workers:
            raise ValueError("SingleController: at least one rollout worker is needed")
        self.config = config
        self.config_text = dump_config(config, Path(run_dir))  # saved with every checkpoint as its run.yaml
        self.trainer = trainer
        self.rollout_workers = list(rollout_workers)
        self.task = task
        self.loader = loader
        self.sampler = sampler
        self.buffer = buffer
        self.metrics = metrics
        self.progress = progress
        self.run_dir = Path(run_dir)
        self.prompts_per_step = config.step.prompts_per_step
        self.groups_per_batch = max(1, config.generation.batch_size // config.step.generations_per_prompt)
        self.max_in_flight = config.runtime.max_inflight_groups or buffer.capacity
        self.max_retries = config.runtime.max_rollout_retries
        self.refills = DynamicSampling(loader, config.step.max_refill_groups)
        self.version = 0
        self.changes = Changes()
        self.gate = RolloutGate(0, self.changes, wait_for_admissions=sampler.gated, max_in_flight=self.max_in_flight)
        self.guard = IntegrityGuard(config.integrity)
        self.weight_sync = self._checked_weight_sync(task)
        self.stopping = False
        self.data_exhausted = False
        self.retry_queue: list[list[RolloutJob]] = []  # failed batches, each re-dispatched as one
        self.jobs: dict[int, RolloutJob] = {}  # reserved slot -> its job, until committed
        self.state = RunState()
        self.interrupts = Interrupts(self.changes, progress.status)
        self.watchdog = Watchdog(config.runtime.watchdog_s)
        self.verdicts: dict[int, bool] = {}  # id of a group of the open step -> the guard lets it train
        self.next_worker = 0
        self.clock = StepClock()
        self.start_time = time.perf_counter()
        self.evals: list[dict] = []
        self.health = RunHealth(config)
        self._tasks: asyncio.TaskGroup | None = None

    def _checked_weight_sync(self, task: Task) -> WeightSync:
        """The weight sync, each of whose loads the guard's sync checks verify before the gate reopens."""
        integrity, sync = self.config.integrity, self.config.sync
        prompts = task.heldout or task.train  # the sampling probe's
        self.sync_checks = SyncChecks(self.guard, integrity, self.trainer, self.rollout_workers, prompts, self.version)
        return WeightSync(
            self.trainer,
            self.rollout_workers,
            self.gate,
            mode=sync.mode,
            timeout_s=sync.timeout_s,
            verify=self.sync_checks,
        )

    @property
    def skipped_prompts(self) -> int:
        return self.state.skipped_prompts

    @property
    def num_evicted(self) -> int:
        return self.state.num_evicted

    # ---- the run --------------------------------------------------------------------------

    async def run(self) -> int:
        """Train to ``step.max_steps`` or the end of the data; returns the steps taken in total.

        Raises ``RunStopped`` (checkpoint saved where possible) or the error that stopped it."""
        with self.interrupts.handled():
            try:
                self.watchdog.progressed()
                try:
                    async with asyncio.TaskGroup() as tasks:
                        self._tasks = tasks
                        work = tasks.create_task(self._evaluate_train_evaluate(tasks))
                        tasks.create_task(self.watchdog.watch(work, self._stall_details))
                except BaseExceptionGroup as group:
                    raise _first_error(group) from None
            except RunStopped as err:
                raise await self._stopped(err) from err.__cause__
        return self.version

    async def _evaluate_train_evaluate(self, tasks: asyncio.TaskGroup) -> None:
        """The whole run, under the watchdog: the first evaluation, both loops, the last
        evaluation and the final checkpoint."""
        await self._first_load()
        if self.version == 0 or self.state.eval_due:
            self.watchdog.waiting["train loop"] = f"the evaluation at step {self.version}"
            await self.evaluate()
        await asyncio.gather(tasks.create_task(self.rollout_loop()), tasks.create_task(self.train_loop()))
        if not self.evals or self.evals[-1]["step"] != self.version:
            self.watchdog.waiting["train loop"] = f"the evaluation at step {self.version}"
            await self.evaluate()
        self.watchdog.waiting["train loop"] = f"the final checkpoint of step {self.version}"
        await self.checkpoint()

    async def _first_load(self) -> None:
        """The generators get the trainer's weights before any rollout, bounded as a sync's loads
        are and under the watchdog and the signals; a failure leaves nothing new to checkpoint."""
        self.watchdog.waiting["train loop"] = f"the first weight load (version {self.version})"
        try:
            await self.interrupts.interruptible(self.weight_sync.first_load(), self.version)
        except SyncTimeoutError as err:
            raise SyncTimedOut(err, saves_checkpoint=False) from None
        except WeightLoadError as err:
            raise WeightLoadFailedError(str(err), saves_checkpoint=False) from err.__cause__
        self.watchdog.progressed()

    async def _stopped(self, err: BaseException) -> BaseException:
        """Save what the run holds before it stops, when the trainer can be trusted to save it."""
        if isinstance(err, RunStopped) and err.saves_checkpoint:
            self.progress.status(f"stopping: checkpointing step {self.version}")
            try:  # bounded like any other wait for progress, not by the weight sync's own limit
                async with asyncio.timeout(self.config.runtime.watchdog_s):
                    err.checkpoint = await self.trainer.save_checkpoint(
                        str(self.run_dir), self.version, self.state_dict(), self.config.checkpoint.keep_last
                    )
            except Exception as save_error:
                err.add_note(f"no checkpoint was written: {type(save_error).__name__}: {save_error}")
        return err

    # ---- rollout loop -------------------------------------------------------------------------

    async def rollout_loop(self) -> None:
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
                self._dispatch(jobs)
                if settled:
                    self.gate.settled()
            self.watchdog.waiting["rollout loop"] = f"a change ({self.gate.in_flight} groups generating)"
            await self.changes.next()

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

    def _dispatch(self, jobs: list[RolloutJob]) -> None:
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
        worker = self.rollout_workers[self.next_worker % len(self.rollout_workers)]
        self.next_worker += 1
        for job in batch:
            self.jobs[job.slot_id] = job
        if not retried:
            self.gate.add_in_flight(len(batch))
        # Submitted now, not when the task first runs: a later weight load queues behind it.
        future = worker.generate(batch)
        self.gate.add_running(1)
        self._tasks.create_task(self._collect(batch, future))

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
        for group in result.groups:  # named by the step that would train it first, as metrics.jsonl numbers it
            self.sync_checks.check_versions(
                group.prompt_uid, group.start_version, group.end_version, self.version + 1, self.gate.sent
            )
        for job, group in zip(committed, result.groups):
            self.buffer.commit(job.slot_id, group)
            del self.jobs[job.slot_id]
            self.state.finish_prompt(skipped=False, window=self.config.runtime.skipped_share_window)
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
        runtime = self.config.runtime
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

    # ---- train loop ---------------------------------------------------------------------------

    async def train_loop(self) -> None:
        try:
            while self.version < self.config.step.max_steps:
                self.interrupts.check(self.version)
                step_start = time.perf_counter()
                report = await self.train_step()
                if report is None:
                    break
                self.version = report.result.version  # the trainer's: a checkpoint from here on holds the step
                self.state.count_step(report.result)  # counted whether or not the sync after it succeeds
                self.watchdog.waiting["train loop"] = f"the weight sync after step {self.version}"
                sync_start = time.perf_counter()
                try:
                    sync = await self.interrupts.interruptible(self.weight_sync.sync(), self.version)
                except (SyncTimeoutError, WeightLoadError, RunInterrupted, IntegrityStop) as err:
                    how = {RunInterrupted: "interrupted", IntegrityStop: "refused"}.get(type(err), "failed")
                    failed = SyncReport.failed(self.version - 1, time.perf_counter() - sync_start, how)
                    self._log_step(report, failed, time.perf_counter() - step_start)  # the step itself is done
                    if isinstance(err, (RunInterrupted, IntegrityStop)):
                        raise
                    if isinstance(err, SyncTimeoutError):
                        raise SyncTimedOut(err) from None
                    raise WeightLoadFailedError(str(err)) from err.__cause__
                self.watchdog.progressed()
                self._log_step(report, sync, time.perf_counter() - step_start)
                self._stop_if_nonfinite(report)
                every = self.config.logging.eval_every_steps
                if every and self.version % every == 0:
                    self.watchdog.waiting["train loop"] = f"the evaluation at step {self.version}"
                    await self.evaluate()
                every = self.config.checkpoint.every_steps
                if every and self.version % every == 0 and self.version < self.config.step.max_steps:
                    self.watchdog.waiting["train loop"] = f"the checkpoint of step {self.version}"
                    await self.checkpoint()
        finally:
            self.stopping = True
            self.changes.notify()

    async def train_step(self) -> StepReport | None:
        """Step V, rerun after an abort up to ``trainer.max_step_retries`` times; None when the data
        ran out before it. An interrupt or a cancellation aborts it, keeping its groups."""
        retries = self.config.trainer.max_step_retries
        for attempt in range(retries + 1):
            try:
                report = await self._attempt_step()
                self.state.step_groups = []
                self.verdicts = {}
                refills = self.refills.end_step()
                if report is not None:
                    report.data.num_refill_groups = refills
                return report
            except Exception as err:
                await self._abort_step()
                if isinstance(err, RunStopped):
                    raise
                if attempt == retries:
                    raise TrainStepError(
                        f"train step {self.version} failed {attempt + 1} times (trainer.max_step_retries={retries}); "
                        f"last error: {type(err).__name__}: {err}"
                    ) from err
                self.state.step_retries += 1
                self.progress.status(f"step {self.version} failed ({type(err).__name__}: {err}); rerunning it")
            except BaseException:
                await self._abort_step()
                raise
        raise AssertionError("unreachable")

    async def _attempt_step(self) -> StepReport | None:
        """Stream step V's groups into the split step: first those a failed attempt had taken."""
        version = self.version
        self.watchdog.waiting["train loop"] = f"trainer.begin_step({version})"
        await self.trainer.begin_step(version)
        if self.state.step_groups:
            self.watchdog.waiting["train loop"] = f"trainer.train_groups, rerunning step {version}"
            await self._trainer_call(self.trainer.train_groups(self._vouched_for(self.state.step_groups, version)))
        while await self._next_chunk(version):
            pass
        if not self.state.step_groups:
            await self.trainer.abort_step()
            return None
        self._failures(version)
        self.watchdog.waiting["train loop"] = f"trainer.finish_step({version})"
        busy_start = time.perf_counter()
        report = await self._trainer_call(self.trainer.finish_step())
        self.clock.train_s += time.perf_counter() - busy_start
        self.guard.record("loss_counts", report.result.count_error)  # checked by the trainer, before its update
        return report

    async def _next_chunk(self, version: int) -> bool:
        """Train the next chunk of step V's groups, or wait for one; False once the step has all
        it will get (its groups and refills, or what exists when the data ran out)."""
        self.interrupts.check(self.version)
        wanted = self.prompts_per_step + self.refills.step_refills
        if len(self.state.step_groups) >= wanted:
            return await self._refill_round(version)
        # Evict on every pass: a stale group committed mid-step would otherwise hold a slot.
        refills = set(self.refills.ready(version, self.buffer))
        stale = [slot_id for slot_id in self.sampler.evict(version, self.buffer) if slot_id not in refills]
        if evicted := self.buffer.evict(stale):
            self.state.num_evicted += evicted
            self.changes.notify()
        remaining = wanted - len(self.state.step_groups)
        exhausted = self.data_exhausted and self.gate.in_flight == 0
        min_k = 1 if exhausted else min(self.config.step.min_groups_per_chunk, remaining)
        slot_ids = self._in_dispatch_order(self._select(version, min_k, remaining))
        if len(slot_ids) < min_k:
            if not exhausted:
                await self._wait_for_groups(version)
            return not exhausted
        groups = self.buffer.take(slot_ids)
        self.state.step_groups.extend(groups)
        self.changes.notify()
        self.watchdog.waiting["train loop"] = f"trainer.train_groups ({len(groups)} groups of step {version})"
        busy_start = time.perf_counter()
        await self._trainer_call(self.trainer.train_groups(self._vouched_for(groups, version)))
        self.clock.train_s += time.perf_counter() - busy_start
        self.watchdog.progressed()
        return True

    def _vouched_for(self, groups: Sequence[RolloutGroup], version: int) -> list[RolloutGroup]:
        """The groups step V may train, each checked once per step by the guard: every trained
        token's own weight version within the staleness bound, and transcripts that only grew. A
        group the guard drops stays with the step's groups (a rerun or a resumed run leaves it out
        again), untrained."""
        if not self.guard.enabled:
            return list(groups)
        for group in groups:
            if id(group) not in self.verdicts:
                verdicts = (self._staleness(group, version), self._transcripts(group, version))
                self.verdicts[id(group)] = "drop" not in verdicts
        return [group for group in groups if self.verdicts[id(group)]]

    def _transcripts(self, group: RolloutGroup, version: int) -> str:
        """Promise 6: no episode of the group met a chat template that rewrote its transcript (the
        episode ended there instead, rollout/episode.py)."""
        breaks = group.episode_metrics.get("transcript_breaks", 0.0)
        return self.guard.check(
            "transcripts",
            breaks,
            step=version + 1,  # as metrics.jsonl numbers the step that trains from version V
            evidence=f"{breaks:.0f} episodes of group {group.prompt_uid} met a chat template that rendered the "
            "transcript differently once messages were appended, so no observation could extend it",
        )

    def _staleness(self, group: RolloutGroup, version: int) -> str:
        """Promise 3: the group's oldest trained token lags step V by at most ``sampler.max_lag``."""
        bound, oldest = self.config.sampler.max_lag, group.oldest_token_version
        return self.guard.check(
            "staleness",
            max(version - oldest - bound, 0),
            step=version + 1,  # as metrics.jsonl numbers the step that trains from version V
            evidence=f"group {group.prompt_uid} (start version {group.start_version}) has a token sampled by "
            f"weights {oldest}: lag {version - oldest} > sampler.max_lag={bound}",
        )

    def _failures(self, version: int) -> None:
        """Promise 4: the trainer leaves a group whose reward raised or was not a finite number out
        of the loss; a step that would lose more than ``integrity.failures.threshold`` of its groups
        so stops (or warns) before its update."""
        if not self.guard.enabled:
            return
        groups = self.state.step_groups
        failed = sum(1 for group in groups if group.reward_errors)
        self.guard.check(
            "failures",
            failed / len(groups),
            step=version + 1,  # as metrics.jsonl numbers the step that trains from version V
            evidence=f"{failed} of the step's {len(groups)} groups have a reward that raised or was not a finite "
            f"number (integrity.failures.threshold={self.config.integrity.failures.threshold})",
        )

    def _select(self, version: int, min_k: int, max_k: int) -> list[int]:
        """The sampler's choice, but for a step with refills out: it takes those, and only those,
        so they are trained in the step they refill (``DynamicSampling``)."""
        if not self.refills.step_refills:
            return self.sampler.select(version, self.buffer, min_k, max_k)
        ready = self.refills.ready(version, self.buffer)
        return ready[:max_k] if len(ready) >= min_k else []

    async def _wait_for_groups(self, version: int) -> None:
        self.watchdog.waiting["train loop"] = (
            f"groups for step {version} ({len(self.state.step_groups)} of {self.prompts_per_step} trained, "
            f"{self.buffer.num_ready} ready, {self.gate.in_flight} generating)"
        )
        wait_start = time.perf_counter()
        await self.changes.next()
        self.clock.train_wait_s += time.perf_counter() - wait_start

    async def _refill_round(self, version: int) -> bool:
        """Every group the step waited for is in: dispatch replacements for the filtered ones
        (``DynamicSampling``), or wait for room to; False when the step wants none."""
        informative = sum(group.informative for group in self.state.step_groups)
        count = self.refills.wanted(self.prompts_per_step - informative, self.buffer.num_free)
        if count <= 0 or self.stopping:
            return False
        count = min(count, self.max_in_flight - self.gate.in_flight)
        if count <= 0:
            self.watchdog.waiting["train loop"] = f"room under runtime.max_inflight_groups to refill step {version}"
            await self.changes.next()
            return True
        prompts = self.refills.take(count)
        self._dispatch(
            [
                RolloutJob(self.buffer.reserve(self.gate.version, version), p, self.gate.version, version)
                for p in prompts
            ]
        )
        return bool(prompts)

    async def _trainer_call(self, call: Awaitable[T]) -> T:
        """A train-step call a signal does not wait for: the trainer drops it at its next module
        and the step is aborted, its groups kept for the stop checkpoint (``Interrupts.abandonable``)."""
        return await self.interrupts.abandonable(call, self.trainer.abandon, self.version, ABORT_TIMEOUT_S)

    async def _abort_step(self) -> None:
        """Abort the trainer's open step; bounded, since the trainer may be what is stuck."""
        abort = asyncio.ensure_future(self.trainer.abort_step())
        await asyncio.wait([abort], timeout=ABORT_TIMEOUT_S)

    def _stop_if_nonfinite(self, report: StepReport) -> None:
        """Stop once more consecutive steps than allowed were skipped as non-finite."""
        if not report.result.skipped:
            return
        limit = self.config.trainer.max_nonfinite_steps
        self.progress.status(f"step {report.result.version - 1} skipped: non-finite loss or gradient")
        if self.state.nonfinite_streak > limit:
            raise NonFiniteStepsError(
                f"{self.state.nonfinite_streak} consecutive steps had a non-finite loss or gradient "
                f"(trainer.max_nonfinite_steps={limit}); the last was step {report.result.version - 1}"
            )

    # ---- the watchdog ------------------------------------------------------------

    def _stall_details(self) -> str:
        """What the watchdog's error says beside the loops' waits."""
        return (
            f"buffer {self.buffer.num_reserved} reserved / {self.buffer.num_ready} ready / "
            f"{self.buffer.capacity} slots; {len(self.retry_queue)} batches waiting to be retried"
        )

    def _in_dispatch_order(self, slot_ids: list[int]) -> list[int]:
        """Hold back groups dispatched after a still-generating group that has a target step.

        Groups then reach the trainer in dispatch order even when a batch is retried, so a
        step's micro-batches (and its result) do not depend on which batch finished first.
        """
        first_in_flight = min(
            (
                slot.slot_id
                for slot in self.buffer.reserved_slots()
                if slot.target_step is not None and slot.target_step <= self.version
            ),
            default=None,
        )
        if first_in_flight is None:
            return slot_ids
        return [slot_id for slot_id in slot_ids if slot_id < first_in_flight]

    # ---- evaluation, checkpoints, metrics ---------------------------------------------------

    async def evaluate(self) -> None:
        """Greedy held-out evaluation, retried on the next worker like a generation batch; past the
        budget the run stops, and ``eval_due`` makes the resumed run evaluate this version first."""
        self.progress.status(f"evaluating at step {self.version}")
        self.state.eval_due = True
        prompts: list[Prompt] = list(self.task.heldout[: self.config.data.eval_size])
        for attempt in range(self.max_retries + 1):
            worker = self.rollout_workers[attempt % len(self.rollout_workers)]
            try:
                result = await self.interrupts.interruptible(worker.evaluate(prompts), self.version)
                break
            except RunStopped:
                raise
            except Exception as err:
                self.watchdog.progressed()
                if attempt == self.max_retries:
                    raise EvaluationFailedError(
                        f"evaluation at step {self.version} failed {attempt + 1} times "
                        f"(runtime.max_rollout_retries={self.max_retries}); last error: {type(err).__name__}: {err}"
                    ) from err
                self.progress.status(f"evaluation at step {self.version} failed ({type(err).__name__}); retrying")
        self.state.eval_due = False
        record = {
            "step": self.version,
            "accuracy": result.accuracy,
            "reward_mean": result.reward_mean,
            "num_prompts": result.num_prompts,
            "response_length_mean": result.response_length_mean,
            "time/eval_s": result.seconds,
            **episode_keys(result.episode_metrics),
        }
        self.evals.append(record)
        self.metrics.log_eval(record)
        if result.samples:
            self.metrics.log_samples([{"step": self.version, "split": "eval", **r} for r in result.samples])
        self.progress.update_eval(record)
        self.watchdog.progressed()

    async def checkpoint(self) -> Path:
        """Save at a quiet point: admissions closed and every dispatched rollout committed, so the
        checkpoint holds whole groups and a resumed run regenerates nothing."""
        self.progress.status(f"checkpointing step {self.version}")
        if not self.stopping:
            await self.interrupts.interruptible(self.gate.close(), self.version)
        await self.interrupts.interruptible(self.gate.drained(), self.version)
        path = await self.trainer.save_checkpoint(
            str(self.run_dir), self.version, self.state_dict(), self.config.checkpoint.keep_last
        )
        if not self.stopping:
            self.gate.open(self.gate.version)
        self.watchdog.progressed()
        return path

    def state_dict(self) -> dict:
        buffer_state = self.buffer.state_dict()
        for slot in buffer_state["ready"]:
            slot["group"] = slot["group"].state_dict()
        pending = [self.jobs[slot.slot_id] for slot in self.buffer.reserved_slots()]
        return {
            "format": STATE_VERSION,
            "version": self.version,
            "data_exhausted": self.data_exhausted,
            **self.state.state_dict(),
            **self.refills.state_dict(),
            "config": self.config_text,
            "sampler": self.sampler.state_dict(),
            "loader": self.loader.state_dict(),
            "buffer": buffer_state,
            "pending": [_job_state(job) for job in pending],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") not in (1, STATE_VERSION):
            raise ValueError(f"checkpoint state format {state.get('format')} is not {STATE_VERSION}")
        self.version = state["version"]
        self.gate.version = self.version
        self.sync_checks.latest = self.version
        self.data_exhausted = state["data_exhausted"]
        self.state.load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self.loader.load_state_dict(state["loader"])
        self.refills.load_state_dict(state)
        buffer_state = dict(state["buffer"])
        buffer_state["ready"] = [
            {**slot, "group": RolloutGroup.from_state_dict(slot["group"])} for slot in buffer_state["ready"]
        ]
        self.buffer.load_state_dict(buffer_state)
        pending = []
        split = {prompt.uid: prompt for loader in (self.loader, self.refills.loader) for prompt in loader.prompts}
        for saved in state["pending"]:
            job = _job_from_state(saved, split)
            slot_id = self.buffer.reserve(job.start_version, job.target_step)
            self.jobs[slot_id] = pending_job = replace(job, slot_id=slot_id)
            pending.append(pending_job)
            self.gate.in_flight += 1
        for start in range(0, len(pending), self.groups_per_batch):
            self.retry_queue.append(pending[start : start + self.groups_per_batch])

    def _log_step(self, report: StepReport, sync: SyncReport, step_s: float) -> None:
        wall_s = time.perf_counter() - self.start_time
        counters = self.state.counters(self.refills.total)
        record = step_record(report, sync, counters, self.clock, step_s, wall_s, len(self.rollout_workers))
        record.update(self.guard.step_metrics())
        self.clock = StepClock()
        self.metrics.log_groups(report.data.groups)
        if samples := spread(report.data.samples, self.config.logging.samples_per_step):
            self.metrics.log_samples(samples)
        self.metrics.log_step(record)
        self.progress.update(record)
        for warning in self.health.observe(record):
            self.progress.warn(f"step {warning.step}: {warning.message}")


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


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The root failure of the loops, rather than the cancellations it caused."""
    for err in group.exceptions:
        if isinstance(err, BaseExceptionGroup):
            return _first_error(err)
        if not isinstance(err, asyncio.CancelledError):
            return err
    return group.exceptions[0]
