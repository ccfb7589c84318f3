"""Models and tokenizers: a tiny seeded model and char tokenizer, local HF loading, token logprobs."""

from asyncrl.models.factory import build_model, build_tokenizer, resolve_device
from asyncrl.models.hf import load_model, load_tokenizer, stop_token_ids
from asyncrl.models.logprobs import SampledDistribution, position_ids_from_mask, token_logprobs
from asyncrl.models.tiny import ATTN_IMPLEMENTATION, build_tiny_model, tiny_config
from asyncrl.models.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DEFAULT_ALPHABET",
    "SampledDistribution",
    "build_char_tokenizer",
    "build_model",
    "build_tokenizer",
    "build_tiny_model",
    "load_model",
    "load_tokenizer",
    "position_ids_from_mask",
    "resolve_device",
    "stop_token_ids",
    "tiny_config",
    "token_logprobs",
]
