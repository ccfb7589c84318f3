"""The ``generation`` and ``vllm`` sections: how rollouts are sampled, and by which servers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config.base import Section

MIN_TEMPERATURE = 1e-6  # logits / T stays finite in float32 for any logit below 3.4e32


class VLLMConfig(Section):
    """The vLLM servers behind generation.backend vllm, one per rollout worker (docs/generation.md)."""

    url: str | None = Field(
        None, description="an OpenAI-compatible vLLM server to use; null starts one per rollout worker"
    )
    python: str | None = Field(
        None, description="interpreter of the vLLM environment; null: the one `asyncrl vllm-env` creates"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights and compute of a started server; auto: bfloat16 on a GPU, else trainer.dtype "
        "(float32 for float64)",
    )
    enforce_eager: bool = Field(
        False, description="no CUDA graphs in a started GPU server (faster start, slower decoding); CPU is always eager"
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="context of a started server, the longest request; null: the task's longest prompt plus "
        "generation.max_new_tokens, with an environment its longest templated opening plus "
        "environment.max_tokens plus generation.max_new_tokens",
    )
    kv_cache_mib: int | None = Field(
        None,
        ge=1,
        description="KV cache of a started server; null: on CPU a step's sequences at max_model_len (at "
        "most 4 GiB, at least one sequence), on a GPU what gpu_memory_utilization leaves",
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="share of GPU memory a started server takes with kv_cache_mib null (the trainer may share the GPU)",
    )
    startup_timeout_s: float = Field(600.0, gt=0.0, description="a started server must answer /health within this")
    request_timeout_s: float = Field(600.0, gt=0.0, description="limit of one HTTP call to the server")
    max_restarts: int = Field(3, ge=0, description="times a started server that died is restarted (and re-synced)")
    weight_transfer: Literal["auto", "file", "collective"] = Field(
        "auto",
        description="how weights reach a server: file (safetensors in /dev/shm), collective (a process group with "
        "the server's worker: NCCL with a GPU, else gloo); auto: collective from a CUDA trainer, else file",
    )
    extra_args: list[str] = Field(default_factory=list, description="more command-line arguments of a started server")


class GenerationConfig(Section):
    """How rollouts are sampled."""

    backend: str = Field(
        "hf",
        description="generation backend: hf (transformers in process), vllm (vLLM servers, section vllm), or "
        "package.module:attr (docs/plugins.md); resolved when the generator is built, as backends import torch",
    )
    backend_options: dict[str, Any] = Field(
        default_factory=dict,
        description="settings of a backend that declares them (its Options model); built-ins take none",
    )
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
    def _backend_named(self) -> GenerationConfig:
        from asyncrl.plugins import check_spec

        check_spec("backend", self.backend, "generation.backend")
        return self

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
