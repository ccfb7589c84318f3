"""The run's sampler, built once from the config, and the replay buffer capacity it needs.

The config only checks the sampler's name; building it runs its code (a user's, for
``package.module:Class``) and keeps state, so a run builds it here exactly once, before any model,
and ``asyncrl config`` builds one to check the same things. Torch-free, like the sampler itself.
"""

from __future__ import annotations

from asyncrl.config import RunConfig
from asyncrl.control.sampler import Sampler, build_sampler


def build_run_sampler(config: RunConfig) -> tuple[Sampler, int]:
    """The sampler ``sampler.name`` names, with its options, and the buffer capacity: the
    configured one, which must hold what the sampler needs plus ``step.max_refill_groups``, or
    exactly that."""
    prompts = config.step.prompts_per_step
    sampler = build_sampler(config.sampler.name, prompts, config.sampler.max_lag, config.sampler.options)
    required = sampler.required_capacity(prompts) + config.step.max_refill_groups
    capacity = config.sampler.buffer_capacity
    if capacity is None:
        return sampler, required
    if capacity < required:
        why = "prompts_per_step * (max_lag + 1) for a gated sampler; less would deadlock"
        if config.step.max_refill_groups:
            why += ", plus step.max_refill_groups, so refills never take an admission's slot"
        raise ValueError(
            f"sampler.buffer_capacity: {capacity} < {required} groups required by sampler "
            f"'{config.sampler.name}' ({why if sampler.gated else 'one step of groups'})"
        )
    return sampler, capacity
