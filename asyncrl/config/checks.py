"""The checks that span sections: each raises a ValueError that names its field, so a run never
starts with a configuration that would deadlock or silently mean something else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config.root import RunConfig

CONTEXT_PARALLEL_MODEL_TYPES = ("gemma2", "gemma3_text", "gpt2", "llama", "mistral", "phi3", "qwen2", "qwen3")


def parallel_ranks(config: RunConfig) -> None:
    parallel, ranks = config.parallel, config.parallel.world_size
    if parallel.backend == "nccl" and config.trainer.device == "cpu":
        raise ValueError("parallel.backend: nccl needs GPU trainer ranks, but trainer.device is cpu (use gloo)")
    if parallel.backend == "gloo" and config.trainer.device == "cuda":
        raise ValueError("parallel.backend: gloo runs CPU trainer ranks, but trainer.device is cuda (use nccl)")
    if ranks > 1 and config.runtime.name == "local":
        raise ValueError(
            f"parallel.dp: dp*cp = {ranks} trainer ranks need runtime.name ray (the local runtime runs one)"
        )
    if config.generation.num_workers > 1 and config.runtime.name == "local":
        raise ValueError(
            f"generation.num_workers: {config.generation.num_workers} rollout workers need runtime.name ray "
            "(the local runtime runs one)"
        )
    sequences = config.grpo.prompts_per_step * config.grpo.generations_per_prompt
    if parallel.dp > sequences:
        raise ValueError(f"parallel.dp: {parallel.dp} data-parallel ranks but only {sequences} sequences per step")


def overlong_cache_fits(config: RunConfig) -> None:
    cache, limit = config.rewards.overlong_cache, config.generation.max_new_tokens
    if "overlong" in config.rewards.functions and cache > limit:
        raise ValueError(f"rewards.overlong_cache: {cache} is more than generation.max_new_tokens {limit}")


def task_reward(config: RunConfig) -> None:
    has_checker, checker_required = config.data._checker
    if checker_required and "task" not in config.rewards.functions:
        raise ValueError(
            f"rewards.functions: data.task {config.data.task} is scored by its own checker; "
            "list task (rewards.functions=[task])"
        )
    if not has_checker and "task" in config.rewards.functions:
        raise ValueError(
            f"rewards.functions: the task reward needs a task with its own checker; data.task '{config.data.task}' has none"
        )


def behaviour_clip_is_one_update(config: RunConfig) -> None:
    if config.loss.clip_against != "behaviour":
        return
    if config.grpo.num_minibatches * config.grpo.num_epochs > 1:
        raise ValueError(
            "loss.clip_against: behaviour takes one update per step; set grpo.num_minibatches and num_epochs to 1"
        )
    if config.loss.importance_sampling not in ("auto", "none"):
        raise ValueError(
            f"loss.importance_sampling: {config.loss.importance_sampling} with clip_against behaviour; the "
            "ratio to the behaviour policy is already the importance weight (use auto or none)"
        )


def context_parallel_architecture(config: RunConfig) -> None:
    """Context parallelism and packing reimplement attention (across ranks, within packed
    sequences); an architecture they were not checked on could silently attend to something else,
    so it is refused."""
    config_file = None if config.model.path is None else Path(config.model.path).expanduser() / "config.json"
    if config_file is None or not config_file.is_file():
        return
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type in CONTEXT_PARALLEL_MODEL_TYPES:
        return
    verified = f"{', '.join(CONTEXT_PARALLEL_MODEL_TYPES)} (docs/parallelism.md)"
    if config.parallel.cp > 1:
        raise ValueError(
            f"parallel.cp: model.path holds a '{model_type}' model; context parallelism is verified for "
            f"{verified}, so use parallel.cp=1"
        )
    if config.trainer.packing:
        raise ValueError(
            f"trainer.packing: model.path holds a '{model_type}' model; packing is verified for {verified}, "
            "so use trainer.packing=false"
        )


def transport_needs_ray(config: RunConfig) -> None:
    if config.sync.transport != "auto" and config.runtime.name == "local":
        raise ValueError(
            f"sync.transport: {config.sync.transport} needs runtime.name ray (the local runtime hands weights over in memory)"
        )


def episodes_template_themselves(config: RunConfig) -> None:
    """An episode applies the chat template to its environment's messages; a prompt text that is
    templated already would be wrapped twice."""
    if config.environment.name is not None and config.data.chat_template:
        raise ValueError(
            "data.chat_template: environment.name is set, and an episode templates its messages itself; "
            "set data.chat_template=false"
        )


CROSS_FIELD_CHECKS = (
    parallel_ranks,
    overlong_cache_fits,
    task_reward,
    behaviour_clip_is_one_update,
    context_parallel_architecture,
    transport_needs_ray,
    episodes_template_themselves,
)
