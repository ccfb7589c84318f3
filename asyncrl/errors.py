"""The run-stop error: what a controller, a worker handle or the CLI raises to end a run cleanly.

Its own module so that workers and the CLI can raise and catch it without importing the controller.
"""

from __future__ import annotations

from pathlib import Path


class RunStopped(RuntimeError):
    """The run stopped before its end. ``checkpoint``: where it was saved first, if it could be."""

    exit_code = 1
    saves_checkpoint = True  # the trainer is known to be healthy when this is raised

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.checkpoint: Path | None = None
