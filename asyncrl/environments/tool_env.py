"""ToolEnvironment: an environment whose model turns are tool calls until one is the answer.

Each model turn is parsed by the configured ``tool_parser`` (asyncrl/environments/parsers.py).
A turn with tool calls gets one tool message per call, run through the run's ``ToolBox``
(asyncrl/environments/tools.py), and the episode goes on; a turn without any is the final answer,
which the run's rewards score (``Turn.reward`` None). A call past ``max_tool_calls`` ends the
episode there, its last turn scored as the answer. Whatever goes wrong with a call is an error
observation the model reads, never a crash, and each one is counted by kind in the turn's metrics.

A subclass lists its tools in ``functions`` and writes ``reset``; ``call_tool`` is the place to
wrap a call (the calculator environment adds a simulated latency there). The tool box is shared by
the episodes of a run: it is built on first use, once per set of functions and tool settings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.environments.base import Environment, Message, Turn
from asyncrl.environments.parsers import build_parser
from asyncrl.environments.tools import ERROR_KINDS, Tool, ToolBox, ToolResult
from asyncrl.plugins import PartRef
from asyncrl.rewards.runner import STARTUP_TIMEOUT_S

METRICS = ("tool_calls", "tool_s", *(f"tool_errors_{kind}" for kind in ERROR_KINDS))
_BOXES: dict[tuple, ToolBox] = {}
_BOXES_LOCK = threading.Lock()


def shared_toolbox(
    functions: Sequence[Callable[..., Any]], timeout_s: float, processes: int, startup_timeout_s: float
) -> ToolBox:
    """The run's tool box for these functions and settings, built on first use."""
    key = (tuple(functions), timeout_s, processes, startup_timeout_s)
    with _BOXES_LOCK:
        if key not in _BOXES:
            _BOXES[key] = ToolBox(
                functions, timeout_s=timeout_s, processes=processes, startup_timeout_s=startup_timeout_s
            )
        return _BOXES[key]


def close_toolboxes() -> None:
    """Stop every shared tool box's processes (the end of a run)."""
    with _BOXES_LOCK:
        while _BOXES:
            _BOXES.popitem()[1].close()


class ToolEnvironment(Environment):
    """Tool calls until an answer; a subclass gives ``functions`` and ``reset``. Built with
    ``environment.startup_timeout_s`` too (``takes_startup_timeout``): its tool processes' deadline."""

    functions: ClassVar[Sequence[Callable[..., Any]]] = ()
    takes_startup_timeout: ClassVar[bool] = True

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        max_tool_calls: int = Field(4, ge=0, description="tool calls per episode; one more ends the episode")
        tool_timeout_s: float = Field(5.0, gt=0.0, description="wall-clock limit of one tool call")
        tool_processes: int = Field(4, ge=1, description="tool processes: calls that run at once")
        parser: Annotated[str, PartRef("tool_parser", options="parser_options")] = Field(
            "hermes", description="tool-call parser: a built-in name or package.module:attr"
        )
        parser_options: dict[str, Any] = Field(default_factory=dict, description="options of the parser")

    @classmethod
    def schemas(cls) -> list[dict]:
        """The JSON schemas of ``functions``, what the chat template's ``tools=`` shows the model."""
        return [Tool(fn).schema for fn in cls.functions]

    @classmethod
    def check_options(cls, options: ToolEnvironment.Options) -> None:
        """The tools, checked with the config: each one's schema, and their names unique."""
        names = [schema["function"]["name"] for schema in cls.schemas()]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: names must be unique, got {names}")

    def __init__(self, options: ToolEnvironment.Options, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """``options``: an instance of the class's own ``Options`` (a subclass's extends them), kept
        as ``settings``."""
        self.settings = settings = options
        self.max_tool_calls = settings.max_tool_calls
        self.toolbox = shared_toolbox(
            self.functions, settings.tool_timeout_s, settings.tool_processes, startup_timeout_s
        )
        self.tools = self.toolbox.schemas
        self.parser = build_parser(settings.parser, settings.parser_options, "environment.options.parser")
        self.calls_made = 0
        self.parse_errors: list[str] = []

    def parse(self, text: str) -> Message:
        parsed = self.parser.parse(text)
        self.parse_errors = parsed.errors
        return parsed.message

    def step(self, assistant: Message) -> Turn:
        calls, errors = assistant.get("tool_calls", []), self.parse_errors
        metrics = dict.fromkeys(METRICS, 0.0)  # every key in every turn: every episode reports each
        if not calls and not errors:
            return Turn([], done=True, metrics=metrics)
        metrics["tool_errors_parse"] = float(len(errors))
        messages = [_tool_message("", f"error: {error}") for error in errors]
        for call in calls:
            if self.calls_made == self.max_tool_calls:
                metrics["tool_errors_limit"] = 1.0
                return Turn([], done=True, metrics=metrics)
            self.calls_made += 1
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            start = time.perf_counter()
            result = self.call_tool(name, arguments)
            metrics["tool_s"] += time.perf_counter() - start
            metrics["tool_calls"] += 1
            if result.error is not None:
                metrics[f"tool_errors_{result.error}"] += 1
            messages.append(_tool_message(name, result.content))
        return Turn(messages, done=False, metrics=metrics)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """One call through the tool box; a subclass may wrap it."""
        return self.toolbox.call(name, arguments)


def _tool_message(name: str, content: str) -> Message:
    return {"role": "tool", "name": name, "content": content}
