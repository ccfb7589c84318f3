"""Promises 3, 4 and 6, checked on the groups a step takes, before the trainer sees them
(docs/integrity.md).

3. ``staleness``: a group trained from weights V has no trained token sampled by weights older
   than V - ``sampler.max_lag`` (its oldest token's own version).
4. ``failures``: before a step's update, the share of its groups whose reward raised or was not a
   finite number (the trainer leaves those out of the loss).
6. ``transcripts``: no episode of the group met a chat template that rewrote its transcript (the
   episode ended there instead, rollout/episode.py).

They read a group's metadata only, so the controller checks them wherever its trainer runs.
Every message names the step as metrics.jsonl numbers it: the one that trains from weights V is
step V + 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl.integrity.guard import IntegrityGuard

if TYPE_CHECKING:
    from asyncrl.types import RolloutGroup


class GroupChecks:
    def __init__(self, guard: IntegrityGuard, max_lag: int) -> None:
        self.guard = guard
        self.max_lag = max_lag
        self.verdicts: dict[int, bool] = {}  # id of a group of the open step -> the guard lets it train

    def vouched_for(self, groups: Sequence[RolloutGroup], version: int) -> list[RolloutGroup]:
        """The groups step V may train, each checked once per step: every trained token's own
        weight version within the staleness bound, and transcripts that only grew. A group the
        guard drops stays with the step's groups (a rerun or a resumed run leaves it out again),
        untrained."""
        if not self.guard.enabled:
            return list(groups)
        for group in groups:
            if id(group) not in self.verdicts:
                verdicts = (self.staleness(group, version), self.transcripts(group, version))
                self.verdicts[id(group)] = "drop" not in verdicts
        return [group for group in groups if self.verdicts[id(group)]]

    def end_step(self) -> None:
        """The step finished: its groups' verdicts are no longer needed."""
        self.verdicts = {}

    def staleness(self, group: RolloutGroup, version: int) -> str:
        """Promise 3: the group's oldest trained token lags step V by at most ``sampler.max_lag``."""
        bound, oldest = self.max_lag, group.oldest_token_version
        return self.guard.check(
            "staleness",
            max(version - oldest - bound, 0),
            step=version + 1,
            evidence=f"group {group.prompt_uid} (start version {group.start_version}) has a token sampled by "
            f"weights {oldest}: lag {version - oldest} > sampler.max_lag={bound}",
        )

    def transcripts(self, group: RolloutGroup, version: int) -> str:
        """Promise 6: no episode of the group met a chat template that rewrote its transcript."""
        breaks = group.episode_metrics.get("transcript_breaks", 0.0)
        return self.guard.check(
            "transcripts",
            breaks,
            step=version + 1,
            evidence=f"{breaks:.0f} episodes of group {group.prompt_uid} met a chat template that rendered the "
            "transcript differently once messages were appended, so no observation could extend it",
        )

    def failures(self, groups: Sequence[RolloutGroup], version: int) -> None:
        """Promise 4: a step that would lose more than ``integrity.failures.threshold`` of its
        groups to rewards that raised or were not finite stops (or warns) before its update."""
        if not self.guard.enabled:
            return
        failed = sum(1 for group in groups if group.reward_errors)
        self.guard.check(
            "failures",
            failed / len(groups),
            step=version + 1,
            evidence=f"{failed} of the step's {len(groups)} groups have a reward that raised or was not a finite "
            f"number (integrity.failures.threshold={self.guard.config.failures.threshold})",
        )
