"""The built-in tool-use environment: the calc tool, the products task, the calculator environment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.config import DataConfig
from asyncrl.data.prompts import Prompt
from asyncrl.environments.calculator import CalculatorEnvironment, ProductsTask, calc, digit_credit
from asyncrl.environments.tool_env import close_toolboxes
from asyncrl.environments.tools import Tool


@pytest.fixture(autouse=True)
def _close_toolboxes():
    yield
    close_toolboxes()


@pytest.mark.parametrize(
    ("expr", "value"),
    [("12*34", "408"), ("-(2+3)*4", "-20"), ("7/2", "3.5"), ("8/2", "4"), ("2**10 % 1000", "24"), (" 1 ", "1")],
)
def test_calc_evaluates_arithmetic(expr, value):
    assert calc(expr) == value


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("__import__('os').system('true')", "Call is not arithmetic"),
        ("x*2", "Name is not arithmetic"),
        ("(1).__class__", "Attribute is not arithmetic"),
        ("'a'*3", "Constant is not arithmetic"),
        ("9**9**9", "too large"),
        ("10**99*10**99", "too large"),
        ("1+", "cannot read"),
        ("1" * 201, "longer than 200"),
    ],
)
def test_calc_refuses_anything_but_bounded_arithmetic(expr, problem):
    with pytest.raises(ValueError, match=problem):
        calc(expr)


def test_calc_raises_what_arithmetic_raises():
    with pytest.raises(ZeroDivisionError):
        calc("1/0")


def test_the_schema_comes_from_the_signature_and_docstring():
    assert CalculatorEnvironment.schemas() == [Tool(calc).schema]
    assert CalculatorEnvironment(CalculatorEnvironment.Options()).tools == CalculatorEnvironment.schemas()
    function = CalculatorEnvironment.schemas()[0]["function"]
    assert function["name"] == "calc"
    assert function["parameters"]["properties"]["expr"]["type"] == "string"
    assert function["parameters"]["required"] == ["expr"]


def products(difficulty: int, num_problems: int = 500, eval_size: int = 50, seed: int = 0) -> ProductsTask:
    return ProductsTask(
        DataConfig(eval_size=eval_size),
        ProductsTask.Options(difficulty=difficulty, num_problems=num_problems, seed=seed),
    )


def test_products_are_two_factors_of_the_difficulty_in_digits_with_disjoint_splits():
    task = products(2).build()
    assert (len(task.train), len(task.heldout)) == (450, 50)
    assert not {p.uid for p in task.train} & {p.uid for p in task.heldout}
    for prompt in [*task.train, *task.heldout]:
        a, b = prompt.text.removesuffix("=").split("*")
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert prompt.answer == str(int(a) * int(b))
    assert products(2).build() == task
    assert products(2, seed=1).build() != task
    assert {p.text for p in products(1, num_problems=100, eval_size=10).build().train} <= {
        f"{a}*{b}=" for a in range(10) for b in range(10)
    }
    with pytest.raises(ValueError, match="^data.eval_size: 100 held-out problems leave none of 100"):
        products(1, num_problems=1000, eval_size=100).build()


@pytest.mark.parametrize(
    ("completion", "credit"), [("1776", 1.0), (" 1776\n", 1.0), ("1726", 0.75), ("17760", 0.8), ("", 0.0), ("abc", 0.0)]
)
def test_the_products_checker_credits_the_digits_in_place_and_only_the_exact_answer_fully(completion, credit):
    assert digit_credit(completion, "1776") == credit
    assert products(2).build().score is digit_credit
    assert ProductsTask.has_checker


def test_the_demonstration_is_one_call_then_the_answer():
    prompt = Prompt("products/2/1", "12*34=", "408")
    user, call, result, answer = CalculatorEnvironment.demonstration(prompt)
    assert user == {"role": "user", "content": "12*34="}
    assert call["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"expr": "12*34"}}
    assert result == {"role": "tool", "name": "calc", "content": "408"}
    assert answer == {"role": "assistant", "content": "408"}


def test_a_tool_process_loads_calc_without_torch_or_transformers():
    """A tool process imports the tool's module: the calculator's must stay light (it starts in a fraction of a second)."""
    probe = "import sys, asyncrl.environments.calculator; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "[]\n"
