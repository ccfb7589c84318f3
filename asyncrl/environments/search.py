"""The built-in search environment: find a hidden number from "up" / "down" answers.

The ``search`` task's prompt names the range (``0-9``) and its answer is the hidden number. The
first guess can only be a guess; each wrong one is answered ``up`` (the number is higher) or
``down``, so an episode is solved by using what the earlier turns revealed, and the best policy
is a binary search. Accuracy is the share of episodes solved within ``environment.max_turns``
guesses; ``episode/turns`` falls as the policy learns to halve the range.

The text is short, since the char tokenizer spends a token on every character: a guess is a
number and EOS, a reply ``U:up`` (option ``reply: range`` answers with the range the number is now
known to be in, ``U:5-9``, which does the bookkeeping for the model). The warm start learns that format and the rules
from the ``demonstration`` episodes, which guess uniformly among the numbers the replies still
allow: no halving, so what GRPO adds (which guess to make) shows in accuracy and turns.
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.data.prompts import Prompt, Task
from asyncrl.environments.base import Environment, Message, Turn

if TYPE_CHECKING:
    from asyncrl.config import DataConfig

_RANGE = re.compile(r"(\d+)-(\d+)")
_GUESS = re.compile(r"\s*(\d+)\s*")


class SearchTask:
    """``search``: a hidden number in ``0 .. difficulty - 1``, the prompt the range (``0-9``).

    Problem ``j`` hides ``j % difficulty``, so the held-out split (the first ``data.eval_size``)
    holds every number equally often when ``eval_size`` is a multiple of the range's size; the
    splits share numbers but not episodes, and the number is never in the prompt."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        difficulty: int = Field(2, ge=2, description="the size of the range the number is hidden in")
        num_problems: int = Field(10000, ge=2, description="episodes, the held-out ones first")

    has_checker = False
    checker_required = False

    def __init__(self, data: DataConfig, options: SearchTask.Options) -> None:
        self.settings, self.eval_size = options, data.eval_size
        if self.settings.num_problems <= self.eval_size:
            raise ValueError(f"data.eval_size: {self.eval_size} held-out problems leave none to train on")

    def build(self) -> Task:
        size, eval_size = self.settings.difficulty, self.eval_size
        prompts = [
            Prompt(f"search/{size}/{j}", f"0-{size - 1}", str(j % size)) for j in range(self.settings.num_problems)
        ]
        return Task("search", prompts[eval_size:], prompts[:eval_size], format_pattern=r"\d+")


class SearchEnvironment(Environment):
    """The prompt's range as the user's turn; each guess answered until it is the hidden number."""

    task = "search"  # its prompts are ranges and its answers hidden numbers

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        bonus: float = Field(0.5, ge=0.0, description="a solved episode scores 1 + bonus / (its number of guesses)")
        reply: Literal["direction", "range"] = Field(
            "direction", description="a wrong guess is told up / down, or the range the number is now known to be in"
        )

    def __init__(self, options: SearchEnvironment.Options) -> None:
        self.settings = options
        self.bonus, self.reply = options.bonus, options.reply
        self.target = self.low = self.high = 0
        self.guesses = 0

    def reset(self, prompt: Prompt) -> list[Message]:
        found = _RANGE.fullmatch(prompt.text)
        if found is None or not prompt.answer.isdigit():
            raise ValueError(f"prompt {prompt.uid}: the search environment needs a range (0-9) and a number")
        self.target, self.low, self.high = int(prompt.answer), int(found.group(1)), int(found.group(2))
        return [{"role": "user", "content": prompt.text}]

    def step(self, assistant: Message) -> Turn:
        self.guesses += 1
        found = _GUESS.fullmatch(assistant.get("content") or "")
        guess = None if found is None else int(found.group(1))
        if guess == self.target:
            return Turn([], done=True, reward=1.0 + self.bonus / self.guesses, metrics={"solved": 1.0})
        if guess is None:
            text = "?"
        elif guess < self.target:
            self.low = max(self.low, guess + 1)
            text = "up" if self.reply == "direction" else f"{self.low}-{self.high}"
        else:
            self.high = min(self.high, guess - 1)
            text = "down" if self.reply == "direction" else f"{self.low}-{self.high}"
        reply = {"role": "user", "content": text}
        return Turn([reply], done=False, metrics={"solved": 0.0, "invalid_guesses": float(guess is None)})

    def demonstration(self, prompt: Prompt) -> list[Message]:
        """An episode of the answer format and the rules, with no strategy in it: each guess is
        drawn uniformly (seeded by the prompt) from the numbers the replies so far still allow,
        never their middle on purpose, until one hits."""
        rng, env = random.Random(prompt.uid), SearchEnvironment(self.settings)
        messages = env.reset(prompt)
        for _ in range(env.high - env.low + 1):  # each wrong guess narrows the range, so one of these hits
            guess = {"role": "assistant", "content": str(rng.randint(env.low, env.high))}
            turn = env.step(guess)
            messages += [guess, *turn.messages]
            if turn.done:
                break
        return messages
