"""The ``rewards`` section: the functions that score responses and their weights."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from asyncrl.config.base import Section
from asyncrl.plugins import check_spec


class RewardConfig(Section):
    """How responses are scored."""

    functions: list[str] = Field(
        default_factory=lambda: ["exact_match"],
        description="exact_match, numeric_match, math, format, overlong, task (the task's own checker: "
        "reasoning_gym, running_sum), or package.module:attr (docs/plugins.md); the first one decides accuracy",
    )
    options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="settings of a listed reward that declares them (its Options model), by its entry in functions; "
        "the built-ins format (pattern) and overlong (cache) too",
    )
    weights: list[float] | None = Field(None, description="one weight per function; null: all 1")
    timeout_s: float = Field(5.0, gt=0.0, description="wall-clock limit of one reward call; past it the reward is 0")
    processes: int = Field(
        4,
        ge=1,
        description="worker processes the reward calls run in, started on the first batch; a call past "
        "timeout_s has its process killed and replaced",
    )
    startup_timeout_s: float = Field(
        60.0,
        gt=0.0,
        allow_inf_nan=False,
        description="a reward process must load the functions within this (a module that blocks at import), "
        "and so must the config check, which loads a package.module:attr reward in a fresh process; past it, "
        "exit code 2",
    )

    @model_validator(mode="after")
    def _functions_valid(self) -> RewardConfig:
        if not self.functions:
            raise ValueError("rewards.functions: at least one reward function is needed")
        for name in self.options:
            if name not in self.functions:
                raise ValueError(f"rewards.options.{name}: not in rewards.functions")
        for name in self.functions:
            if self.functions.count(name) > 1:
                raise ValueError(f"rewards.functions: '{name}' is listed twice")
            check_spec("reward", name, "rewards.functions")  # the name only: parts.check_parts loads it
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(f"rewards.weights: {len(self.weights)} weights for {len(self.functions)} functions")
        if self.weights is not None and not any(self.weights):
            raise ValueError("rewards.weights: all 0, so every reward and every advantage is 0")
        return self
