"""Every worker a run needs, built in one place from its config: trainer ranks and rollout workers.

The local runtime, the Ray actors, ``asyncrl eval`` and the benchmarks all build through here, so
their copies cannot disagree on the warm start (demonstrations included), the algorithm, the
in-flight setting or fault injection. A runtime whose workers live in the driver's process
(``Runtime.in_process``) hands the builders the driver's ``Shared`` objects, its warm-started
model, tokenizer, rewards, ``RunParts`` (the algorithm, the environment) and the run's request
bound, instead of letting each build its own; a worker in a process of its own builds each once
there. This is also where a generator gets the request bound a backend declaring
``takes_request_bound`` needs (``generator_request_bound``): the backend never builds the task or
resolves the environment itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

from asyncrl.checkpoint import STATE_FILE, load_contents, load_state
from asyncrl.config import RunConfig
from asyncrl.data import Task, build_task
from asyncrl.data.files import Budget
from asyncrl.environments.base import EnvironmentPart
from asyncrl.faults import inject_rollout_faults, inject_trainer_faults
from asyncrl.generation import Generator, SamplingParams, build_generator, takes_request_bound
from asyncrl.models.factory import DTYPES, build_model, build_tokenizer, resolve_device
from asyncrl.models.lora import generator_copy
from asyncrl.parts import RunParts, build_run_parts
from asyncrl.rewards import RewardRunner
from asyncrl.rollout import RolloutWorker
from asyncrl.rollout.context import request_bound
from asyncrl.rollout.episode import build_episodes
from asyncrl.trainer.parallel import ParallelContext, init_parallel, start_rank
from asyncrl.trainer.policy import PolicyTrainer
from asyncrl.trainer.worker import TrainerWorker
from asyncrl.warm_start import warm_start_policy


@dataclass(frozen=True)
class Shared:
    """The driver's objects that workers in its own process use instead of building their own: the
    policy (already warm-started; a LoRA trainer turns it into its adapters' base in place), its
    tokenizer, the rewards, the run's parts, and the request bound its generators' backend takes
    (``generator_request_bound``: None when it declares none)."""

    tokenizer: Any
    model: nn.Module
    rewards: RewardRunner
    parts: RunParts
    request_bound: tuple[int, Budget] | None = None


def generator_request_bound(
    config: RunConfig, task: Task, environment: EnvironmentPart | None, tokenizer: Any
) -> tuple[int, Budget] | None:
    """What ``build_generator`` hands a backend that declares ``takes_request_bound``: the run's
    longest first request and what a request may add to it (``asyncrl.rollout.context.request_bound``
    over ``task`` and ``environment``, ``RunParts.environment``), computed here, once; None for any
    other backend, which nothing is tokenized for."""
    if not takes_request_bound(config):
        return None
    return request_bound(task, config, environment, tokenizer)


def build_trainer_rank(
    config: RunConfig,
    rank: int,
    init_method: str | None,
    checkpoint_dir: str | None = None,
    shared: Shared | None = None,
) -> TrainerWorker:
    """This process's trainer rank, ready for the controller's calls.

    ``init_method`` (``tcp://host:port`` or ``file://...``) is where the ranks meet; None when the
    run has a single rank or this process already belongs to the ranks' process group. Without
    ``shared`` every rank builds the same model and applies the warm start, which the driver has
    cached beforehand; the ranks then take rank 0's weights, so they start identical whatever
    their caches held. A CUDA rank uses its current device (one visible GPU per rank).
    ``checkpoint_dir``: resume from it. The ``faults`` section, when set, wraps the worker
    (asyncrl/faults.py)."""
    parallel = _rank_parallel(config, rank, init_method)
    if shared is None:
        torch.manual_seed(config.seed)
        transformers.utils.logging.disable_progress_bar()
        tokenizer, parts = build_tokenizer(config), build_run_parts(config)
        model = build_model(config, tokenizer)
        warm_start_policy(model, tokenizer, config, parts.environment)
    else:
        tokenizer, model, parts = shared.tokenizer, shared.model, shared.parts
    if parallel is not None:
        _take_rank0_weights(model)
    trainer = PolicyTrainer.from_config(config, model, parallel=parallel, algorithm=parts.algorithm)
    worker = TrainerWorker(trainer, config.step, tokenizer, rank=rank, seed=config.seed, integrity=config.integrity)
    if checkpoint_dir is not None:
        state = load_state(Path(checkpoint_dir))["trainer"]
        load_contents(str(Path(checkpoint_dir) / STATE_FILE), worker.load_checkpoint, checkpoint_dir, state)
    return inject_trainer_faults(worker, config.faults)


def _rank_parallel(config: RunConfig, rank: int, init_method: str | None) -> ParallelContext | None:
    """This rank's place among ``parallel.world_size`` ranks (None for one rank)."""
    if config.parallel.world_size == 1:
        return None
    device = resolve_device(config.trainer.device)
    if init_method is not None:
        return start_rank(config.parallel, rank=rank, init_method=init_method, device=device)
    if dist.is_initialized():
        return init_parallel(config.parallel, device)
    raise ValueError(f"parallel.dp: {config.parallel.world_size} trainer ranks need an init_method to meet at")


def _take_rank0_weights(model: nn.Module) -> None:
    """Broadcast every parameter and buffer from rank 0 (before any wrapping shards them)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def build_rollout_worker(config: RunConfig, run_dir: Path | None = None, shared: Shared | None = None) -> Any:
    """A rollout worker of the run, fault injection included. Without ``shared`` it builds its own
    model, generator and rewards (the weights come from the trainer before the first batch, so
    the model is not warm-started here); with it, the generator's model is a copy of the
    driver's (with LoRA, the same base tensors, in memory once), and the rewards and the request
    bound are the driver's."""
    if shared is None:
        tokenizer, parts = build_tokenizer(config), build_run_parts(config)
        model = build_model(config, tokenizer)
        task = build_task(config.data, tokenizer)
        rewards = RewardRunner.from_config(config.rewards, task, max_new_tokens=config.generation.max_new_tokens)
        bound = generator_request_bound(config, task, parts.environment, tokenizer)
    else:
        tokenizer, rewards, parts, bound = shared.tokenizer, shared.rewards, shared.parts, shared.request_bound
        model = generator_copy(shared.model, config.lora.rank, DTYPES[config.trainer.dtype])
    generator = build_generator(config, model, tokenizer, run_dir, request_bound=bound)
    return inject_rollout_faults(rollout_worker(config, parts, generator, rewards, tokenizer), config.faults)


def rollout_worker(
    config: RunConfig, parts: RunParts, generator: Generator, rewards: RewardRunner, tokenizer: Any
) -> RolloutWorker:
    """The run's rollout worker over a built generator: its seed, group size, sampling, the
    algorithm that judges its groups, its episodes, and whether weights load while it generates."""
    return RolloutWorker(
        generator,
        rewards,
        tokenizer,
        run_seed=config.seed,
        group_size=config.step.generations_per_prompt,
        sampling=SamplingParams.from_config(config.generation),
        inflight=config.sync.mode == "inflight" and generator.loads_while_generating,
        algorithm=parts.algorithm,
        episodes=build_episodes(config, parts.environment, generator, tokenizer),
        samples=min(config.logging.samples_per_step, config.step.generations_per_prompt),
        eval_samples=config.logging.eval_samples,
        fingerprints=config.integrity.enabled,
    )
