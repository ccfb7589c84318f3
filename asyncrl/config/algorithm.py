"""The ``algorithm``, ``grpo`` and ``loss`` sections: advantages, step shape and the loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import Section

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


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
