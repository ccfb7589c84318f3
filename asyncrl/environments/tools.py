"""Tools: typed Python callables the model calls, run where a timeout can stop them.

A tool is a module-level function with type hints and a Google-style docstring; its JSON schema,
what the chat template's ``tools=`` shows the model, comes from both through transformers'
``get_json_schema``. A ``ToolBox`` checks each call's arguments against the signature here, then
runs the call in a tool process: the reward processes' interpreter (``asyncrl.rewards.worker``),
killed and replaced when a call runs past ``timeout_s``, so a tool stuck in C code cannot hold the
run. Calls from different episodes (threads) run at once, one per process, up to ``processes``.

Nothing a call does crashes the run: an unknown tool, arguments that do not fit the signature, a
tool that raises, returns something unprintable, runs too long or kills its process all give a
``ToolResult`` with an error ``kind``, which the environment sends back as an error observation
and counts.
"""

from __future__ import annotations

import inspect
import pickle
import threading
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from asyncrl.errors import RunStopped
from asyncrl.rewards.processes import StartFailed, Worker, not_started, start_loaded
from asyncrl.rewards.runner import STARTUP_TIMEOUT_S

_START_TOOL_PROCESS = "from asyncrl.rewards.worker import call_tool, main; main(call_tool)"

ERROR_KINDS = ("parse", "unknown_tool", "arguments", "raised", "timeout", "crashed", "limit")


class ToolStartError(RunStopped):
    """A tool process did not start: a tool's module does not import in a fresh interpreter, or
    not within the start deadline. The environment is at fault, so the CLI exits with code 2."""

    exit_code = 2


@dataclass(frozen=True)
class ToolResult:
    content: str  # what the model sees in the tool message: the result, or what went wrong
    error: str | None  # None, or one of ERROR_KINDS


class Tool:
    """One callable, its schema, and the check of a call's arguments against its signature."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        from transformers.utils import get_json_schema  # here: a tool process never needs it (1-2 s to import)

        name = getattr(fn, "__name__", repr(fn))
        try:
            self.schema = get_json_schema(fn)
            hints = typing.get_type_hints(fn)
            pickle.dumps(fn)
        except Exception as err:
            raise ValueError(f"tool {name}: {type(err).__name__}: {err}") from None
        self.fn, self.name = fn, self.schema["function"]["name"]
        self.signature = inspect.signature(fn)
        self.adapters = {p: TypeAdapter(hints[p]) for p in self.signature.parameters}

    def arguments(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The arguments as the tool takes them (``3`` for a float is ``3.0``); a wrong name, a
        missing one or a JSON type that does not fit raises ValueError saying which."""
        try:
            bound = self.signature.bind(**arguments)
        except TypeError as err:
            raise ValueError(str(err)) from None
        checked = {}
        for name, value in bound.arguments.items():
            try:
                checked[name] = self.adapters[name].validate_python(value, strict=True)
            except ValidationError as err:
                raise ValueError(f"argument {name}: {err.errors()[0]['msg']}") from None
        return checked


class ToolBox:
    """The tools of an environment, shared by the episodes of a run; thread-safe."""

    def __init__(
        self,
        functions: Sequence[Callable[..., Any]],
        *,
        timeout_s: float = 5.0,
        processes: int = 4,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.tools = {tool.name: tool for tool in map(Tool, functions)}
        if len(self.tools) != len(functions):
            raise ValueError(f"tools: names must be unique, got {[Tool(fn).name for fn in functions]}")
        if not timeout_s > 0:
            raise ValueError(f"tool_timeout_s: must be a positive number of seconds, got {timeout_s}")
        if processes < 1:
            raise ValueError(f"tool_processes: must be at least 1, got {processes}")
        self.schemas = [tool.schema for tool in self.tools.values()]
        self.timeout_s, self.processes, self.startup_timeout_s = timeout_s, processes, startup_timeout_s
        self._index = {name: i for i, name in enumerate(self.tools)}
        self._payload = pickle.dumps([pickle.dumps(tool.fn) for tool in self.tools.values()])
        self._idle: list[Worker] = []
        self._started = 0  # processes alive: idle or running a call
        self._free = threading.Condition()
        self._closed = False

    def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call, blocking this thread only."""
        return ToolResult(*self._call(name, arguments))

    def close(self) -> None:
        """Stop the idle processes; a call still running stops its own when it ends. Idempotent."""
        with self._free:
            self._closed = True
            while self._idle:
                self._idle.pop().kill()
                self._started -= 1

    def __enter__(self) -> ToolBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, str | None]:
        tool = self.tools.get(name)
        if tool is None:
            return f"error: no tool named {name!r}; the tools are {', '.join(self.tools)}", "unknown_tool"
        try:
            checked = tool.arguments(arguments)
        except ValueError as err:
            return f"error: {name}: {err}", "arguments"
        process = self._acquire()
        try:
            process.conn.send([(self._index[name], checked)])
            if not process.conn.poll(self.timeout_s):
                return f"error: {name} ran past its time limit of {self.timeout_s} s", "timeout"
            _, (content, problem) = process.conn.recv()
        except (EOFError, OSError):
            return f"error: {name} ended its process (exit code {process.process.wait()})", "crashed"
        else:
            self._release(process)
            process = None
            return (content, None) if problem is None else (f"error: {name} {problem}", "raised")
        finally:
            if process is not None:  # timed out or died: a fresh one takes its place
                self._discard(process)

    def _acquire(self) -> Worker:
        """An idle process, or a new one while fewer than ``processes`` are alive; else wait for one.

        An idle process can be dead: it dies with the thread that started it (``_die_with``), an
        episode thread the environments' pool may retire. It is replaced, never handed a call."""
        with self._free:
            while not self._idle and self._started >= self.processes:
                self._free.wait()
            if self._closed:
                raise RuntimeError("ToolBox.call: the tool box is closed")
            while self._idle:
                process = self._idle.pop()
                if process.process.poll() is None:
                    return process
                process.kill()
                self._started -= 1
            self._started += 1
        try:
            return self._start()
        except BaseException:
            self._discard(None)
            raise

    def _start(self) -> Worker:
        """A fresh tool process with the tools loaded, within ``environment.startup_timeout_s``."""
        try:
            return start_loaded(_START_TOOL_PROCESS, self._payload, self.startup_timeout_s)
        except StartFailed as failed:
            if failed.exit_code is not None:
                problem = f"a tool process loading the tools {self._origin()} exited while starting (exit code {failed.exit_code})"
            elif failed.problem is not None:
                problem = f"the tools {self._origin()} do not load in a tool process ({failed.problem})"
            else:
                loading = None if failed.loading is None else f"the tools {self._origin()}"
                problem = not_started(
                    "a tool process", "environment.startup_timeout_s", self.startup_timeout_s, loading
                )
            raise ToolStartError(f"environment: {problem}") from None

    def _origin(self) -> str:
        """The tools as ``module:name``, for an error that must say which one would not load."""
        return ", ".join(f"{tool.fn.__module__}:{tool.fn.__qualname__}" for tool in self.tools.values())

    def _release(self, process: Worker) -> None:
        with self._free:
            if self._closed:
                process.kill()
                self._started -= 1
            else:
                self._idle.append(process)
            self._free.notify()

    def _discard(self, process: Worker | None) -> None:
        if process is not None:
            process.kill()
        with self._free:
            self._started -= 1
            self._free.notify()
