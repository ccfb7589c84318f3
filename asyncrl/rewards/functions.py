"""Reward functions: (completion text, reference answer) -> score, 1.0 meaning correct.

Built-ins, by name:

- ``exact_match``: the stripped completion equals the stripped answer.
- ``numeric_match``: both parse as numbers and are equal ("19", "19.0", " 19 " all match 19);
  anything that is not a plain decimal number scores 0.
- ``math``: equivalence checked by math-verify (LaTeX, fractions, boxed answers, ...).
- ``format``: the stripped completion matches a regex as a whole (``rewards.format_pattern``, or
  the task's own pattern).
- ``overlong``: DAPO's soft overlong penalty, from the response's length in tokens alone
  (``OverlongPenalty``; docs/data.md).
- ``task``: the task's own checker (a reasoning-gym dataset's ``score_answer``, running_sum's credit
  per partial sum).
- ``package.module:function``: any importable callable taking (completion, answer).

A reward with ``uses_num_tokens = True`` is also given the response's length in tokens, as the
keyword ``num_tokens``: text alone does not say how many tokens the generator spent.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from asyncrl.plugins import import_attribute

RewardFn = Callable[[str, str], float]
BUILTIN_REWARDS = ("exact_match", "numeric_match", "math", "format", "overlong", "task")

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def _number(text: str) -> Decimal | None:
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:  # an exponent beyond what decimal represents
        return None


def numeric_match(completion: str, answer: str) -> float:
    """Exact decimal comparison: no float rounding makes two different numbers equal."""
    got, expected = _number(completion), _number(answer)
    return float(got is not None and expected is not None and got == expected)


class FormatReward:
    """1.0 when the stripped completion matches ``pattern`` as a whole; the answer is not looked at."""

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)

    def __call__(self, completion: str, answer: str) -> float:
        return float(self.pattern.fullmatch(completion.strip()) is not None)


class OverlongPenalty:
    """DAPO's soft overlong punishment: 0 up to L_max - L_cache tokens, then falling linearly to -1
    at L_max (``max_new_tokens``), -1 beyond. A response near the limit is penalized gradually
    instead of all truncated ones scoring like wrong answers."""

    uses_num_tokens = True

    def __init__(self, max_new_tokens: int, cache: int) -> None:
        if not 1 <= cache <= max_new_tokens:
            raise ValueError(
                f"rewards.overlong_cache: {cache} must be between 1 and generation.max_new_tokens {max_new_tokens}"
            )
        self.max_new_tokens, self.cache = max_new_tokens, cache

    def __call__(self, completion: str, answer: str, *, num_tokens: int) -> float:
        over = num_tokens - (self.max_new_tokens - self.cache)
        return -min(max(over, 0), self.cache) / self.cache


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns when its own timeouts are off; the runner enforces ours instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_DROP_TIMEOUT_NOTICE = _DropTimeoutNotice()


class MathReward:
    """Equivalence by math-verify, imported on construction so that the slow first import never
    counts against a call's timeout.

    math-verify's own timeouts (SIGALRM) are switched off: the runner's timeout, which kills the
    call's process, applies instead, even to a call stuck in C code that holds the interpreter lock.
    """

    def __init__(self) -> None:
        import math_verify

        self._math_verify = math_verify
        for logger in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(logger).addFilter(_DROP_TIMEOUT_NOTICE)  # adding it again is a no-op

    def __call__(self, completion: str, answer: str) -> float:
        gold = self._math_verify.parse(answer, parsing_timeout=None)
        predicted = self._math_verify.parse(completion, parsing_timeout=None)
        return float(self._math_verify.verify(gold, predicted, timeout_seconds=None))

    def __reduce__(self):
        return MathReward, ()


def resolve_reward(
    name: str,
    *,
    format_pattern: str | None = None,
    task_score: RewardFn | None = None,
    max_new_tokens: int | None = None,
    overlong_cache: int | None = None,
) -> RewardFn:
    """A built-in reward by name, or a ``package.module:function`` path. ``task_score`` is the
    task's own checker, the ``task`` reward."""
    if name == "exact_match":
        return exact_match
    if name == "numeric_match":
        return numeric_match
    if name == "math":
        return MathReward()
    if name == "format":
        if format_pattern is None:
            raise ValueError("rewards.format_pattern: the format reward needs a pattern and the task has none")
        return FormatReward(format_pattern)
    if name == "overlong":
        if max_new_tokens is None or overlong_cache is None:
            raise ValueError(
                "rewards.overlong_cache: the overlong reward needs a cache length and generation.max_new_tokens"
            )
        return OverlongPenalty(max_new_tokens, overlong_cache)
    if name == "task":
        if task_score is None:
            raise ValueError(
                "rewards.functions: the task reward needs a task with its own checker (reasoning_gym, running_sum)"
            )
        return task_score
    if ":" not in name:
        raise ValueError(
            f"rewards.functions: unknown reward '{name}'; built-ins are {', '.join(BUILTIN_REWARDS)}, "
            "or give package.module:function"
        )
    fn = import_attribute(name, "rewards.functions")
    if isinstance(fn, type):
        raise ValueError(
            f"rewards.functions: '{name}' is a class; give a function taking (completion, answer), or an instance"
        )
    if not callable(fn):
        raise ValueError(f"rewards.functions: '{name}' is not callable")
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):  # noqa: B004 (not a callable check)
        raise ValueError(f"rewards.functions: '{name}' is async; rewards are called, not awaited: use a plain def")
    try:
        inspect.signature(fn).bind(
            "completion", "answer", **({"num_tokens": 0} if getattr(fn, "uses_num_tokens", False) else {})
        )
    except TypeError:
        raise ValueError(
            f"rewards.functions: '{name}' must accept (completion, answer), the two strings it is called with"
        ) from None
    except ValueError:
        pass  # no inspectable signature (some builtins); a wrong one surfaces as counted errors
    return fn
