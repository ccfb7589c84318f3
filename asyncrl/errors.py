"""The run-stop error and its kinds: what a controller, a worker handle or the CLI raises to end a
run cleanly (docs/reliability.md has a row for each).

Its own module so that workers and the CLI can raise and catch them without importing the controller.
"""

from __future__ import annotations

import signal
from pathlib import Path


class SyncTimeoutError(RuntimeError):
    """A phase of a weight sync did not finish within ``sync.timeout_s``. ``trainer_healthy``:
    False when the trainer's export was what hung, so nothing more should be asked of it."""

    def __init__(self, message: str, *, trainer_healthy: bool = True) -> None:
        super().__init__(message)
        self.trainer_healthy = trainer_healthy


class WeightLoadError(RuntimeError):
    """A generator failed to load a version, after whatever restarts its backend makes itself."""


class RunStopped(RuntimeError):
    """The run stopped before its end. ``checkpoint``: where it was saved first, if it could be."""

    exit_code = 1
    saves_checkpoint = True  # the trainer is known to be healthy when this is raised

    def __init__(self, message: str, *, saves_checkpoint: bool | None = None) -> None:
        """``saves_checkpoint``: this stop's own answer, where the kind's default does not hold
        (a failure before the first step has nothing new to save)."""
        super().__init__(message)
        self.checkpoint: Path | None = None
        if saves_checkpoint is not None:
            self.saves_checkpoint = saves_checkpoint


class RolloutFailedError(RunStopped):
    """A prompt's generation failed more often than ``runtime.max_rollout_retries`` allows."""


class TrainStepError(RunStopped):
    """A train step kept failing after ``trainer.max_step_retries`` reruns (each aborted first)."""


class NonFiniteStepsError(RunStopped):
    """More consecutive non-finite steps than ``trainer.max_nonfinite_steps``."""


class RunInterrupted(RunStopped):
    """SIGINT or SIGTERM: the open step was aborted and its groups kept; exit 128 + signal."""

    def __init__(self, signum: int, version: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {version}")
        self.exit_code = 128 + signum


class SyncTimedOut(RunStopped, SyncTimeoutError):
    """A weight sync phase took longer than ``sync.timeout_s``; the step before it is complete, so
    the run checkpoints it, unless the trainer's export was what hung."""

    def __init__(self, err: SyncTimeoutError, *, saves_checkpoint: bool = True) -> None:
        super().__init__(str(err))
        self.trainer_healthy = err.trainer_healthy
        self.saves_checkpoint = saves_checkpoint and err.trainer_healthy


class WeightLoadFailedError(RunStopped):
    """A generator could not load the weights of a complete step, its backend's own restarts
    included; the run checkpoints that step."""


class EvaluationFailedError(RunStopped):
    """An evaluation failed more often than ``runtime.max_rollout_retries`` allows."""


class StallError(RunStopped):
    """No loop made progress for ``runtime.watchdog_s``; the message says what each waited on."""

    saves_checkpoint = False  # whatever hangs may be the trainer: the last checkpoint stands


class ProcessGroupError(RunStopped):
    """Workers could not form a process group (the trainer ranks', or the weight broadcast's): one
    could not reach another at the address it was given. Nothing was trained yet."""

    saves_checkpoint = False


class IntegrityStop(RunStopped):
    """A promise the run makes about what it trains was broken (the integrity guard,
    docs/integrity.md): exit code 3, distinct from a crash (1) and bad input (2). The checkpoint is
    the last good step's: the breach is caught before the suspect data is trained."""

    exit_code = 3

    def __init__(self, promise: str, evidence: str, step: int) -> None:
        super().__init__(f"integrity: {promise} broken at step {step}: {evidence}")
        self.promise, self.evidence, self.step = promise, evidence, step

    def __reduce__(self) -> tuple:
        """Rebuilt from its three parts when it crosses a process (a Ray trainer rank's)."""
        return type(self), (self.promise, self.evidence, self.step)
