"""RunState: what the controller counts over a run, and what a checkpoint restores of it.

The controller coordinates the loops; the books they keep live here, so that they are counted,
saved and restored in one place: the run's totals (evictions, skipped prompts and which of the latest prompts were, step
reruns, non-finite and empty steps), the groups the open step has taken (rerun after an abort, saved in
every checkpoint) and whether an evaluation is due.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncrl.metrics import RunCounters
from asyncrl.types import RolloutGroup

if TYPE_CHECKING:
    from asyncrl.types import StepResult

_TOTALS = ("num_evicted", "skipped_prompts", "step_retries", "nonfinite_steps", "nonfinite_streak", "empty_steps")


@dataclass
class RunState:
    num_evicted: int = 0
    skipped_prompts: int = 0
    step_retries: int = 0  # train steps rerun after a failure
    nonfinite_steps: int = 0  # skipped: a non-finite loss or gradient
    nonfinite_streak: int = 0  # consecutive non-finite steps, up to the last one
    empty_steps: int = 0  # steps without an informative group: no update (docs/loss.md)
    eval_due: bool = False  # an evaluation of this version was started and has not finished
    step_groups: list[RolloutGroup] = field(default_factory=list)  # taken by the open step, until it finishes
    recent_prompts: deque[bool] = field(default_factory=deque)  # the latest finished prompts: skipped or not

    def finish_prompt(self, *, skipped: bool, window: int) -> int:
        """A prompt committed its group or was skipped; returns the skipped among the last ``window``."""
        self.skipped_prompts += skipped
        self.recent_prompts.append(skipped)
        while len(self.recent_prompts) > window:
            self.recent_prompts.popleft()
        return sum(self.recent_prompts)

    def count_step(self, result: StepResult) -> None:
        """A finished step: a non-finite one extends the streak, any other ends it; one that
        trained no token is empty."""
        if result.skipped:
            self.nonfinite_steps += 1
            self.nonfinite_streak += 1
        else:
            self.nonfinite_streak = 0
        self.empty_steps += result.num_tokens == 0

    def counters(self, refill_groups_total: int) -> RunCounters:
        """The totals every step record repeats."""
        return RunCounters(
            refill_groups_total=refill_groups_total,
            evicted_groups=self.num_evicted,
            skipped_prompts=self.skipped_prompts,
            step_retries=self.step_retries,
            nonfinite_steps=self.nonfinite_steps,
            empty_steps=self.empty_steps,
        )

    def state_dict(self) -> dict:
        """Tensors and plain values, for ``torch.load(weights_only=True)``."""
        return {
            **{name: getattr(self, name) for name in _TOTALS},
            "eval_due": self.eval_due,
            "step_groups": [group.state_dict() for group in self.step_groups],
            "recent_prompts": list(self.recent_prompts),
        }

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's run state; totals an older checkpoint lacks start at 0."""
        self.num_evicted = state["num_evicted"]
        for name in _TOTALS[1:]:
            setattr(self, name, state.get(name, 0))
        self.eval_due = bool(state.get("eval_due", False))
        self.step_groups = [RolloutGroup.from_state_dict(group) for group in state.get("step_groups", [])]
        self.recent_prompts = deque(bool(skipped) for skipped in state.get("recent_prompts", []))
