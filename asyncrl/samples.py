"""The sample log: what the model generated, kept so a run can be read, not just plotted.

A rollout worker keeps the transcripts of a group's first ``logging.samples_per_step`` samples
(and of an evaluation's first ``logging.eval_samples`` prompts) as plain JSON records; the trainer
adds each training sample's step and advantage; the controller writes the step's share to
``samples.jsonl`` beside ``metrics.jsonl``. Users debug RL by reading samples: a reward stuck at 0
is often a response cut at ``generation.max_new_tokens``, which one transcript shows at once.

The record is documented in docs/samples.md; this module picks a step's records and renders a
record as plain text for the TensorBoard and W&B mirrors. ``asyncrl samples`` reads the file back
and prints it (asyncrl/sample_view.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

SAMPLES_FILE = "samples.jsonl"


def spread(samples: Sequence[dict], count: int) -> list[dict]:
    """``count`` of a step's samples, spread over its groups: the first sample of each group in
    the order they were trained, then the second of each, and so on (a sort on the sample index
    keeps the groups' order)."""
    return sorted(samples, key=lambda record: record["sample"])[:count]


def as_text(record: dict) -> str:
    """The record as plain text, one block per message: what TensorBoard and W&B show."""
    lines = [headline(record)] + ([f"[prompt] {record['prompt']}"] if shows_prompt(record) else [])
    for message in record["messages"]:
        lines.append(f"[{role_label(message)}] {shown_text(message)}")
        lines += [f"  -> call {call_text(call)}" for call in tool_calls(message)]
    return "\n".join(lines)


def shows_prompt(record: dict) -> bool:
    """An episode's messages open with what its environment said (the prompt, as the model saw
    it); a single turn's is the response alone, which needs the prompt before it."""
    return not record["messages"] or record["messages"][0].get("role") == "assistant"


def headline(record: dict) -> str:
    """Where the sample is from and what it scored, in one line."""
    return f"{origin(record)} | {scores(record)}"


def origin(record: dict) -> str:
    """The step, the split, the prompt and the sample's index in its group."""
    return f"step {record['step']} {record['split']} | {record['prompt_uid']} #{record.get('sample', 0)}"


def scores(record: dict) -> str:
    """Reward (and its parts), advantage, correctness, finish reason, weight versions, token counts."""
    reward = f"reward {_number(record['reward'])}"
    reward_parts = record.get("reward_parts") or {}
    if isinstance(reward_parts, dict) and len(reward_parts) > 1:
        reward += " (" + ", ".join(f"{name} {_number(value)}" for name, value in reward_parts.items()) + ")"
    parts = [reward]
    if record.get("failed") is True:
        parts.append("failed (a reward raised: not trained)")
    elif record.get("advantage") is not None:
        parts.append(f"advantage {_number(record['advantage'], '+.3f')}")
    elif record["split"] == "train":
        parts.append("filtered (no advantage)")
    if "correct" in record:
        parts.append("correct" if record["correct"] else "wrong")
    parts.append(f"finish {record['finish_reason']}")
    if isinstance(record.get("versions"), list) and record["versions"]:
        parts.append("version " + ",".join(str(v) for v in record["versions"]))
    tokens = record.get("tokens")
    if isinstance(tokens, dict):
        parts.append(f"tokens {tokens.get('prompt', '?')} prompt + {tokens.get('sampled', '?')} sampled")
    return " | ".join(parts)


def role_label(message: dict) -> str:
    """Who speaks: the role, a tool result's tool, and a model turn's tokens and where it was cut."""
    label = str(message["role"]) + (f" {message['name']}" if message.get("name") else "")
    if message.get("role") != "assistant" or "tokens" not in message:
        return label
    cut = {"length": ", CUT at generation.max_new_tokens", "max_tokens": ", CUT at environment.max_tokens"}
    return f"{label}, {message['tokens']} tokens{cut.get(message.get('finish_reason'), '')}"


def shown_text(message: dict) -> str:
    """What a message says: a model turn's text as sampled, where its environment parsed it into
    something else (the tool calls are shown beside it), else its content."""
    text = message.get("text", message.get("content"))
    return "" if text is None else str(text)


def tool_calls(message: dict) -> list:
    """A message's tool calls. An environment's messages may hold anything (the run mirrors them
    as they come; ``asyncrl samples`` refuses a file whose calls are not a list of calls), so
    anything but a list is none."""
    calls = message.get("tool_calls")
    return calls if isinstance(calls, list) else []


def call_text(call: object) -> str:
    """A tool call as ``name(arguments)``, the arguments as JSON; a call of another shape as its text."""
    function = call.get("function", call) if isinstance(call, dict) else call
    if not isinstance(function, dict):
        return str(function)
    arguments = function.get("arguments", "")
    return f"{function.get('name', '?')}({arguments if isinstance(arguments, str) else json.dumps(arguments)})"


def _number(value: object, spec: str = ".3f") -> str:
    """A number as ``spec`` says; anything else (a file written by other code) as its text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)
