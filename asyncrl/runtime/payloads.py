"""What travels between the Ray runtime's actors and the controller: plain data, no actor code.

A committed group as the controller holds it (``RemoteGroup``: metadata plus an object reference),
exported weights (``WeightsRef`` in the object store, ``BroadcastWeights`` while rank 0 broadcasts
them) and the weights a handle last sent to its actor (``SentWeights``). This module imports
neither ray nor torch at import time (torch and ``RolloutGroup`` are annotations only), so code
and tests can name and build these types without loading the runtime; ``RemoteGroup.fetch``
imports ray when a trainer rank calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # annotations only
    from torch import Tensor

    from asyncrl.runtime.ray import WeightBroadcast
    from asyncrl.types import RolloutGroup


@dataclass
class RemoteGroup:
    """A committed group as the controller holds it: ``RolloutGroup``'s attributes except the four
    ``[n, T]`` tensors, plus the object reference of the whole group."""

    prompt_uid: str
    rewards: Tensor
    correct: Tensor | None
    finish_reasons: list[str]
    start_version: int
    end_version: int
    target_step: int | None
    reward_errors: int
    reward_timeouts: int
    retries: int
    informative: bool
    size: int
    response_tokens: int
    sequence_lengths: list[int]
    row_response_tokens: list[int]
    oldest_token_version: int
    episode_metrics: dict[str, float]
    ref: Any = None  # ray.ObjectRef of the RolloutGroup; set by the caller that owns it

    @classmethod
    def describe(cls, group: RolloutGroup) -> RemoteGroup:
        """The metadata of ``group``, without its reference (the generator does not own one)."""
        return cls(**{f.name: getattr(group, f.name) for f in fields(cls) if f.name != "ref"})

    def fetch(self) -> RolloutGroup:
        import ray

        return ray.get(self.ref)

    def state_dict(self) -> dict:
        """The whole group's state, so controller checkpoints hold payloads as on the local runtime."""
        return self.fetch().state_dict()


@dataclass(frozen=True)
class WeightsRef:
    """Exported weights left in the object store: ``state_dict_bytes`` reads ``nbytes``."""

    ref: Any
    nbytes: int
    transport: ClassVar[str] = "object_store"


@dataclass(frozen=True)
class BroadcastWeights:
    """A version rank 0 is broadcasting: the layout the generators join it with (a reference)."""

    layout: Any
    nbytes: int
    channel: WeightBroadcast
    transport: ClassVar[str] = "broadcast"


@dataclass(frozen=True)
class SentWeights:
    """The last weights a handle sent to its actor; travels with every call, unresolved.

    ``ref`` is None for a broadcast version: an actor that lacks it asks ``source`` (rank 0)."""

    version: int
    ref: Any
    source: Any = None
