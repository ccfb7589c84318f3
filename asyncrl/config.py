"""The run configuration: pydantic models, YAML loading, dotted overrides, cross-field checks.

Every problem is reported as a one-line ``ConfigError`` that names the field, at load time, so a
run never starts with a configuration that would deadlock or silently mean something else.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class ConfigError(ValueError):
    """A configuration problem, always a single line naming the offending field."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    """The policy model: a local Hugging Face checkpoint, or the built-in tiny model."""

    path: str | None = Field(None, description="local HF causal LM directory; null builds the tiny model below")
    arch: Literal["qwen2", "llama"] = Field("qwen2", description="tiny model architecture")
    hidden_size: int = Field(128, ge=8, description="tiny model width")
    num_layers: int = Field(2, ge=1, description="tiny model depth")
    num_heads: int = Field(4, ge=1, description="tiny model attention heads; must divide hidden_size")
    num_kv_heads: int = Field(2, ge=1, description="tiny model key/value heads; must divide num_heads")
    intermediate_size: int = Field(512, ge=8, description="tiny model MLP width")
    init_seed: int = Field(0, description="seed of the tiny model's initialization")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        return self


class TokenizerConfig(Section):
    """The tokenizer: a local HF tokenizer, the one saved with model.path, or the char tokenizer."""

    path: str | None = Field(None, description="local HF tokenizer directory; null: model.path, else char-level")


class DataConfig(Section):
    """Where prompts and reference answers come from."""

    task: str = Field(
        "running_sum",
        description="built-in task (arithmetic, running_sum; docs/data.md), jsonl / parquet for a local file, "
        "hf_dataset for a Hugging Face dataset directory, reasoning_gym, or package.module:Class (docs/plugins.md)",
    )
    path: str | None = Field(None, description="the jsonl / parquet file, or the hf_dataset directory")
    eval_path: str | None = Field(
        None, description="a jsonl / parquet file of held-out rows; null: the last eval_size rows of path are held out"
    )
    split: str = Field("train", description="hf_dataset: the split trained on")
    eval_split: str | None = Field(
        None, description="hf_dataset: the held-out split; null: the last eval_size rows of split are held out"
    )
    prompt_field: str = Field("prompt", description="row field holding the prompt")
    answer_field: str = Field("answer", description="row field holding the reference answer")
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template")
    difficulty: int = Field(2, ge=1, description="built-in task difficulty (levels in docs/data.md)")
    task_seed: int = Field(0, description="built-in tasks: seed choosing the problems and their train / held-out split")
    num_problems: int = Field(
        10000, ge=2, description="built-in tasks: distinct problems drawn (held-out first); a level may have fewer"
    )
    shuffle_seed: int = Field(0, description="seed of the prompt order")
    epochs: int | None = Field(None, ge=1, description="passes over the train split; null repeats it forever")
    eval_size: int = Field(256, ge=1, description="held-out prompts per evaluation")
    dataset: str | None = Field(
        None,
        description="reasoning_gym: the dataset name, e.g. chain_sum; the char tokenizer "
        "encodes digits, letters, space, newline and +-*/=()?.,:;!<> only; other text is rejected (docs/data.md)",
    )
    dataset_config: dict[str, Any] = Field(
        default_factory=dict, description="reasoning_gym: the dataset's settings, e.g. {min_terms: 2, max_terms: 2}"
    )

    task_options: dict[str, Any] = Field(
        default_factory=dict,
        description="settings of a task that declares them (its Options model, docs/plugins.md); built-ins take none",
    )

    _checker: tuple[bool, bool] = PrivateAttr((False, False))  # the task's has_checker, checker_required

    @model_validator(mode="after")
    def _task_known(self) -> DataConfig:
        """Builds the task part once, which checks its name, options and settings, and keeps what it
        declares about its checker; its prompts are read only when the run builds the task."""
        from asyncrl.data.tasks import task_source

        source = task_source(self)
        self._checker = (getattr(source, "has_checker", False), getattr(source, "checker_required", False))
        return self


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
        description="context of a started server, prompt plus response; null: the task's longest prompt "
        "plus generation.max_new_tokens",
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


class RewardConfig(Section):
    """How responses are scored."""

    functions: list[str] = Field(
        default_factory=lambda: ["exact_match"],
        description="exact_match, numeric_match, math, format, overlong, task (the task's own checker: "
        "reasoning_gym, running_sum), or package.module:attr (docs/plugins.md); the first one decides accuracy",
    )
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="settings of a listed reward that declares them (its Options model), by its entry in functions; "
        "built-ins take theirs from the keys below",
    )
    weights: list[float] | None = Field(None, description="one weight per function; null: all 1")
    timeout_s: float = Field(5.0, gt=0.0, description="wall-clock limit of one reward call; past it the reward is 0")
    format_pattern: str | None = Field(
        None, description="regex the whole stripped completion must match for the format reward; null: the task's own"
    )
    overlong_cache: int | None = Field(
        None,
        ge=1,
        description="L_cache of the overlong reward: 0 up to generation.max_new_tokens - L_cache tokens, then "
        "linearly down to -1 at max_new_tokens (DAPO); required with overlong",
    )
    processes: int = Field(
        4,
        ge=1,
        description="worker processes the reward calls run in, started on the first batch; a call past "
        "timeout_s has its process killed and replaced",
    )

    @model_validator(mode="after")
    def _functions_valid(self) -> RewardConfig:
        from asyncrl.rewards.functions import reward_part

        if not self.functions:
            raise ValueError("rewards.functions: at least one reward function is needed")
        for name in self.options:
            if name not in self.functions:
                raise ValueError(f"rewards.options.{name}: not in rewards.functions")
        for name in self.functions:
            if self.functions.count(name) > 1:
                raise ValueError(f"rewards.functions: '{name}' is listed twice")
            reward_part(name, self.options.get(name))
        if "overlong" in self.functions and self.overlong_cache is None:
            raise ValueError("rewards.overlong_cache: the overlong reward needs a cache length L_cache")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(f"rewards.weights: {len(self.weights)} weights for {len(self.functions)} functions")
        if self.weights is not None and not any(self.weights):
            raise ValueError("rewards.weights: all 0, so every reward and every advantage is 0")
        if self.format_pattern is not None:
            try:
                re.compile(self.format_pattern)
            except re.error as err:
                raise ValueError(f"rewards.format_pattern: invalid regex ({err})") from None
        return self


class AlgorithmConfig(Section):
    """The RL algorithm: advantages, the informative-group test, the per-token loss (asyncrl/algorithms)."""

    name: str = Field(
        "grpo", description="grpo (its variants are loss and grpo options), or package.module:attr (docs/plugins.md)"
    )

    @model_validator(mode="after")
    def _named(self) -> AlgorithmConfig:
        from asyncrl.plugins import check_spec

        check_spec("algorithm", self.name, "algorithm.name")
        return self


class GRPOConfig(Section):
    """Step shape and advantages."""

    prompts_per_step: int = Field(16, ge=1, description="P: prompt groups per optimizer step")
    generations_per_prompt: int = Field(8, ge=1, description="n: samples per prompt")
    step_batch_size: int | None = Field(None, ge=1, description="sequences per step; must equal P*n if given")
    max_steps: int = Field(400, ge=1, description="optimizer steps of the run (also the cosine schedule's length)")
    baseline: Literal["mean", "leave_one_out"] = Field("mean", description="advantage baseline within a group")
    scale_by_std: bool = Field(True, description="divide advantages by the group std; false is Dr. GRPO")
    filter_zero_variance: bool = Field(False, description="drop groups whose rewards are all equal")
    mask_truncated: bool = Field(
        False, description="leave responses cut off by generation.max_new_tokens (finish reason length) out of the loss"
    )
    max_refill_groups: int = Field(
        0,
        ge=0,
        description="dynamic sampling: per step, up to this many replacement prompts are generated for groups that "
        "filter_zero_variance dropped, so the step trains prompts_per_step informative groups; 0 disables refill",
    )
    min_groups_per_chunk: int = Field(1, ge=1, description="stream a step in chunks of at least this many groups")
    num_minibatches: int = Field(
        1,
        ge=1,
        description="K: split a step's groups into K mini-batches, one optimizer update each, all clipped against "
        "logprobs taken once at step start (the clip acts from the second update); 1 streams the step into one update",
    )
    num_epochs: int = Field(
        1,
        ge=1,
        description="E: passes over a step's mini-batches, each after the first in a seeded order; a step takes K*E "
        "updates",
    )

    @model_validator(mode="after")
    def _batch_size_consistent(self) -> GRPOConfig:
        expected = self.prompts_per_step * self.generations_per_prompt
        if self.step_batch_size is not None and self.step_batch_size != expected:
            raise ValueError(
                f"grpo.step_batch_size: {self.step_batch_size} != prompts_per_step * generations_per_prompt "
                f"= {self.prompts_per_step} * {self.generations_per_prompt} = {expected}"
            )
        if self.baseline == "leave_one_out" and self.generations_per_prompt < 2:
            raise ValueError("grpo.baseline: leave_one_out needs generations_per_prompt >= 2")
        if self.max_refill_groups and not self.filter_zero_variance:
            raise ValueError(
                "grpo.max_refill_groups: refill replaces filtered groups; set grpo.filter_zero_variance=true"
            )
        if self.num_minibatches > self.prompts_per_step:
            raise ValueError(f"grpo.num_minibatches: {self.num_minibatches} > prompts_per_step {self.prompts_per_step}")
        if self.generations_per_prompt < 2:
            raise ValueError(
                "grpo.generations_per_prompt: 1 sample per prompt makes every advantage 0 (a group's baseline is "
                "its own reward); use at least 2"
            )
        if self.min_groups_per_chunk > self.prompts_per_step:
            raise ValueError(
                f"grpo.min_groups_per_chunk: {self.min_groups_per_chunk} > prompts_per_step {self.prompts_per_step}"
            )
        return self


class LossConfig(Section):
    """The per-token GRPO loss and its aggregation (docs/loss.md)."""

    mode: AggMode = Field("token-mean", description="loss aggregation mode (normalization contract)")
    norm_constant: float | None = Field(None, gt=0.0, description="C of seq-mean-token-sum-norm")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="ratio clip below: 1 - clip_low")
    clip_high: float = Field(0.28, ge=0.0, description="ratio clip above: 1 + clip_high")
    dual_clip: float | None = Field(
        3.0, gt=1.0, description="cap the loss of a negative advantage A at dual_clip times -A; null disables"
    )
    clip_against: Literal["proximal", "behaviour"] = Field(
        "proximal",
        description="proximal: ratio to the trainer's logprobs at step start (identically 1 with one update per step, "
        "so the clip acts only with grpo.num_minibatches or num_epochs > 1); behaviour: ratio to the generator's "
        "logprobs, which bounds stale data directly (one update per step; no separate importance weight)",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="token: each token's own ratio is clipped (PPO); sequence: every token of a response uses the "
        "geometric mean of its token ratios, clipped per sequence (GSPO)",
    )
    importance_sampling: Literal["auto", "none", "tis", "icepop"] = Field(
        "auto",
        description="off-policy correction; auto: tis whenever the generator's distribution can differ from the "
        "trainer's (sampler.max_lag > 0 or trainer.dtype bfloat16), else none; none with clip_against behaviour",
    )
    is_cap: float = Field(2.0, gt=0.0, description="tis: importance weights are clamped at this cap")
    is_low: float = Field(0.5, ge=0.0, description="icepop: weights below this are zeroed")
    is_high: float = Field(2.0, gt=0.0, description="icepop: weights above this are zeroed")
    kl_coef: float = Field(0.0, ge=0.0, description="k3 KL penalty to a frozen reference; 0 disables")
    kl_log_ratio_clamp: float = Field(20.0, gt=0.0, description="KL input clamp on the magnitude of lp_ref - lp")
    kl_clamp: float = Field(10.0, gt=0.0, description="KL output clamp")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus coefficient")
    track_entropy: bool = Field(True, description="report policy entropy even when entropy_coef is 0")

    @model_validator(mode="after")
    def _mode_constants(self) -> LossConfig:
        if self.mode == "seq-mean-token-sum-norm" and self.norm_constant is None:
            raise ValueError("loss.norm_constant: required when loss.mode is seq-mean-token-sum-norm")
        if self.is_low >= self.is_high:
            raise ValueError(f"loss.is_low: {self.is_low} must be below loss.is_high {self.is_high}")
        if self.ratio_level == "sequence" and self.importance_sampling == "icepop":
            raise ValueError(
                "loss.importance_sampling: icepop drops single tokens, but with ratio_level sequence each token still "
                "moves its sequence's ratio (use tis, none or auto)"
            )
        return self


class SamplerConfig(Section):
    """The staleness contract between the rollout and train loops."""

    name: str = Field(
        "in_order", description="in_order, weight_fifo, windowed, or package.module:Class (docs/plugins.md)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="settings of a sampler that declares them (its Options model); built-ins take none",
    )
    max_lag: int = Field(1, ge=0, description="how many weight versions behind trained data may be; 0 is synchronous")
    buffer_capacity: int | None = Field(
        None, ge=1, description="replay buffer size in groups; null: the sampler's minimum plus grpo.max_refill_groups"
    )


class TrainerConfig(Section):
    """Optimizer, schedule and numerics of the policy trainer."""

    optimizer: Literal["adamw"] = Field("adamw", description="optimizer")
    lr: float = Field(3e-4, gt=0.0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    lr_schedule: Literal["constant", "cosine"] = Field("cosine", description="schedule after warmup")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine floor as a fraction of lr")
    micro_batch_size: int = Field(
        128, ge=1, description="sequences per forward/backward (the tiny default model takes a whole step at once)"
    )
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="gradient clipping norm; null disables")
    max_step_retries: int = Field(
        0, ge=0, description="reruns of a train step that raised (after it is aborted) before the run stops"
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=0,
        description="consecutive steps with a non-finite loss or gradient that are skipped (weights untouched) "
        "before the run stops; 0 stops at the first",
    )
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32",
        description="compute dtype; bfloat16 runs forward and backward in bfloat16 over float32 master parameters and "
        "optimizer state, and the generators get bfloat16 weights",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each transformer block's activations in the backward pass instead of keeping them"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")

    @model_validator(mode="after")
    def _betas_in_range(self) -> TrainerConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"trainer.betas: {list(self.betas)} must each be in [0, 1)")
        return self


class RuntimeConfig(Section):
    """Where workers run."""

    name: Literal["local", "ray"] = Field("local", description="local: one process, worker threads; ray: actors")
    max_inflight_groups: int | None = Field(None, ge=1, description="dispatched, uncommitted groups; null: capacity")
    max_rollout_retries: int = Field(
        2, ge=0, description="retries of a failed rollout before on_rollout_failure applies"
    )
    on_rollout_failure: Literal["stop", "skip"] = Field(
        "stop",
        description="a prompt whose generation keeps failing: stop the run, or skip it (counted) and generate the "
        "next prompt in its place",
    )
    watchdog_s: float | None = Field(
        900.0,
        gt=0.0,
        description="stop the run, naming what each loop waits on, after this long without progress; null disables",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads per torch op; null: cores / 2 on the local runtime, a Ray actor's CPUs (at least 1) on ray",
    )
    address: str | None = Field(
        None, description="ray: null starts a local Ray cluster for the run; auto or host:port joins a running one"
    )
    controller_actor: bool = Field(
        False, description="ray: run the controller inside a CPU actor on the driver's node instead of in the driver"
    )
    generator_cpus: float = Field(1.0, ge=0.0, description="ray: CPUs reserved by each rollout worker actor")
    generator_gpus: float = Field(0.0, ge=0.0, description="ray: GPUs reserved by each rollout worker actor")
    trainer_cpus: float = Field(1.0, ge=0.0, description="ray: CPUs reserved by each trainer rank actor")
    trainer_gpus: float = Field(0.0, ge=0.0, description="ray: GPUs reserved by each trainer rank actor")
    generator_restarts: int = Field(
        3, ge=0, description="ray: times a dead rollout worker actor is restarted (it reloads the latest weights)"
    )

    @model_validator(mode="after")
    def _ray_fields_need_ray(self) -> RuntimeConfig:
        if self.name == "local" and self.address is not None:
            raise ValueError("runtime.address: set, but runtime.name is local; use runtime.name=ray")
        if self.name == "local" and self.controller_actor:
            raise ValueError("runtime.controller_actor: needs runtime.name ray")
        return self


class ParallelConfig(Section):
    """Trainer ranks: data parallel (dp) times context parallel (cp), see docs/parallelism.md."""

    dp: int = Field(1, ge=1, description="data-parallel ranks: each trains its own sequences of the step")
    cp: int = Field(1, ge=1, description="context-parallel ranks per sequence: each holds 2 of its 2*cp chunks")
    wrap: Literal["fsdp", "ddp"] = Field(
        "fsdp", description="fsdp: FSDP2 shards parameters over all dp*cp ranks; ddp: every rank holds them all"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="collectives; auto: nccl on cuda, gloo on cpu")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp


class SyncConfig(Section):
    """Weight sync from the trainer to the generators."""

    mode: Literal["drain", "inflight"] = Field(
        "inflight", description="drain: wait for in-flight rollouts first; inflight: they finish on old weights"
    )
    timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="closing the rollout gate, exporting the weights or loading them into the generators taking "
        "longer than this fails the run; waiting for running generation does not count",
    )
    transport: Literal["auto", "object_store", "broadcast"] = Field(
        "auto",
        description="ray: how weights reach the generators; object_store: rank 0 exports to Ray's object store; "
        "broadcast: a process group of rank 0 and the generators (NCCL when each has a whole GPU, else gloo); auto: "
        "broadcast when that is NCCL, else object_store",
    )


TINY_WARM_START_STEPS = 600
CONTEXT_PARALLEL_MODEL_TYPES = ("gemma2", "gemma3_text", "gpt2", "llama", "mistral", "phi3", "qwen2", "qwen3")


class WarmStartConfig(Section):
    """A short supervised warm start on the train split, cached on disk, before GRPO begins."""

    steps: int | None = Field(
        None,
        ge=0,
        description="supervised steps; 0 skips the warm start; null: 600 for the built-in tiny model, 0 with model.path "
        "(a pretrained model would lose its own skills to it), so a checkpoint warm-starts only when this is set",
    )
    lr: float = Field(3e-3, gt=0.0, description="warm start learning rate")
    batch_size: int = Field(64, ge=1, description="examples per warm start step")
    seed: int = Field(
        0,
        description="seed of the warm start's batch order; independent of the run seed, so every seed of a run starts "
        "from the same warm-started policy, as the seeds of a real run start from one checkpoint",
    )
    cache_dir: str = Field("~/.cache/asyncrl/warm_start", description="where warm-started weights are cached")


class CheckpointConfig(Section):
    """When run state is saved."""

    every_steps: int | None = Field(200, ge=1, description="save every k steps (and at the end); null: only at the end")
    keep_last: int = Field(2, ge=1, description="checkpoints kept on disk")


class LoggingConfig(Section):
    """Outputs, evaluation cadence and metric sinks."""

    output_dir: str | None = Field(
        None,
        description="run directory (metrics, checkpoints, report); null: runs/<date>-<time>; must not hold another run",
    )
    eval_every_steps: int | None = Field(50, ge=1, description="held-out evaluation cadence; null: start and end only")
    tensorboard: bool = Field(True, description="write TensorBoard event files")
    wandb: bool = Field(False, description="log to Weights & Biases when it is installed")
    progress: bool = Field(True, description="live progress display")


class FaultsConfig(Section):
    """Injected faults, for testing how a run survives them (docs/reliability.md); all off by default."""

    generate_errors: list[int] = Field(
        default_factory=list, description="generation calls of a rollout worker (0-based, in call order) that raise"
    )
    failing_prompts: list[str] = Field(
        default_factory=list, description="prompt uids whose generation raises on every attempt"
    )
    eval_errors: list[int] = Field(
        default_factory=list, description="evaluation calls of a rollout worker (0-based, in call order) that raise"
    )
    hang_generate_calls: list[int] = Field(
        default_factory=list, description="generation calls of a rollout worker that hang for hang_s first"
    )
    hang_s: float = Field(30.0, gt=0.0, description="how long an injected hang lasts")
    train_errors: list[int] = Field(
        default_factory=list, description="train steps whose first attempt raises after its first chunk"
    )
    nonfinite_steps: list[int] = Field(
        default_factory=list, description="train steps whose gradients are made NaN, on every attempt"
    )
    slow_sync_s: float = Field(0.0, ge=0.0, description="every weight load into a generator first sleeps this long")
    load_errors: list[int] = Field(
        default_factory=list, description="weight loads into a rollout worker (0-based, in call order) that raise"
    )
    kill_in_checkpoint: int | None = Field(
        None, ge=1, description="the process kills itself (SIGKILL) while writing the checkpoint of this step"
    )


class RunConfig(Section):
    """One asyncrl run."""

    _required_capacity: int = PrivateAttr(0)  # the sampler's buffer minimum, found while validating

    seed: int = Field(0, description="run seed: sampling seeds derive from it, the prompt uid and the sample index")
    model: ModelConfig = Field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)

    @model_validator(mode="after")
    def _warm_start_steps(self) -> RunConfig:
        if self.warm_start.steps is None:
            self.warm_start.steps = 0 if self.model.path is not None else TINY_WARM_START_STEPS
        return self

    @model_validator(mode="after")
    def _sampler_capacity(self) -> RunConfig:
        """Builds the sampler once, which checks its name and options, and keeps the capacity it needs
        (the run builds its own: a sampler has state)."""
        from asyncrl.control.sampler import build_sampler

        sampler = build_sampler(
            self.sampler.name, self.grpo.prompts_per_step, self.sampler.max_lag, self.sampler.options
        )
        required = sampler.required_capacity(self.grpo.prompts_per_step) + self.grpo.max_refill_groups
        self._required_capacity = required
        capacity = self.sampler.buffer_capacity
        if capacity is not None and capacity < required:
            why = "prompts_per_step * (max_lag + 1) for a gated sampler; less would deadlock"
            if self.grpo.max_refill_groups:
                why += ", plus grpo.max_refill_groups, so refills never take an admission's slot"
            raise ValueError(
                f"sampler.buffer_capacity: {capacity} < {required} groups required by sampler "
                f"'{self.sampler.name}' ({why if sampler.gated else 'one step of groups'})"
            )
        return self

    @model_validator(mode="after")
    def _parallel_ranks(self) -> RunConfig:
        parallel, ranks = self.parallel, self.parallel.world_size
        if parallel.backend == "nccl" and self.trainer.device == "cpu":
            raise ValueError("parallel.backend: nccl needs GPU trainer ranks, but trainer.device is cpu (use gloo)")
        if parallel.backend == "gloo" and self.trainer.device == "cuda":
            raise ValueError("parallel.backend: gloo runs CPU trainer ranks, but trainer.device is cuda (use nccl)")
        if ranks > 1 and self.runtime.name == "local":
            raise ValueError(
                f"parallel.dp: dp*cp = {ranks} trainer ranks need runtime.name ray (the local runtime runs one)"
            )
        if self.generation.num_workers > 1 and self.runtime.name == "local":
            raise ValueError(
                f"generation.num_workers: {self.generation.num_workers} rollout workers need runtime.name ray "
                "(the local runtime runs one)"
            )
        sequences = self.grpo.prompts_per_step * self.grpo.generations_per_prompt
        if parallel.dp > sequences:
            raise ValueError(f"parallel.dp: {parallel.dp} data-parallel ranks but only {sequences} sequences per step")
        return self

    @model_validator(mode="after")
    def _overlong_cache_fits(self) -> RunConfig:
        cache, limit = self.rewards.overlong_cache, self.generation.max_new_tokens
        if "overlong" in self.rewards.functions and cache > limit:
            raise ValueError(f"rewards.overlong_cache: {cache} is more than generation.max_new_tokens {limit}")
        return self

    @model_validator(mode="after")
    def _task_reward(self) -> RunConfig:
        has_checker, checker_required = self.data._checker
        if checker_required and "task" not in self.rewards.functions:
            raise ValueError(
                f"rewards.functions: data.task {self.data.task} is scored by its own checker; "
                "list task (rewards.functions=[task])"
            )
        if not has_checker and "task" in self.rewards.functions:
            raise ValueError(
                f"rewards.functions: the task reward needs a task with its own checker; data.task '{self.data.task}' has none"
            )
        return self

    @model_validator(mode="after")
    def _behaviour_clip_is_one_update(self) -> RunConfig:
        if self.loss.clip_against != "behaviour":
            return self
        if self.grpo.num_minibatches * self.grpo.num_epochs > 1:
            raise ValueError(
                "loss.clip_against: behaviour takes one update per step; set grpo.num_minibatches and num_epochs to 1"
            )
        if self.loss.importance_sampling not in ("auto", "none"):
            raise ValueError(
                f"loss.importance_sampling: {self.loss.importance_sampling} with clip_against behaviour; the "
                "ratio to the behaviour policy is already the importance weight (use auto or none)"
            )
        return self

    @model_validator(mode="after")
    def _context_parallel_architecture(self) -> RunConfig:
        """Context parallelism reimplements attention across ranks; an architecture it was not
        checked on could silently attend to something else, so it is refused."""
        config_file = None if self.model.path is None else Path(self.model.path).expanduser() / "config.json"
        if self.parallel.cp == 1 or config_file is None or not config_file.is_file():
            return self
        model_type = json.loads(config_file.read_text()).get("model_type")
        if model_type not in CONTEXT_PARALLEL_MODEL_TYPES:
            raise ValueError(
                f"parallel.cp: model.path holds a '{model_type}' model; context parallelism is verified for "
                f"{', '.join(CONTEXT_PARALLEL_MODEL_TYPES)} (docs/parallelism.md), so use parallel.cp=1"
            )
        return self

    @model_validator(mode="after")
    def _transport_needs_ray(self) -> RunConfig:
        if self.sync.transport != "auto" and self.runtime.name == "local":
            raise ValueError(
                f"sync.transport: {self.sync.transport} needs runtime.name ray (the local runtime hands weights over in memory)"
            )
        return self

    @property
    def weight_transport(self) -> Literal["in_process", "object_store", "broadcast"]:
        """How a sync moves weights: ``sync.transport`` with ``auto`` resolved."""
        if self.runtime.name == "local":
            return "in_process"
        if self.sync.transport == "auto":
            return "broadcast" if self.broadcast_backend == "nccl" else "object_store"
        return self.sync.transport

    @property
    def broadcast_backend(self) -> Literal["nccl", "gloo"]:
        """NCCL when trainer rank 0 and the generators each have a whole GPU of their own (on Ray an
        actor sees a GPU only when it reserves one; generators use ``trainer.device`` too; NCCL
        refuses two members on one GPU, which fractional GPUs allow), gloo otherwise."""
        gpus = self.runtime.trainer_gpus >= 1 and self.runtime.generator_gpus >= 1
        return "nccl" if gpus and self.trainer.device != "cpu" else "gloo"

    @property
    def buffer_capacity(self) -> int:
        """The configured capacity, or the sampler's minimum when none is given."""
        if self.sampler.buffer_capacity is not None:
            return self.sampler.buffer_capacity
        return self._required_capacity

    @property
    def importance_sampling(self) -> str:
        """The effective importance-sampling mode: ``auto`` is tis whenever the behaviour and the
        trainer's distributions can differ: lagged weights, or bfloat16, where the generator's
        cached decoding and the trainer's forward round differently. Top-k and top-p do not: the
        trainer scores the same truncated distribution."""
        if self.loss.importance_sampling != "auto":
            return self.loss.importance_sampling
        if self.loss.clip_against == "behaviour":
            return "none"
        differ = self.sampler.max_lag > 0 or self.trainer.dtype == "bfloat16"
        return "tis" if differ else "none"

    @property
    def scoring_temperature(self) -> float:
        """The temperature the trainer divides logits by: the one rollouts sample at (validation
        keeps it above 0, so logits / temperature is finite)."""
        return self.generation.temperature


def _unknown_key_error(path: tuple[str, ...], key: str, valid: list[str]) -> ConfigError:
    dotted = ".".join((*path, key))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f" (did you mean '{'.'.join((*path, close[0]))}'?)" if close else f" (valid keys: {', '.join(valid)})"
    return ConfigError(f"{dotted}: unknown key{hint}")


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds, or None for a plain value."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _numeric(annotation: Any) -> bool:
    """int or float, optional or not, or a list or tuple of them."""
    if annotation in (int, float):
        return True
    args = [a for a in get_args(annotation) if a is not type(None) and a is not Ellipsis]
    return bool(args) and all(_numeric(a) for a in args)


def _textual(annotation: Any) -> bool:
    """str, optional or not."""
    return annotation is str or set(get_args(annotation)) == {str, type(None)}


def _scalars(value: Any) -> list:
    """A list or tuple value's items; any other value alone."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _check_keys(model: type[BaseModel], data: Any, path: tuple[str, ...] = ()) -> None:
    """Reject unknown keys anywhere in the tree (suggesting the closest valid one), a value where a
    section belongs, and true / false where a number belongs (pydantic would read them as 1 / 0)."""
    fields = model.model_fields
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key_error(path, str(key), list(fields))
        dotted = ".".join((*path, key))
        annotation = fields[key].annotation
        section = _section(annotation)
        if section is not None:
            if not isinstance(value, dict):
                example = f"{dotted}.{next(iter(section.model_fields))}"
                raise ConfigError(
                    f"{dotted}: is a section, so it takes keys such as {example}, not a value (got {_shown(value)})"
                )
            _check_keys(section, value, (*path, key))
        elif _numeric(annotation) and any(isinstance(v, bool) for v in _scalars(value)):
            raise ConfigError(f"{dotted}: expected a number, got {_shown(value)}")


def _check_finite(config: BaseModel, path: tuple[str, ...] = ()) -> None:
    """No float anywhere is inf or nan: every one is a size, a rate or a limit (null disables a limit)."""
    for key, value in config:
        dotted = (*path, key)
        if isinstance(value, BaseModel):
            _check_finite(value, dotted)
        elif any(isinstance(v, float) and not math.isfinite(v) for v in _scalars(value)):
            raise ConfigError(f"{'.'.join(dotted)}: must be a finite number (got {_shown(value)})")


SHOWN_CHARS = 200  # an input value echoed in an error is cut to this many characters
MAX_YAML_VALUES = 100_000  # values a YAML document may expand to through aliases; a run config has a few hundred
_NAMES_ITS_FIELD = re.compile(r"^[a-z_]+\.[a-z_]+\S*: ")  # options name their key: rewards.options.m:f.scale


def _format_validation_error(err: ValidationError) -> ConfigError:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if _NAMES_ITS_FIELD.match(message):
        return ConfigError(message)  # a cross-field check already names its field
    if first["type"] == "missing" and first["loc"] and isinstance(first["loc"][-1], int):
        parent = ".".join(str(p) for p in first["loc"][:-1])
        return ConfigError(f"{parent}: too few values (got {_shown(first['input'])})")
    if first["input"] is None:
        default = _shown(_default(first["loc"]))
        return ConfigError(f"{loc}: cannot be null (an empty value is null); give a value, e.g. the default {default}")
    got = "" if isinstance(first["input"], dict) else f" (got {_clipped(repr(first['input']))})"
    return ConfigError(f"{loc or 'config'}: {message}{got}")


def _shown(value: Any) -> str:
    """A value as it is written in YAML or an override: true, null, [0.9, 0.99], .inf; cut short
    past ``SHOWN_CHARS`` so an error message stays one readable line."""
    if isinstance(value, (list, tuple, dict)) and len(value) > SHOWN_CHARS:
        value = list(value)[:SHOWN_CHARS]  # enough to show; dumping all of a huge value is not
    return _clipped(
        yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip().removesuffix("...").strip()
    )


def _clipped(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _default(loc: tuple) -> Any:
    value: Any = RunConfig().model_dump(mode="json")
    for part in loc:
        value = value[part]
    return value


class _YamlLoader(yaml.SafeLoader):
    """``yaml.safe_load``, except that a key given twice in one mapping is an error: YAML would
    silently keep the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' is given twice", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _TooLarge(Exception):
    """A YAML document that would expand past ``MAX_YAML_VALUES`` values, or into itself."""


def _load_yaml(text: str) -> Any:
    """``yaml.load`` with ``_YamlLoader``, refusing (``_TooLarge``) a document whose aliases would
    expand it past ``MAX_YAML_VALUES`` values, before anything is built from it."""
    loader = _YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _count_values(node, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _count_values(node: yaml.Node, counted: dict[int, int], open_nodes: set[int]) -> int:
    """Values in ``node`` once every alias is expanded; an alias reuses the node it names, so a
    node is counted once and ``counted`` keeps the work linear in the document's size."""
    key = id(node)
    if key in counted:
        return counted[key]
    if key in open_nodes:
        raise _TooLarge("an alias refers to a value that contains it")
    open_nodes.add(key)
    children = node.value if isinstance(node.value, list) else []
    total = 1
    for child in children:
        for item in child if isinstance(child, tuple) else (child,):
            total += _count_values(item, counted, open_nodes)
            if total > MAX_YAML_VALUES:
                raise _TooLarge(f"its aliases expand it past {MAX_YAML_VALUES} values")
    open_nodes.discard(key)
    counted[key] = total
    return total


def _set_dotted(data: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override '{override}': expected key=value, e.g. loss.mode=token-mean")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override '{override}': empty key")
    model: type[BaseModel] = RunConfig
    node = data
    for depth, key in enumerate(keys):
        fields = model.model_fields
        if key not in fields:
            raise _unknown_key_error(tuple(keys[:depth]), key, list(fields))
        if depth == len(keys) - 1:
            try:
                value = _load_yaml(raw) if raw.strip() else None
            except _TooLarge as err:
                raise ConfigError(f"{dotted.strip()}: the value is refused: {err}") from None
            except (yaml.YAMLError, RecursionError):
                value = raw
            if _textual(fields[key].annotation) and isinstance(value, (int, float)):
                value = raw.strip()  # data.path=2024 names a file, not a number
            node[key] = value
            return
        section = _section(fields[key].annotation)
        if section is None:
            raise ConfigError(f"{'.'.join(keys[: depth + 1])}: is a value, not a section")
        model = section
        if node.get(key) is None:
            node[key] = {}
        if not isinstance(node[key], dict):
            raise ConfigError(f"{'.'.join(keys[: depth + 1])}: expected a section (a mapping), got {node[key]!r}")
        node = node[key]


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Validate a plain mapping into a RunConfig, raising a one-line ConfigError."""
    _check_keys(RunConfig, data)
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as err:
        raise _format_validation_error(err) from None
    _check_finite(config)
    return config


def _read_yaml(path: Path) -> dict[str, Any]:
    """A config file's mapping; every problem with the file itself is a one-line --config error."""
    if path.is_dir():
        raise ConfigError(f"--config: '{path}' is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"--config: no such file '{path}'")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"--config: cannot read '{path}' ({err.strerror or err})") from None
    try:
        data = _load_yaml(raw.decode("utf-8"))
    except _TooLarge as err:
        raise ConfigError(f"--config: '{path}' is refused: {err}") from None
    except RecursionError:
        raise ConfigError(f"--config: '{path}' is nested too deeply to be a run config") from None
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"--config: '{path}' line {line}: not UTF-8 text; save the file as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None)
        raise ConfigError(f"--config: '{path}'{where}: invalid YAML" + (f" ({problem})" if problem else "")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: '{path}' must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load YAML (or the defaults when ``path`` is None), then apply ``a.b=value`` overrides."""
    data = _read_yaml(Path(path)) if path is not None else {}
    for override in overrides:
        _set_dotted(data, override)
    return config_from_dict(data)


def dump_config(config: RunConfig) -> str:
    """The fully resolved configuration as YAML (written next to every run's outputs)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _type_name(annotation: Any) -> str:
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return " \\| ".join(str(a) for a in args)
    if get_origin(annotation) is dict:
        return "mapping"
    if args:
        inner = [_type_name(a) for a in args if a is not type(None)]
        suffix = " or null" if type(None) in args else ""
        if get_origin(annotation) in (list, tuple):
            return f"{get_origin(annotation).__name__}[{', '.join(inner)}]"
        return " or ".join(inner) + suffix
    return getattr(annotation, "__name__", str(annotation))


def config_reference() -> str:
    """Every section and key with its type, default and meaning, as Markdown (docs/configuration.md)."""
    defaults = RunConfig().model_dump(mode="json")
    lines = [
        "# Configuration reference",
        "",
        "Generated by `asyncrl config --reference`; every key can be set in YAML or overridden on the",
        "command line as `section.key=value`. Unknown keys, wrong types, out-of-range values and",
        "inconsistent combinations are rejected at load time with a one-line error naming the field.",
        "",
        f"- `seed` ({_type_name(RunConfig.model_fields['seed'].annotation)}, default `{defaults['seed']}`): "
        f"{RunConfig.model_fields['seed'].description}",
    ]
    for name, field in RunConfig.model_fields.items():
        section = _section(field.annotation)
        if section is None:
            continue
        lines += [
            "",
            f"## `{name}`",
            "",
            section.__doc__.strip(),
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        for key, sub in section.model_fields.items():
            default = yaml.safe_dump(defaults[name][key], default_flow_style=True).strip().removesuffix("...").strip()
            lines.append(f"| `{key}` | {_type_name(sub.annotation)} | `{default}` | {sub.description} |")
    return "\n".join(lines) + "\n"
