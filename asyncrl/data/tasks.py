"""build_task: the configured prompts, from a built-in task or a user's file."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from asyncrl.data.files import file_task, hf_dataset_task
from asyncrl.data.prompts import Prompt, Task, apply_chat_template
from asyncrl.data.synthetic import SYNTHETIC_TASKS, synthetic_task

if TYPE_CHECKING:
    from asyncrl.config import DataConfig

FILE_TASKS = ("jsonl", "parquet")


def build_task(cfg: DataConfig, tokenizer=None) -> Task:
    """``cfg.task``: a built-in name, reasoning_gym, jsonl / parquet for ``cfg.path``, or hf_dataset. The
    tokenizer is needed only for ``cfg.chat_template``."""
    if cfg.task in SYNTHETIC_TASKS:
        task = synthetic_task(
            cfg.task, cfg.difficulty, seed=cfg.task_seed, num_problems=cfg.num_problems, eval_size=cfg.eval_size
        )
    elif cfg.task in FILE_TASKS:
        if cfg.path is None:
            raise ValueError(f"data.path: required when data.task is {cfg.task}")
        task = file_task(
            cfg.task,
            cfg.path,
            cfg.eval_path,
            prompt_field=cfg.prompt_field,
            answer_field=cfg.answer_field,
            eval_size=cfg.eval_size,
        )
    elif cfg.task == "hf_dataset":
        if cfg.path is None:
            raise ValueError("data.path: required when data.task is hf_dataset")
        task = hf_dataset_task(
            cfg.path,
            cfg.split,
            cfg.eval_split,
            prompt_field=cfg.prompt_field,
            answer_field=cfg.answer_field,
            eval_size=cfg.eval_size,
        )
    elif cfg.task == "reasoning_gym":
        from asyncrl.data.reasoning_gym import reasoning_gym_task

        if cfg.dataset is None:
            raise ValueError(
                "data.dataset: required when data.task is reasoning_gym (a reasoning-gym dataset name, e.g. chain_sum)"
            )
        task = reasoning_gym_task(
            cfg.dataset, cfg.dataset_config, seed=cfg.task_seed, num_problems=cfg.num_problems, eval_size=cfg.eval_size
        )
    else:
        raise ValueError(
            f"data.task: unknown task '{cfg.task}'; built-ins are {', '.join(SYNTHETIC_TASKS)}, or jsonl / parquet / hf_dataset / reasoning_gym"
        )
    if cfg.chat_template:
        task = replace(task, train=_templated(task.train, tokenizer), heldout=_templated(task.heldout, tokenizer))
    return task


def _templated(prompts, tokenizer) -> list[Prompt]:
    texts = apply_chat_template([p.text for p in prompts], tokenizer)
    return [replace(p, text=text) for p, text in zip(prompts, texts)]
