"""Task parts and build_task: the configured prompts, from a built-in task or a user's.

A task part (docs/plugins.md) is a class built as ``Part(data, options)`` (``plugins.build_part``):
``data`` is the ``data`` config section, ``options`` is ``data.task.options`` checked by the part's
``Options`` model, its instance. Its constructor only checks the settings (``asyncrl config`` builds it to check a file), and
``build()`` returns the ``Task``. What it declares:

- ``has_checker``: its Task carries a ``score``, the ``task`` reward; ``checker_required``: it is
  scored by that checker alone, so ``rewards.functions`` must list ``task``.

The built-ins are parts like any other, found through ``asyncrl.plugins.BUILTINS``; each keeps the
``Options`` instance it is given as its settings, so each default is written once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.config.base import Seed
from asyncrl.data.files import file_task, hf_dataset_task
from asyncrl.data.prompts import Prompt, Task, apply_chat_template
from asyncrl.data.synthetic import SYNTHETIC_TASKS, GeneratedOptions, check_difficulty, synthetic_task
from asyncrl.plugins import build_part, resolve, validate_options

if TYPE_CHECKING:
    from asyncrl.config import DataConfig


class RowFields(BaseModel):
    """Which fields of a row hold the prompt and the reference answer."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)  # path=2024 names a file

    prompt_field: str = Field("prompt", description="row field holding the prompt")
    answer_field: str = Field("answer", description="row field holding the reference answer")


class SyntheticTaskSource:
    """arithmetic, running_sum: problems generated at a difficulty from a seed (docs/data.md)."""

    Options = GeneratedOptions
    checker_required = False

    def __init__(self, data: DataConfig, options: GeneratedOptions) -> None:
        self.name, self.settings, self.eval_size = data.task.name, options, data.eval_size
        check_difficulty(self.name, self.settings.difficulty)
        self.has_checker = SYNTHETIC_TASKS[self.name].score is not None

    def build(self) -> Task:
        s = self.settings
        return synthetic_task(
            self.name, s.difficulty, seed=s.seed, num_problems=s.num_problems, eval_size=self.eval_size
        )


class FileTaskSource:
    """jsonl, parquet: the rows of a file, held-out rows from another file or its tail."""

    class Options(RowFields):
        path: str = Field(description="the jsonl / parquet file of train rows")
        eval_path: str | None = Field(
            None, description="a jsonl / parquet file of held-out rows; null: the last data.eval_size rows of path"
        )

    has_checker = checker_required = False

    def __init__(self, data: DataConfig, options: FileTaskSource.Options) -> None:
        self.kind, self.settings, self.eval_size = data.task.name, options, data.eval_size

    def build(self) -> Task:
        return file_task(self.kind, eval_size=self.eval_size, **self.settings.model_dump())


class HFDatasetTaskSource:
    """hf_dataset: a split of a Hugging Face dataset directory, held out: another split or its tail."""

    class Options(RowFields):
        path: str = Field(description="the Hugging Face dataset directory (saved with save_to_disk, or data files)")
        split: str = Field("train", description="the split trained on")
        eval_split: str | None = Field(
            None, description="the held-out split; null: the last data.eval_size rows of split are held out"
        )

    has_checker = checker_required = False

    def __init__(self, data: DataConfig, options: HFDatasetTaskSource.Options) -> None:
        self.settings, self.eval_size = options, data.eval_size

    def build(self) -> Task:
        return hf_dataset_task(eval_size=self.eval_size, **self.settings.model_dump())


class ReasoningGymTaskSource:
    """reasoning_gym: entries of a reasoning-gym dataset, scored by its own checker."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        dataset: str = Field(
            description="the reasoning-gym dataset, e.g. chain_sum; the char tokenizer encodes digits, letters, "
            "space, newline and +-*/=()?.,:;!<> only; other text is rejected (docs/data.md)"
        )
        dataset_config: dict[str, Any] = Field(
            default_factory=dict, description="the dataset's settings, e.g. {min_terms: 2, max_terms: 2}"
        )
        seed: Seed = Field(0, description="seed of the generated entries and their train / held-out split")
        num_problems: int = Field(10000, ge=2, description="entries generated, the held-out ones first")

    has_checker = checker_required = True

    def __init__(self, data: DataConfig, options: ReasoningGymTaskSource.Options) -> None:
        self.settings, self.eval_size = options, data.eval_size

    def build(self) -> Task:
        from asyncrl.data.reasoning_gym import reasoning_gym_task  # reasoning-gym is optional

        s = self.settings
        return reasoning_gym_task(
            s.dataset, s.dataset_config, seed=s.seed, num_problems=s.num_problems, eval_size=self.eval_size
        )


def task_source(data: DataConfig) -> Any:
    """The part ``data.task.name`` names, built from ``data`` and its checked ``data.task.options``."""
    spec = data.task.name
    part = resolve("task", spec, "data.task.name")
    return build_part(part, validate_options(part, spec, data.task.options, "data.task.options"), data)


def build_task(cfg: DataConfig, tokenizer=None) -> Task:
    """The prompts of ``cfg.task``: a built-in, or a user's part. The tokenizer is needed only
    for ``cfg.chat_template``."""
    task = task_source(cfg).build()
    if cfg.chat_template:
        task = replace(task, train=_templated(task.train, tokenizer), heldout=_templated(task.heldout, tokenizer))
    return task


def _templated(prompts, tokenizer) -> list[Prompt]:
    texts = apply_chat_template([p.text for p in prompts], tokenizer)
    return [replace(p, text=text) for p, text in zip(prompts, texts)]
