"""Reward functions and the runner that applies them in worker processes, under a wall-clock timeout per call."""

from asyncrl.rewards.functions import (
    BUILTIN_REWARDS,
    FormatReward,
    MathReward,
    OverlongPenalty,
    RewardFn,
    exact_match,
    numeric_match,
    resolve_reward,
)
from asyncrl.rewards.runner import RewardCounts, RewardResult, RewardRunner

__all__ = [
    "BUILTIN_REWARDS",
    "FormatReward",
    "MathReward",
    "OverlongPenalty",
    "RewardCounts",
    "RewardFn",
    "RewardResult",
    "RewardRunner",
    "exact_match",
    "numeric_match",
    "resolve_reward",
]
