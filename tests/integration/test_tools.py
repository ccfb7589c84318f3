"""ToolBox: typed tools run in tool processes; every failure is an error observation of its kind, never a crash."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncrl.environments.tools import Tool, ToolBox, ToolResult


def add(a: int, b: float = 0.5) -> float:
    """Add two numbers.

    Args:
        a: an integer
        b: a number
    """
    return a + b


def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: what to say
    """
    return text.upper()


def fail(reason: str) -> str:
    """Always raises.

    Args:
        reason: the message of the error
    """
    raise RuntimeError(reason)


def hang(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def die(code: int) -> str:
    """Ends its process.

    Args:
        code: the exit code
    """
    os._exit(code)


def meet(directory: str, name: str, count: int) -> str:
    """Waits until ``count`` calls are in ``directory`` at once.

    Args:
        directory: where the calls sign in
        name: this call's name
        count: how many calls to wait for
    """
    Path(directory, name).touch()
    while len(os.listdir(directory)) < count:
        time.sleep(0.01)
    return "met"


def pid() -> int:
    """The tool process's id."""
    return os.getpid()


@pytest.fixture
def box():
    box = ToolBox([add, shout, fail, hang, die, meet, pid], timeout_s=30.0, processes=2)
    yield box
    box.close()


def test_the_schema_comes_from_the_signature_and_the_docstring():
    schema = Tool(add).schema
    assert schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add two numbers."
    assert schema["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "an integer"},
        "b": {"type": "number", "description": "a number"},
    }
    assert schema["function"]["parameters"]["required"] == ["a"]


def test_a_function_without_a_docstring_or_hints_is_refused_naming_it():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="^tool bare: "):
        Tool(bare)


def test_calls_run_in_a_tool_process_with_their_checked_arguments(box):
    assert box.call("add", {"a": 2, "b": 3}) == ToolResult("5.0", None)
    assert box.call("add", {"a": 2}) == ToolResult("2.5", None)
    assert box.call("shout", {"text": "hi"}) == ToolResult("HI", None)
    assert int(box.call("pid", {}).content) != os.getpid()


@pytest.mark.parametrize(
    ("name", "arguments", "kind", "says"),
    [
        ("divide", {"a": 1}, "unknown_tool", "no tool named 'divide'"),
        ("add", {"b": 1.0}, "arguments", "missing a required argument: 'a'"),
        ("add", {"a": 1, "c": 2}, "arguments", "unexpected keyword argument 'c'"),
        ("add", {"a": "1"}, "arguments", "argument a: Input should be a valid integer"),
        ("add", {"a": 1.5}, "arguments", "argument a: Input should be a valid integer"),
        ("shout", {"text": 3}, "arguments", "argument text: Input should be a valid string"),
        ("fail", {"reason": "no luck"}, "raised", "raised RuntimeError: no luck"),
    ],
)
def test_a_bad_call_is_an_error_observation_of_its_kind(box, name, arguments, kind, says):
    result = box.call(name, arguments)
    assert result.error == kind
    assert result.content.startswith("error: ")
    assert says in result.content


def test_a_call_past_the_timeout_or_that_kills_its_process_is_an_error_and_the_next_call_runs():
    with ToolBox([hang, die, pid], timeout_s=1.0, processes=1) as box:
        first = int(box.call("pid", {}).content)
        timed_out = box.call("hang", {"seconds": 60.0})
        assert timed_out == ToolResult("error: hang ran past its time limit of 1.0 s", "timeout")
        second = int(box.call("pid", {}).content)
        assert second != first  # the process that ran past the limit was killed and replaced
        crashed = box.call("die", {"code": 3})
        assert crashed == ToolResult("error: die ended its process (exit code 3)", "crashed")
        assert int(box.call("pid", {}).content) not in (first, second)
        assert box.call("hang", {"seconds": 0.0}) == ToolResult("woke", None)


def test_calls_of_different_episodes_run_at_once(box, tmp_path):
    """Two calls that each wait for the other finish only if they run at the same time."""
    with ThreadPoolExecutor(2) as threads:
        results = list(
            threads.map(lambda name: box.call("meet", {"directory": str(tmp_path), "name": name, "count": 2}), "ab")
        )
    assert results == [ToolResult("met", None)] * 2


def test_calls_beyond_the_process_count_wait_for_a_free_process(tmp_path):
    """With one process, a second call waits until the first is done: the first never sees it."""
    with ToolBox([meet], timeout_s=2.0, processes=1) as box:
        with ThreadPoolExecutor(2) as threads:
            calls = [{"directory": str(tmp_path), "name": name, "count": 2} for name in "ab"]
            results = list(threads.map(lambda arguments: box.call("meet", arguments), calls))
    assert sorted(str(r.error) for r in results) == ["None", "timeout"]


def test_close_stops_the_processes_and_a_later_call_is_refused(box):
    process = int(box.call("pid", {}).content)
    box.close()
    with pytest.raises(ProcessLookupError):  # killed and waited for
        os.kill(process, 0)
    with pytest.raises(RuntimeError, match="^ToolBox.call: the tool box is closed$"):
        box.call("pid", {})


@pytest.mark.skipif(sys.platform != "linux", reason="a process dies with its thread through Linux's PDEATHSIG")
def test_an_idle_process_that_died_is_replaced_before_a_call_is_handed_to_it():
    """A tool process dies with the thread that started it; the next call must not see that as a crash."""
    with ToolBox([pid], timeout_s=30.0, processes=1) as box:
        with ThreadPoolExecutor(1) as thread:  # its thread starts the process, then exits
            first = int(thread.submit(box.call, "pid", {}).result().content)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{first}/stat").read_text().split()[2] != "Z":  # killed, not yet waited for
            assert time.monotonic() < deadline, "the tool process outlived the thread that started it"
            time.sleep(0.01)
        result = box.call("pid", {})
        assert result.error is None and int(result.content) != first
