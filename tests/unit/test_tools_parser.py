"""The tool-call parser: Hermes / Qwen blocks in, an assistant message with tool_calls and the parse errors out."""

from __future__ import annotations

import pytest

from asyncrl.environments.parsers import HermesParser, ParsedTurn, build_parser


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_hermes_reads_calls_and_keeps_the_text_around_them():
    text = 'let me see <tool_call>\n{"name": "calculator", "arguments": {"x": "12*34"}}\n</tool_call>'
    parsed = HermesParser().parse(text)
    assert parsed.errors == []
    assert parsed.message == {
        "role": "assistant",
        "content": "let me see",
        "tool_calls": [call("calculator", {"x": "12*34"})],
    }


def test_hermes_reads_several_calls_in_order_and_a_call_without_arguments():
    text = '<tool_call>{"name": "a", "arguments": {"n": 1}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    parsed = HermesParser().parse(text)
    assert parsed.message["tool_calls"] == [call("a", {"n": 1}), call("b", {})]
    assert parsed.message["content"] == ""


def test_a_plain_answer_has_no_tool_calls_key():
    parsed = HermesParser().parse(" 408\n")
    assert parsed == ParsedTurn({"role": "assistant", "content": "408"}, [])


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "calculator", "arguments": {"x": "1"}', "not valid JSON"),
        ('["calculator"]', 'not a JSON object with "name"'),
        ('{"arguments": {}}', 'no "name" string'),
        ('{"name": "", "arguments": {}}', 'no "name" string'),
        ('{"name": "calculator", "arguments": "1+2"}', '"arguments" of calculator is not a JSON object'),
    ],
)
def test_a_malformed_call_is_an_error_and_the_good_calls_are_kept(body, error):
    good = '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    parsed = HermesParser().parse(f"{good}<tool_call>{body}</tool_call>{good}")
    assert parsed.message["tool_calls"] == [call("ok", {}), call("ok", {})]
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 2: ")
    assert error in parsed.errors[0]


def test_an_unclosed_block_is_an_error_and_its_text_is_not_content():
    parsed = HermesParser().parse('answer <tool_call>{"name": "calculator"')
    assert parsed.message == {"role": "assistant", "content": "answer"}
    assert parsed.errors == ["tool call 1: <tool_call> is never closed"]


class Upper:
    """A user's parser: any text in capitals is a call of the tool ``shout``."""

    def parse(self, text):
        if text.isupper():
            return ParsedTurn({"role": "assistant", "content": "", "tool_calls": [call("shout", {"x": text})]})
        return ParsedTurn({"role": "assistant", "content": text})


def test_the_parser_is_a_part_a_config_names():
    assert isinstance(build_parser("hermes", {}, "environment.options.parser"), HermesParser)
    user = build_parser("test_tools_parser:Upper", {}, "environment.options.parser")
    assert user.parse("HI").message["tool_calls"] == [call("shout", {"x": "HI"})]
    with pytest.raises(ValueError, match=r"^environment.options.parser: unknown tool_parser 'json'"):
        build_parser("json", {}, "environment.options.parser")
    with pytest.raises(ValueError, match=r"^environment.options.parser_options.strict: unknown option"):
        build_parser("hermes", {"strict": True}, "environment.options.parser")
