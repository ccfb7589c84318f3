"""ToolEnvironment: a turn's tool calls become tool messages, every failure an error observation counted by kind."""

from __future__ import annotations

import re
import statistics
import sys

import pytest
from helpers import ROOT, SMALL, error

from asyncrl.data.prompts import Prompt
from asyncrl.environments.calculator import CalculatorEnvironment
from asyncrl.environments.tool_env import METRICS, ToolEnvironment, close_toolboxes
from asyncrl.plugins import build_part, resolve, validate_options

PROMPT = Prompt("products/2/7", "12*34=", "408")


@pytest.fixture(autouse=True)
def _close_toolboxes():
    yield
    close_toolboxes()


def calculator(**options) -> CalculatorEnvironment:
    """The calculator environment built as a run builds it, with these options checked."""
    return CalculatorEnvironment(CalculatorEnvironment.Options(**options))


def call(expr, name="calc"):
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expr": "{expr}"}}}}</tool_call>'


def step(env, text):
    return env.step(env.parse(text))


def test_a_call_is_answered_by_a_tool_message_and_the_answer_ends_the_episode():
    env = calculator()
    assert env.reset(PROMPT) == [{"role": "user", "content": "12*34="}]
    turn = step(env, call("12*34"))
    assert not turn.done
    assert turn.messages == [{"role": "tool", "name": "calc", "content": "408"}]
    assert turn.metrics["tool_calls"] == 1 and turn.metrics["tool_s"] > 0
    assert not [key for key, value in turn.metrics.items() if key.startswith("tool_errors") and value]
    last = step(env, "408")
    assert (last.done, last.reward, last.messages) == (True, None, [])  # the run's rewards score "408"
    assert last.metrics == dict.fromkeys(METRICS, 0.0)  # every episode reports every key


@pytest.mark.parametrize(
    ("text", "kind", "says"),
    [
        ('<tool_call>{"name": "calc", "arguments": {"expr": 12}</tool_call>', "parse", "not valid JSON"),
        ("<tool_call>", "parse", "never closed"),
        (call("12*34", name="calculator"), "unknown_tool", "no tool named 'calculator'"),
        ('<tool_call>{"name": "calc", "arguments": {"expr": 12}}</tool_call>', "arguments", "valid string"),
        (call("import os"), "raised", "cannot read 'import os' as arithmetic"),
        (call("1/0"), "raised", "ZeroDivisionError"),
    ],
)
def test_a_failed_call_is_an_error_observation_counted_by_kind_and_the_episode_goes_on(text, kind, says):
    env = calculator()
    env.reset(PROMPT)
    turn = step(env, text)
    assert not turn.done
    (message,) = turn.messages
    assert message["role"] == "tool" and message["content"].startswith("error: ") and says in message["content"]
    assert turn.metrics[f"tool_errors_{kind}"] == 1
    assert turn.metrics["tool_calls"] == (0 if kind == "parse" else 1)
    assert step(env, call("2*3")).messages[0]["content"] == "6"


def test_every_call_of_a_turn_is_run_in_order_and_a_call_past_the_limit_ends_the_episode():
    env = calculator(max_tool_calls=3)
    env.reset(PROMPT)
    first = step(env, call("1+1") + call("2+2"))
    assert [m["content"] for m in first.messages] == ["2", "4"]
    assert first.metrics["tool_calls"] == 2
    last = step(env, call("3+3") + call("4+4"))
    assert last.done and last.reward is None
    assert last.metrics["tool_calls"] == 1 and last.metrics["tool_errors_limit"] == 1


def test_the_simulated_latency_is_lognormal_with_its_median_and_seeded_by_the_prompt():
    def draws(uid, seed=0, count=2001):
        env = calculator(latency_median_s=0.05, latency_sigma=1.0, latency_seed=seed)
        env.reset(Prompt(uid, "1*1=", "1"))
        return [env.latency() for _ in range(count)]

    sample = draws("a")
    assert sample == draws("a")
    assert sample != draws("b") and sample != draws("a", seed=1)
    assert statistics.median(sample) == pytest.approx(0.05, rel=0.1)
    assert statistics.mean(sample) > 1.4 * statistics.median(sample)  # long-tailed: exp(sigma^2 / 2) = 1.65
    assert calculator().latency() == 0.0


def test_a_tool_environment_checks_its_options_and_parser():
    with pytest.raises(ValueError, match="^environment.options.parser: unknown tool_parser 'xml'"):
        calculator(parser="xml")
    assert set(ToolEnvironment.Options.model_fields) <= set(CalculatorEnvironment.Options.model_fields)


def test_the_example_of_docs_environments_runs(tmp_path, monkeypatch):
    """The tool environment docs/environments.md shows, copied into a module as a user would."""
    doc = (ROOT / "docs" / "environments.md").read_text()
    source = re.search(r"```python\n(# my_tools.py\n.*?)```", doc, re.S).group(1)
    (tmp_path / "my_tools.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    env_class = resolve("environment", "my_tools:Dictionary", "environment.name")
    env = build_part(
        env_class, validate_options(env_class, "my_tools:Dictionary", {"max_tool_calls": 2}, "environment.options")
    )
    assert env.tools[0]["function"]["name"] == "lookup"
    env.reset(Prompt("d/1", "What is a cat?", "a small carnivore"))
    turn = step(env, '<tool_call>{"name": "lookup", "arguments": {"word": "cat", "limit": 1}}</tool_call>')
    assert turn.messages == [{"role": "tool", "name": "lookup", "content": "a small carnivore"}]
    assert step(env, "a small carnivore").done


def test_the_simulated_latency_is_waited_before_each_call_and_counted_in_the_tool_time():
    env = calculator(latency_median_s=0.2, latency_sigma=0.0)  # every draw is the median
    env.reset(PROMPT)
    turn = step(env, call("1+1") + call("2+2"))
    assert [m["content"] for m in turn.messages] == ["2", "4"]
    assert turn.metrics["tool_s"] >= 2 * 0.2  # a sleep lasts at least as long as asked


@pytest.mark.slow
def test_a_tool_module_that_does_not_import_in_a_fresh_process_is_refused_with_the_config(capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "broken_tools", raising=False)  # the config check loads it elsewhere
    assert error(capsys, "config", "environment.name=broken_tools:EchoEnvironment") == (
        "environment.name: cannot load 'broken_tools:EchoEnvironment' "
        "(ImportError: a dependency of this tool is missing here)"
    )


@pytest.mark.slow
def test_a_tool_module_that_does_not_import_in_a_tool_process_stops_the_run_with_one_line_and_code_2(tmp_path, capsys):
    import broken_tools  # noqa: F401 (imported by this process already, so the config check passes here)

    message = error(
        capsys,
        "train",
        "--output-dir",
        str(tmp_path / "run"),
        *SMALL,
        "environment.name=broken_tools:EchoEnvironment",
        "environment.options.parser=broken_tools:AlwaysCalls",
    )
    assert message.startswith(
        "environment: the tools broken_tools:echo do not load in a tool process "
        "(ImportError: a dependency of this tool is missing here)"
    ), message
