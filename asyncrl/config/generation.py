"""The ``generation`` section: how rollouts are sampled, and by which backend."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from asyncrl.config.base import PartSection, Section

MIN_TEMPERATURE = 1e-6  # logits / T stays finite in float32 for any logit below 3.4e32


class BackendConfig(PartSection):
    """The generation backend part: a name and its options, like every part (docs/plugins.md)."""

    kind, at = "backend", "generation.backend"

    name: str = Field(
        "hf",
        description="hf (transformers in process), vllm (vLLM servers; docs/configuration.md lists its options), or "
        "package.module:attr (docs/plugins.md); resolved when the generator is built, as backends import torch",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="the backend's settings (its Options model); hf takes none"
    )


class GenerationConfig(Section):
    """How rollouts are sampled."""

    backend: BackendConfig = Field(default_factory=BackendConfig, description="the generation backend")
    max_new_tokens: int = Field(16, ge=1, description="response length limit")
    temperature: float = Field(
        1.0, ge=0.0, description="sampling temperature of rollouts, at least 1e-6 (evaluation is always greedy)"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass; 1 disables it")
    top_k: int = Field(0, ge=0, description="top-k sampling, at least 2; 0 disables it")
    batch_size: int = Field(
        128, ge=1, description="sequences per generation forward (the tiny default model takes a whole step at once)"
    )
    num_workers: int = Field(
        1, ge=1, description="rollout workers, each with its own generator: Ray actors; the local runtime runs one"
    )

    @model_validator(mode="after")
    def _samples_can_differ(self) -> GenerationConfig:
        """Rollouts must be sampled: identical samples of a prompt give every advantage 0."""
        if self.temperature == 0 or self.top_k == 1:
            setting = "temperature 0 (greedy)" if self.temperature == 0 else "top_k 1"
            raise ValueError(
                f"generation.{'temperature' if self.temperature == 0 else 'top_k'}: {setting} makes the samples of a "
                "prompt identical, so every advantage is 0; evaluation is greedy already"
            )
        if self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"generation.temperature: {self.temperature:g} is so small that logits / temperature can overflow "
                f"float32, the sampler's dtype; use at least {MIN_TEMPERATURE:g}"
            )
        return self
