"""Supervised warm start: a short teacher-forced pass over the train split, cached on disk.

GRPO learns only from reward differences within a group. A freshly initialized model almost never
answers correctly, so every group scores the same and there is nothing to learn from. A few
hundred supervised steps make the policy partly competent; RL takes it from there. The result is
cached under a hash of everything that determines it (initial weights, tokenizer, data, settings),
so only the first run pays for it. Its batches are drawn from ``warm_start.seed``, not from the run
seed: every seed of a run starts from one warm-started policy, as the seeds of a real run start
from one checkpoint, and the spread over seeds measures the RL rather than where a short
supervised run happened to end.

The initial weights enter the key without a host copy of the model: a checkpoint by its files'
names, sizes and modification times (the weights were just loaded from them) plus the dtype and
shape of every parameter; the built-in tiny model by its bytes, hashed one tensor at a time.
It runs by default only on the tiny model (``warm_start.steps`` in docs/configuration.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from asyncrl.config import ConfigError, WarmStartConfig
from asyncrl.data import Prompt, encode_prompts
from asyncrl.models.logprobs import token_logprobs


def warm_start(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Prompt],
    cfg: WarmStartConfig,
    *,
    model_path: str | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
) -> Path | None:
    """Train ``model`` in place for ``cfg.steps`` steps, or load the cached result. Returns the cache file.

    ``model_path``: the checkpoint directory ``model`` was just loaded from (None: the tiny model).
    """
    if cfg.steps == 0:
        return None
    if not prompts:
        raise ValueError("warm_start.steps: the train split is empty")
    path = Path(cfg.cache_dir).expanduser() / f"{_cache_key(model, model_path, tokenizer, prompts, cfg)}.safetensors"
    if path.is_file():
        try:
            load_model(model, path)
        except Exception as err:
            raise ConfigError(
                f"warm_start.cache_dir: the cached weights {path} cannot be loaded ({type(err).__name__}); "
                "delete the file to warm-start again"
            ) from None
        return path
    examples = [_encode(tokenizer, p) for p in prompts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.seed)
    device = next(model.parameters()).device
    was_training = model.training
    model.train()
    for step in range(cfg.steps):
        index = torch.randint(len(examples), (cfg.batch_size,), generator=generator).tolist()
        input_ids, attention_mask, target_mask = _batch([examples[i] for i in index], tokenizer.pad_token_id)
        logprobs, _ = token_logprobs(model, input_ids.to(device), attention_mask.to(device))
        target_mask = target_mask.to(device, logprobs.dtype)
        loss = -(logprobs * target_mask).sum() / target_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if on_progress is not None:
            on_progress(step + 1, cfg.steps, loss.item())
    model.train(was_training)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_model(model, str(tmp))
    os.replace(tmp, path)
    return path


def _encode(tokenizer, prompt: Prompt) -> tuple[list[int], int]:
    """(prompt + answer + eos token ids, number of prompt tokens)."""
    prompt_ids = encode_prompts([prompt.text], tokenizer)[0]
    answer_ids = tokenizer(prompt.answer, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids + [tokenizer.eos_token_id], len(prompt_ids)


def _batch(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and a mask on the answer tokens (the targets)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    target_mask = torch.zeros((len(examples), width))
    for row, (ids, prompt_len) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        target_mask[row, prompt_len : len(ids)] = 1.0
    return input_ids, attention_mask, target_mask


def _cache_key(
    model: nn.Module, model_path: str | None, tokenizer, prompts: Sequence[Prompt], cfg: WarmStartConfig
) -> str:
    digest = hashlib.sha256()
    settings = {
        "steps": cfg.steps,
        "lr": cfg.lr,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "torch": torch.__version__,
    }
    digest.update(json.dumps(settings, sort_keys=True).encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for prompt in prompts:
        digest.update(f"{prompt.text}\0{prompt.answer}\0".encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        if model_path is None:
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
    if model_path is not None:
        directory = Path(model_path).expanduser().resolve()
        digest.update(str(directory).encode())
        for file in sorted(p for p in directory.rglob("*") if p.is_file()):
            stat = file.stat()
            digest.update(f"{file.relative_to(directory)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]
