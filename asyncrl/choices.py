"""Choice options for the command line: a str Enum of the allowed values, which typer validates
and lists in ``--help``. Shared by ``asyncrl.cli`` and the bench commands (``asyncrl.bench.cli``)."""

from __future__ import annotations

from enum import Enum


def choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum, which typer turns into a validated choice option."""
    return Enum(name, {v: v for v in values}, type=str)
