"""User datasets: local jsonl or parquet files, read through Hugging Face ``datasets``.

Nothing is downloaded: the files are read with the library's packaged json / parquet builders into
a throwaway cache. Every row is checked before training starts, and a bad one is reported by
field, row number (1-based; blank lines of a jsonl file do not count) and file. A row's uid is
``split/row``.

The held-out split comes from ``data.eval_path`` when it is set; otherwise the last
``data.eval_size`` rows of ``data.path`` are held out and the rows before them are trained on.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from asyncrl.data.prompts import Prompt, Task


def file_task(kind: str, path: str, eval_path: str | None, *, prompt_field: str, answer_field: str, eval_size: int) -> Task:
    """The train and held-out prompts of a ``kind`` ("jsonl" or "parquet") dataset."""
    columns = _read_columns(kind, path, "data.path")
    train = _prompts(columns, "train", path, prompt_field, answer_field)
    if eval_path is not None:
        heldout = _prompts(_read_columns(kind, eval_path, "data.eval_path"), "heldout", eval_path, prompt_field, answer_field)
    elif len(train) <= eval_size:
        raise ValueError(
            f"data.eval_size: holding out the last {eval_size} rows of {path} leaves no train rows "
            f"(it has {len(train)}); set data.eval_path or lower data.eval_size"
        )
    else:
        train, heldout = train[:-eval_size], [_as_heldout(p) for p in train[-eval_size:]]
    return Task(kind, train=train, heldout=heldout)


def _as_heldout(prompt: Prompt) -> Prompt:
    """``train/row`` -> ``heldout/row``: the row number still points into data.path."""
    return Prompt("heldout/" + prompt.uid.removeprefix("train/"), prompt.text, prompt.answer)


def _read_columns(kind: str, path: str, field: str) -> dict[str, list]:
    """The file's rows as columns; ``field`` names the config key in errors."""
    if not Path(path).is_file():
        raise ValueError(f"{field}: no such file '{path}'")
    import datasets

    reader = {"jsonl": datasets.Dataset.from_json, "parquet": datasets.Dataset.from_parquet}[kind]
    bars_were_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-data-") as cache_dir:
            table = reader(path, cache_dir=cache_dir, keep_in_memory=True)
            columns = table.to_dict()
    except Exception as err:
        cause = err.__cause__ or err
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ValueError(f"{field}: cannot read '{path}' as {kind}: {detail}") from err
    finally:
        if bars_were_enabled:
            datasets.enable_progress_bars()
    if not columns or not next(iter(columns.values())):
        raise ValueError(f"{field}: '{path}' has no rows")
    return columns


def _prompts(columns: dict[str, list], split: str, path: str, prompt_field: str, answer_field: str) -> list[Prompt]:
    prompts = _column(columns, prompt_field, "data.prompt_field", path)
    answers = _column(columns, answer_field, "data.answer_field", path)
    out = []
    for row, (text, answer) in enumerate(zip(prompts, answers), start=1):
        where = f"row {row} of {path}"
        if text is None:
            raise ValueError(f"data.prompt_field: {where} has no field '{prompt_field}'")
        if not isinstance(text, str):
            raise ValueError(f"data.prompt_field: {where}: '{prompt_field}' is {type(text).__name__}, not a string")
        if not text.strip():
            raise ValueError(f"data.prompt_field: {where}: '{prompt_field}' is empty")
        if answer is None:
            raise ValueError(f"data.answer_field: {where} has no field '{answer_field}'")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(
                f"data.answer_field: {where}: '{answer_field}' is {type(answer).__name__}, not a string or number"
            )
        out.append(Prompt(f"{split}/{row}", text, str(answer)))
    return out


def _column(columns: dict[str, list], name: str, field: str, path: str) -> list:
    if name not in columns:
        raise ValueError(f"{field}: row 1 of {path} has no field '{name}' (its fields: {', '.join(columns)})")
    return columns[name]
