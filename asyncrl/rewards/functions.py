"""Reward functions: (completion text, reference answer) -> score, 1.0 meaning correct.

Built-ins, by name:

- ``exact_match``: the stripped completion equals the stripped answer.
- ``numeric_match``: both parse as numbers and are equal ("19", "19.0", " 19 " all match 19);
  anything that is not a plain decimal number scores 0.
- ``math``: the answer the completion states (asyncrl/rewards/extract.py: a box, an "answer is", a
  closing "=", a closing math span, else a last number that stands alone), equivalent by math-verify
  (LaTeX, fractions, ...); a completion that only restates the question states none and scores 0.
- ``format``: the stripped completion matches a regex as a whole (its option ``pattern``, or the
  task's own pattern).
- ``overlong``: DAPO's soft overlong penalty, from the response's length in tokens alone
  (``OverlongPenalty``, its option ``cache``; docs/data.md).
- ``task``: the task's own checker (a reasoning-gym dataset's ``score_answer``, running_sum's credit
  per partial sum).
- ``package.module:attr``: a function (or an instance) taking (completion, answer), or a class
  built as ``Class(options)`` with ``rewards.options[spec]`` checked by its ``Options`` model
  (``plugins.build_part``; ``Class()`` without one).

A class with a ``from_run(context, options)`` classmethod is built by it instead, for a reward
that needs the run (a ``RewardContext``): that is how ``format``, ``overlong`` and ``task`` get the
task's pattern and checker and generation.max_new_tokens. Built-ins are resolved exactly like a
user's path (asyncrl/plugins.py, docs/plugins.md).

A reward with ``uses_num_tokens = True`` is also given the response's length in tokens, as the
keyword ``num_tokens``: text alone does not say how many tokens the generator spent.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from pydantic import BaseModel, Field, field_validator

from asyncrl.plugins import build_part, refused_arguments, resolve, validate_options
from asyncrl.rewards.extract import stated_answer

RewardFn = Callable[[str, str], float]


@dataclass(frozen=True)
class RewardContext:
    """What a reward built by ``from_run`` may need from the run besides its options."""

    format_pattern: str | None = None  # the task's own, for a format reward given no pattern
    task_score: RewardFn | None = None  # the task's own checker
    max_new_tokens: int | None = None  # generation.max_new_tokens


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


class FormatOptions(BaseModel):
    """``rewards.options.format``."""

    pattern: str | None = Field(
        None, description="regex the whole stripped completion must match; null: the task's own"
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"invalid regex ({err})") from None
        return pattern


class FormatReward:
    """1.0 when the stripped completion matches ``pattern`` as a whole; the answer is not looked at."""

    Options = FormatOptions

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)

    @classmethod
    def from_run(cls, context: RewardContext, options: FormatOptions) -> FormatReward:
        pattern = options.pattern if options.pattern is not None else context.format_pattern
        if pattern is None:
            raise ValueError("rewards.options.format.pattern: the format reward needs a pattern and the task has none")
        return cls(pattern)

    def __call__(self, completion: str, answer: str) -> float:
        return float(self.pattern.fullmatch(completion.strip()) is not None)


class OverlongPenalty:
    """DAPO's soft overlong punishment: 0 up to L_max - L_cache tokens, then falling linearly to -1
    at L_max (``max_new_tokens``), -1 beyond. A response near the limit is penalized gradually
    instead of all truncated ones scoring like wrong answers."""

    uses_num_tokens = True

    class Options(BaseModel):
        """``rewards.options.overlong``."""

        cache: int = Field(
            ge=1,
            description="L_cache: 0 up to generation.max_new_tokens - L_cache tokens, then linearly down to -1 at "
            "max_new_tokens (DAPO)",
        )

    def __init__(self, max_new_tokens: int, cache: int) -> None:
        if not 1 <= cache <= max_new_tokens:
            raise ValueError(
                f"rewards.options.overlong.cache: {cache} must be between 1 and generation.max_new_tokens "
                f"{max_new_tokens}"
            )
        self.max_new_tokens, self.cache = max_new_tokens, cache

    @classmethod
    def from_run(cls, context: RewardContext, options: OverlongPenalty.Options) -> OverlongPenalty:
        if context.max_new_tokens is None:
            raise ValueError("rewards.options.overlong.cache: the overlong reward needs generation.max_new_tokens")
        return cls(context.max_new_tokens, options.cache)

    def __call__(self, completion: str, answer: str, *, num_tokens: int) -> float:
        over = num_tokens - (self.max_new_tokens - self.cache)
        return -min(max(over, 0), self.cache) / self.cache


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns when its own timeouts are off; the runner enforces ours instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_DROP_TIMEOUT_NOTICE = _DropTimeoutNotice()


class MathReward:
    """The stated answer's equivalence by math-verify, imported on construction so that the slow
    first import never counts against a call's timeout.

    Only the answer ``stated_answer`` extracts is parsed: math-verify given the whole completion
    would find "86 + 40" in "To add 86 + 40, we need" equal to 126.

    math-verify's own timeouts (SIGALRM) are switched off: the runner's timeout, which kills the
    call's process, applies instead, even to a call stuck in C code that holds the interpreter lock.
    """

    def __init__(self) -> None:
        import math_verify

        self._math_verify = math_verify
        for logger in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(logger).addFilter(_DROP_TIMEOUT_NOTICE)  # adding it again is a no-op

    def __call__(self, completion: str, answer: str) -> float:
        stated = stated_answer(completion)
        if stated is None:
            return 0.0
        gold = self._math_verify.parse(answer, parsing_timeout=None)
        predicted = self._parse_value(stated)
        return float(self._math_verify.verify(gold, predicted, timeout_seconds=None))

    def _parse_value(self, value: str) -> list:
        """A stated value is math without its delimiters ("\\frac{1}{2}", "42 apples"): parsed as
        such, or as text where that finds nothing."""
        if "$" not in value:
            parsed = self._math_verify.parse(f"${value}$", parsing_timeout=None)
            if parsed:
                return parsed
        return self._math_verify.parse(value, parsing_timeout=None)

    def __reduce__(self):
        return MathReward, ()


class TaskReward:
    """The ``task`` reward: the task's own checker, which the run supplies."""

    @staticmethod
    def from_run(context: RewardContext) -> RewardFn:
        if context.task_score is None:
            raise ValueError(
                "rewards.functions: the task reward needs a task with its own checker (reasoning_gym, running_sum)"
            )
        return context.task_score


def reward_part(name: str, options: Mapping[str, Any] | None = None) -> tuple[Any, BaseModel | None]:
    """What ``name`` resolves to, and its checked options: what ``parts.check_parts`` checks before a run."""
    part = resolve("reward", name, "rewards.functions")
    if not callable(part):
        raise ValueError(f"rewards.functions: '{name}' is not callable")
    checked = validate_options(part if isinstance(part, type) else None, name, options or {}, f"rewards.options.{name}")
    if isinstance(part, type):
        build = getattr(part, "from_run", None)
        refused = refused_arguments(build or part, checked, **({"context": RewardContext()} if build else {}))
        if refused is not None:
            how = f"{part.__name__}.from_run" if build else part.__name__
            raise ValueError(f"rewards.functions: '{name}' is a class that must be constructible as {how}({refused})")
    return part, checked


def resolve_reward(
    name: str,
    options: Mapping[str, Any] | None = None,
    *,
    format_pattern: str | None = None,
    task_score: RewardFn | None = None,
    max_new_tokens: int | None = None,
) -> RewardFn:
    """The reward function ``name`` gives: a built-in name or a ``package.module:attr`` path, built
    with ``options``. ``task_score`` is the task's own checker, the ``task`` reward, and
    ``format_pattern`` its pattern, the format reward's when its options give none."""
    part, checked = reward_part(name, options)
    fn = part
    if isinstance(part, type):
        build = getattr(part, "from_run", None)
        context = RewardContext(format_pattern, task_score, max_new_tokens)
        fn = build_part(build, checked, context) if build else build_part(part, checked)
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
