"""Staleness samplers: the whole contract for how old trained data may be, for both loops.

Rollout side: ``admit(version, buffer)`` either returns an ``Admission`` (the caller reserves a
slot with its ``start_version`` and ``target_step`` right away, before anything else can touch the
buffer) or None: not now, poll again after the next buffer change or version bump. ``version`` is
the weight version the rollout will be generated with. An admission is consumed by the call that
returns it. Train side: ``evict(V, buffer)`` and ``select(V, buffer, min_k, max_k)`` only name
slots; the caller passes them to ``buffer.evict`` and ``buffer.take``. Neither touches the buffer.

A group's lag when trained at version V is ``V - start_version``. Built-ins, by ``sampler.name``:

- ``in_order`` (default): the n-th admission gets ``target_step = n // P`` and the step-V batch is
  exactly the groups with ``target_step == V``. Admission stops at ``target_step > version +
  max_lag``; a weight sync must wait until that gate has closed, so a group with target step t is
  generated with weights ``max(0, t - max_lag)`` and the run is reproducible. ``max_lag: 0`` is
  synchronous GRPO.
- ``weight_fifo``: the same admission gate; trains any group with lag <= max_lag, oldest first.
- ``windowed``: admission bounded by capacity only; trains any group with lag <= max_lag, oldest
  first. Both evict groups whose lag exceeds max_lag.
- ``package.module:Class``: any class with the ``Sampler`` methods, built as
  ``Class(prompts_per_step, max_lag, options)`` with ``sampler.options`` checked by its ``Options``
  model (``plugins.build_part``, docs/plugins.md); built-ins take no options.

Retrying a failed rollout needs no new admission. Either keep its slot reserved and commit the
regenerated group to it (it keeps its place in dispatch order), or ``buffer.cancel`` it and
``buffer.reserve`` again with the slot's own ``start_version`` and ``target_step``, without calling
``admit``. Samplers keep no per-slot state, so both are safe. The same holds for prompts that were
in flight when a checkpoint was taken: resume them with their recorded values.

Dynamic sampling's refills are not the sampler's to choose: while a step has refills out, the
controller trains those without calling ``select``, and it never evicts them (``control/refill.py``),
so a refill is trained in the step it refills under any sampler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from asyncrl.control.buffer import ReplayBuffer, Slot
from asyncrl.plugins import build_part, refused_arguments, resolve, validate_options


@dataclass(frozen=True)
class Admission:
    """What the rollout loop passes to ``buffer.reserve`` for the prompt it dispatches next."""

    start_version: int
    target_step: int | None


@runtime_checkable
class Sampler(Protocol):
    gated: bool  # gated admission needs capacity >= P * (max_lag + 1), or the loops deadlock

    def admit(self, version: int, buffer: ReplayBuffer) -> Admission | None: ...

    def select(self, version: int, buffer: ReplayBuffer, min_k: int, max_k: int) -> list[int]: ...

    def evict(self, version: int, buffer: ReplayBuffer) -> list[int]: ...

    def required_capacity(self, prompts_per_step: int) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


PROTOCOL_METHODS = ("admit", "select", "evict", "required_capacity", "state_dict", "load_state_dict")


class _DispatchCountingSampler:
    """What the built-ins share: validated knobs, and the admission count that the gate and the
    in_order stamp are computed from (the only state, saved for exact resume)."""

    name: ClassVar[str]
    gated: ClassVar[bool]

    def __init__(self, prompts_per_step: int, max_lag: int) -> None:
        if prompts_per_step < 1:
            raise ValueError(f"step.prompts_per_step: {prompts_per_step} < 1")
        if max_lag < 0:
            raise ValueError(f"sampler.max_lag: {max_lag} < 0")
        self.prompts_per_step = prompts_per_step
        self.max_lag = max_lag
        self.num_admitted = 0

    def required_capacity(self, prompts_per_step: int) -> int:
        return prompts_per_step * (self.max_lag + 1) if self.gated else prompts_per_step

    def admit(self, version: int, buffer: ReplayBuffer) -> Admission | None:
        step = self.num_admitted // self.prompts_per_step
        if buffer.num_free == 0 or (self.gated and step > version + self.max_lag):
            return None
        self.num_admitted += 1
        return Admission(start_version=version, target_step=self._target_step(step))

    def select(self, version: int, buffer: ReplayBuffer, min_k: int, max_k: int) -> list[int]:
        """Up to ``max_k`` trainable slot ids, or none while fewer than ``min_k`` are ready."""
        if not 1 <= min_k <= max_k:
            raise ValueError(f"{type(self).__name__}.select: need 1 <= min_k <= max_k, got {min_k}, {max_k}")
        eligible = [slot.slot_id for slot in self._trainable(version, buffer)]
        return eligible[:max_k] if len(eligible) >= min_k else []

    def evict(self, version: int, buffer: ReplayBuffer) -> list[int]:
        """Ready slot ids that can never be trained from ``version`` on."""
        return [slot.slot_id for slot in buffer.ready_slots() if self._too_stale(version, slot)]

    def state_dict(self) -> dict[str, Any]:
        return {"num_admitted": self.num_admitted, "prompts_per_step": self.prompts_per_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["prompts_per_step"] != self.prompts_per_step:
            # num_admitted // P would point at another step than the one being trained: a hang.
            raise ValueError(
                f"step.prompts_per_step: {self.prompts_per_step} differs from {state['prompts_per_step']} "
                "in the checkpoint; the sampler cannot resume with another step size"
            )
        self.num_admitted = state["num_admitted"]

    def _target_step(self, step: int) -> int | None:
        return None

    def _trainable(self, version: int, buffer: ReplayBuffer) -> list[Slot]:
        """Oldest weights first; ties keep dispatch order (the sort is stable)."""
        ready = [slot for slot in buffer.ready_slots() if version - slot.start_version <= self.max_lag]
        return sorted(ready, key=lambda slot: slot.start_version)

    def _too_stale(self, version: int, slot: Slot) -> bool:
        return version - slot.start_version > self.max_lag


class InOrderSampler(_DispatchCountingSampler):
    name = "in_order"
    gated = True

    def _target_step(self, step: int) -> int | None:
        return step

    def _trainable(self, version: int, buffer: ReplayBuffer) -> list[Slot]:
        return [slot for slot in buffer.ready_slots() if slot.target_step == version]

    def _too_stale(self, version: int, slot: Slot) -> bool:
        return slot.target_step is None or slot.target_step < version


class WeightFifoSampler(_DispatchCountingSampler):
    name = "weight_fifo"
    gated = True


class WindowedSampler(_DispatchCountingSampler):
    name = "windowed"
    gated = False


def resolve_sampler(name: str) -> type:
    """The sampler class for a built-in name or a ``package.module:ClassName`` path."""
    cls = resolve("sampler", name, "sampler.name")
    if not isinstance(cls, type):
        raise ValueError(f"sampler.name: '{name}' is not a class")
    missing = [m for m in PROTOCOL_METHODS if not callable(getattr(cls, m, None))]
    if not hasattr(cls, "gated"):
        missing.append("gated")
    if missing:
        missing_list = ", ".join(missing)
        raise ValueError(f"sampler.name: '{name}' does not implement the Sampler protocol; missing {missing_list}")
    return cls


def sampler_part(name: str, options: Mapping[str, Any] | None = None) -> type:
    """The class ``sampler.name`` names, its options checked: what the parts check runs in a fresh
    process for a user's sampler (asyncrl/parts.py), before the run builds it here."""
    cls = resolve_sampler(name)
    validate_options(cls, name, options or {}, "sampler.options")
    return cls


def build_sampler(name: str, prompts_per_step: int, max_lag: int, options: Mapping[str, Any] | None = None) -> Sampler:
    """``Class(prompts_per_step, max_lag, options)``, the options checked by ``Class.Options``."""
    cls = resolve_sampler(name)
    checked = validate_options(cls, name, options or {}, "sampler.options")
    refused = refused_arguments(cls, checked, prompts_per_step=prompts_per_step, max_lag=max_lag)
    if refused is not None:
        raise ValueError(f"sampler.name: '{name}' must be constructible as {cls.__name__}({refused})")
    return build_part(cls, checked, prompts_per_step, max_lag)
