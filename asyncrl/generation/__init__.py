"""Generation: the Generator protocol, sampling parameters and seeds, and the backends behind them."""

from __future__ import annotations

from transformers import PreTrainedModel

from asyncrl.config import RunConfig
from asyncrl.generation.base import Generator, SampleRequest, SamplingParams, sample_seed
from asyncrl.generation.hf import HFGenerator
from asyncrl.models.factory import DTYPES
from asyncrl.models.hf import stop_token_ids


def build_generator(config: RunConfig, model: PreTrainedModel, tokenizer) -> Generator:
    """The backend ``generation.backend`` names ("hf" or "vllm"), batch size from ``generation``,
    stopping on every end token the tokenizer and ``model.path`` declare.

    The generator owns ``model``: pass a copy if the trainer keeps training its own. It runs in
    ``trainer.dtype``, the trainer's compute dtype, which is also the dtype of exported weights.
    """
    if config.generation.backend not in ("hf", "vllm"):
        raise ValueError(f"generation.backend: unknown backend {config.generation.backend!r}; known: ['hf', 'vllm']")
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer.path: the tokenizer has no eos token, so generation could never stop early")
    stops = stop_token_ids(tokenizer, config.model.path)
    if config.generation.backend == "vllm":
        from asyncrl.generation.vllm import build_vllm_generator  # imported only when used

        return build_vllm_generator(config, model, tokenizer, stops)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFGenerator(
        model.to(DTYPES[config.trainer.dtype]),
        stop_token_ids=stops,
        pad_token_id=pad_token_id,
        batch_size=config.generation.batch_size,
    )


__all__ = ["Generator", "HFGenerator", "SampleRequest", "SamplingParams", "build_generator", "sample_seed"]
