"""``asyncrl samples RUN_DIR``: a run's sample log, read back and laid out for a person.

Each sample is a panel: where it came from and what it scored in the title, the prompt, then the
transcript turn by turn (the model's turns, the environment's observations, tool calls and their
results), a turn the generator cut marked where it was cut. A file that cannot be read is one
ValueError naming it, which the command turns into its one-line error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.text import Text

from asyncrl.metrics import read_jsonl
from asyncrl.samples import (
    SAMPLES_FILE,
    call_text,
    origin,
    role_label,
    scores,
    shown_text,
    shows_prompt,
    tool_calls,
)

SPLITS = ("train", "eval")
Check = Callable[[Any], bool]  # whether a value has the shape a key must hold


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return _integer(value) or isinstance(value, float)


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


def _nullable(check: Check) -> Check:
    return lambda value: value is None or check(value)


def _list_of(check: Check) -> Check:
    return lambda value: isinstance(value, list) and all(check(item) for item in value)


def _object_of(check: Check) -> Check:
    return lambda value: isinstance(value, dict) and all(check(item) for item in value.values())


def _tool_call(call: Any) -> bool:
    """A call as the chat template reads it: an object, its ``function`` (or itself) an object
    whose name, if it has one, is a string; the arguments are any JSON."""
    function = call.get("function", call) if isinstance(call, dict) else None
    return isinstance(function, dict) and _text(function.get("name", ""))


# key: (its check, what it must be), as docs/samples.md describes the record; every record has these
_REQUIRED: dict[str, tuple[Check, str]] = {
    "step": (_integer, "an integer"),
    "split": (_text, "train or eval"),
    "prompt_uid": (_text, "a string"),
    "prompt": (_text, "a string"),
    "messages": (lambda value: isinstance(value, list), "a list of messages"),
    "reward": (_number, "a number"),
    "finish_reason": (_text, "a string"),
}
# the keys a record may lack (a file written by an earlier version, or by other code)
_OPTIONAL: dict[str, tuple[Check, str]] = {
    "sample": (_integer, "an integer"),
    "answer": (_text, "a string"),
    "reward_parts": (_object_of(_number), "an object of numbers"),
    "correct": (_flag, "true or false"),
    "advantage": (_nullable(_number), "a number or null"),
    "failed": (_flag, "true or false"),
    "versions": (_list_of(_integer), "a list of integers"),
    "tokens": (_object_of(_integer), "an object of integers"),
}
# a message's keys that the view reads; an environment's messages may carry others, kept as they are
_MESSAGE: dict[str, tuple[Check, str]] = {
    "content": (_nullable(_text), "a string or null"),
    "name": (_nullable(_text), "a string or null"),
    "tokens": (_integer, "an integer"),
    "finish_reason": (_text, "a string"),
    "text": (_text, "a string"),
    "tool_calls": (
        _nullable(_list_of(_tool_call)),
        "a list of tool calls (objects whose function is an object with a string name)",
    ),
}
_ROLE_STYLES = {"assistant": "bold green", "tool": "bold magenta", "user": "bold cyan", "system": "bold blue"}


def read_samples(run_dir: str | Path) -> list[dict]:
    """The records of the run directory's sample log, each checked to have the shape the view reads."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a run directory")
    path = run_dir / SAMPLES_FILE
    if not path.is_file():
        raise ValueError(
            f"{run_dir}: holds no {SAMPLES_FILE} (a run writes it unless logging.samples_per_step "
            "and logging.eval_samples are both 0)"
        )
    records = read_jsonl(path)
    for number, record in enumerate(records, start=1):
        _check_record(record, f"{path}: record {number}")
    return records


def _check_record(record: dict, where: str) -> None:
    for key, (check, what) in _REQUIRED.items():
        if not check(record.get(key)):
            raise ValueError(f"{where} has no '{key}' that is {what}")
    if record["split"] not in SPLITS:
        raise ValueError(f"{where} has split '{record['split']}', not train or eval")
    _check_present(record, _OPTIONAL, where)
    for index, message in enumerate(record["messages"], start=1):
        if not (isinstance(message, dict) and _text(message.get("role"))):
            raise ValueError(f"{where} has a message that is not an object with a role")
        _check_present(message, _MESSAGE, f"{where} message {index}")


def _check_present(values: dict, shapes: dict[str, tuple[Check, str]], where: str) -> None:
    """Each key of ``shapes`` that ``values`` has holds what it must."""
    for key, (check, what) in shapes.items():
        if key in values and not check(values[key]):
            raise ValueError(f"{where}: '{key}' is not {what}")


def at_step(records: list[dict], step: int | None, where: str) -> list[dict]:
    """The records of ``step`` (None: the last step that has any), training samples first."""
    steps = sorted({record["step"] for record in records})
    if not steps:
        raise ValueError(f"{where}: holds no samples yet")
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise ValueError(f"--step: {where} has no samples at step {step}; it has steps {_ranges(steps)}")
    return sorted((r for r in records if r["step"] == chosen), key=lambda r: SPLITS.index(r["split"]))


def show(records: list[dict], console: Console) -> None:
    """Every record as a panel."""
    for record in records:
        console.print(Panel(_body(record), title=Text(origin(record)), title_align="left", expand=True))


def _body(record: dict) -> Group:
    lines: list = [Text(scores(record), style="italic")]
    if shows_prompt(record):
        lines += [Text("prompt", style="bold"), Padding(Text(record["prompt"], style="dim"), (0, 0, 0, 2))]
    for message in record["messages"]:
        label = Text(role_label(message), style=_ROLE_STYLES.get(message["role"], "bold"))
        if message.get("finish_reason") in ("length", "max_tokens"):
            label.stylize("bold red")
        lines.append(label)
        if text := shown_text(message):
            lines.append(Padding(Text(text), (0, 0, 0, 2)))
        for call in tool_calls(message):
            lines.append(Text.assemble(("  -> call ", "magenta"), call_text(call)))
    return Group(*lines)


def _ranges(steps: list[int]) -> str:
    """Sorted steps as ``0, 2-5, 9``."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
