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

import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from asyncrl.config import ConfigError, RunConfig, WarmStartConfig
from asyncrl.data import Prompt, build_task, encode_prompts
from asyncrl.environments.base import EnvironmentPart
from asyncrl.models.logprobs import token_logprobs


def warm_start(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[Prompt],
    cfg: WarmStartConfig,
    *,
    model_path: str | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
    demonstration: Callable[[Prompt], list[dict]] | None = None,
    tools: list[dict] | None = None,
) -> Path | None:
    """Train ``model`` in place for ``cfg.steps`` steps, or load the cached result. Returns the cache file.

    ``model_path``: the checkpoint directory ``model`` was just loaded from (None: the tiny model).
    ``demonstration``: an environment's whole episode for a prompt, in chat messages (a tool
    environment's calls and results); the model learns its assistant turns, with the chat
    template's ``tools``, and every other token (the prompt, tool results) is masked out.
    """
    if cfg.steps == 0:
        return None
    if not prompts:
        raise ValueError("warm_start.steps: the train split is empty")
    conversations = None if demonstration is None else [demonstration(p) for p in prompts]
    key = _cache_key(model, model_path, tokenizer, prompts, cfg, conversations, tools)
    path = Path(cfg.cache_dir).expanduser() / f"{key}.safetensors"
    if path.is_file():
        _load_cached(model, path)
        return path

    def example(i: int) -> tuple[list[int], list[int]]:
        if conversations is None:
            return _encode(tokenizer, prompts[i])
        return encode_conversation(tokenizer, conversations[i], tools)

    # rendered only on a miss, and only the examples a batch draws: templating all 64,000
    # demonstrations of configs/tool-use.yaml took longer than a tenth of its 300 steps
    _train(model, len(prompts), functools.cache(example), tokenizer.pad_token_id, cfg, on_progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_model(model, str(tmp))
    os.replace(tmp, path)
    return path


def warm_start_policy(
    model: nn.Module,
    tokenizer,
    config: RunConfig,
    environment: EnvironmentPart | None,
    *,
    prompts: Sequence[Prompt] | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
) -> Path | None:
    """The run's warm start of ``model``, just built from ``config``: its train split (or
    ``prompts``, that split already built), its checkpoint and the demonstrations of its
    ``environment`` (``RunParts.environment``).
    Every process that needs the run's starting policy (the driver, each trainer rank on Ray,
    ``eval``) calls this, so all of them compute one cache key and start from the same weights."""
    if not config.warm_start.steps:
        return None
    if prompts is None:
        prompts = build_task(config.data, tokenizer).train
    return warm_start(
        model,
        tokenizer,
        prompts,
        config.warm_start,
        model_path=config.model.path,
        on_progress=on_progress,
        **demonstrations(environment),
    )


def _load_cached(model: nn.Module, path: Path) -> None:
    try:
        load_model(model, path)
    except Exception as err:
        raise ConfigError(
            f"warm_start.cache_dir: the cached weights {path} cannot be loaded ({type(err).__name__}); "
            "delete the file to warm-start again"
        ) from None


def _train(
    model: nn.Module,
    num_examples: int,
    example: Callable[[int], tuple[list[int], list[int]]],
    pad_id: int,
    cfg: WarmStartConfig,
    on_progress: Callable[[int, int, float], None] | None,
) -> None:
    """``cfg.steps`` AdamW steps on batches of ``example(i)`` (token ids, target mask), ``i``
    drawn with replacement from ``warm_start.seed``: the mean negative log-likelihood of the
    target tokens."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(cfg.seed)
    device = next(model.parameters()).device
    was_training = model.training
    model.train()
    for step in range(cfg.steps):
        index = torch.randint(num_examples, (cfg.batch_size,), generator=generator).tolist()
        input_ids, attention_mask, target_mask = _batch([example(i) for i in index], pad_id)
        logprobs, _ = token_logprobs(model, input_ids.to(device), attention_mask.to(device))
        target_mask = target_mask.to(device, logprobs.dtype)
        loss = -(logprobs * target_mask).sum() / target_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if on_progress is not None:
            on_progress(step + 1, cfg.steps, loss.item())
    model.train(was_training)


def demonstrations(environment: EnvironmentPart | None) -> dict[str, Any]:
    """The ``warm_start`` keywords of the run's environment (``RunParts.environment``): its
    ``demonstration`` and tools, when it has one (the calculator environment); none otherwise."""
    if environment is None or not hasattr(environment.cls, "demonstration"):
        return {}
    env = environment.build()
    return {"demonstration": env.demonstration, "tools": env.tools}


def _encode(tokenizer, prompt: Prompt) -> tuple[list[int], list[int]]:
    """(prompt + answer + eos token ids, 1 on the answer and eos: the targets)."""
    prompt_ids = encode_prompts([prompt.text], tokenizer)[0]
    answer_ids = tokenizer(prompt.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)


def encode_conversation(tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """A whole conversation's token ids as an episode lays them out, each message appended as the
    chat template's delta, and 1 on the assistant turns' tokens up to their last EOS (what the
    generator samples); 0 on everything else."""
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        prompt_next = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(
            messages[: i + 1], tools=tools or None, add_generation_prompt=prompt_next, tokenize=False
        )
        rendered = encode_prompts([text], tokenizer)[0]
        if rendered[: len(ids)] != ids:
            raise ValueError("warm_start: the chat template renders a conversation differently as it grows")
        new = rendered[len(ids) :]
        trained = [0] * len(new)
        if message["role"] == "assistant" and tokenizer.eos_token_id in new:
            last = len(new) - new[::-1].index(tokenizer.eos_token_id)
            trained[:last] = [1] * last
        ids, mask = ids + new, mask + trained
    return ids, mask


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and the target mask."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    target_mask = torch.zeros((len(examples), width))
    for row, (ids, targets) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        target_mask[row, : len(ids)] = torch.tensor(targets, dtype=torch.float32)
    return input_ids, attention_mask, target_mask


def _cache_key(
    model: nn.Module,
    model_path: str | None,
    tokenizer,
    prompts: Sequence[Prompt],
    cfg: WarmStartConfig,
    conversations: list[list[dict]] | None = None,
    tools: list[dict] | None = None,
) -> str:
    """What determines the warm-started weights: the settings, the tokenizer (its vocabulary and
    chat template), the prompts, the demonstrations as messages with the tools the template shows,
    and the initial weights. The encoded examples follow from these, so they are not rendered to
    find out whether the cache holds the result."""
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
    if conversations is not None:
        digest.update(json.dumps([getattr(tokenizer, "chat_template", None), tools], sort_keys=True).encode())
        for messages in conversations:
            digest.update(json.dumps(messages, sort_keys=True).encode())
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
