"""The ``data`` section: the task, its prompts and its held-out split."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from asyncrl.config.base import Section


class DataConfig(Section):
    """Where prompts and reference answers come from."""

    task: str = Field(
        "running_sum",
        description="built-in task (arithmetic, running_sum; docs/data.md), jsonl / parquet for a local file, "
        "hf_dataset for a Hugging Face dataset directory, reasoning_gym, or package.module:Class (docs/plugins.md)",
    )
    path: str | None = Field(None, description="the jsonl / parquet file, or the hf_dataset directory")
    eval_path: str | None = Field(
        None, description="a jsonl / parquet file of held-out rows; null: the last eval_size rows of path are held out"
    )
    split: str = Field("train", description="hf_dataset: the split trained on")
    eval_split: str | None = Field(
        None, description="hf_dataset: the held-out split; null: the last eval_size rows of split are held out"
    )
    prompt_field: str = Field("prompt", description="row field holding the prompt")
    answer_field: str = Field("answer", description="row field holding the reference answer")
    chat_template: bool = Field(False, description="wrap prompts in the tokenizer's chat template")
    difficulty: int = Field(2, ge=1, description="built-in task difficulty (levels in docs/data.md)")
    task_seed: int = Field(0, description="built-in tasks: seed choosing the problems and their train / held-out split")
    num_problems: int = Field(
        10000, ge=2, description="built-in tasks: distinct problems drawn (held-out first); a level may have fewer"
    )
    shuffle_seed: int = Field(0, description="seed of the prompt order")
    epochs: int | None = Field(None, ge=1, description="passes over the train split; null repeats it forever")
    eval_size: int = Field(256, ge=1, description="held-out prompts per evaluation")
    dataset: str | None = Field(
        None,
        description="reasoning_gym: the dataset name, e.g. chain_sum; the char tokenizer "
        "encodes digits, letters, space, newline and +-*/=()?.,:;!<> only; other text is rejected (docs/data.md)",
    )
    dataset_config: dict[str, Any] = Field(
        default_factory=dict, description="reasoning_gym: the dataset's settings, e.g. {min_terms: 2, max_terms: 2}"
    )

    task_options: dict[str, Any] = Field(
        default_factory=dict,
        description="settings of a task that declares them (its Options model, docs/plugins.md); built-ins take none",
    )

    @model_validator(mode="after")
    def _task_named(self) -> DataConfig:
        """The name only: the task part is built, its options and settings checked, by ``parts.check_parts``."""
        from asyncrl.plugins import check_spec

        check_spec("task", self.task, "data.task")
        return self
