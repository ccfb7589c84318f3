"""PromptLoader: the train split in a seeded order, epoch after epoch, resumable to the prompt.

Epoch e visits every prompt once, in a permutation derived only from (shuffle_seed, e). The whole
state is therefore (epoch, position): a loader restored from ``state_dict`` hands out exactly the
prompts the saved one would have, with no replay of earlier epochs. A prompt comes out with uid
``"{uid}/{epoch}"`` so that a repeated prompt gets fresh sampling seeds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from asyncrl.data.prompts import Prompt


class PromptLoader:
    def __init__(self, prompts: Sequence[Prompt], *, shuffle_seed: int, epochs: int | None) -> None:
        if not prompts:
            raise ValueError("data: the train split is empty")
        if epochs is not None and epochs < 1:
            raise ValueError(f"data.epochs: must be at least 1 or null, got {epochs}")
        self.prompts = prompts
        self.shuffle_seed = shuffle_seed
        self.epochs = epochs
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """Completed passes over the train split."""
        return self._epoch

    @property
    def position(self) -> int:
        """Index, within the current epoch's order, of the next prompt."""
        return self._position

    def next(self) -> Prompt | None:
        """The next prompt, or None once ``epochs`` passes are done (never, when epochs is None)."""
        if self.epochs is not None and self._epoch >= self.epochs:
            return None
        prompt = self.prompts[self._order[self._position]]
        prompt = replace(prompt, uid=f"{prompt.uid}/{self._epoch}")
        self._position += 1
        if self._position == len(self.prompts):
            self._epoch, self._position = self._epoch + 1, 0
            self._order = self._permutation(self._epoch)
        return prompt

    def state_dict(self) -> dict:
        return {
            "shuffle_seed": self.shuffle_seed,
            "num_prompts": len(self.prompts),
            "epoch": self._epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["shuffle_seed"] != self.shuffle_seed:
            raise ValueError(
                f"data.shuffle_seed: the saved loader used {state['shuffle_seed']}, this one uses {self.shuffle_seed}"
            )
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(
                f"data: the saved loader's train split has {state['num_prompts']} prompts, "
                f"this one has {len(self.prompts)}; the dataset changed"
            )
        if not 0 <= state["position"] < len(self.prompts) or state["epoch"] < 0:
            raise ValueError(
                f"data: invalid saved loader position (epoch {state['epoch']}, position {state['position']})"
            )
        self._epoch, self._position = state["epoch"], state["position"]
        self._order = self._permutation(self._epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(f"prompt-order:{self.shuffle_seed}:{epoch}").shuffle(order)
        return order
