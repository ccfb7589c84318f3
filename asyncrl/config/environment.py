"""The ``environment`` section: multi-turn episodes against an environment (docs/environments.md)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from asyncrl.config.base import PartSection


class EnvironmentConfig(PartSection):
    """What an episode talks to, and its limits; no name: one response per prompt (single turn)."""

    kind, at = "environment", "environment"

    name: str | None = Field(
        None,
        description="a built-in environment (docs/environments.md lists them) or package.module:Class; null: "
        "single-turn, the prompt's text and one response",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="settings of the environment (its Options model), built once per episode"
    )
    max_turns: int = Field(
        4, ge=1, description="model turns per episode; an episode still going after them is truncated"
    )
    max_tokens: int = Field(
        256, ge=1, description="response tokens per episode, observations included; past them it is truncated"
    )
    max_seconds: float | None = Field(
        None,
        gt=0.0,
        description="wall time per episode; past it the episode is truncated (null: no limit, and a "
        "limit makes a run depend on timing)",
    )
    threads: int = Field(32, ge=1, description="environment steps that run at once in a rollout worker")
    startup_timeout_s: float = Field(
        60.0,
        gt=0.0,
        allow_inf_nan=False,
        description="a process loading the environment's code must be done within this: the config check, "
        "which resolves the environment and the parts its options name in a fresh process, and each tool "
        "process (a module that blocks at import); past it, exit code 2",
    )

    @model_validator(mode="after")
    def _options_need_a_name(self) -> EnvironmentConfig:
        """Options without a name: single-turn, nothing to set them on."""
        if self.name is None and self.options:
            raise ValueError("environment.options: set, but environment.name is null (single-turn)")
        return self
