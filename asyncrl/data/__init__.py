"""Prompt datasets (built-in synthetic tasks, reasoning-gym, local jsonl / parquet files) and the resumable loader."""

from asyncrl.data.files import check_encodable, check_prompt_lengths, longest_prompt
from asyncrl.data.loader import PromptLoader
from asyncrl.data.prompts import Prompt, Task, encode_prompts
from asyncrl.data.synthetic import ARITHMETIC_LEVELS, SYNTHETIC_TASKS
from asyncrl.data.tasks import build_task

__all__ = [
    "ARITHMETIC_LEVELS",
    "SYNTHETIC_TASKS",
    "Prompt",
    "PromptLoader",
    "Task",
    "build_task",
    "check_encodable",
    "check_prompt_lengths",
    "encode_prompts",
    "longest_prompt",
]
