"""The vllm backend's options: the servers behind ``generation.backend.name: vllm``.

A plain pydantic model, with no torch and no vLLM, so the configuration reference lists it and a
config names its keys (``generation.backend.options.url``) like any part's options.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.config import Section


class VLLMOptions(Section):
    """``generation.backend.options`` of ``vllm``: its servers, one per rollout worker (docs/generation.md)."""

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
