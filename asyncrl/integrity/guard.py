"""IntegrityGuard: one rule for every promise, so each check only measures.

A check hands the guard a value where larger is worse (a lag beyond the bound, a share of failed
groups, a count error). Up to the promise's ``threshold`` the promise holds; past it, its
``action`` applies: ``stop`` raises ``IntegrityStop`` (the controller checkpoints the last good
step and the CLI exits with code 3), ``drop`` tells the caller to leave the group out, ``warn``
logs one line. Every promise's largest value of the step goes into that step's metrics, 0 where
nothing was measured, so a healthy run's ``integrity/`` columns are zero, but for the sampling
probe's rounding-sized gap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from asyncrl.config import PROMISES, IntegrityConfig
from asyncrl.errors import IntegrityStop

logger = logging.getLogger(__name__)

DROPPED = "integrity/dropped_groups"


class IntegrityGuard:
    """The run's rule for every promise; the controller owns one, and each trainer rank its own."""

    def __init__(self, config: IntegrityConfig, warn: Callable[[str], None] = logger.warning) -> None:
        self.config = config
        self.warn = warn
        self._values: dict[str, float] = {}
        self._dropped = 0

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def check(self, promise: str, value: float, *, step: int, evidence: str) -> str:
        """What the caller does with what was measured: "ok", "drop" or "warn"; raises
        ``IntegrityStop`` when the promise is broken and its action is stop. ``step`` is numbered
        as metrics.jsonl numbers steps, from 1: the step that trains from weight version V is
        step V + 1, and a weight sync's check names the step whose update made the version."""
        self.record(promise, value)
        if not self.config.enabled:
            return "ok"
        rule = getattr(self.config, promise)
        if value <= rule.threshold:  # a NaN breaks the promise
            return "ok"
        if rule.action == "stop":
            raise IntegrityStop(promise, evidence, step)
        if rule.action == "drop":
            self._dropped += 1
        else:
            self.warn(f"integrity: {promise} broken at step {step}: {evidence} (integrity.{promise}.action=warn)")
        return rule.action

    def record(self, promise: str, value: float) -> None:
        """Keep the step's largest value of ``promise`` for its metrics; alone, for a value checked
        where it was measured (a trainer rank's own guard, before its update)."""
        if promise not in PROMISES:
            raise ValueError(f"IntegrityGuard: unknown promise {promise!r}; the promises are {PROMISES}")
        if self.config.enabled:
            key, value = f"integrity/{promise}", float(value)
            previous = self._values.get(key, 0.0)
            self._values[key] = previous if previous >= value else value  # a NaN is kept

    def step_metrics(self) -> dict[str, float]:
        """The step's ``integrity/<promise>`` values and the groups dropped, then a fresh step;
        empty when the guard is off."""
        if not self.config.enabled:
            return {}
        metrics = {f"integrity/{name}": self._values.get(f"integrity/{name}", 0.0) for name in PROMISES}
        metrics[DROPPED] = self._dropped
        self._values, self._dropped = {}, 0
        return metrics
