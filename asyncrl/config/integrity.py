"""The ``integrity`` section: the promises a run checks about what it trains (docs/integrity.md).

One sub-section per promise, each with the same two keys: ``threshold``, the largest value of the
promise's measurement that still keeps it, and ``action``, what a larger value does. Which actions
a promise offers depends on what can be set aside: a group can be dropped, a weight sync cannot.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from asyncrl.config.base import Section

STOP_OR_WARN = "stop: end the run with an integrity stop (exit code 3); warn: log it and go on"
STOP_DROP_OR_WARN = "stop: end the run with an integrity stop (exit code 3); drop: leave the group out of the step, counted; warn: log it and train it"


class WeightsCheck(Section):
    """Promise 1: the generator holds the weights it says it holds."""

    action: Literal["stop", "warn"] = Field("stop", description=STOP_OR_WARN)
    threshold: float = Field(
        0.0,
        ge=0.0,
        description="generators in a sync whose weights' fingerprint differs from the trainer's export, plus "
        "generated groups that report a weight version no generator was given",
    )


class SamplingCheck(Section):
    """Promise 2: the generator samples the distribution the trainer scores."""

    action: Literal["stop", "warn"] = Field("stop", description=STOP_OR_WARN)
    threshold: float = Field(
        0.01,
        ge=0.0,
        description="mean absolute difference between the trainer's and the generator's logprobs of the post-sync "
        "probe's sampled tokens, in nats per token, for a generator holding float32 (or float64) weights; 0: any "
        "difference breaks the promise, in every dtype",
    )
    noise_multiple: float = Field(
        10.0,
        gt=0.0,
        description="for a generator holding bfloat16 or float16 weights (or not saying which), the threshold is the "
        "larger of threshold and this many times the probe's noise: the mean difference between the trainer's own "
        "logprobs of its tokens in bfloat16 and in float32",
    )
    half_precision_threshold: float = Field(
        0.1,
        gt=0.0,
        description="the threshold for such a generator where the trainer cannot measure that noise (FSDP2 casts "
        "its parameters to bfloat16)",
    )
    every_syncs: int = Field(
        10,
        ge=0,
        description="probe at the weight syncs of versions 1, 1 + every_syncs, 1 + 2 every_syncs, ... (by version, so "
        "a resumed run probes where the uninterrupted one did); 0: never",
    )
    prompts: int = Field(4, ge=1, description="probe prompts (the first of the held-out split), one response each")


class StalenessCheck(Section):
    """Promise 3: every trained token is within the staleness bound."""

    action: Literal["stop", "drop", "warn"] = Field("stop", description=STOP_DROP_OR_WARN)
    threshold: float = Field(
        0.0,
        ge=0.0,
        description="weight versions a trained token's own version may lag beyond sampler.max_lag",
    )


class FailuresCheck(Section):
    """Promise 4: no failure becomes a reward. A group with a reward that raised or was not a finite
    number is never trained (it is dropped and counted); the threshold bounds how many a step may lose."""

    action: Literal["stop", "warn"] = Field("stop", description=STOP_OR_WARN)
    threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="share of a step's groups whose reward failed that the step may drop"
    )


class LossCountsCheck(Section):
    """Promise 5: the loss is counted once."""

    action: Literal["stop", "warn"] = Field("stop", description=STOP_OR_WARN)
    threshold: float = Field(
        0.0,
        ge=0.0,
        description="relative difference between the response tokens and sequences an update's loss summed "
        "(over micro-batches and ranks) and those of the groups it trained",
    )


class TranscriptsCheck(Section):
    """Promise 6: transcripts only grow."""

    action: Literal["stop", "drop", "warn"] = Field("stop", description=STOP_DROP_OR_WARN)
    threshold: float = Field(
        0.0,
        ge=0.0,
        description="episodes of a group whose chat template rewrote the transcript instead of extending it",
    )


class IntegrityConfig(Section):
    """The integrity guard: the promises checked at every step or sync, and what a breach does (docs/integrity.md)."""

    enabled: bool = Field(True, description="check the promises below; false: no checks and no integrity/ metrics")
    weights: WeightsCheck = Field(default_factory=WeightsCheck, description=WeightsCheck.__doc__)
    sampling: SamplingCheck = Field(default_factory=SamplingCheck, description=SamplingCheck.__doc__)
    staleness: StalenessCheck = Field(default_factory=StalenessCheck, description=StalenessCheck.__doc__)
    failures: FailuresCheck = Field(default_factory=FailuresCheck, description="Promise 4: no failure becomes a reward")
    loss_counts: LossCountsCheck = Field(default_factory=LossCountsCheck, description=LossCountsCheck.__doc__)
    transcripts: TranscriptsCheck = Field(default_factory=TranscriptsCheck, description=TranscriptsCheck.__doc__)

    def promises(self) -> dict[str, Section]:
        """Each promise's sub-section, by the promise's name."""
        return {name: getattr(self, name) for name in PROMISES}


PROMISES = ("weights", "sampling", "staleness", "failures", "loss_counts", "transcripts")
