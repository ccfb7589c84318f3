"""Tool-call parsers: one model turn's text -> an assistant message with its ``tool_calls``.

A parser is a part of kind ``tool_parser`` (asyncrl/plugins.py): a built-in name or
``package.module:attr``, a class built as ``Class(options)`` (``Class()`` without ``Options``)
whose ``parse(text)`` returns a ``ParsedTurn``. A call the parser cannot read is not dropped silently: it becomes one entry of
``errors``, which the tool environment answers with an error observation and counts.

The built-in ``hermes`` reads the format of Hermes and Qwen chat templates, one JSON object per
``<tool_call>`` block: ``<tool_call>{"name": "calculator", "arguments": {"x": "2*3"}}</tool_call>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.environments.base import Message
from asyncrl.plugins import build_part, resolve, validate_options


@dataclass
class ParsedTurn:
    message: Message  # {"role": "assistant", "content": ..., "tool_calls": [...]} (no key when there are none)
    errors: list[str] = field(default_factory=list)  # one line per call that could not be read


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the text around them is the content."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls, errors, content = [], [], []
        rest = text
        while self.open_tag in rest:
            before, _, after = rest.partition(self.open_tag)
            content.append(before)
            body, closed, rest = after.partition(self.close_tag)
            if not closed:
                errors.append(f"tool call {len(calls) + len(errors) + 1}: {self.open_tag} is never closed")
                break
            call, error = self._call(body)
            if error is None:
                calls.append(call)
            else:
                errors.append(f"tool call {len(calls) + len(errors) + 1}: {error}")
        else:
            content.append(rest)
        message: Message = {"role": "assistant", "content": "".join(content).strip()}
        if calls:
            message["tool_calls"] = calls
        return ParsedTurn(message, errors)

    @staticmethod
    def _call(body: str) -> tuple[dict[str, Any], str | None]:
        """One block's call in the chat-template layout, or the reason it cannot be read."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError as err:
            return {}, f"not valid JSON ({err.msg} at character {err.pos})"
        if not isinstance(value, dict):
            return {}, 'not a JSON object with "name" and "arguments"'
        name, arguments = value.get("name"), value.get("arguments", {})
        if not isinstance(name, str) or not name:
            return {}, 'no "name" string'
        if not isinstance(arguments, dict):
            return {}, f'"arguments" of {name} is not a JSON object'
        return {"type": "function", "function": {"name": name, "arguments": arguments}}, None


def build_parser(spec: str, options: dict[str, Any], field_name: str) -> ToolCallParser:
    """The parser ``spec`` names, built with ``options`` checked by its ``Options`` model."""
    part = resolve("tool_parser", spec, field_name)
    return build_part(part, validate_options(part, spec, options, f"{field_name}_options"))
