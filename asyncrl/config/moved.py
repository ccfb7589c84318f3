"""Keys that moved: a config written for an earlier layout fails with one line naming the new place.

The ``grpo`` section held the step's shape beside two of GRPO's options, and ``loss`` held GRPO's
loss terms beside the trainer's aggregation. The algorithm now owns its options
(``algorithm.options``), the step's shape is ``step``, and the aggregation, the same for every
algorithm, is the trainer's. The ``vllm`` section was the vllm backend's settings outside the
options every part has: they are ``generation.backend.options`` now; the format and overlong
rewards' settings are their ``rewards.options``. The task and the backend were a name key beside
an options key (``data.task`` + ``data.task_options``); they are ``{name, options}`` sections like
every part, and the built-in tasks' settings (``data.path``, ``data.difficulty``, ...) are their
options.
"""

from __future__ import annotations

from typing import Any

from asyncrl.config.base import ConfigError

_STEP_KEYS = (
    "prompts_per_step",
    "generations_per_prompt",
    "step_batch_size",
    "max_steps",
    "filter_zero_variance",
    "mask_truncated",
    "max_refill_groups",
    "min_groups_per_chunk",
    "num_minibatches",
    "num_epochs",
)
_VLLM_KEYS = (
    "url",
    "python",
    "dtype",
    "enforce_eager",
    "max_model_len",
    "kv_cache_mib",
    "gpu_memory_utilization",
    "startup_timeout_s",
    "request_timeout_s",
    "max_restarts",
    "weight_transfer",
    "extra_args",
)
_TRAINER_KEYS = {"mode": "aggregation", "norm_constant": "norm_constant", "track_entropy": "track_entropy"}
_OPTION_KEYS = {
    "grpo": ("baseline", "scale_by_std"),
    "loss": (
        "clip_low",
        "clip_high",
        "dual_clip",
        "clip_against",
        "ratio_level",
        "importance_sampling",
        "is_cap",
        "is_low",
        "is_high",
        "kl_coef",
        "kl_log_ratio_clamp",
        "kl_clamp",
        "entropy_coef",
    ),
}

SECTIONS = {
    "grpo": "step (the step's shape) and algorithm.options (baseline, scale_by_std)",
    "loss": "algorithm.options (the loss terms) and trainer (aggregation, norm_constant, track_entropy)",
    "vllm": "generation.backend.options (the vllm backend's options)",
}


def new_place(section: str, key: str) -> str | None:
    """Where ``section.key`` of the earlier layout lives now; None for a key it never had."""
    if section == "vllm":
        return f"generation.backend.options.{key}" if key in _VLLM_KEYS else None
    if key in _OPTION_KEYS[section]:
        return f"algorithm.options.{key}"
    if section == "grpo" and key in _STEP_KEYS:
        return f"step.{key}"
    if section == "loss" and key in _TRAINER_KEYS:
        return f"trainer.{_TRAINER_KEYS[key]}"
    return None


_TASK_SETTINGS = (
    "path",
    "eval_path",
    "split",
    "eval_split",
    "prompt_field",
    "answer_field",
    "difficulty",
    "num_problems",
    "dataset",
    "dataset_config",
)

# keys that moved into a part's options
KEYS = {
    "rewards.format_pattern": "rewards.options.format.pattern",
    "rewards.overlong_cache": "rewards.options.overlong.cache",
    "generation.backend_options": "generation.backend.options",
    "data.task_options": "data.task.options",
    "data.task_seed": "data.task.options.seed",
    **{f"data.{key}": f"data.task.options.{key}" for key in _TASK_SETTINGS},
}


def moved_key_error(keys: tuple[str, ...], value: Any = None) -> ConfigError | None:
    """The error for a key of the earlier layout (``grpo.max_steps``, a whole ``loss:`` section,
    ``rewards.format_pattern``), or None for a key that never existed."""
    moved = ".".join(keys[:2])
    if moved in KEYS:
        return ConfigError(f"{moved}: moved to {KEYS[moved]}")
    if not keys or keys[0] not in SECTIONS:
        return None
    section = keys[0]
    if len(keys) == 1 and isinstance(value, dict) and value:
        keys = (section, str(next(iter(value))))
    place = new_place(section, keys[1]) if len(keys) > 1 else None
    if place is None:
        return ConfigError(
            f"{'.'.join(keys[:2])}: the {section} section moved; its keys are now in {SECTIONS[section]}"
        )
    return ConfigError(f"{section}.{keys[1]}: moved to {place}")
