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
    sequences = config.step.prompts_per_step * config.step.generations_per_prompt
    if parallel.dp > sequences:
        raise ValueError(f"parallel.dp: {parallel.dp} data-parallel ranks but only {sequences} sequences per step")


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
    context_parallel_architecture,
    transport_needs_ray,
    episodes_template_themselves,
)
