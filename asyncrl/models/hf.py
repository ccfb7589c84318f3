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


def _first_line(err: Exception, limit: int = 200) -> str:
    """``Type: first line of the message``, cut at ``limit`` characters: one line whatever the library says."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def load_model(
    path: str | Path, *, dtype: torch.dtype | None = None, attn_implementation: str | None = None
) -> PreTrainedModel:
    """The causal LM saved at ``path``, in eval mode.

    Weights load from safetensors only: a directory holding just a pickled ``pytorch_model.bin``
    is refused rather than unpickled. ``dtype=None`` keeps the checkpoint's dtype; ``attn_implementation=None`` lets transformers
    choose (sdpa where available), except that a model with attention logit softcapping (Gemma 2)
    gets eager attention: sdpa cannot softcap, and transformers before 5.21 picks it anyway, silently
    computing a different model.
    """
    directory = _local_dir(path, "config.json")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory,
            dtype="auto" if dtype is None else dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
            use_safetensors=True,
        )
    except Exception as err:  # transformers reports a damaged file with many error types
        raise ValueError(f"{directory}: cannot be loaded as a model ({_first_line(err)})") from None
    if attn_implementation is None and getattr(model.config, "attn_logit_softcapping", None) is not None:
        model.set_attn_implementation("eager")
    return model


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved at ``path``, padding on the left, with a pad token.

    Many causal LM tokenizers ship without a pad token; then EOS doubles as pad. That is safe as
    long as padding is found through the attention mask, never by comparing token ids with pad.
    """
    directory = _local_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as err:
        raise ValueError(f"{directory}: cannot be loaded as a tokenizer ({_first_line(err)})") from None
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
        declared = _declared_end_ids(config_file)
        ids += [declared] if isinstance(declared, int) else list(declared or [])
    return list(dict.fromkeys(ids))


def _declared_end_ids(config_file: Path) -> int | list[int] | None:
    """``eos_token_id`` of a generation_config.json, checked: a damaged file is named, not traced."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file}: cannot be read as JSON ({_first_line(err)})") from None
    declared = config.get("eos_token_id") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not (
        declared is None
        or (isinstance(declared, int) and not isinstance(declared, bool))
        or (isinstance(declared, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in declared))
    ):
        raise ValueError(f"{config_file}: eos_token_id must be a token id or a list of token ids")
    return declared
