"""The ``checkpoint``, ``logging`` and ``faults`` sections: what a run writes, and faults for tests."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from asyncrl.config.base import Section

Index = Annotated[int, Field(ge=0)]  # a call or a step, counted from 0


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
    samples_per_step: int = Field(
        4, ge=0, description="sample transcripts written per step to samples.jsonl, spread over its groups; 0: none"
    )
    eval_samples: int = Field(8, ge=0, description="transcripts written per evaluation, of its first prompts; 0: none")
    health_window: int = Field(
        10, ge=1, description="steps a run-health condition must hold before the run warns about it (once)"
    )


class FaultsConfig(Section):
    """Injected faults, for testing how a run survives them (docs/reliability.md); all off by default."""

    generate_errors: list[Index] = Field(
        default_factory=list, description="generation calls of a rollout worker (0-based, in call order) that raise"
    )
    failing_prompts: list[str] = Field(
        default_factory=list, description="prompt uids whose generation raises on every attempt"
    )
    eval_errors: list[Index] = Field(
        default_factory=list, description="evaluation calls of a rollout worker (0-based, in call order) that raise"
    )
    hang_generate_calls: list[Index] = Field(
        default_factory=list, description="generation calls of a rollout worker that hang for hang_s first"
    )
    hang_s: float = Field(30.0, gt=0.0, description="how long an injected hang lasts")
    train_errors: list[Index] = Field(
        default_factory=list, description="train steps whose first attempt raises after its first chunk"
    )
    nonfinite_steps: list[Index] = Field(
        default_factory=list, description="train steps whose gradients are made NaN, on every attempt"
    )
    slow_sync_s: float = Field(0.0, ge=0.0, description="every weight load into a generator first sleeps this long")
    slow_module_s: float = Field(
        0.0,
        ge=0.0,
        description="every module of the trainer's model that holds parameters of its own sleeps this long before "
        "a forward that records gradients: a micro-batch as slow as a real model's",
    )
    slow_sync_from: int = Field(
        0,
        ge=0,
        description="the first weight load (0-based, in call order; 0 is the run's initial one) slow_sync_s slows",
    )
    load_errors: list[Index] = Field(
        default_factory=list, description="weight loads into a rollout worker (0-based, in call order) that raise"
    )
    stale_tokens: int = Field(
        0,
        ge=0,
        description="every trained token of a rollout worker's groups carries a weight version this many versions "
        "older (never below 0), as from a generator serving part of its responses from older weights",
    )
    rewards_raise: bool = Field(
        False, description="every reward call of a rollout worker fails as if the reward function raised"
    )
    duplicate_microbatch: bool = Field(
        False, description="each trainer rank trains the first micro-batch of every step twice: its loss counted twice"
    )
    template_rewrites_transcript: bool = Field(
        False,
        description="multi-turn episodes: once the model has spoken, the chat template renders the transcript's "
        "first message one character short, so the transcript is rewritten instead of extended",
    )
    kill_in_checkpoint: int | None = Field(
        None, ge=1, description="the process kills itself (SIGKILL) while writing the checkpoint of this step"
    )
    sync_skips_load: bool = Field(
        False, description="every rollout worker acknowledges each weight sync (reports its version) without loading it"
    )
    generator_temperature: float | None = Field(
        None,
        ge=0.0,
        description="the generators sample at this temperature while the trainer scores at generation.temperature",
    )
