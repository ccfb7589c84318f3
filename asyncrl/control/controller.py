"""SingleController: the train loop, and the one place the run's components meet.

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
awaited handles (threads on the local runtime, actors on Ray). Each is its own component:

- rollout loop (``RolloutLoop``, rollout_loop.py): admission, dispatch, retries, commits.
- train loop (here): ``sampler.evict`` -> ``sampler.select`` chunks of at least
  ``min_groups_per_chunk`` groups, streamed into the trainer while stragglers still generate, each
  vouched for by the integrity guard's group checks first -> the split step -> weight sync. Then
  evaluation and checkpoints at their cadence.
- weight sync (``WeightSync``, weight_sync.py): gate closed, weights exported once, loaded by version.

A group's lag when trained is ``V - start_version``; the sampler bounds it. Under ``in_order``
every decision above is a function of the version alone, never of timing: that is what makes a
run reproducible, and a resumed run identical to an uninterrupted one.

Faults end in one of two ways (docs/reliability.md). What can be retried is retried within a
budget: a generation batch, an evaluation, a train step (aborted first, then rerun on the groups
it had taken). Otherwise the run stops with a ``RunStopped`` error; when the trainer is known to be
healthy it first writes a checkpoint that holds everything committed, including the groups of the
aborted step, so nothing is lost and ``--resume`` continues. A watchdog stops a stalled run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrl.config import RunConfig, dump_config
from asyncrl.control.buffer import ReplayBuffer
from asyncrl.control.changes import Changes
from asyncrl.control.gate import RolloutGate
from asyncrl.control.handles import RolloutHandle, TrainerHandle
from asyncrl.control.health import RunHealth
from asyncrl.control.interrupts import Interrupts
from asyncrl.control.refill import DynamicSampling
from asyncrl.control.rollout_loop import RolloutLoop
from asyncrl.control.run_state import RunState
from asyncrl.control.sampler import Sampler
from asyncrl.control.watchdog import Watchdog
from asyncrl.control.weight_sync import WeightSync
from asyncrl.data import Prompt, PromptLoader, Task
from asyncrl.errors import (
    EvaluationFailedError,
    IntegrityStop,
    NonFiniteStepsError,
    RunInterrupted,
    RunStopped,
    SyncTimedOut,
    SyncTimeoutError,
    TrainStepError,
    WeightLoadError,
    WeightLoadFailedError,
)
from asyncrl.integrity import IntegrityGuard
from asyncrl.integrity.group_checks import GroupChecks
from asyncrl.integrity.sync_checks import SyncChecks
from asyncrl.metrics import StepClock, episode_keys, step_record
from asyncrl.samples import spread
from asyncrl.types import RolloutGroup, RolloutJob, SyncReport

if TYPE_CHECKING:
    from asyncrl.types import StepReport

T = TypeVar("T")
STATE_VERSION = 2
ABORT_TIMEOUT_S = 60.0  # a trainer too stuck to abort its step within this is left behind


class SingleController:
    """Drives one run from its first weight load to its final checkpoint (``run``): it owns the
    train loop and the run's books, and wires the rollout loop, the weight sync, the integrity
    checks, the watchdog and the signal handling around one ``Changes``."""

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
        self.max_in_flight = config.runtime.max_inflight_groups or buffer.capacity
        self.max_retries = config.runtime.max_rollout_retries
        self.refills = DynamicSampling(loader, config.step.max_refill_groups)
        self.version = 0
        self.changes = Changes()
        self.gate = RolloutGate(0, self.changes, wait_for_admissions=sampler.gated, max_in_flight=self.max_in_flight)
        self.guard = IntegrityGuard(config.integrity)
        self.weight_sync = self._checked_weight_sync(task)
        self.state = RunState()
        self.interrupts = Interrupts(self.changes, progress.status)
        self.watchdog = Watchdog(config.runtime.watchdog_s)
        self.group_checks = GroupChecks(self.guard, config.sampler.max_lag)
        self.clock = StepClock()
        self.rollouts = RolloutLoop(
            config,
            workers=self.rollout_workers,
            loader=loader,
            sampler=sampler,
            buffer=buffer,
            gate=self.gate,
            refills=self.refills,
            state=self.state,
            watchdog=self.watchdog,
            clock=self.clock,
            check_group=self._check_versions,
        )
        self.start_time = time.perf_counter()
        self.evals: list[dict] = []
        self.health = RunHealth(config)

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

    def _check_versions(self, group: RolloutGroup) -> None:
        """A generated group's weight versions, named by the step that would train it first."""
        self.sync_checks.check_versions(
            group.prompt_uid, group.start_version, group.end_version, self.version + 1, self.gate.sent
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
                        self.rollouts.tasks = tasks
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
        await asyncio.gather(tasks.create_task(self.rollouts.run()), tasks.create_task(self.train_loop()))
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
            self.rollouts.stop()

    async def train_step(self) -> StepReport | None:
        """Step V, rerun after an abort up to ``trainer.max_step_retries`` times; None when the data
        ran out before it. An interrupt or a cancellation aborts it, keeping its groups."""
        retries = self.config.trainer.max_step_retries
        for attempt in range(retries + 1):
            try:
                report = await self._attempt_step()
                self.state.step_groups = []
                self.group_checks.end_step()
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
            await self._trainer_call(
                self.trainer.train_groups(self.group_checks.vouched_for(self.state.step_groups, version))
            )
        while await self._next_chunk(version):
            pass
        if not self.state.step_groups:
            await self.trainer.abort_step()
            return None
        self.group_checks.failures(self.state.step_groups, version)
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
        exhausted = self.rollouts.data_exhausted and self.gate.in_flight == 0
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
        await self._trainer_call(self.trainer.train_groups(self.group_checks.vouched_for(groups, version)))
        self.clock.train_s += time.perf_counter() - busy_start
        self.watchdog.progressed()
        return True

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
        if count <= 0 or self.rollouts.stopping:
            return False
        count = min(count, self.max_in_flight - self.gate.in_flight)
        if count <= 0:
            self.watchdog.waiting["train loop"] = f"room under runtime.max_inflight_groups to refill step {version}"
            await self.changes.next()
            return True
        prompts = self.refills.take(count)
        self.rollouts.dispatch(
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
            f"{self.buffer.capacity} slots; {len(self.rollouts.retry_queue)} batches waiting to be retried"
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
        if not self.rollouts.stopping:
            await self.interrupts.interruptible(self.gate.close(), self.version)
        await self.interrupts.interruptible(self.gate.drained(), self.version)
        path = await self.trainer.save_checkpoint(
            str(self.run_dir), self.version, self.state_dict(), self.config.checkpoint.keep_last
        )
        if not self.rollouts.stopping:
            self.gate.open(self.gate.version)
        self.watchdog.progressed()
        return path

    def state_dict(self) -> dict:
        buffer_state = self.buffer.state_dict()
        for slot in buffer_state["ready"]:
            slot["group"] = slot["group"].state_dict()
        return {
            "format": STATE_VERSION,
            "version": self.version,
            **self.rollouts.state_dict(),
            **self.state.state_dict(),
            **self.refills.state_dict(),
            "config": self.config_text,
            "sampler": self.sampler.state_dict(),
            "loader": self.loader.state_dict(),
            "buffer": buffer_state,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") not in (1, STATE_VERSION):
            raise ValueError(f"checkpoint state format {state.get('format')} is not {STATE_VERSION}")
        self.version = state["version"]
        self.gate.version = self.version
        self.sync_checks.latest = self.version
        self.state.load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self.loader.load_state_dict(state["loader"])
        self.refills.load_state_dict(state)
        buffer_state = dict(state["buffer"])
        buffer_state["ready"] = [
            {**slot, "group": RolloutGroup.from_state_dict(slot["group"])} for slot in buffer_state["ready"]
        ]
        self.buffer.load_state_dict(buffer_state)
        split = {prompt.uid: prompt for loader in (self.loader, self.refills.loader) for prompt in loader.prompts}
        self.rollouts.load_state_dict(state, split)

    def _log_step(self, report: StepReport, sync: SyncReport, step_s: float) -> None:
        wall_s = time.perf_counter() - self.start_time
        counters = self.state.counters(self.refills.total)
        record = step_record(report, sync, counters, self.clock.lap(), step_s, wall_s, len(self.rollout_workers))
        record.update(self.guard.step_metrics())
        self.metrics.log_groups(report.data.groups)
        if samples := spread(report.data.samples, self.config.logging.samples_per_step):
            self.metrics.log_samples(samples)
        self.metrics.log_step(record)
        self.progress.update(record)
        for warning in self.health.observe(record):
            self.progress.warn(f"step {warning.step}: {warning.message}")


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The root failure of the loops, rather than the cancellations it caused."""
    for err in group.exceptions:
        if isinstance(err, BaseExceptionGroup):
            return _first_error(err)
        if not isinstance(err, asyncio.CancelledError):
            return err
    return group.exceptions[0]
