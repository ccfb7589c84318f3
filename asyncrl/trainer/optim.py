"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine decay).

The schedule's length is ``step.max_steps``, and a resumed run rebuilds it for the length it is
given: a resume that changes ``step.max_steps`` under cosine decay moves the lr of every step still
to come (from the floor back up, when a finished run is extended), which it says at the start.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import yaml
from torch.optim.lr_scheduler import LambdaLR

from asyncrl.config import RunConfig, TrainerConfig


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


class Schedule(LambdaLR):
    """``LambdaLR`` whose loaded state takes effect at once: the optimizer's saved state holds the
    lr the saved schedule set for the next step, and a resumed run trains that step at the lr of the
    schedule it built (the same value when ``step.max_steps`` is the same)."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group, base_lr, factor in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas, strict=True):
            group["lr"] = base_lr * factor(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig, total_steps: int) -> Schedule:
    factor = partial(
        lr_factor,
        warmup_steps=cfg.warmup_steps,
        total_steps=total_steps,
        schedule=cfg.lr_schedule,
        min_lr_ratio=cfg.min_lr_ratio,
    )
    return Schedule(optimizer, factor)


def resumed_schedule_warning(config: RunConfig, state: dict | None) -> str | None:
    """The warning of a run resumed from a checkpoint's ``state`` (None: a fresh run) whose
    schedule, rebuilt for ``step.max_steps``, gives its next step another lr than the schedule of
    the run that saved it would have; None when both agree (a constant schedule, the same length)."""
    run, trainer = (state.get("run"), state.get("trainer")) if isinstance(state, dict) else (None, None)
    saved_steps = _saved_max_steps(run)
    if saved_steps is None or saved_steps == config.step.max_steps or not isinstance(run.get("version"), int):
        return None
    scheduler = trainer.get("scheduler") if isinstance(trainer, dict) else None
    taken = scheduler.get("last_epoch") if isinstance(scheduler, dict) else None  # a skipped step takes none
    position = taken if isinstance(taken, int) else run["version"]
    cfg = config.trainer
    factor = partial(lr_factor, warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio)
    rebuilt, saved = factor(position, total_steps=config.step.max_steps), factor(position, total_steps=saved_steps)
    if math.isclose(rebuilt, saved, rel_tol=1e-9):
        return None
    return (
        f"lr schedule rebuilt for {config.step.max_steps} steps: lr factor at step {run['version'] + 1} is "
        f"{rebuilt:.3f} (was {saved:.3f} in the {saved_steps}-step schedule the checkpoint was trained on)"
    )


def _saved_max_steps(run_state: dict | None) -> int | None:
    """``step.max_steps`` of the config a run state was saved under (its ``config``, the YAML of
    the checkpoint's run.yaml); None for no state, or one that does not say."""
    if not isinstance(run_state, dict) or not isinstance(run_state.get("config"), str):
        return None
    try:
        saved = yaml.safe_load(run_state["config"])
    except yaml.YAMLError:
        return None
    steps = saved.get("step") if isinstance(saved, dict) else None
    max_steps = steps.get("max_steps") if isinstance(steps, dict) else None
    return max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) else None
