"""feedback: answer a numeric problem; a wrong answer is told "too high" or "too low" and tried again.

The prompt's text is the user's turn and its answer the target. The reward of an episode solved at
its k-th answer is ``discount ** (k - 1)``, so a first answer that is right scores 1 (and counts as
correct) while a later one scores less; an episode that ends unsolved at the turn limit is scored
by the run's rewards like any truncated one. Each step is instant: this environment exercises the
episode loop and the loss masks, not tool latency.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.data.prompts import Prompt
from asyncrl.environments.base import Environment, Message, Turn

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class FeedbackEnvironment(Environment):
    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        discount: float = Field(0.5, gt=0.0, le=1.0, description="reward factor per extra answer")
        too_high: str = Field("too high", description="the user's reply to an answer above the target")
        too_low: str = Field("too low", description="the user's reply to an answer below the target")
        not_a_number: str = Field("a number?", description="the user's reply to an answer without a number")

    def __init__(self, options: FeedbackEnvironment.Options) -> None:
        self.discount = options.discount
        self.replies = {1: options.too_high, -1: options.too_low, 0: options.not_a_number}
        self.target = 0.0
        self.answers = 0

    def reset(self, prompt: Prompt) -> list[Message]:
        self.target = float(prompt.answer)
        return [{"role": "user", "content": prompt.text}]

    def step(self, assistant: Message) -> Turn:
        self.answers += 1
        found = _NUMBER.search(assistant.get("content") or "")
        if found is not None and float(found.group()) == self.target:
            return Turn([], done=True, reward=self.discount ** (self.answers - 1), metrics={"solved": 1.0})
        side = 0 if found is None else (1 if float(found.group()) > self.target else -1)
        return Turn([{"role": "user", "content": self.replies[side]}], done=False, metrics={"solved": 0.0})

    @staticmethod
    def demonstration(prompt: Prompt) -> list[Message]:
        """A solved episode for the warm start: the question and the right answer."""
        return [{"role": "user", "content": prompt.text}, {"role": "assistant", "content": prompt.answer}]
