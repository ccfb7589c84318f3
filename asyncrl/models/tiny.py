"""A tiny, seeded causal LM (Qwen2 or Llama layout) that trains on a laptop CPU.

The defaults give about 1.6M parameters with the character vocabulary. Attention is "sdpa": it is
deterministic on CPU, supports float64, and keeps fully masked rows (left padding) finite, whereas
transformers' "eager" path runs its softmax in float32, turning float64's mask value into -inf and
a left-padded float64 row into NaN.
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen2Config

ATTN_IMPLEMENTATION = "sdpa"
_CONFIG_CLASSES = {"qwen2": Qwen2Config, "llama": LlamaConfig}


def tiny_config(
    vocab_size: int,
    *,
    arch: Literal["qwen2", "llama"] = "qwen2",
    hidden_size: int = 192,
    num_layers: int = 4,
    num_heads: int = 6,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 1024,
) -> PretrainedConfig:
    """The transformers config of a tiny model with tied input and output embeddings."""
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"tiny_config: arch {arch!r} is not one of {sorted(_CONFIG_CLASSES)}")
    return _CONFIG_CLASSES[arch](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        attn_implementation=ATTN_IMPLEMENTATION,
    )


def build_tiny_model(vocab_size: int, *, seed: int, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A freshly initialized tiny model; the same seed gives bit-identical weights.

    ``overrides`` are ``tiny_config`` keywords. The seed is applied to a forked RNG, so building a
    model leaves the caller's global torch RNG untouched.
    """
    config = tiny_config(vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
