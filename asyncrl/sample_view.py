"""``asyncrl samples RUN_DIR``: a run's sample log, read back and laid out for a person.

Each sample is a panel: where it came from and what it scored in the title, the prompt, then the
transcript turn by turn (the model's turns, the environment's observations, tool calls and their
results), a turn the generator cut marked where it was cut. A file that cannot be read is one
ValueError naming it, which the command turns into its one-line error.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.text import Text

from asyncrl.metrics import read_jsonl
from asyncrl.samples import SAMPLES_FILE, call_text, origin, role_label, scores, shown_text, shows_prompt

SPLITS = ("train", "eval")
# key: (types it may hold, what it must be); every record has each
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "step": ((int,), "an integer"),
    "split": ((str,), "train or eval"),
    "prompt_uid": ((str,), "a string"),
    "prompt": ((str,), "a string"),
    "messages": ((list,), "a list of messages"),
    "reward": ((int, float), "a number"),
    "finish_reason": ((str,), "a string"),
}
_ROLE_STYLES = {"assistant": "bold green", "tool": "bold magenta", "user": "bold cyan", "system": "bold blue"}


def read_samples(run_dir: str | Path) -> list[dict]:
    """The records of the run directory's sample log, each checked to have what the view reads."""
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
        for key, (types, what) in _FIELDS.items():
            value = record.get(key)
            if not isinstance(value, types) or isinstance(value, bool):
                raise ValueError(f"{path}: record {number} has no '{key}' that is {what}")
        if record["split"] not in SPLITS:
            raise ValueError(f"{path}: record {number} has split '{record['split']}', not train or eval")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in record["messages"]):
            raise ValueError(f"{path}: record {number} has a message that is not an object with a role")
    return records


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
        for call in message.get("tool_calls") or []:
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
