"""Decisions derived from several sections at once: the defaults that depend on another section,
and the effective settings (``auto`` resolved) that the run reads instead of the raw keys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from asyncrl.config.root import RunConfig

TINY_WARM_START_STEPS = 600


def fill_defaults(config: RunConfig) -> None:
    """Resolve the keys whose null default depends on another section."""
    if config.warm_start.steps is None:
        config.warm_start.steps = 0 if config.model.path is not None else TINY_WARM_START_STEPS


class DerivedSettings:
    """The effective settings of a ``RunConfig``, read as properties of it."""

    @property
    def weight_transport(self: RunConfig) -> Literal["in_process", "object_store", "broadcast"]:
        """How a sync moves weights: ``sync.transport`` with ``auto`` resolved."""
        if self.runtime.name == "local":
            return "in_process"
        if self.sync.transport == "auto":
            return "broadcast" if self.broadcast_backend == "nccl" else "object_store"
        return self.sync.transport

    @property
    def broadcast_backend(self: RunConfig) -> Literal["nccl", "gloo"]:
        """NCCL when trainer rank 0 and the generators each have a whole GPU of their own (on Ray an
        actor sees a GPU only when it reserves one; generators use ``trainer.device`` too; NCCL
        refuses two members on one GPU, which fractional GPUs allow), gloo otherwise."""
        gpus = self.runtime.trainer_gpus >= 1 and self.runtime.generator_gpus >= 1
        return "nccl" if gpus and self.trainer.device != "cpu" else "gloo"

    @property
    def scoring_temperature(self: RunConfig) -> float:
        """The temperature the trainer divides logits by: the one rollouts sample at (validation
        keeps it above 0, so logits / temperature is finite)."""
        return self.generation.temperature
