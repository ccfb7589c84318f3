"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine decay)."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from asyncrl.config import TrainerConfig


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier on the base lr before optimizer step ``step + 1`` (``step`` counts steps taken)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params, cfg: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; ``foreach`` keeps the update a handful of kernels."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=True,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig, total_steps: int) -> LambdaLR:
    factor = partial(
        lr_factor,
        warmup_steps=cfg.warmup_steps,
        total_steps=total_steps,
        schedule=cfg.lr_schedule,
        min_lr_ratio=cfg.min_lr_ratio,
    )
    return LambdaLR(optimizer, factor)
