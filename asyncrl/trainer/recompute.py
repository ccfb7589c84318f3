"""Activation checkpointing: each transformer block keeps only its inputs and recomputes the rest
of its activations in the backward pass (``trainer.activation_checkpointing``).

Hugging Face's ``gradient_checkpointing_enable`` only acts in train mode, and the trainer scores in
eval mode (dropout off), so the block's ``forward`` is wrapped here instead. Like Hugging Face's,
the wrapper sits inside ``forward``, not ``__call__``: module hooks such as FSDP2's gathers stay
outside the recomputed region. The recomputation runs with the RNG state of the forward and with
the block's modules in the train/eval modes they had in it: LoRA's dropout is switched on for the
loss forward alone (``adapter_dropout``) and is off again when the backward recomputes, so it
drops the same inputs again and the gradients are those of the plain model.
"""

from __future__ import annotations

import types
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules of the classes it names in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute every transformer block's activations in the backward pass."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError("trainer.activation_checkpointing: the model names no transformer blocks (_no_split_modules)")
    for block in blocks:
        block.forward = types.MethodType(_checkpointed_forward, block)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    """The class's forward, checkpointed when a backward may follow (bound to its module, so a
    deep copy of the model binds to the copy); plain under ``no_grad``, where nothing is kept."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    return checkpoint(forward, self, *args, use_reentrant=False, context_fn=lambda: _modes_as_now(self), **kwargs)


def _modes_as_now(block: nn.Module) -> tuple[nullcontext, _Modes]:
    """``checkpoint``'s contexts, made at the forward: none for it; the block's modules in their
    modes of now for the recomputation."""
    return nullcontext(), _Modes({module: module.training for module in block.modules()})


class _Modes:
    """Sets each module's ``training`` flag inside the block and restores the flags it found after."""

    def __init__(self, modes: dict[nn.Module, bool]) -> None:
        self.modes = modes
        self.found: list[dict[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.found.append({module: module.training for module in self.modes})
        for module, training in self.modes.items():
            module.training = training

    def __exit__(self, *exc) -> None:
        for module, training in self.found.pop().items():
            module.training = training
