"""The built-in tool-use environment: multiply two numbers with a calculator tool.

The tiny model cannot multiply multi-digit numbers in its head, but it can learn to copy the
problem into a calculator call and the tool's answer into its reply: held-out accuracy then
measures how well it uses the tool. ``products`` is the task (``data.task.name: products``; each factor
has ``data.task.options.difficulty`` digits), ``calculator`` the environment, whose one tool is ``calc``, and
``configs/tool-use.yaml`` the run.

``calc`` evaluates arithmetic by walking Python's syntax tree over a closed set of number
and operator nodes: no name, call or attribute is ever looked up, so no code runs. The tool's
latency is simulated, drawn per call from a lognormal distribution (seeded by the prompt and
the call's index), so that benchmarks can show what waiting on tools costs a synchronous trainer.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import time
from typing import TYPE_CHECKING, Any

from pydantic import Field

from asyncrl.config.base import Seed
from asyncrl.data.prompts import Prompt, Task
from asyncrl.data.synthetic import GeneratedOptions
from asyncrl.environments.base import Message
from asyncrl.environments.tool_env import ToolEnvironment
from asyncrl.environments.tools import ToolResult
from asyncrl.rewards.runner import STARTUP_TIMEOUT_S

if TYPE_CHECKING:
    from asyncrl.config import DataConfig

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_LENGTH = 200  # characters of one expression
MAX_MAGNITUDE = 10**100  # larger intermediate values are refused, so ``9**9**9`` cannot exhaust memory


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expr: numbers, + - * / // % ** and parentheses, e.g. 12*34
    """
    if len(expr) > MAX_LENGTH:
        raise ValueError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expr!r} as arithmetic") from None
    value = _evaluate(tree.body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * math.log2(max(abs(left), 2)) > math.log2(MAX_MAGNITUDE):
            raise ValueError("the result is too large")
        value = _OPERATORS[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("the result is too large")
        return value
    raise ValueError(f"{type(node).__name__} is not arithmetic")


def digit_credit(completion: str, answer: str) -> float:
    """The share of the answer's digits given in place, out of its length or the completion's if
    longer: ``1726`` for ``1776`` scores 0.75, and only the exact answer scores 1 (the ``task``
    reward, which lets GRPO learn from answers that are almost copied right)."""
    given = completion.strip()
    return sum(a == b for a, b in zip(given, answer)) / max(len(given), len(answer))


class ProductsTask:
    """``products``: ``37*48=`` -> ``1776``, two factors of ``difficulty`` digits each; its checker
    (the ``task`` reward) is ``digit_credit``."""

    Options = GeneratedOptions
    has_checker = True
    checker_required = False

    def __init__(self, data: DataConfig, options: GeneratedOptions) -> None:
        self.settings, self.eval_size = options, data.eval_size

    def build(self) -> Task:
        digits, eval_size = self.settings.difficulty, self.eval_size
        low = 10 ** (digits - 1) if digits > 1 else 0
        size = (10**digits - low) ** 2
        count = min(size, self.settings.num_problems)
        if count <= eval_size:
            raise ValueError(f"data.eval_size: {eval_size} held-out problems leave none of {count} to train on")
        numbers = random.Random(f"products:{digits}:{self.settings.seed}").sample(range(size), count)
        prompts = [self._prompt(n, low) for n in numbers]
        return Task("products", prompts[eval_size:], prompts[:eval_size], format_pattern=r"-?\d+", score=digit_credit)

    def _prompt(self, number: int, low: int) -> Prompt:
        digits = self.settings.difficulty
        a, b = divmod(number, 10**digits - low)
        return Prompt(f"products/{digits}/{number}", f"{a + low}*{b + low}=", str((a + low) * (b + low)))


class CalculatorEnvironment(ToolEnvironment):
    """The prompt as the user's turn, the calculator as the tool; the run's rewards score the answer."""

    functions = (calc,)

    class Options(ToolEnvironment.Options):
        latency_median_s: float = Field(0.0, ge=0.0, description="median simulated latency of a tool call; 0: none")
        latency_sigma: float = Field(1.0, ge=0.0, description="spread of the lognormal latency (sigma of its log)")
        latency_seed: Seed = Field(0, description="seed of the simulated latencies, with the prompt's uid")

    def __init__(self, options: CalculatorEnvironment.Options, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        super().__init__(options, startup_timeout_s)
        settings = self.settings
        self.latency_median_s, self.latency_sigma = settings.latency_median_s, settings.latency_sigma
        self.latency_seed = settings.latency_seed
        self.rng = random.Random(self.latency_seed)

    def reset(self, prompt: Prompt) -> list[Message]:
        self.rng = random.Random(f"{self.latency_seed}:{prompt.uid}")
        return [{"role": "user", "content": prompt.text}]

    def latency(self) -> float:
        """The next call's simulated latency in seconds: lognormal, ``latency_median_s`` its median."""
        return self.latency_median_s * math.exp(self.latency_sigma * self.rng.gauss(0.0, 1.0))

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if self.latency_median_s > 0:
            time.sleep(self.latency())
        return super().call_tool(name, arguments)

    @staticmethod
    def demonstration(prompt: Prompt) -> list[Message]:
        """The episode a competent model has with ``prompt``: one call, then the tool's answer."""
        expression = prompt.text.removesuffix("=")
        call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": expression}}}
        return [
            {"role": "user", "content": prompt.text},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calc", "content": calc(expression)},
            {"role": "assistant", "content": prompt.answer},
        ]
