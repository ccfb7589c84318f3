"""``asyncrl merge``: a LoRA checkpoint's adapter added into its base, saved as a plain HF model.

A LoRA checkpoint holds the adapter alone (docs/lora.md); the base is rebuilt from the run's
config as the run built it (``model.*``, its warm start, cast to ``trainer.dtype`` as the trainer
held it) and checked against the SHA-256 the checkpoint recorded. peft's ``merge_and_unload``
adds B A alpha / r into each target's weight, and the result is written with the tokenizer into a
new directory, renamed into place whole, that ``AutoModelForCausalLM.from_pretrained`` loads with
no peft.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import transformers

from asyncrl.checkpoint import CheckpointError, is_adapter_checkpoint, write_directory_atomic
from asyncrl.config import RunConfig
from asyncrl.environments.base import environment_class
from asyncrl.models.factory import DTYPES, build_model, build_tokenizer
from asyncrl.models.lora import merged_model
from asyncrl.warm_start import warm_start_policy


def merge(config: RunConfig, checkpoint_dir: Path, out_dir: Path) -> Path:
    """Write the merged policy of the checked LoRA checkpoint ``checkpoint_dir`` to ``out_dir``."""
    if not is_adapter_checkpoint(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir}: holds no LoRA adapter (a full checkpoint is already an HF model)")
    transformers.utils.logging.disable_progress_bar()
    tokenizer = build_tokenizer(config)
    base = build_model(config, tokenizer)
    warm_start_policy(base, tokenizer, config, environment_class(config))
    model = merged_model(base, checkpoint_dir, DTYPES[config.trainer.dtype])
    write_directory_atomic(out_dir, partial(_save, model, tokenizer))
    return Path(out_dir)


def _save(model, tokenizer, directory: Path) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
