"""The positions one generation request of a run may take: what the model's context, and a vLLM
server's ``max_model_len``, must hold.

A single-turn request is the prompt, encoded as the rollout worker encodes it, and up to
``generation.max_new_tokens`` sampled tokens. An episode's first request is its templated opening
(the environment's reset messages and tools through the chat template), not the raw prompt. A
later turn's request is the opening plus the episode's response so far, which stays under
``environment.max_tokens`` (an observation that would reach it ends the episode), and it then
samples up to ``generation.max_new_tokens`` tokens however little room the episode has left (the
episode keeps only those that fit). So a request of an episode needs at most its opening +
``environment.max_tokens`` + ``generation.max_new_tokens`` positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from asyncrl.data.files import TOKENIZE_BATCH, Budget, encoded_prompts, request_budget
from asyncrl.data.prompts import Prompt, Task, encode_prompts
from asyncrl.environments.base import EnvironmentPart

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


def first_requests(task: Task, environment: EnvironmentPart | None, tokenizer) -> Iterator[tuple[Prompt, list[int]]]:
    """Every prompt of both splits with the ids of its first request: the encoded prompt, or with
    an environment the templated opening, as the episode loop builds it (one environment instance
    gives every prompt's opening: ``reset`` only reads the prompt)."""
    if environment is None:
        yield from encoded_prompts(task, tokenizer)
        return
    env = environment.build()
    for split in (task.train, task.heldout):
        for start in range(0, len(split), TOKENIZE_BATCH):
            chunk = split[start : start + TOKENIZE_BATCH]
            texts = [opening_text(env, prompt, tokenizer) for prompt in chunk]
            yield from zip(chunk, encode_prompts(texts, tokenizer))


def opening_text(env, prompt: Prompt, tokenizer) -> str:
    """The chat template over ``env``'s opening messages and tools, up to the model's first turn."""
    return tokenizer.apply_chat_template(
        env.reset(prompt), tools=env.tools or None, add_generation_prompt=True, tokenize=False
    )


def request_bound(task: Task, config: RunConfig, environment: EnvironmentPart | None, tokenizer) -> tuple[int, Budget]:
    """The longest first request of the task, in tokens, and what a request may add to it: their
    sum is the most positions a request of this run takes."""
    return max(len(ids) for _, ids in first_requests(task, environment, tokenizer)), request_budget(config)
