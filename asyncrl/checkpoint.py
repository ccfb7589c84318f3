"""Checkpoints: atomic on disk, exact on resume.

A checkpoint is a directory ``<run>/checkpoints/step-<V>/`` holding

- the policy as an HF model (``config.json`` + ``model.safetensors``) and the tokenizer, so
  ``AutoModelForCausalLM.from_pretrained`` works on it directly;
- ``state.pt``: optimizer, scheduler, RNG and version of the trainer, the sampler, the prompt
  loader, the ready buffer groups and any prompt still waiting for its rollout, all tensors and
  plain Python so it loads with ``torch.load(weights_only=True)``.

It is written into a temporary directory and renamed into place, and ``latest`` is rewritten the
same way afterwards, so a crash at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from torch import nn

STATE_FILE = "state.pt"
WEIGHTS_FILE = "model.safetensors"
LATEST_FILE = "latest"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    write_model: Callable[[Path], None],
    tokenizer,
    state: dict,
    keep_last: int,
) -> Path:
    """Write checkpoint ``step`` atomically, point ``latest`` at it, keep the newest ``keep_last``."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    for stale in root.glob(".tmp-step-*"):  # left by a writer that died mid-write; one run, one writer
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    tmp.mkdir()
    write_model(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_text_atomic(root / LATEST_FILE, final.name)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself, its run directory, or the run's checkpoints folder."""
    path = Path(path).expanduser()
    candidates = [path, path / "checkpoints"]
    for candidate in candidates:
        if (candidate / STATE_FILE).is_file():
            return candidate
        latest = candidate / LATEST_FILE
        if latest.is_file():
            target = candidate / latest.read_text().strip()
            if (target / STATE_FILE).is_file():
                return target
    raise FileNotFoundError(f"--resume: no checkpoint found in '{path}' (expected {STATE_FILE} or checkpoints/{LATEST_FILE})")


def load_state(checkpoint_dir: Path) -> dict:
    return torch.load(checkpoint_dir / STATE_FILE, weights_only=True)


def load_weights(model: nn.Module, checkpoint_dir: Path) -> None:
    """Load ``model.safetensors`` into ``model``; tied weights that HF leaves out stay tied."""
    weights = load_file(checkpoint_dir / WEIGHTS_FILE, device=str(next(model.parameters()).device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    params = model.state_dict()
    loaded_storage = {params[name].data_ptr() for name in weights if name in params}
    untied = [name for name in missing if params[name].data_ptr() not in loaded_storage]
    if unexpected or untied:
        raise ValueError(
            f"checkpoint {checkpoint_dir}: weights do not match the model "
            f"(missing {untied[:5]}, unexpected {unexpected[:5]})"
        )


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
