"""Reward functions and the runner that applies them under a wall-clock timeout per call."""

from asyncrl.rewards.functions import (
    BUILTIN_REWARDS,
    RewardFn,
    exact_match,
    format_reward,
    numeric_match,
    resolve_reward,
)
from asyncrl.rewards.runner import RewardCounts, RewardResult, RewardRunner

__all__ = [
    "BUILTIN_REWARDS",
    "RewardCounts",
    "RewardFn",
    "RewardResult",
    "RewardRunner",
    "exact_match",
    "format_reward",
    "numeric_match",
    "resolve_reward",
]
