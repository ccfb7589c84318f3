"""User datasets: local jsonl or parquet files, or a Hugging Face dataset on disk, parsed as data and nothing else.

A jsonl file is decoded as UTF-8 and parsed line by line with the standard ``json`` module, so a
bad byte or a broken line is reported by its line number; a file holding one JSON array of objects
loads too. A parquet file is read with pyarrow. Nothing is downloaded, imported or unpickled.

Every row is checked before training starts, and a bad one is reported by field, row number
(1-based, counting records: blank lines of a jsonl file do not count) and file. A row's uid is
``split/row``. Once the model is built, ``check_prompt_lengths`` rejects, by row, a prompt whose
longest request (with an environment: its templated opening and the whole episode) does not fit
the model's context, and ``check_encodable`` rejects, by row and character, text the tokenizer
cannot reproduce.

The held-out split comes from ``data.task.options.eval_path`` when it is set; otherwise the last
``data.eval_size`` rows of ``data.task.options.path`` are held out and the rows before them are trained on.

``hf_dataset`` reads ``data.task.options.path`` with the ``datasets`` package (an optional extra, imported only
then): a ``save_to_disk`` directory (a Dataset, or a DatasetDict of named splits), or a directory
of data files whose names give the splits (``train.jsonl``, ``test.parquet``, ...). It trains on
split ``data.task.options.split`` and holds out split ``data.task.options.eval_split`` (null: the last ``data.eval_size``
rows of the train split), with the same fields, checks and uids as a file. Only an existing local
directory is read, so nothing is fetched from the Hub.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.data.prompts import Prompt, Task, encode_prompts

if TYPE_CHECKING:
    from asyncrl.config import RunConfig

OPTIONS = "data.task.options"  # where a file task's settings are, for errors naming them
TOKENIZE_BATCH = 4096  # prompts per tokenizer call when checking lengths


def file_task(
    kind: str, path: str, eval_path: str | None, *, prompt_field: str, answer_field: str, eval_size: int
) -> Task:
    """The train and held-out prompts of a ``kind`` ("jsonl" or "parquet") dataset."""
    if eval_path is not None and Path(eval_path).resolve() == Path(path).resolve():
        raise ValueError(
            f"{OPTIONS}.eval_path: '{eval_path}' is path itself, so the held-out rows would be trained on; "
            "give another file, or null to hold out the last data.eval_size rows"
        )
    train = _prompts(_read_rows(kind, path, f"{OPTIONS}.path"), "train", path, prompt_field, answer_field)
    if eval_path is None:
        return Task(kind, *_hold_out(train, eval_size, path, "eval_path"), sources={"train": path, "heldout": path})
    rows = _read_rows(kind, eval_path, f"{OPTIONS}.eval_path")
    heldout = _prompts(rows, "heldout", eval_path, prompt_field, answer_field)
    return Task(kind, train=train, heldout=heldout, sources={"train": path, "heldout": eval_path})


def hf_dataset_task(
    path: str, split: str, eval_split: str | None, *, prompt_field: str, answer_field: str, eval_size: int
) -> Task:
    """The train and held-out prompts of a Hugging Face dataset on disk (``hf_dataset``)."""
    splits = _hf_splits(path)
    train_where = _split_where(split, path)
    rows = _split_rows(splits, split, path, f"{OPTIONS}.split")
    train = _prompts(rows, "train", train_where, prompt_field, answer_field)
    if eval_split is None:
        sources = {"train": train_where, "heldout": train_where}
        return Task("hf_dataset", *_hold_out(train, eval_size, train_where, "eval_split"), sources=sources)
    if eval_split == split:
        raise ValueError(
            f"{OPTIONS}.eval_split: '{eval_split}' is split itself, so the held-out rows would be trained on; "
            "name another split, or null to hold out the last data.eval_size rows"
        )
    rows = _split_rows(splits, eval_split, path, f"{OPTIONS}.eval_split")
    heldout_where = _split_where(eval_split, path)
    heldout = _prompts(rows, "heldout", heldout_where, prompt_field, answer_field)
    return Task("hf_dataset", train=train, heldout=heldout, sources={"train": train_where, "heldout": heldout_where})


def _hold_out(train: list[Prompt], eval_size: int, where: str, other: str) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out): the last ``eval_size`` rows held out; ``other`` names the key that avoids it."""
    if len(train) <= eval_size:
        raise ValueError(
            f"data.eval_size: holding out the last {eval_size} rows of {where} leaves no train rows "
            f"(it has {len(train)}); set {OPTIONS}.{other} or lower data.eval_size"
        )
    return train[:-eval_size], [_as_heldout(p) for p in train[-eval_size:]]


def _hf_splits(path: str) -> dict[str, Any]:
    """Split name -> ``datasets.Dataset``; a saved single Dataset is the one split ``train``."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "data.task.name: hf_dataset needs the datasets package; install it with: pip install -e '.[hf-datasets]'"
        ) from None
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(
            f"{OPTIONS}.path: '{path}' is a file; hf_dataset reads a directory (one file is data.task.name jsonl or parquet)"
            if directory.exists()
            else f"{OPTIONS}.path: no such directory '{path}'"
        )
    saved = (directory / "dataset_dict.json").is_file() or (directory / "state.json").is_file()
    bars_were_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # a load's bars would interleave with the run's log, or precede its error line
    try:
        loaded = datasets.load_from_disk(str(directory)) if saved else datasets.load_dataset(str(directory))
    except Exception as err:  # datasets reports a damaged or foreign directory with a variety of errors
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{OPTIONS}.path: cannot read '{path}' as a Hugging Face dataset: {detail}") from None
    finally:
        if not bars_were_disabled:
            datasets.enable_progress_bars()
    return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}


def _split_rows(splits: dict[str, Any], name: str, path: str, field: str) -> list[dict[str, Any]]:
    if name not in splits:
        raise ValueError(f"{field}: '{path}' has no split '{name}' (its splits: {', '.join(splits)})")
    rows = splits[name].to_list()
    if not rows:
        raise ValueError(f"{field}: split '{name}' of '{path}' has no rows")
    return rows


def _split_where(split: str, path: str) -> str:
    """How an error names a row's place: ``row N of split 'train' of DIR``."""
    return f"split '{split}' of {path}"


def _as_heldout(prompt: Prompt) -> Prompt:
    """``train/row`` -> ``heldout/row``: the row number still points into the train file."""
    return Prompt("heldout/" + prompt.uid.removeprefix("train/"), prompt.text, prompt.answer)


def _read_rows(kind: str, path: str, field: str) -> list[dict[str, Any]]:
    """The file's rows as dicts; ``field`` names the config key in errors."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"{field}: '{path}' is a directory, not a {kind} file"
            if file.is_dir()
            else f"{field}: no such file '{path}'"
        )
    try:
        rows = _jsonl_rows(file, field) if kind == "jsonl" else _parquet_rows(file, field)
    except OSError as err:
        raise ValueError(f"{field}: cannot read '{path}' ({err.strerror or err})") from None
    if not rows:
        raise ValueError(f"{field}: '{path}' has no rows")
    return rows


def _jsonl_rows(path: Path, field: str) -> list[dict[str, Any]]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise ValueError(
            f"{field}: line {line} of {path}: byte 0x{data[err.start]:02x} at column {column} is not UTF-8; "
            "save the file as UTF-8"
        ) from None
    if text.lstrip().startswith("["):
        return _json_array_rows(text, path, field)
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{field}: line {number} of {path}: invalid JSON ({err.msg} at column {err.colno})"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{field}: line {number} of {path}: expected one JSON object per line, got {_json_type(row)}"
            )
        rows.append(row)
    return rows


def _json_array_rows(text: str, path: Path, field: str) -> list[dict[str, Any]]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{field}: line {err.lineno} of {path}: invalid JSON ({err.msg} at column {err.colno})"
        ) from None
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise ValueError(f"{field}: row {number} of {path}: expected a JSON object, got {_json_type(row)}")
    return rows


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _parquet_rows(path: Path, field: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow reports a damaged or foreign file with a variety of errors
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{field}: cannot read '{path}' as parquet: {detail}") from None
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        row, column = _first_non_utf8(table)
        raise ValueError(
            f"{field}: row {row} of {path}: field '{column}' is not UTF-8 text; write strings as UTF-8"
        ) from None


def _first_non_utf8(table) -> tuple[int, str]:
    """(row, column) of the first string cell that does not decode: the slow search, run only on failure."""
    for column in table.column_names:
        for row, cell in enumerate(table.column(column), start=1):
            try:
                cell.as_py()
            except UnicodeDecodeError:
                return row, column
    raise AssertionError("to_pylist failed to decode, yet every cell decodes")


def _prompts(rows: list[dict[str, Any]], split: str, path: str, prompt_field: str, answer_field: str) -> list[Prompt]:
    out = []
    for number, row in enumerate(rows, start=1):
        where = f"row {number} of {path}"
        text, answer = row.get(prompt_field), row.get(answer_field)
        if text is None:
            raise ValueError(
                f"{OPTIONS}.prompt_field: {where} has no field '{prompt_field}'{_fields_hint(rows, row, prompt_field)}"
            )
        if not isinstance(text, str):
            raise ValueError(
                f"{OPTIONS}.prompt_field: {where}: '{prompt_field}' is {type(text).__name__}, not a string"
            )
        if not text.strip():
            raise ValueError(f"{OPTIONS}.prompt_field: {where}: '{prompt_field}' is empty")
        if answer is None:
            raise ValueError(
                f"{OPTIONS}.answer_field: {where} has no field '{answer_field}'{_fields_hint(rows, row, answer_field)}"
            )
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(
                f"{OPTIONS}.answer_field: {where}: '{answer_field}' is {type(answer).__name__}, not a string or number"
            )
        if isinstance(answer, float) and not math.isfinite(answer):
            raise ValueError(f"{OPTIONS}.answer_field: {where}: '{answer_field}' is {answer}, not a finite number")
        if not str(answer).strip():
            raise ValueError(f"{OPTIONS}.answer_field: {where}: '{answer_field}' is empty")
        out.append(Prompt(f"{split}/{number}", text, str(answer)))
    return out


def _fields_hint(rows: list[dict[str, Any]], row: dict[str, Any], name: str) -> str:
    """When no row has the field the config names the wrong one: list the fields there are."""
    if any(other.get(name) is not None for other in rows):
        return ""
    return f" (its fields: {', '.join(map(str, row))})"


@dataclass(frozen=True)
class Budget:
    """What a request may add to the ids of its prompt's first request."""

    tokens: int
    terms: str  # the settings it sums, with their values: what an error shows
    field: str  # the setting to lower when a request does not fit
    value: int  # that setting's value; the other terms sum to ``tokens - value``
    opening: str  # what the first request is: "prompt", or "templated opening"


def request_budget(config: RunConfig) -> Budget:
    """``generation.max_new_tokens``; with an environment, the whole episode
    (``environment.max_tokens``) and then a turn's sampled tokens (asyncrl/rollout/context.py)."""
    new = config.generation.max_new_tokens
    if config.environment.name is None:
        return Budget(new, f"generation.max_new_tokens {new}", "generation.max_new_tokens", new, "prompt")
    episode = config.environment.max_tokens
    terms = f"environment.max_tokens {episode} + generation.max_new_tokens {new}"
    return Budget(episode + new, terms, "environment.max_tokens", episode, "templated opening")


def check_prompt_lengths(
    first_requests: Iterable[tuple[Prompt, list[int]]], task: Task, config: RunConfig, max_positions: int | None
) -> None:
    """Reject, naming its row, a prompt whose longest request does not fit the model's
    ``max_positions`` (None: the model sets no limit): its first request's ids (the prompt as the
    rollout worker encodes it, or an episode's templated opening: ``first_requests`` of
    asyncrl/rollout/context.py) and all a request may add to them (``request_budget``)."""
    if max_positions is None:
        return
    room = request_budget(config)
    if max_positions - room.tokens < 1:
        others = room.tokens - room.value
        with_others = f" (with generation.max_new_tokens {others})" if others else ""
        raise ValueError(
            f"{room.field}: {room.value}{with_others} leaves no room for a prompt in the model's {max_positions} "
            f"positions; set it below {max_positions - others}"
        )
    for prompt, prompt_ids in first_requests:
        if not prompt_ids:
            raise ValueError(f"{_where(prompt, task)}: the prompt tokenizes to no tokens")
        if len(prompt_ids) + room.tokens > max_positions:
            raise ValueError(
                f"{_where(prompt, task)}: the {room.opening} is {len(prompt_ids)} tokens, and with {room.terms} "
                f"needs {len(prompt_ids) + room.tokens} positions, but the model has {max_positions}; shorten "
                f"it or lower {room.field}"
            )


def longest_prompt(task: Task, tokenizer) -> int:
    """Tokens in the task's longest prompt (train or held-out), as the rollout worker encodes it."""
    return max(len(prompt_ids) for _, prompt_ids in encoded_prompts(task, tokenizer))


def encoded_prompts(task: Task, tokenizer) -> Iterator[tuple[Prompt, list[int]]]:
    """Every prompt of both splits with its token ids, tokenized in batches."""
    for split in (task.train, task.heldout):
        for start in range(0, len(split), TOKENIZE_BATCH):
            chunk = split[start : start + TOKENIZE_BATCH]
            yield from zip(chunk, encode_prompts([p.text for p in chunk], tokenizer))


def check_encodable(task: Task, tokenizer) -> None:
    """Reject, by row and character, a prompt or answer the tokenizer does not reproduce exactly:
    an unknown character would reach the model as ``<unk>`` (and an answer holding one could never
    be generated), and a normalizing tokenizer would train on text other than the row's."""
    for split in (task.train, task.heldout):
        for start in range(0, len(split), TOKENIZE_BATCH):
            chunk = split[start : start + TOKENIZE_BATCH]
            texts = [text for p in chunk for text in (p.text, p.answer)]  # a row's prompt, then its answer
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            decoded = tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for i, (text, back) in enumerate(zip(texts, decoded)):
                if back != text:
                    field = "answer_field" if i % 2 else "prompt_field"
                    where = _where(chunk[i // 2], task, field)
                    raise ValueError(f"{where}: {_round_trip_error(text, back, ids[i], tokenizer)}")


def _round_trip_error(text: str, back: str, ids: list[int], tokenizer) -> str:
    at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
    char = text[at] if at < len(text) else ""
    shown = f"{char!r} (U+{ord(char):04X}) at character {at + 1}" if char else f"the end (character {at + 1})"
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
        return (
            f"{shown} is not in the tokenizer's vocabulary; remove it, or set tokenizer.path to a tokenizer that has it"
        )
    return (
        f"the tokenizer does not reproduce the text: it changes {shown}; the model would see other text than the row's"
    )


def _where(prompt: Prompt, task: Task, field: str = "prompt_field") -> str:
    """The config field and row a prompt came from: its uid is ``split/row`` for a file."""
    if task.sources is None:
        return f"data.task.name: prompt '{prompt.uid}' of {task.name}"
    split, _, row = prompt.uid.partition("/")
    return f"{OPTIONS}.{field}: row {row} of {task.sources[split]}"
