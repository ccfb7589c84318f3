"""RolloutGate: the controller's admission control, the only place admission and weight versions
meet. The rollout loop admits under ``gate.version``; a weight sync (weight_sync.py) closes the
gate, waits on it and reopens it at the new version; checkpoints close it too.
"""

from __future__ import annotations

from typing import Literal

from asyncrl.control.changes import Changes


class RolloutGate:
    """Admission control shared by the rollout loop, weight sync and checkpoints.

    ``closing`` lets the rollout loop finish admitting under the current version; the loop calls
    ``settled()`` once the sampler (or the data) refuses further admissions, and only then is the
    gate closed. ``in_flight`` counts dispatched groups that are neither committed nor cancelled;
    at ``max_in_flight`` the rollout loop admits nothing until a batch finishes.
    """

    def __init__(
        self, version: int, changes: Changes, *, wait_for_admissions: bool, max_in_flight: int | None = None
    ) -> None:
        self.version = version
        self.changes = changes
        self.wait_for_admissions = wait_for_admissions
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.running_batches = 0  # generation calls submitted to a worker and not yet returned
        self.loading = False  # weights are being loaded: nothing may be dispatched until open()
        # the newest version handed to the generators: a sync's from the moment its load starts, since
        # an in-flight generator may serve it, and a group report it, before the gate reopens
        self.sent = version
        self._state: Literal["open", "closing", "closed"] = "open"

    @property
    def admitting(self) -> bool:
        return self._state != "closed"

    @property
    def closing_waits_for_generation(self) -> bool:
        """Closing, and the rollout loop cannot admit what it still may until a batch finishes."""
        return self._state == "closing" and self.max_in_flight is not None and self.in_flight >= self.max_in_flight

    async def close(self) -> None:
        """Stop admissions; with ``wait_for_admissions``, after the loop has admitted all it may."""
        self.request_close()
        await self.changes.wait_for(lambda: not self.admitting)

    def request_close(self) -> None:
        """Begin closing; the gate is closed once ``admitting`` is False."""
        self._state = "closing" if self.wait_for_admissions else "closed"
        self.changes.notify()

    def settled(self) -> None:
        """The rollout loop's admission pass ended because nothing more may be admitted now."""
        if self._state == "closing":
            self._state = "closed"
            self.changes.notify()

    async def drained(self) -> None:
        await self.changes.wait_for(lambda: self.in_flight == 0)

    async def generators_idle(self) -> None:
        """No generation call is running. Once ``loading`` holds back retries, none starts."""
        await self.changes.wait_for(lambda: self.running_batches == 0)

    def open(self, version: int) -> None:
        self.version = version
        self.sent = max(self.sent, version)
        self.loading = False
        self._state = "open"
        self.changes.notify()

    def add_in_flight(self, delta: int) -> None:
        self.in_flight += delta
        self.changes.notify()

    def add_running(self, delta: int) -> None:
        self.running_batches += delta
        self.changes.notify()
