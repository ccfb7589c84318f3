"""Build the tokenizer and policy model a run config asks for: a local HF model, or the tiny one."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.config import RunConfig
from asyncrl.models.hf import load_model, load_tokenizer
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.tokenizer import build_char_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def master_dtype(name: str) -> torch.dtype:
    """The dtype parameters are stored and trained in: float64 for float64, float32 otherwise
    (bfloat16 is a compute dtype only, see ``trainer.dtype``)."""
    return torch.float64 if name == "float64" else torch.float32


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when a GPU is visible, else CPU; asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device: cuda was requested but no CUDA device is available")
    return torch.device(name)


def build_tokenizer(config: RunConfig) -> PreTrainedTokenizerBase:
    """``tokenizer.path``, else the tokenizer saved with ``model.path``, else the char tokenizer
    (with its chat template when episodes run against an environment)."""
    path = config.tokenizer.path or config.model.path
    return load_tokenizer(path) if path is not None else build_char_tokenizer(chat=config.environment.name is not None)


def build_model(config: RunConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The policy with ``master_dtype`` parameters on ``trainer.device``, checked against the
    tokenizer; a generator casts its copy to ``trainer.dtype`` (``build_generator``)."""
    dtype = master_dtype(config.trainer.dtype)
    if config.model.path is not None:
        model = load_model(config.model.path, dtype=dtype)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"tokenizer.path: {len(tokenizer)} tokens but the model at {config.model.path} embeds only "
                f"{model.get_input_embeddings().num_embeddings}"
            )
    else:
        m = config.model
        model = build_tiny_model(
            len(tokenizer),
            seed=m.init_seed,
            dtype=dtype,
            arch=m.arch,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size,
        )
    return model.to(resolve_device(config.trainer.device))
