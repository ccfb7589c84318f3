"""The ``data`` section: the task that makes the prompts, and how they are fed and held out."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from asyncrl.config.base import PartSection, Section, Seed


class TaskConfig(PartSection):
    """The task part: a name and its options, like every part (docs/plugins.md)."""

    kind, at = "task", "data.task"

    name: str = Field(
        "running_sum",
        description="built-in task (arithmetic, running_sum; docs/data.md), jsonl / parquet for a local file, "
        "hf_dataset for a Hugging Face dataset directory, reasoning_gym, or package.module:Class (docs/plugins.md)",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the task's settings (its Options model): a built-in generator's difficulty, seed and "
        "num_problems, a file's path and fields (docs/data.md lists each built-in's)",
    )
    startup_timeout_s: float = Field(
        60.0,
        gt=0.0,
        allow_inf_nan=False,
        description="a user's task (package.module:Class) must load within this in the fresh process the config "
        "check resolves it in (a module that blocks at import); past it, exit code 2",
    )


class DataConfig(Section):
    """Where prompts and reference answers come from."""

    task: TaskConfig = Field(default_factory=TaskConfig, description="the task that makes the prompts")
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template")
    shuffle_seed: Seed = Field(0, description="seed of the prompt order")
    epochs: int | None = Field(None, ge=1, description="passes over the train split; null repeats it forever")
    eval_size: int = Field(256, ge=1, description="held-out prompts per evaluation")
