"""Reward functions and the runner that applies them in worker processes, under a wall-clock timeout per call."""

from asyncrl.rewards.functions import (
    FormatReward,
    MathReward,
    OverlongPenalty,
    RewardContext,
    RewardFn,
    TaskReward,
    exact_match,
    numeric_match,
    resolve_reward,
)
from asyncrl.rewards.runner import RewardCounts, RewardResult, RewardRunner

__all__ = [
    "FormatReward",
    "MathReward",
    "OverlongPenalty",
    "RewardContext",
    "RewardCounts",
    "RewardFn",
    "RewardResult",
    "RewardRunner",
    "TaskReward",
    "exact_match",
    "numeric_match",
    "resolve_reward",
]
