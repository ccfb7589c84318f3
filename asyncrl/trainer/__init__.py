"""The policy trainer: split train-step API, optimizer and schedule."""

from asyncrl.trainer.policy import PolicyTrainer, StepInProgressError

__all__ = ["PolicyTrainer", "StepInProgressError"]
