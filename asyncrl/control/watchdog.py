"""Watchdog: stops a run that has made no progress for ``runtime.watchdog_s``.

The loops say what they wait on (``waiting``) and when they make progress (``progressed``); the
watch raises ``StallError`` naming each wait, so a hung worker ends the run instead of freezing it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from asyncrl.errors import StallError


class Watchdog:
    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s  # None: never stop
        self.last_progress = time.monotonic()
        self.waiting = {"rollout loop": "starting", "train loop": "starting"}

    def progressed(self) -> None:
        self.last_progress = time.monotonic()

    async def watch(self, work: asyncio.Task, describe: Callable[[], str]) -> None:
        """Until ``work`` is done; ``describe``: what else the error should say of the run's state."""
        if self.limit_s is None:
            return
        while not work.done():
            await asyncio.wait([work], timeout=min(self.limit_s / 4, 1.0))
            idle = time.monotonic() - self.last_progress
            if idle > self.limit_s and not work.done():
                waits = "; ".join(f"{loop} waits on {what}" for loop, what in self.waiting.items())
                raise StallError(
                    f"no progress for {idle:.1f}s (runtime.watchdog_s={self.limit_s:g}): {waits}; {describe()}"
                )
