"""The ``algorithm`` and ``step`` sections: which algorithm trains, with its options, and the shape of a step."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from asyncrl.config.base import PartSection, Section


class AlgorithmConfig(PartSection):
    """The RL algorithm: advantages, the informative-group test, the per-token loss (asyncrl/algorithms)."""

    kind, at = "algorithm", "algorithm"

    name: str = Field(
        "grpo",
        description="grpo (its variants are its options, docs/loss.md), or package.module:attr (docs/plugins.md)",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="settings of the algorithm (its Options model; grpo's are listed in docs/loss.md), checked "
        "where the run is built",
    )


class StepConfig(Section):
    """The shape of an optimizer step, the same for every algorithm: its groups, their samples, its updates."""

    prompts_per_step: int = Field(16, ge=1, description="P: prompt groups per optimizer step")
    generations_per_prompt: int = Field(8, ge=1, description="n: samples per prompt")
    step_batch_size: int | None = Field(None, ge=1, description="sequences per step; must equal P*n if given")
    max_steps: int = Field(
        400,
        ge=1,
        description="optimizer steps of the run, also the cosine schedule's length: a resume that changes it "
        "rebuilds the schedule for the new length (and warns that the lr moves)",
    )
    filter_zero_variance: bool = Field(False, description="drop groups whose rewards are all equal")
    mask_truncated: bool = Field(
        False,
        description="leave responses cut off (finish reason length: at generation.max_new_tokens, or an episode "
        "at environment.max_tokens) out of the loss; an episode ended by environment.max_turns or max_seconds stays in",
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
    def _batch_size_consistent(self) -> StepConfig:
        expected = self.prompts_per_step * self.generations_per_prompt
        if self.step_batch_size is not None and self.step_batch_size != expected:
            raise ValueError(
                f"step.step_batch_size: {self.step_batch_size} != prompts_per_step * generations_per_prompt "
                f"= {self.prompts_per_step} * {self.generations_per_prompt} = {expected}"
            )
        if self.max_refill_groups and not self.filter_zero_variance:
            raise ValueError(
                "step.max_refill_groups: refill replaces filtered groups; set step.filter_zero_variance=true"
            )
        if self.num_minibatches > self.prompts_per_step:
            raise ValueError(f"step.num_minibatches: {self.num_minibatches} > prompts_per_step {self.prompts_per_step}")
        if self.generations_per_prompt < 2:
            raise ValueError(
                "step.generations_per_prompt: 1 sample per prompt makes every advantage 0 (a group's baseline is "
                "its own reward); use at least 2"
            )
        if self.min_groups_per_chunk > self.prompts_per_step:
            raise ValueError(
                f"step.min_groups_per_chunk: {self.min_groups_per_chunk} > prompts_per_step {self.prompts_per_step}"
            )
        return self
