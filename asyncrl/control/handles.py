"""What the controller and WeightSync need from a worker handle, on any runtime.

A handle call submits its work at once and returns an awaitable, so calls to one worker run in the
order they were made (docs/architecture.md). ``runtime.local.LocalHandle``, ``runtime.ray``'s
handles and ``trainer.group.TrainerGroup`` all satisfy these protocols; workers never see them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # importing this module loads no torch
    from asyncrl.data import Prompt
    from asyncrl.types import EvalResult, ProbeGap, RolloutBatch, RolloutGroup, RolloutJob, StepReport


class TrainerHandle(Protocol):
    """The trainer (every rank of it): one step is begin_step, train_groups..., then finish or abort."""

    def begin_step(self, step: int) -> Awaitable[None]: ...

    def train_groups(self, groups: Sequence[RolloutGroup]) -> Awaitable[int]: ...

    def finish_step(self) -> Awaitable[StepReport]: ...

    def abort_step(self) -> Awaitable[None]: ...

    def abandon(self) -> Awaitable[None]:
        """Make the call in flight drop the open step at its next module, beside the queued calls
        (a single rank; several finish it); the ``abort_step`` after it puts the step back."""

    def export_weights(self) -> Awaitable[tuple[int, Any]]:
        """(version, weights): a state dict, or a runtime's reference to one."""

    def exported_fingerprints(self, dtypes: Sequence[str]) -> Awaitable[dict[str, str]]:
        """The fingerprint of the weights last exported in each of ``dtypes``, by dtype
        (weights/fingerprint.py); empty before the first export."""

    def probe_gap(self, group: RolloutGroup) -> Awaitable[ProbeGap]:
        """How far the logprobs a generator sampled ``group`` with are from the trainer's."""

    def save_checkpoint(self, run_dir: str, step: int, run_state: dict, keep_last: int) -> Awaitable[Path | None]: ...


class RolloutHandle(Protocol):
    """One rollout worker: generation batches, evaluations and weight loads, run in call order."""

    def generate(self, jobs: Sequence[RolloutJob]) -> Awaitable[RolloutBatch]: ...

    def evaluate(self, prompts: Sequence[Prompt]) -> Awaitable[EvalResult]: ...

    def load_weights(self, weights: Any, version: int) -> Awaitable[str | None]:
        """Load what ``TrainerHandle.export_weights`` returned as ``weights``; the fingerprint of
        what the generator serves afterwards, read back from it (None: its backend cannot tell,
        or its actor died and reloads the weights when restarted)."""

    def probe(self, prompts: Sequence[Prompt], version: int) -> Awaitable[RolloutGroup]:
        """One response to each prompt with the run's sampling settings: the sampling probe."""

    @property
    def loads_while_generating(self) -> bool:
        """A load runs beside a generation batch in progress, not after it (``unordered_methods``)."""
