"""Generation: the Generator protocol, sampling parameters and seeds, and the backends behind them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from transformers import PreTrainedModel

from asyncrl.config import RunConfig
from asyncrl.generation.base import (
    Generator,
    GeneratorBase,
    SampleRequest,
    SamplingParams,
    missing_members,
    sample_seed,
)
from asyncrl.generation.hf import HFGenerator
from asyncrl.models.hf import stop_token_ids
from asyncrl.plugins import build_part, resolve, validate_options

if TYPE_CHECKING:
    from asyncrl.data.files import Budget


def takes_request_bound(config: RunConfig) -> bool:
    """Whether the backend ``generation.backend.name`` names declares ``takes_request_bound``: the
    composition root then computes the run's request bound (``asyncrl.workers.generator_request_bound``)
    and hands it to ``build_generator``; for any other backend there is nothing to compute."""
    backend = resolve("backend", config.generation.backend.name, "generation.backend.name")
    return getattr(backend, "takes_request_bound", False)


def build_generator(
    config: RunConfig,
    model: PreTrainedModel,
    tokenizer,
    run_dir: Path | None = None,
    request_bound: tuple[int, Budget] | None = None,
) -> Generator:
    """The generator of the backend ``generation.backend.name`` names (a built-in, hf or vllm, or
    ``package.module:attr``): ``backend(config, model, tokenizer, stop_token_ids, options)``
    (``plugins.build_part``) with ``generation.backend.options`` checked by its ``Options`` model, its
    instance (none without one), stopping on every end token the tokenizer and ``model.path``
    declare (docs/plugins.md). A backend that declares
    ``writes_to_run_dir`` also gets ``run_dir=``, the run's directory (None outside a run); one that
    declares ``takes_request_bound`` also gets ``request_bound=``, the run's longest request as
    ``asyncrl.rollout.context.request_bound`` returns it (the longest first request's tokens and
    the ``Budget`` a request may add to it), which the caller, the composition root, computes
    once (``asyncrl.workers.generator_request_bound``) and must pass for such a backend; any other
    backend never sees it. With ``lora.rank`` > 0 the backend must declare ``takes_lora_adapters``
    (its generator loads the adapter-only weights a LoRA trainer exports). The generator must have
    every member of ``Generator``: deriving it from ``GeneratorBase`` gives each capability its
    default.

    The generator owns ``model``: pass a copy if the trainer keeps training its own. It runs in
    ``trainer.dtype``, the trainer's compute dtype, which is also the dtype of exported weights.
    """
    spec = config.generation.backend.name
    backend = resolve("backend", spec, "generation.backend.name")
    options = validate_options(backend, spec, config.generation.backend.options, "generation.backend.options")
    if config.lora.rank > 0 and not getattr(backend, "takes_lora_adapters", False):
        raise ValueError(
            f"lora.rank: generation.backend.name '{spec}' does not declare takes_lora_adapters, so it cannot load "
            "the adapters a LoRA trainer syncs (docs/plugins.md)"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer.path: the tokenizer has no eos token, so generation could never stop early")
    keywords = {}
    if getattr(backend, "writes_to_run_dir", False):
        keywords["run_dir"] = run_dir
    if getattr(backend, "takes_request_bound", False):
        if request_bound is None:
            raise TypeError(
                f"build_generator: generation.backend.name '{spec}' declares takes_request_bound; pass the run's "
                "request_bound (asyncrl.workers.generator_request_bound)"
            )
        keywords["request_bound"] = request_bound
    stops = stop_token_ids(tokenizer, config.model.path)
    generator = build_part(backend, options, config, model, tokenizer, stops, **keywords)
    missing = missing_members(generator)
    if missing:
        raise ValueError(
            f"generation.backend.name: '{spec}' built a {type(generator).__name__} without {', '.join(missing)} of the "
            "Generator protocol; derive it from asyncrl.generation.GeneratorBase, which gives every capability "
            "its default (docs/generation.md)"
        )
    return generator


__all__ = [
    "Generator",
    "GeneratorBase",
    "HFGenerator",
    "SampleRequest",
    "SamplingParams",
    "build_generator",
    "sample_seed",
    "takes_request_bound",
]
