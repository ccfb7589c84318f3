"""GRPO: its options, group-relative advantages, per-token policy loss terms, and the ``GRPO`` algorithm.

Every function here is pure tensor math that works in the dtype of its inputs; ``GRPO`` binds them
to a run's ``algorithm.options`` (``GRPOOptions``) as its ``Algorithm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from asyncrl.algorithms import MetricKeys, Scoring
from asyncrl.config import RunConfig, Section
from asyncrl.types import TokenLossInputs, row_sum

ISMode = Literal["none", "tis", "icepop"]
RatioLevel = Literal["token", "sequence"]


class GRPOOptions(Section):
    """``algorithm.options`` of ``grpo``: the advantage baseline and the per-token loss terms (docs/loss.md)."""

    baseline: Literal["mean", "leave_one_out"] = Field("mean", description="advantage baseline within a group")
    scale_by_std: bool = Field(True, description="divide advantages by the group std; false is Dr. GRPO")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="ratio clip below: 1 - clip_low")
    clip_high: float = Field(0.28, ge=0.0, description="ratio clip above: 1 + clip_high")
    dual_clip: float | None = Field(
        3.0, gt=1.0, description="cap the loss of a negative advantage A at dual_clip times -A; null disables"
    )
    clip_against: Literal["proximal", "behaviour"] = Field(
        "proximal",
        description="proximal: ratio to the trainer's logprobs at step start (identically 1 with one update per step, "
        "so the clip acts only with step.num_minibatches or num_epochs > 1); behaviour: ratio to the generator's "
        "logprobs, which bounds stale data directly (one update per step; no separate importance weight)",
    )
    ratio_level: RatioLevel = Field(
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

    @model_validator(mode="after")
    def _consistent(self) -> GRPOOptions:
        if self.is_low >= self.is_high:
            raise ValueError(f"is_low: {self.is_low} must be below is_high {self.is_high}")
        if self.ratio_level == "sequence" and self.importance_sampling == "icepop":
            raise ValueError(
                "importance_sampling: icepop drops single tokens, but with ratio_level sequence each token still "
                "moves its sequence's ratio (use tis, none or auto)"
            )
        return self


# ---- advantages ------------------------------------------------------------------------------


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """Which groups have all rewards exactly equal: rewards [..., n] -> bool [...].

    Such a group carries no learning signal (every advantage is 0), so it can be filtered out.
    """
    return (rewards == rewards[..., :1]).all(dim=-1)


def group_advantages(
    rewards: Tensor,
    *,
    baseline: Literal["mean", "leave_one_out"] = "mean",
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages A = (r - b) / (std + eps), one group per row of rewards [..., n].

    b is the group mean, or with ``leave_one_out`` the mean of the other samples,
    b_i = (sum_j r_j - r_i) / (n - 1). std is the group's unbiased standard deviation (as torch.std).
    ``scale_by_std=False`` (Dr. GRPO) gives A = r - b. A zero-variance group, including a group of
    one, gets A = 0 exactly: r - b is only rounding noise there, which std + eps would amplify.
    """
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"baseline: '{baseline}' is not one of mean, leave_one_out")
    n = rewards.shape[-1]
    if baseline == "leave_one_out" and n < 2:
        raise ValueError(f"baseline: leave_one_out needs groups of at least 2 samples, got {n}")
    if n == 1:
        return torch.zeros_like(rewards)
    if baseline == "mean":
        advantages = rewards - rewards.mean(dim=-1, keepdim=True)
    else:
        advantages = rewards - (rewards.sum(dim=-1, keepdim=True) - rewards) / (n - 1)
    if scale_by_std:
        advantages = advantages / (rewards.std(dim=-1, keepdim=True) + eps)
    return advantages.masked_fill(zero_variance_groups(rewards)[..., None], 0.0)


# ---- per-token loss terms --------------------------------------------------------------------


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token, and where its gradient is cut.

    r = exp(lp - lp_old);  loss = max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high)).
    With ``dual_clip`` c > 1, a negative-advantage token's loss is capped: loss = min(loss, -A c),
    so one very unlikely-now token cannot dominate the step.

    Returns (loss, clipped): ``clipped`` is 1.0 where the loss no longer depends on lp, i.e. the
    clamped term is strictly larger than -A r, or the dual clip strictly lowered the loss; else 0.0.
    Where both terms are equal (r inside the range, or A = 0) the token is not clipped.
    """
    return _clip(torch.exp(logprobs - old_logprobs), advantages, clip_low, clip_high, dual_clip)


def _clip(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """``clipped_surrogate`` of a given ratio: a token's own, or its sequence's (``sequence_ratio``)."""
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip: must be > 1, got {dual_clip}")
    unclipped = -advantages * ratio
    clamped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clamped)
    clipped = clamped > unclipped
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (cap < loss)
        loss = torch.where(dual_clipped, cap, loss)
        clipped = clipped | dual_clipped
    return loss, clipped.to(loss.dtype)


def sequence_ratio(
    logprobs: Tensor,
    old_logprobs: Tensor,
    response_mask: Tensor,
    sequence_sum: Callable[[Tensor], Tensor] = row_sum,
) -> Tensor:
    """GSPO's sequence ratio s_i = exp(mean_t (lp_it - lp_old_it)) over response tokens, at each
    token of sequence i (the shape of ``logprobs``).

    ``sequence_sum`` gives each token its sequence's sum; under context parallelism it reduces the
    shards of the CP group (``ContextParallel.sequence_sum``), so the mean is the sequence's own
    and not a shard's, and on a packed row it sums each segment. The gradient is
    s_i * mean_t grad lp_it (docs/loss.md).
    """
    log_ratio = torch.where(response_mask > 0, logprobs - old_logprobs, 0.0)
    tokens = sequence_sum(response_mask).clamp(min=1)
    return torch.exp(sequence_sum(log_ratio) / tokens)


def importance_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    *,
    mode: ISMode,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> Tensor:
    """Off-policy correction w = exp(lp_old - lp_gen), truncated, with no gradient.

    The generator's policy (lp_gen) lags or differs numerically from the trainer's (lp_old).
    ``none``: w = 1.  ``tis``: min(w, cap).  ``icepop``: w where low <= w <= high, else 0 (the
    token is dropped rather than down-weighted).
    """
    if mode not in ("none", "tis", "icepop"):
        raise ValueError(f"mode: '{mode}' is not one of none, tis, icepop")
    weights = torch.exp(old_logprobs - behaviour_logprobs).detach()
    if mode == "none":
        return torch.ones_like(weights)
    if mode == "tis":
        if cap <= 0:
            raise ValueError(f"cap: must be > 0, got {cap}")
        return weights.clamp(max=cap)
    if low < 0:
        raise ValueError(f"low: must be >= 0, got {low}")
    if high <= low:
        raise ValueError(f"high: must be above low {low}, got {high}")
    return torch.where((weights >= low) & (weights <= high), weights, 0.0)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, *, log_ratio_clamp: float = 20.0, kl_clamp: float = 10.0) -> Tensor:
    """k3 estimator of KL(policy || reference) per token: exp(d) - 1 - d with d = lp_ref - lp.

    k3 >= 0 and is unbiased for tokens sampled from the policy. d is clamped to
    [-log_ratio_clamp, log_ratio_clamp] so exp cannot overflow, and k3 to at most ``kl_clamp``;
    the gradient flows through lp wherever neither clamp is active.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-log_ratio_clamp, log_ratio_clamp)
    return (torch.exp(log_ratio) - 1 - log_ratio).clamp(max=kl_clamp)


def mismatch_kl(behaviour_logprobs: Tensor, trainer_logprobs: Tensor, **clamps: float) -> Tensor:
    """k3 estimate of KL(generator || trainer) per token, with no gradient.

    The tokens were sampled by the generator, so the generator plays the policy of ``kl_k3`` and
    the trainer the reference: d = lp_train - lp_gen. (The other orientation estimates
    E_gen[p_gen / p_train] - 1 + KL(gen || train), which over-states the divergence.)
    """
    return kl_k3(behaviour_logprobs, trainer_logprobs, **clamps).detach()


def token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    *,
    cfg: GRPOOptions,
    is_mode: ISMode,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    response_mask: Tensor | None = None,
    sequence_sum: Callable[[Tensor], Tensor] = row_sum,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss per token, l = w_is * surrogate + kl_coef * k3 - entropy_coef * entropy.

    ``cfg`` is the run's ``algorithm.options``, read as it is; ``is_mode`` its importance sampling with
    ``auto`` resolved (``importance_sampling_mode``). With ``cfg.clip_against`` "behaviour"
    the ratio is taken to ``behaviour_logprobs`` instead of ``old_logprobs`` (then w_is = 1, and
    "mismatch_kl" measures the generator against the current policy). With ``cfg.ratio_level``
    "sequence" (GSPO) the surrogate of every token of sequence i uses ``sequence_ratio`` s_i, which
    needs ``response_mask`` and the row sum ``sequence_sum``; "clip" and "ratio" are then the
    sequence's, repeated on each of its tokens.

    ``advantages`` is [B, T] or [B, 1]. Returns (l [B, T], metrics): per-token, detached tensors
    "clip", "is_weight", "ratio", "mismatch_kl" (``mismatch_kl``: how far the generator is from the
    trainer) and "kl" when ``ref_logprobs`` is given. They are unmasked: reduce them as masked
    (sum, count), never as means.
    """
    if cfg.kl_coef != 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs: required when kl_coef != 0")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("entropy: required when entropy_coef != 0")
    trainer_logprobs = old_logprobs  # the trainer's side of mismatch_kl
    if cfg.clip_against == "behaviour":
        old_logprobs, trainer_logprobs = behaviour_logprobs, logprobs.detach()
    ratio = _policy_ratio(logprobs, old_logprobs, cfg.ratio_level, response_mask, sequence_sum)
    surrogate, clipped = _clip(ratio, advantages, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    is_weight = importance_weights(
        old_logprobs, behaviour_logprobs, mode=is_mode, cap=cfg.is_cap, low=cfg.is_low, high=cfg.is_high
    )
    clamps = {"log_ratio_clamp": cfg.kl_log_ratio_clamp, "kl_clamp": cfg.kl_clamp}
    metrics = {
        "clip": clipped,
        "is_weight": is_weight,
        "ratio": ratio.detach(),
        "mismatch_kl": mismatch_kl(behaviour_logprobs, trainer_logprobs, **clamps),
    }
    loss = _regularized(is_weight * surrogate, logprobs, ref_logprobs, entropy, cfg, clamps, metrics)
    return loss, metrics


def _policy_ratio(
    logprobs: Tensor,
    old_logprobs: Tensor,
    level: str,
    response_mask: Tensor | None,
    sequence_sum: Callable[[Tensor], Tensor],
) -> Tensor:
    """The surrogate's ratio per token: its own, or its sequence's (``ratio_level`` sequence, GSPO)."""
    if level != "sequence":
        return torch.exp(logprobs - old_logprobs)
    if response_mask is None:
        raise ValueError("response_mask: required when ratio_level is sequence")
    return sequence_ratio(logprobs, old_logprobs, response_mask, sequence_sum).expand_as(logprobs)


def _regularized(
    loss: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
    cfg: GRPOOptions,
    clamps: dict[str, float],
    metrics: dict[str, Tensor],
) -> Tensor:
    """``loss`` + kl_coef * k3 to the reference - entropy_coef * entropy; the KL, where a reference
    is given, is also recorded in ``metrics`` ("kl"), even with a coefficient of 0 (the entropy is
    the trainer's to report)."""
    if ref_logprobs is not None:
        kl = kl_k3(logprobs, ref_logprobs, **clamps)
        if cfg.kl_coef != 0:
            loss = loss + cfg.kl_coef * kl
        metrics["kl"] = kl.detach()
    if entropy is not None and cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * entropy
    return loss


def importance_sampling_mode(options: GRPOOptions, config: RunConfig) -> ISMode:
    """The effective importance-sampling mode: ``auto`` is tis whenever the behaviour and the
    trainer's distributions can differ: lagged weights, or bfloat16, where the generator's cached
    decoding and the trainer's forward round differently. Top-k and top-p do not: the trainer
    scores the same truncated distribution."""
    if options.importance_sampling != "auto":
        return options.importance_sampling
    if options.clip_against == "behaviour":
        return "none"
    differ = config.sampler.max_lag > 0 or config.trainer.dtype == "bfloat16"
    return "tis" if differ else "none"


def build_grpo(config: RunConfig, options: GRPOOptions) -> GRPO:
    """The built-in ``algorithm.name: grpo``; a ValueError names the option the run contradicts."""
    if options.clip_against == "behaviour":
        if config.step.num_minibatches * config.step.num_epochs > 1:
            raise ValueError(
                "clip_against: behaviour takes one update per step; set step.num_minibatches and num_epochs to 1"
            )
        if options.importance_sampling not in ("auto", "none"):
            raise ValueError(
                f"importance_sampling: {options.importance_sampling} with clip_against behaviour; the ratio to "
                "the behaviour policy is already the importance weight (use auto or none)"
            )
    return GRPO(options, importance_sampling_mode(options, config))


build_grpo.Options = GRPOOptions  # type: ignore[attr-defined]  # what algorithm.options holds
# the options `asyncrl verify` checks grpo under unless told otherwise: every loss term on (docs/loss.md)
build_grpo.verify_options = {"kl_coef": 0.05, "entropy_coef": 0.01, "importance_sampling": "tis"}  # type: ignore[attr-defined]


@dataclass(frozen=True)
class GRPO:
    """GRPO and its variants as options: Dr. GRPO (``scale_by_std`` false), GSPO (``ratio_level``
    sequence), DAPO's clip-higher (``clip_high``), dynamic sampling (``informative`` with
    ``step.filter_zero_variance``), the behaviour clip (``clip_against``); DAPO's token-mean loss is
    the trainer's ``trainer.aggregation``. Implements ``asyncrl.algorithms.Algorithm``."""

    options: GRPOOptions = field(default_factory=GRPOOptions)
    importance_sampling: ISMode = "none"

    @property
    def scoring(self) -> Scoring:
        return Scoring(reference=self.options.kl_coef > 0, entropy=self.options.entropy_coef > 0)

    @property
    def metrics(self) -> dict[str, MetricKeys]:
        """clip_fraction, the importance weight's mean and range, mismatch_kl; kl with a reference."""
        metrics = {
            "clip": MetricKeys("clip_fraction"),
            "is_weight": MetricKeys("is_weight_mean", "is_weight_min", "is_weight_max"),
            "ratio": MetricKeys("ratio_mean"),
            "mismatch_kl": MetricKeys("mismatch_kl"),
        }
        if self.scoring.reference:
            metrics["kl"] = MetricKeys("kl")
        return metrics

    def advantages(self, rewards: Tensor) -> Tensor:
        return group_advantages(rewards, baseline=self.options.baseline, scale_by_std=self.options.scale_by_std)

    def informative(self, rewards: Tensor) -> bool:
        """A group with unequal rewards; the others have every advantage 0."""
        return not bool(zero_variance_groups(rewards))

    def token_loss(self, inputs: TokenLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        old_logprobs = inputs.old_logprobs if inputs.old_logprobs is not None else inputs.logprobs.detach()
        return token_loss(
            inputs.logprobs,
            old_logprobs,
            inputs.behaviour_logprobs,
            inputs.advantages,
            cfg=self.options,
            is_mode=self.importance_sampling,
            ref_logprobs=inputs.ref_logprobs if self.scoring.reference else None,
            entropy=inputs.entropy,
            response_mask=inputs.response_mask,
            sequence_sum=inputs.sequence_sum,
        )
