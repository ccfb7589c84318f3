"""Built-in tasks: seeded synthetic problems with checkable answers and a difficulty knob.

A task numbers every problem of a difficulty level 0 .. size-1. A seeded sample of
``num_problems`` distinct numbers (``GeneratedOptions``) picks the problems; the first ``data.eval_size`` of them
form the held-out split and the rest the train split, so the two never share a problem. A prompt's
uid is ``task/difficulty/number``: a problem keeps its uid, and so its sampling seeds, whatever
was sampled around it.

- ``arithmetic``: ``12+7=`` -> ``19``. Integer expressions; ``*`` binds before ``+`` and ``-``.
- ``running_sum``: ``running sum 3 8 5 1:`` -> ``3,11,16,17``. Every partial sum, written out,
  so the final total is reached one step at a time. Its own checker (the ``task`` reward) gives
  credit per partial sum: the share of leading sums that are right, so ``3,11,15,17`` scores 0.5.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.config.base import Seed
from asyncrl.data.prompts import Prompt, Task


class SyntheticTask(Protocol):
    name: str
    format_pattern: str  # a well-formed answer, for the format reward
    max_difficulty: int | None  # None: every level from 1 up exists
    score: Callable[[str, str], float] | None  # the task's own checker, the task reward; None: none

    def size(self, difficulty: int) -> int: ...
    def problem(self, number: int, difficulty: int) -> tuple[str, str]: ...


class GeneratedOptions(BaseModel):
    """A generated task's settings: which level, and which of its problems (docs/data.md)."""

    model_config = ConfigDict(extra="forbid")

    difficulty: int = Field(2, ge=1, description="the level of the problems (each task's levels are in docs/data.md)")
    seed: Seed = Field(0, description="seed choosing the problems and their train / held-out split")
    num_problems: int = Field(
        10000, ge=2, description="distinct problems drawn, the held-out ones first; a level may have fewer"
    )


@dataclass(frozen=True)
class ArithmeticLevel:
    terms: int
    max_operand: int  # operands are 0 .. max_operand
    operators: str


ARITHMETIC_LEVELS = {
    1: ArithmeticLevel(terms=2, max_operand=19, operators="+"),
    2: ArithmeticLevel(terms=2, max_operand=19, operators="+-*"),
    3: ArithmeticLevel(terms=2, max_operand=99, operators="+-*"),
    4: ArithmeticLevel(terms=3, max_operand=99, operators="+-*"),
    5: ArithmeticLevel(terms=4, max_operand=999, operators="+-*"),
}


def _digits(number: int, base: int, count: int) -> tuple[int, list[int]]:
    """Peel ``count`` base-``base`` digits off ``number``; returns (what is left, digits)."""
    digits = []
    for _ in range(count):
        number, digit = divmod(number, base)
        digits.append(digit)
    return number, digits


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Products first, then sums and differences from left to right."""
    total, sign, product = 0, 1, operands[0]
    for operator, operand in zip(operators, operands[1:]):
        if operator == "*":
            product *= operand
        else:
            total += sign * product
            sign, product = (1 if operator == "+" else -1), operand
    return total + sign * product


class Arithmetic:
    name = "arithmetic"
    format_pattern = r"-?\d+"
    max_difficulty = max(ARITHMETIC_LEVELS)
    score = None

    def size(self, difficulty: int) -> int:
        level = ARITHMETIC_LEVELS[difficulty]
        return (level.max_operand + 1) ** level.terms * len(level.operators) ** (level.terms - 1)

    def problem(self, number: int, difficulty: int) -> tuple[str, str]:
        level = ARITHMETIC_LEVELS[difficulty]
        number, operands = _digits(number, level.max_operand + 1, level.terms)
        _, operator_ids = _digits(number, len(level.operators), level.terms - 1)
        operators = [level.operators[i] for i in operator_ids]
        expression = "".join(f"{op}{x}" for op, x in zip(["", *operators], operands))
        return f"{expression}=", str(evaluate(operands, operators))


def partial_sum_credit(completion: str, answer: str) -> float:
    """The share of leading partial sums that are right, out of those expected or given if more:
    ``3,11,15,17`` for ``3,11,16,17`` scores 0.5, and only the exact answer scores 1."""
    expected, given = answer.split(","), completion.strip().split(",")
    right = 0
    for want, got in zip(expected, given):
        if got.strip() != want:
            break
        right += 1
    return right / max(len(expected), len(given))


class RunningSum:
    """Difficulty d: d + 2 single-digit numbers."""

    name = "running_sum"
    format_pattern = r"\d+(,\d+)+"
    max_difficulty = None
    score = staticmethod(partial_sum_credit)

    def size(self, difficulty: int) -> int:
        return 10 ** (difficulty + 2)

    def problem(self, number: int, difficulty: int) -> tuple[str, str]:
        _, numbers = _digits(number, 10, difficulty + 2)
        text = "running sum " + " ".join(map(str, numbers)) + ":"
        return text, ",".join(map(str, accumulate(numbers)))


SYNTHETIC_TASKS: dict[str, SyntheticTask] = {task.name: task for task in (Arithmetic(), RunningSum())}


def check_difficulty(name: str, difficulty: int) -> None:
    highest = SYNTHETIC_TASKS[name].max_difficulty
    if difficulty < 1 or (highest is not None and difficulty > highest):
        levels = f"1-{highest}" if highest is not None else "1 and up"
        raise ValueError(f"data.task.options.difficulty: {name} has levels {levels}, got {difficulty}")


def synthetic_task(name: str, difficulty: int, *, seed: int, num_problems: int, eval_size: int) -> Task:
    """``eval_size`` held-out problems and up to ``num_problems - eval_size`` train problems."""
    check_difficulty(name, difficulty)
    task = SYNTHETIC_TASKS[name]
    size = task.size(difficulty)
    count = min(size, num_problems)
    if count <= eval_size:
        raise ValueError(
            f"data.eval_size: {eval_size} held-out problems leave none to train on "
            f"({name} difficulty {difficulty} has {size} problems, data.task.options.num_problems is {num_problems})"
        )
    numbers = random.Random(f"{name}:{difficulty}:{seed}").sample(range(size), count)
    prompts = [Prompt(f"{name}/{difficulty}/{n}", *task.problem(n, difficulty)) for n in numbers]
    return Task(
        name,
        train=prompts[eval_size:],
        heldout=prompts[:eval_size],
        format_pattern=task.format_pattern,
        score=task.score,
    )
