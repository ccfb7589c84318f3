"""Dynamic sampling: replacement prompts for the groups that zero-variance filtering drops.

Replacements come from a prompt stream of their own (the train split reshuffled, uids prefixed
``refill:``), so which prompts refill a step never depends on how refills and admissions
interleave. The controller asks for a round only once every group the step waits for has arrived;
a round is stamped with the current weights and the open step as its target, and bounded by the
step's budget (``step.max_refill_groups``), the buffer's free slots and the in-flight limit. Under
``in_order`` what refills a step is then a function of the config alone.

A refill is trained in the step it refills, at lag 0, whatever the sampler: the controller takes the
open step's refills itself (``ready``) rather than asking the sampler, which would pick by its own
order (oldest weights first under ``weight_fifo`` and ``windowed``) and fill the step with groups
meant for later steps, leaving the refills to a later step or to eviction. For the same reason the
controller never evicts them.

Admissions leave the budget's slots to refills (``reserved_slots``): the buffer is sized for them
(``run_sampler.build_run_sampler``), and a sampler that admits up to capacity would otherwise take
them. A refill the step has trained keeps its slot from admissions until the step ends, so turning
refill on never lets a sampler hold more groups: under ``windowed`` with ``max_lag: 0`` each such
group, admitted while the step waits for its refills, could only have been evicted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from asyncrl.data import Prompt, PromptLoader

if TYPE_CHECKING:
    from asyncrl.control.buffer import ReplayBuffer
    from asyncrl.types import RolloutGroup

REFILL_PREFIX = "refill:"


class DynamicSampling:
    def __init__(self, loader: PromptLoader, budget: int) -> None:
        self.budget = budget
        self.loader = PromptLoader(
            [replace(prompt, uid=f"{REFILL_PREFIX}{prompt.uid}") for prompt in loader.prompts],
            shuffle_seed=loader.shuffle_seed + 1,
            epochs=loader.epochs,
        )
        self.exhausted = False
        self.step_refills = 0  # replacement prompts dispatched for the open step and not given up
        self.total = 0  # over the run

    @staticmethod
    def is_refill(prompt: Prompt) -> bool:
        return prompt.uid.startswith(REFILL_PREFIX)

    def reserved_slots(self, step_groups: list[RolloutGroup]) -> int:
        """Buffer slots that admissions leave free: the budget, less the open step's refills that
        hold a slot now (those in ``step_groups`` gave theirs back to the buffer, not to admissions)."""
        trained = sum(group.prompt_uid.startswith(REFILL_PREFIX) for group in step_groups)
        return self.budget - self.step_refills + trained

    def wanted(self, missing: int, free_slots: int) -> int:
        """How many replacements the step may still take for ``missing`` informative groups."""
        if self.exhausted:
            return 0
        return max(0, min(missing, self.budget - self.step_refills, free_slots))

    def take(self, count: int) -> list[Prompt]:
        """Up to ``count`` replacement prompts, counted against the step's budget."""
        prompts = []
        while len(prompts) < count and (prompt := self.next_prompt()) is not None:
            prompts.append(prompt)
        self.step_refills += len(prompts)
        return prompts

    def next_prompt(self) -> Prompt | None:
        """The stream's next prompt (also what replaces a refill that failed for good)."""
        prompt = None if self.exhausted else self.loader.next()
        self.exhausted = prompt is None
        return prompt

    def ready(self, step: int, buffer: ReplayBuffer) -> list[int]:
        """Slot ids of step ``step``'s committed refills, in dispatch order."""
        return [
            slot.slot_id
            for slot in buffer.ready_slots()
            if slot.target_step == step and slot.group.prompt_uid.startswith(REFILL_PREFIX)
        ]

    def given_up(self) -> None:
        """A refill of the open step failed for good and nothing replaces it: the step stops waiting for it."""
        self.step_refills -= 1

    def end_step(self) -> int:
        """The open step's refill count, added to the run's total; the next step starts at 0."""
        count, self.step_refills = self.step_refills, 0
        self.total += count
        return count

    def state_dict(self) -> dict:
        return {
            "step_refills": self.step_refills,
            "refill_groups": self.total,
            "refill_exhausted": self.exhausted,
            "refill_loader": self.loader.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_refills = state.get("step_refills", 0)
        self.total = state.get("refill_groups", 0)
        self.exhausted = state.get("refill_exhausted", False)
        if "refill_loader" in state:
            self.loader.load_state_dict(state["refill_loader"])
