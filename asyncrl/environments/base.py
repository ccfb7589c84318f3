"""The environment seam: what a multi-turn episode talks to, in chat messages.

An environment speaks messages; the episode loop (``episode.py``) speaks token ids. One
instance serves one episode: ``reset`` gives the opening messages, then each model turn, parsed
into an assistant message by ``parse``, goes to ``step``, which answers with the observation
messages and whether the episode is over. The loop never re-templates the transcript: it appends
the chat template's delta for each observation and keeps the sampled tokens as they were.

A part of kind ``environment`` (asyncrl/plugins.py) is a subclass of ``Environment``, built once
per episode as ``Class(options)`` (``plugins.build_part``) with its options checked by its
``Options`` model, that model's instance (``Class()`` without one). State shared by
the episodes of a run (a pool of tool processes) lives at class level, created on first use.
This module imports no torch: environment code stays light enough for the reward processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from asyncrl.data.prompts import Prompt
from asyncrl.plugins import build_part, resolve, validate_options

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

Message = dict[str, Any]  # a chat message: {"role": ..., "content": ..., "tool_calls": [...]}


@dataclass
class Turn:
    """The environment's answer to one model turn."""

    messages: list[Message]  # new observation messages (role "tool" or "user"); [] when done
    done: bool
    reward: float | None = None  # the episode's reward when done; None: the run's rewards score the last answer
    metrics: dict[str, float] = field(default_factory=dict)  # summed over the episode's turns (tool_calls, ...)


class Environment(ABC):
    """One episode's environment. ``tools``: JSON schemas for the chat template's ``tools=``;
    ``task``: the ``data.task.name`` whose prompts it reads, checked with the config (None: any)."""

    tools: ClassVar[list[dict]] = []
    task: ClassVar[str | None] = None

    @abstractmethod
    def reset(self, prompt: Prompt) -> list[Message]:
        """The opening messages of the episode for ``prompt`` (system and user turns)."""

    @abstractmethod
    def step(self, assistant: Message) -> Turn:
        """The model's parsed turn -> the observation, or the end of the episode."""

    def parse(self, text: str) -> Message:
        """The generated text of one turn as an assistant message (a tool environment parses calls)."""
        return {"role": "assistant", "content": text}


@dataclass(frozen=True)
class EnvironmentPart:
    """An environment class with its checked options, and ``environment.startup_timeout_s`` for a
    class that declares ``takes_startup_timeout`` (its tool processes' deadline)."""

    cls: type[Environment]
    options: BaseModel | None
    startup_timeout_s: float

    def build(self) -> Environment:
        """One episode's environment."""
        if getattr(self.cls, "takes_startup_timeout", False):
            return build_part(self.cls, self.options, startup_timeout_s=self.startup_timeout_s)
        return build_part(self.cls, self.options)


def environment_part(
    spec: str, options: dict[str, Any], task: str | None = None
) -> tuple[type[Environment], BaseModel | None]:
    """The class ``environment.name`` names and its checked options, nested parts included: what
    the parts check runs in a fresh process (asyncrl/parts.py). ``task``: the run's
    ``data.task.name``, refused when the environment reads another task's prompts."""
    part = resolve("environment", spec, "environment.name")
    if not (isinstance(part, type) and issubclass(part, Environment)):
        raise ValueError(f"environment.name: '{spec}' is not a subclass of asyncrl.environments.Environment")
    if task is not None and part.task is not None and task != part.task:
        raise ValueError(
            f"data.task.name: environment '{spec}' reads the prompts of the '{part.task}' task, not '{task}' "
            f"(set data.task.name={part.task})"
        )
    return part, validate_options(part, spec, options, "environment.options")


def environment_class(config: RunConfig) -> EnvironmentPart | None:
    """The class ``environment.name`` names and its checked options; None for single-turn runs."""
    spec = config.environment.name
    if spec is None:
        return None
    part, options = environment_part(spec, config.environment.options)
    return EnvironmentPart(part, options, config.environment.startup_timeout_s)
