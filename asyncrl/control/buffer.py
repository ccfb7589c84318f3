"""ReplayBuffer: the group-granular hand-off between the rollout loop and the train loop.

A prompt takes a slot when it is dispatched (``reserve``), so buffer order is dispatch order and
in-flight rollouts count against capacity. The finished group fills its slot (``commit``) or a
failed rollout gives it back (``cancel``). Ready groups leave exactly once: ``take`` when trained,
``evict`` when too stale, and evictions are counted. Which slots to take or evict is the sampler's
decision; the buffer only keeps the books, and raises before any side effect on a bad request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.types import RolloutGroup

RESERVED = "reserved"
READY = "ready"


class BufferFullError(RuntimeError):
    """``reserve`` on a full buffer: the caller should have waited for a free slot."""


class SlotError(KeyError):
    """A slot that is unknown, or not in the state the operation needs."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


@dataclass(frozen=True)
class Slot:
    """One dispatched prompt. ``start_version`` and ``target_step`` are stamped at reserve time
    and are what samplers read: the committed group is stored as given."""

    slot_id: int
    start_version: int
    target_step: int | None
    group: RolloutGroup | None = None
    state: str = RESERVED


class ReplayBuffer:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ReplayBuffer.capacity: {capacity} < 1")
        self._capacity = capacity
        self._slots: dict[int, Slot] = {}  # insertion order == slot id order == dispatch order
        self._next_slot_id = 0
        self.num_reserved_total = 0
        self.num_committed_total = 0
        self.num_cancelled_total = 0
        self.num_taken_total = 0
        self.num_evicted = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_reserved(self) -> int:
        return sum(slot.state == RESERVED for slot in self._slots.values())

    @property
    def num_ready(self) -> int:
        return sum(slot.state == READY for slot in self._slots.values())

    @property
    def num_free(self) -> int:
        return self._capacity - len(self._slots)

    def ready_slots(self) -> list[Slot]:
        """Committed groups, in dispatch order."""
        return [slot for slot in self._slots.values() if slot.state == READY]

    def reserved_slots(self) -> list[Slot]:
        """Dispatched prompts whose rollouts are still in flight, in dispatch order."""
        return [slot for slot in self._slots.values() if slot.state == RESERVED]

    def reserve(self, start_version: int, target_step: int | None = None) -> int:
        if self.num_free == 0:
            raise BufferFullError(f"ReplayBuffer.reserve: all {self._capacity} slots are reserved or ready")
        slot_id = self._next_slot_id
        self._next_slot_id += 1
        self._slots[slot_id] = Slot(slot_id, start_version, target_step)
        self.num_reserved_total += 1
        return slot_id

    def commit(self, slot_id: int, group: RolloutGroup) -> None:
        slot = self._slot_in_state(slot_id, RESERVED, "commit")
        self._slots[slot_id] = replace(slot, group=group, state=READY)
        self.num_committed_total += 1

    def cancel(self, slot_id: int) -> None:
        """Give back the slot of a rollout that will not be committed."""
        self._slot_in_state(slot_id, RESERVED, "cancel")
        del self._slots[slot_id]
        self.num_cancelled_total += 1

    def take(self, slot_ids: Iterable[int]) -> list[RolloutGroup]:
        """Remove the ready groups selected for training; returns them in the order given."""
        slot_ids = self._ready_ids(slot_ids, "take")
        groups = [self._slots.pop(slot_id).group for slot_id in slot_ids]
        self.num_taken_total += len(groups)
        return groups

    def evict(self, slot_ids: Iterable[int]) -> int:
        """Drop ready groups that will never be trained; they are counted in ``num_evicted``."""
        slot_ids = self._ready_ids(slot_ids, "evict")
        for slot_id in slot_ids:
            del self._slots[slot_id]
        self.num_evicted += len(slot_ids)
        return len(slot_ids)

    def _slot_in_state(self, slot_id: int, state: str, operation: str) -> Slot:
        slot = self._slots.get(slot_id)
        if slot is None:
            raise SlotError(f"ReplayBuffer.{operation}: slot {slot_id} is unknown (never reserved, or already gone)")
        if slot.state != state:
            raise SlotError(f"ReplayBuffer.{operation}: slot {slot_id} is {slot.state}, not {state}")
        return slot

    def _ready_ids(self, slot_ids: Iterable[int], operation: str) -> list[int]:
        """Validate the whole request first, so a bad id leaves the buffer untouched."""
        slot_ids = list(slot_ids)
        if len(set(slot_ids)) != len(slot_ids):
            raise SlotError(f"ReplayBuffer.{operation}: slot ids {slot_ids} contain duplicates")
        for slot_id in slot_ids:
            self._slot_in_state(slot_id, READY, operation)
        return slot_ids

    def state_dict(self) -> dict[str, Any]:
        """Ready groups, counters and the next slot id, as plain Python plus the group objects.

        Reserved slots are not saved: their rollouts are in flight, and a resumed run dispatches
        those prompts again. They are left out of ``num_reserved_total`` as well, so the counters
        of a resumed run match those of an uninterrupted one.
        """
        return {
            "next_slot_id": self._next_slot_id,
            "ready": [
                {"slot_id": s.slot_id, "start_version": s.start_version, "target_step": s.target_step, "group": s.group}
                for s in self.ready_slots()
            ],
            "num_reserved_total": self.num_reserved_total - self.num_reserved,
            "num_committed_total": self.num_committed_total,
            "num_cancelled_total": self.num_cancelled_total,
            "num_taken_total": self.num_taken_total,
            "num_evicted": self.num_evicted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the buffer's contents (reserved slots included) with a saved state."""
        if len(state["ready"]) > self._capacity:
            raise ValueError(
                f"ReplayBuffer.load_state_dict: {len(state['ready'])} ready groups exceed capacity {self._capacity}"
            )
        self._slots = {
            s["slot_id"]: Slot(s["slot_id"], s["start_version"], s["target_step"], s["group"], READY)
            for s in state["ready"]
        }
        self._next_slot_id = state["next_slot_id"]
        self.num_reserved_total = state["num_reserved_total"]
        self.num_committed_total = state["num_committed_total"]
        self.num_cancelled_total = state["num_cancelled_total"]
        self.num_taken_total = state["num_taken_total"]
        self.num_evicted = state["num_evicted"]
