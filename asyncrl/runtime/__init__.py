"""Runtimes turn plain worker objects into handles whose method calls the controller awaits.

A handle call submits the work immediately and returns an awaitable, so calls to one worker run
in the order they were made. That ordering is what the weight sync relies on: a weight load
submitted after a generation batch runs after it. The controller is identical on every runtime.
"""

from asyncrl.runtime.local import LocalHandle, LocalRuntime

__all__ = ["LocalHandle", "LocalRuntime", "build_runtime"]


def build_runtime(name: str):
    """The runtime ``runtime.name`` selects."""
    if name == "local":
        return LocalRuntime()
    raise ValueError(f"runtime.name: '{name}' is not available yet; use local")
