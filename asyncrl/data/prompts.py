"""Prompt and Task: all the rest of asyncrl sees of a dataset, whatever its source."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    uid: str  # stable and unique within its split; sampling seeds derive from it
    text: str  # what the policy sees (chat template already applied when enabled)
    answer: str  # the reference answer the rewards compare against


@dataclass(frozen=True)
class Task:
    """A train split, a disjoint held-out split, and the shape a well-formed answer has.

    ``format_pattern`` is the regex the ``format`` reward uses when its ``pattern`` option is not
    set; None where the task cannot know it (user files). ``score`` is the task's own checker, the
    ``task`` reward, (completion, answer) -> score; None where the task has none. ``sources`` names
    where each split's rows were read ("train" / "heldout" -> a file, or a split of a directory), so
    an error can name a prompt's row (a uid ``split/row``); None for generated problems.
    """

    name: str
    train: Sequence[Prompt]
    heldout: Sequence[Prompt]
    format_pattern: str | None = None
    score: Callable[[str, str], float] | None = None
    sources: Mapping[str, str] | None = None


def apply_chat_template(texts: Sequence[str], tokenizer) -> list[str]:
    """Wrap each text as one user turn, ending where the assistant's reply begins."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.chat_template: the tokenizer has no chat template; set data.chat_template=false")
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        for text in texts
    ]


def encode_prompts(texts: Sequence[str], tokenizer) -> list[list[int]]:
    """Each prompt's token ids, starting with BOS exactly when the tokenizer puts one before plain
    text (Llama, Gemma; not Qwen or the char tokenizer). A chat template that writes BOS into the
    text already starts with it, so it is not doubled; no EOS is appended."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is None or tokenizer("a")["input_ids"][:1] != [bos]:
        return ids
    return [row if row[:1] == [bos] else [bos, *row] for row in ids]
