"""Build a run from its config and drive it: the code behind ``asyncrl train`` and ``asyncrl eval``.

Everything heavy is built here (tokenizer, models, task, workers) and handed to the controller as
handles, so ``control/controller.py`` stays the algorithm and nothing else.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers
import yaml

from asyncrl.checkpoint import (
    RUN_CONFIG_FILE,
    STATE_FILE,
    CheckpointError,
    is_adapter_checkpoint,
    load_contents,
    load_run_state,
    load_weights,
    resolve_checkpoint,
)
from asyncrl.config import ConfigError, LoraConfig, RunConfig, dump_config
from asyncrl.control.buffer import ReplayBuffer
from asyncrl.control.controller import SingleController
from asyncrl.control.handles import RolloutHandle, TrainerHandle
from asyncrl.control.health import run_warnings
from asyncrl.data import PromptLoader, build_task, check_encodable, check_prompt_lengths
from asyncrl.generation import build_generator
from asyncrl.metrics import METRICS_FILE, MetricsWriter, ProgressDisplay, read_jsonl, write_json_atomic
from asyncrl.models.factory import DTYPES, build_model, build_tokenizer
from asyncrl.models.hf import stop_token_ids
from asyncrl.models.lora import merged_model
from asyncrl.parts import RunParts, build_run_parts, check_parts
from asyncrl.plots import write_report
from asyncrl.rewards import RewardRunner
from asyncrl.rollout.context import first_requests
from asyncrl.run_sampler import build_run_sampler
from asyncrl.runtime import Runtime, build_runtime
from asyncrl.trainer.group import TrainerGroup
from asyncrl.trainer.optim import resumed_schedule_warning
from asyncrl.warm_start import warm_start_policy
from asyncrl.workers import (
    Shared,
    build_rollout_worker,
    build_trainer_rank,
    generator_request_bound,
    rollout_worker,
)

T = TypeVar("T")


@dataclass(frozen=True)
class RunContext:
    """What a run knows besides its config, found once before anything is built and handed to
    what needs it: the directory it writes to and, when it resumes, the checkpoint and the run
    state saved in it."""

    run_dir: Path
    checkpoint_dir: Path | None = None
    state: dict | None = None

    @property
    def resume_step(self) -> int | None:
        """The step the resumed checkpoint was taken at; None for a fresh run."""
        return self.state["run"]["version"] if self.state is not None else None


def open_run(config: RunConfig, output_dir: Path | None = None, resume: str | Path | None = None) -> RunContext:
    """The run's context: the checkpoint ``resume`` names, checked, and the run directory
    (``output_dir``, else ``logging.output_dir``, else a new ``runs/<date>-<time>``)."""
    checkpoint_dir = _checkpoint_input(resolve_checkpoint, resume) if resume is not None else None
    state = _checkpoint_input(load_run_state, checkpoint_dir) if checkpoint_dir is not None else None
    directory = output_dir if output_dir is not None else config.logging.output_dir
    return RunContext(run_directory(directory, resuming=checkpoint_dir is not None), checkpoint_dir, state)


@dataclass
class _Built:
    """What the driver builds once from the config: the policy and its tokenizer, the task, the
    rewards, the algorithm and the environment, and the control side's sampler and replay buffer."""

    tokenizer: Any
    model: Any
    task: Any
    rewards: RewardRunner
    sampler: Any
    buffer: ReplayBuffer
    parts: RunParts


def train(
    config: RunConfig, *, output_dir: Path | None = None, resume: str | Path | None = None, console: Any = None
) -> dict:
    """Run GRPO to the end; returns the summary that is also written to ``summary.json``."""
    start = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()  # loads and saves would print bars over the display and errors
    context = open_run(config, output_dir, resume)
    built = _build(config)
    context.run_dir.mkdir(parents=True, exist_ok=True)
    (context.run_dir / "config.yaml").write_text(dump_config(config, context.run_dir))
    torch.manual_seed(config.seed)
    torch.set_num_threads(local_torch_threads(config))
    progress = ProgressDisplay(config.step.max_steps, enabled=config.logging.progress, console=console)
    if schedule_warning := resumed_schedule_warning(config, context.state):
        progress.warn(schedule_warning)
    metrics = None if config.runtime.controller_actor else _input(_metrics_writer, config, context)
    runtime = _input(build_runtime, config)
    try:
        with progress:
            steps_done = _warm_start_then_run(runtime, config, context, built, progress, metrics)
            progress.status("writing the report")
    finally:
        runtime.shutdown()
        built.rewards.close()
        if metrics is not None:
            metrics.close()
    summary = _summary(config, context.run_dir, steps_done, time.perf_counter() - start)
    write_json_atomic(context.run_dir / "summary.json", summary)
    write_report(context.run_dir)
    return summary


def _build(config: RunConfig) -> _Built:
    """Every part's options first (a user's module loaded in a fresh process before this one
    imports it), the sampler, the algorithm and the environment, then the models, the checked
    task and the rewards."""
    _input(check_parts, config)  # sampler, rewards, environment, backend and task: resolved, options checked
    sampler, capacity = _input(build_run_sampler, config)
    parts = _input(build_run_parts, config)  # the algorithm's options checked against the run, too
    tokenizer = _input(build_tokenizer, config)
    model = _input(build_model, config, tokenizer)
    task = _checked_task(config, parts, tokenizer, model)
    rewards = _input(RewardRunner.from_config, config.rewards, task, config.generation.max_new_tokens)
    return _Built(tokenizer, model, task, rewards, sampler, ReplayBuffer(capacity), parts)


def _warm_start_then_run(
    runtime: Runtime, config: RunConfig, context: RunContext, built: _Built, progress: ProgressDisplay, metrics: Any
) -> int:
    """Warm-start the policy, start the workers and drive the run to the end, in this process or,
    with ``runtime.controller_actor``, in a Ray actor; returns the steps taken in total."""
    # Once, here: on Ray every trainer rank then finds the result in the warm start cache.
    warm_start_policy(
        built.model,
        built.tokenizer,
        config,
        built.parts.environment,
        prompts=built.task.train,
        on_progress=lambda step, total, loss: progress.status(f"warm start {step}/{total}, loss {loss:.3f}"),
    )
    trainer, rollout_workers = _start_workers(runtime, config, context, built)
    control = {"sampler": built.sampler, "buffer": built.buffer}
    if config.runtime.controller_actor:
        progress.status("training; the controller runs in a Ray actor")
        return runtime.run_controller(partial(drive_in_actor, config, context, trainer, rollout_workers, **control))
    return drive(
        config, context, trainer, rollout_workers, task=built.task, metrics=metrics, progress=progress, **control
    )


def _start_workers(
    runtime: Runtime, config: RunConfig, context: RunContext, built: _Built
) -> tuple[TrainerHandle, list[RolloutHandle]]:
    """The trainer and rollout worker handles, built by asyncrl/workers.py's builders wherever the
    runtime places them: a runtime in this process shares the driver's warm-started model,
    tokenizer, rewards, run parts and the request bound its backend takes (computed once, here)
    with them. Rollout workers first: with LoRA their model copies the
    policy's base before the trainer turns the policy into its adapters' base in place."""
    shared = None
    if runtime.in_process:
        bound = _input(generator_request_bound, config, built.task, built.parts.environment, built.tokenizer)
        shared = Shared(built.tokenizer, built.model, built.rewards, built.parts, bound)
    resume_from = str(context.checkpoint_dir) if context.checkpoint_dir is not None else None
    generators = _input(
        runtime.spawn_generators,
        partial(build_rollout_worker, config, context.run_dir, shared),
        config.generation.num_workers,
    )
    ranks = _input(
        runtime.spawn_trainer_ranks,
        lambda rank, init_method: partial(build_trainer_rank, config, rank, init_method, resume_from, shared),
        config.parallel.world_size,
    )
    _input(runtime.ready)  # both kinds of workers start together
    # one rank's handle as it is: a TrainerGroup's fan-out would reorder the event loop's callbacks
    return (ranks[0] if len(ranks) == 1 else TrainerGroup(ranks)), generators


def local_torch_threads(config: RunConfig) -> int:
    """Threads per torch op in this process: ``runtime.torch_threads``, else half the cores, so
    the trainer and the generator overlapping on their threads do not oversubscribe the CPU."""
    return config.runtime.torch_threads or max(1, (os.cpu_count() or 2) // 2)


def _checked_task(config: RunConfig, parts: RunParts, tokenizer: Any, model: Any) -> Any:
    """The run's prompts, each checked to survive the tokenizer unchanged and to leave room for its
    response in the model's context; the end tokens the checkpoint declares, checked once here."""
    _input(stop_token_ids, tokenizer, config.model.path)
    task = _input(build_task, config.data, tokenizer)
    _input(check_encodable, task, tokenizer)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    _input(check_prompt_lengths, first_requests(task, parts.environment, tokenizer), task, config, max_positions)
    return task


def drive(
    config: RunConfig,
    context: RunContext,
    trainer: TrainerHandle,
    rollout_workers: list[RolloutHandle],
    *,
    sampler: Any,
    buffer: ReplayBuffer,
    task: Any,
    metrics: Any,
    progress: Any,
) -> int:
    """Run the controller over these handles to the end; returns the steps taken in total."""
    controller = SingleController(
        config,
        trainer=trainer,
        rollout_workers=rollout_workers,
        task=task,
        loader=PromptLoader(task.train, shuffle_seed=config.data.shuffle_seed, epochs=config.data.epochs),
        sampler=sampler,
        buffer=buffer,
        metrics=metrics,
        progress=progress,
        run_dir=context.run_dir,
    )
    if context.state is not None:
        load_contents(f"the resumed checkpoint's {STATE_FILE}", controller.load_state_dict, context.state["run"])
        controller.health.replay(read_jsonl(context.run_dir / METRICS_FILE))  # what was said before is not repeated
    return asyncio.run(controller.run())


def drive_in_actor(
    config: RunConfig, context: RunContext, trainer: TrainerHandle, rollout_workers: list[RolloutHandle], **control: Any
) -> int:
    """``drive`` inside the controller actor, with the driver's sampler and buffer (``control``):
    it writes the metrics itself; there is no live display."""
    torch.set_num_threads(1)
    task = build_task(config.data, build_tokenizer(config))
    metrics = _metrics_writer(config, context)
    try:
        progress = ProgressDisplay(config.step.max_steps, enabled=False)
        return drive(
            config, context, trainer, rollout_workers, task=task, metrics=metrics, progress=progress, **control
        )
    finally:
        metrics.close()


def _metrics_writer(config: RunConfig, context: RunContext) -> MetricsWriter:
    return MetricsWriter(
        context.run_dir,
        config.logging,
        run_config=yaml.safe_load(dump_config(config, context.run_dir)),
        resume_step=context.resume_step,
    )


def run_directory(output_dir: str | Path | None, *, resuming: bool) -> Path:
    """``output_dir``, or a new ``runs/<date>-<time>``; a fresh run never reuses another's, and a
    path that cannot become a writable directory is refused before anything is built."""
    if output_dir is None:
        run_dir = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    else:
        run_dir = Path(output_dir).expanduser()
    if not resuming and any((run_dir / name).exists() for name in ("metrics.jsonl", "checkpoints")):
        raise ConfigError(
            f"logging.output_dir: '{run_dir}' already holds a run; resume it with --resume {run_dir} "
            "or choose another --output-dir"
        )
    existing = next(p for p in (run_dir.absolute(), *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"logging.output_dir: '{existing}' is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"logging.output_dir: cannot write into '{existing}' (permission denied)")
    return run_dir


def _input(build: Callable[..., T], *args: Any) -> T:
    """Build from user input with a builder that raises ValueError naming the field or file for bad
    input (models/, data/, rewards/, the run's own files, and the Ray factories that call them):
    that, or a missing file, becomes a one-line config error."""
    try:
        return build(*args)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(" ".join(str(err).split())) from None


def _checkpoint_input(load: Callable[..., T], *args: Any) -> T:
    """Read a checkpoint the user named. checkpoint.py reports every bad file as a CheckpointError,
    so only that and a missing file are input errors here: any other ValueError is a bug in our
    code and keeps its traceback."""
    try:
        return load(*args)
    except (CheckpointError, FileNotFoundError) as err:
        raise ConfigError(" ".join(str(err).split())) from None


def resumed_checkpoint(resume: str | Path, option: str = "--resume") -> Path:
    """The checked checkpoint directory ``--resume`` (or ``option``) names."""
    return _checkpoint_input(resolve_checkpoint, resume, option)


def resumed_config_path(checkpoint_dir: Path) -> Path:
    """The config the checkpoint was saved under, checked with its other files: a resumed run
    continues with it."""
    path = checkpoint_dir / RUN_CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"--resume: checkpoint {checkpoint_dir} holds no {RUN_CONFIG_FILE}; pass --config")
    return path


def _summary(config: RunConfig, run_dir: Path, steps_done: int, wall_seconds: float) -> dict:
    """Headline numbers and the run-health warnings; they come from the record files, so a resumed
    run reports the whole run."""
    evals = read_jsonl(run_dir / "eval.jsonl")
    steps = read_jsonl(run_dir / "metrics.jsonl")
    summary = {
        "run_dir": str(run_dir),
        "steps": steps_done,
        "wall_seconds": wall_seconds,
        "initial_eval_accuracy": evals[0]["accuracy"] if evals else None,
        "final_eval_accuracy": evals[-1]["accuracy"] if evals else None,
        "initial_eval_reward_mean": evals[0]["reward_mean"] if evals else None,
        "final_eval_reward_mean": evals[-1]["reward_mean"] if evals else None,
        "final_train_reward_mean": steps[-1]["reward_mean"] if steps else None,
        "evicted_groups": steps[-1]["evicted_groups"] if steps else 0,
        "reward_errors": sum(s["reward_errors"] for s in steps),
        "reward_timeouts": sum(s["reward_timeouts"] for s in steps),
        "rollout_retries": sum(s["rollout_retries"] for s in steps),
        "max_lag_trained": max((int(lag) for s in steps for lag in s["lag_histogram"]), default=0),
        "warnings": run_warnings(config, steps),
    }
    return summary


def evaluate(config: RunConfig, *, checkpoint: str | Path | None = None) -> dict:
    """Greedy held-out accuracy of the config's policy (warm start included) or of a checkpoint
    (a LoRA checkpoint's adapter over that warm-started base)."""
    transformers.utils.logging.disable_progress_bar()
    checkpoint_dir = (
        _checkpoint_input(resolve_checkpoint, checkpoint, "--checkpoint") if checkpoint is not None else None
    )
    _input(check_parts, config)
    parts = _input(build_run_parts, config)
    tokenizer = _input(build_tokenizer, config)
    model = _input(build_model, config, tokenizer)
    task = _checked_task(config, parts, tokenizer, model)
    adapter = checkpoint_dir is not None and is_adapter_checkpoint(checkpoint_dir)
    if checkpoint_dir is not None and not adapter:
        _checkpoint_input(load_weights, model, checkpoint_dir)
    else:  # the run's warm-started policy: also the base a LoRA checkpoint's adapter was trained over
        warm_start_policy(model, tokenizer, config, parts.environment, prompts=task.train)
    if adapter:  # LoRA: base + adapter, merged
        model = _checkpoint_input(merged_model, model, checkpoint_dir, DTYPES[config.trainer.dtype])
        config = config.model_copy(update={"lora": LoraConfig()})
    rewards = _input(RewardRunner.from_config, config.rewards, task, config.generation.max_new_tokens)
    generator = worker = None
    try:
        bound = _input(generator_request_bound, config, task, parts.environment, tokenizer)
        generator = _input(build_generator, config, model, tokenizer, None, bound)
        worker = _input(rollout_worker, config, parts, generator, rewards, tokenizer)
        result = worker.evaluate(list(task.heldout[: config.data.eval_size]))
    finally:
        rewards.close()
        if worker is not None:
            worker.close()
        elif generator is not None:
            generator.close()
    return {
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "num_prompts": result.num_prompts,
        "accuracy": result.accuracy,
        "reward_mean": result.reward_mean,
        "response_length_mean": result.response_length_mean,
    }
