"""Changes: the one asyncio primitive the controller's loops, the rollout gate, the weight sync
and interrupts wait on. Every change to shared state is announced here; each waiter re-checks
its own condition, so a wait needs no lock and no event of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Changes:
    """Wakes every waiter when shared state changes; a waiter re-checks its own condition.

    Asyncio is single-threaded, so checking a condition and then waiting on the current event,
    with no ``await`` in between, can never miss a change.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._event.wait()

    async def next(self) -> None:
        """Wait for the next change, whatever it is."""
        await self._event.wait()
