"""Promises 1 and 2, checked at each weight sync: the generators hold the weights they say they
hold, and sample the distribution the trainer scores (docs/integrity.md).

``SyncChecks`` runs inside the weight sync, after every generator loaded the new version and
before the rollout gate reopens, so no rollout is admitted on weights that failed the check.

1. ``weights``: each generator's fingerprint of what it serves, read back after its load, against
   the trainer's of what it exported (weights/fingerprint.py), in the dtype the generator holds;
   and every generated group's weight versions must be versions the generators were given (0 up
   to the newest synced: every step syncs).
   The value is the number of generators (or groups) that broke it.
2. ``sampling``: at the syncs of versions 1, 1 + ``integrity.sampling.every_syncs``, ..., each generator
   samples one response to each of a few fixed prompts with the run's sampling settings and seeds
   of the probe's own; the trainer scores the sampled tokens as it scores a step. The value is the
   largest mean absolute logprob gap per token among the generators, against a bound for the
   dtype the generator holds (``SyncChecks.bound``: half precision's is a multiple of its measured
   rounding noise), scaled to the float32 threshold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Protocol

from asyncrl.config import IntegrityConfig
from asyncrl.data import Prompt
from asyncrl.integrity.guard import IntegrityGuard

if TYPE_CHECKING:
    from asyncrl.types import ProbeGap, RolloutGroup, SyncReport

FULL_PRECISION = ("float32", "float64")


class ProbedGenerator(Protocol):
    """What the sampling probe asks of a generator's handle (``RolloutHandle`` has it)."""

    def probe(self, prompts: Sequence[Prompt], version: int) -> Awaitable[RolloutGroup]: ...


class ProbeScorer(Protocol):
    """What the sampling probe asks of the trainer's handle (``TrainerHandle`` has it)."""

    def probe_gap(self, group: RolloutGroup) -> Awaitable[ProbeGap]: ...


class SyncChecks:
    def __init__(
        self,
        guard: IntegrityGuard,
        config: IntegrityConfig,
        trainer: ProbeScorer,
        generators: Sequence[ProbedGenerator],
        probe_prompts: Sequence[Prompt],
        version: int,
    ) -> None:
        """``version``: the one the generators hold at the start (0, or the resumed step's)."""
        self.guard = guard
        self.config = config
        self.trainer = trainer
        self.generators = list(generators)
        self.probe_prompts = list(probe_prompts)[: config.sampling.prompts]
        self.latest = version  # the newest version a generator was given: every step syncs, so 0..latest all were

    async def __call__(self, report: SyncReport) -> None:
        """Check the sync that ``report`` describes; raises ``IntegrityStop`` where a promise's action is stop."""
        self.latest = max(self.latest, report.version)
        if not self.guard.enabled:
            return
        self.check_fingerprints(report)
        every = self.config.sampling.every_syncs
        if (
            every and (report.version - 1) % every == 0 and self.probe_prompts
        ):  # by version: a resume keeps the schedule
            await self.probe(report)

    def check_fingerprints(self, report: SyncReport) -> None:
        wrong = report.fingerprint_mismatches()
        evidence = "fingerprints agree"
        if wrong:
            index = wrong[0]
            served = report.served[index]
            dtype = served.split(":", 1)[0]
            evidence = (
                f"generator {index} reports weight version {report.version} but serves weights with fingerprint "
                f"{served}, the trainer exported {report.exported.get(dtype, f'none in {dtype}')} "
                f"({len(wrong)} of {len(report.served)} generators differ)"
            )
        self.guard.check("weights", len(wrong), step=report.version, evidence=evidence)

    def check_versions(self, prompt_uid: str, start_version: int, end_version: int, step: int, sent: int) -> None:
        """A generated group's versions are ones the generators were given: up to the newest whose
        load has started (``RolloutGate.sent``), which an in-flight generator may serve before the
        sync's checks run. ``step``: the first that would train the group."""
        newest = max(self.latest, sent)
        unknown = sorted(v for v in {start_version, end_version} if not 0 <= v <= newest)
        if not unknown or not self.guard.enabled:
            return
        evidence = (
            f"group {prompt_uid} reports weight version {unknown[0]}, which no generator was given "
            f"(the newest given is {newest})"
        )
        self.guard.check("weights", len(unknown), step=step, evidence=evidence)

    def bound(self, dtype: str, gap: ProbeGap) -> tuple[float, str]:
        """The largest mean gap per token a generator holding ``dtype`` may show, and why:
        ``threshold`` in full precision; in half precision, whose rounding moves logprobs more the
        larger and sharper the model, ``noise_multiple`` times what bfloat16 moves the trainer's
        own scores of the probe (``half_precision_threshold`` where it cannot tell), and never
        under ``threshold``. A threshold of 0 allows no gap in any dtype."""
        sampling = self.config.sampling
        if dtype in FULL_PRECISION or sampling.threshold == 0:
            return sampling.threshold, ""
        if gap.noise is None:
            return sampling.half_precision_threshold, " (integrity.sampling.half_precision_threshold)"
        bound = max(sampling.threshold, sampling.noise_multiple * gap.noise)
        return bound, (
            f" (the larger of integrity.sampling.threshold and {sampling.noise_multiple:g} times the "
            f"{gap.noise:.3g} that bfloat16 moves the trainer's own scores)"
        )

    async def probe(self, report: SyncReport) -> None:
        """Sample the probe on every generator, score it on the trainer; check the worst gap."""
        groups = await asyncio.gather(*(g.probe(self.probe_prompts, report.version) for g in self.generators))
        worst, evidence = 0.0, ""
        for index, group in enumerate(groups):
            gap = await self.trainer.probe_gap(group)
            served = report.served[index] if index < len(report.served) else None
            dtype = served.split(":", 1)[0] if served is not None else "an unknown dtype"
            bound, why = self.bound(dtype, gap)
            # scaled to the float32 threshold, so one guard threshold applies to every dtype (0: any gap)
            value = gap.mean * self.config.sampling.threshold / bound if bound > 0 else gap.mean
            if value >= worst:
                worst = value
                evidence = (
                    f"generator {index}'s logprobs of its {gap.tokens} probe tokens differ from the trainer's by "
                    f"{gap.mean:.4g} per token on average (max {gap.max:.4g}), above the {bound:.3g} allowed "
                    f"for weights in {dtype}{why}"
                )
        self.guard.check("sampling", worst, step=report.version, evidence=evidence)
