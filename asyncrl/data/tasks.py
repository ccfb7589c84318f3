"""Task parts and build_task: the configured prompts, from a built-in task or a user's.

A task part (docs/plugins.md) is a class built as ``Part(data, **options)``: ``data`` is the
``data`` config section, ``options`` is ``data.task_options`` checked by the part's ``Options``
model. Its constructor only checks the settings (the config builds it while loading), and
``build()`` returns the ``Task``. What it declares:

- ``reads``: the file and dataset settings of ``data`` (``TASK_SETTINGS``) it uses; setting
  another is an error, since it would be silently ignored.
- ``has_checker``: its Task carries a ``score``, the ``task`` reward; ``checker_required``: it is
  scored by that checker alone, so ``rewards.functions`` must list ``task``.

The built-ins are parts like any other, found through ``asyncrl.plugins.BUILTINS``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from asyncrl.data.files import file_task, hf_dataset_task
from asyncrl.data.prompts import Prompt, Task, apply_chat_template
from asyncrl.data.synthetic import SYNTHETIC_TASKS, check_difficulty, synthetic_task
from asyncrl.plugins import BUILTINS, resolve, validate_options

if TYPE_CHECKING:
    from asyncrl.config import DataConfig

FILE_TASKS = ("jsonl", "parquet")
TASK_SETTINGS = ("path", "eval_path", "split", "eval_split", "dataset", "dataset_config")


class SyntheticTaskSource:
    """arithmetic, running_sum: problems generated at data.difficulty from data.task_seed (docs/data.md)."""

    reads = ()
    checker_required = False

    def __init__(self, data: DataConfig) -> None:
        check_difficulty(data.task, data.difficulty)
        self.data = data
        self.has_checker = SYNTHETIC_TASKS[data.task].score is not None

    def build(self) -> Task:
        data = self.data
        return synthetic_task(
            data.task, data.difficulty, seed=data.task_seed, num_problems=data.num_problems, eval_size=data.eval_size
        )


class FileTaskSource:
    """jsonl, parquet: the rows of data.path, held-out rows from data.eval_path or its tail."""

    reads = ("path", "eval_path")
    has_checker = checker_required = False

    def __init__(self, data: DataConfig) -> None:
        if data.path is None:
            raise ValueError(f"data.path: required when data.task is {data.task}")
        self.data = data

    def build(self) -> Task:
        data = self.data
        return file_task(
            data.task,
            data.path,
            data.eval_path,
            prompt_field=data.prompt_field,
            answer_field=data.answer_field,
            eval_size=data.eval_size,
        )


class HFDatasetTaskSource:
    """hf_dataset: data.split of the Hugging Face dataset directory data.path, held out: data.eval_split."""

    reads = ("path", "split", "eval_split")
    has_checker = checker_required = False

    def __init__(self, data: DataConfig) -> None:
        if data.path is None:
            raise ValueError("data.path: required when data.task is hf_dataset")
        if data.eval_path is not None:
            raise ValueError("data.eval_path: hf_dataset holds out a split of data.path; name it with data.eval_split")
        self.data = data

    def build(self) -> Task:
        data = self.data
        return hf_dataset_task(
            data.path,
            data.split,
            data.eval_split,
            prompt_field=data.prompt_field,
            answer_field=data.answer_field,
            eval_size=data.eval_size,
        )


class ReasoningGymTaskSource:
    """reasoning_gym: the reasoning-gym dataset data.dataset with data.dataset_config, scored by its own checker."""

    reads = ("dataset", "dataset_config")
    has_checker = checker_required = True

    def __init__(self, data: DataConfig) -> None:
        if data.dataset is None:
            raise ValueError(
                "data.dataset: required when data.task is reasoning_gym (a reasoning-gym dataset name, e.g. chain_sum)"
            )
        self.data = data

    def build(self) -> Task:
        from asyncrl.data.reasoning_gym import reasoning_gym_task  # reasoning-gym is optional

        data = self.data
        return reasoning_gym_task(
            data.dataset,
            data.dataset_config,
            seed=data.task_seed,
            num_problems=data.num_problems,
            eval_size=data.eval_size,
        )


def task_source(data: DataConfig) -> Any:
    """The part ``data.task`` names, built from ``data`` and ``data.task_options``, its settings checked."""
    part = resolve("task", data.task, "data.task")
    source = part(data, **validate_options(part, data.task, data.task_options, "data.task_options"))
    reads = getattr(source, "reads", ())
    for name in TASK_SETTINGS:
        if name not in reads and getattr(data, name) != type(data).model_fields[name].get_default(
            call_default_factory=True
        ):
            readers = ", ".join(task for task in BUILTINS["task"] if name in resolve("task", task, "data.task").reads)
            raise ValueError(f"data.{name}: set, but data.task '{data.task}' does not read it (read by {readers})")
    return source


def build_task(cfg: DataConfig, tokenizer=None) -> Task:
    """The prompts of ``cfg.task``: a built-in name, or a user's part. The tokenizer is needed only
    for ``cfg.chat_template``."""
    task = task_source(cfg).build()
    if cfg.chat_template:
        task = replace(task, train=_templated(task.train, tokenizer), heldout=_templated(task.heldout, tokenizer))
    return task


def _templated(prompts, tokenizer) -> list[Prompt]:
    texts = apply_chat_template([p.text for p in prompts], tokenizer)
    return [replace(p, text=text) for p, text in zip(prompts, texts)]
