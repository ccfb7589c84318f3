"""Load a Hugging Face causal LM and tokenizer from a local directory, never from a hub.

A path that is not a local model directory fails at once with a one-line error naming it, instead
of transformers falling back to treating it as a hub repository id.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


def _local_dir(path: str | Path, required_file: str | None = None) -> Path:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a local directory (models load from local paths only)")
    if required_file is not None and not (directory / required_file).is_file():
        raise FileNotFoundError(f"{directory}: no {required_file}, so this is not a Hugging Face model directory")
    return directory


def load_model(
    path: str | Path, *, dtype: torch.dtype | None = None, attn_implementation: str | None = None
) -> PreTrainedModel:
    """The causal LM saved at ``path``, in eval mode.

    Weights load from safetensors only: a directory holding just a pickled ``pytorch_model.bin``
    is refused rather than unpickled. ``dtype=None`` keeps the checkpoint's dtype; ``attn_implementation=None`` lets transformers
    choose (sdpa where available).
    """
    directory = _local_dir(path, "config.json")
    return AutoModelForCausalLM.from_pretrained(
        directory,
        dtype="auto" if dtype is None else dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
        use_safetensors=True,
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved at ``path``, padding on the left, with a pad token.

    Many causal LM tokenizers ship without a pad token; then EOS doubles as pad. That is safe as
    long as padding is found through the attention mask, never by comparing token ids with pad.
    """
    tokenizer = AutoTokenizer.from_pretrained(_local_dir(path), local_files_only=True)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"{path}: the tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: str | Path | None = None) -> list[int]:
    """Every token that ends a response: the tokenizer's EOS and each ``eos_token_id`` (one id or a
    list) in ``model_path``'s generation_config.json. Chat models list their end of turn there, and
    a generator stopping only on EOS would run every such answer to its length limit."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    config_file = None if model_path is None else Path(model_path).expanduser() / "generation_config.json"
    if config_file is not None and config_file.is_file():
        declared = json.loads(config_file.read_text()).get("eos_token_id")
        ids += [declared] if isinstance(declared, int) else list(declared or [])
    return list(dict.fromkeys(ids))
