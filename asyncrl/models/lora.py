"""LoRA adapters over a frozen base, built with peft (``lora`` section, docs/lora.md).

The base keeps the dtype it is given (the run's ``trainer.dtype``) and gets no gradient; peft
adds low-rank A and B matrices to the named projections, in float32 over a bfloat16 or float32
base and in float64 over a float64 one, so the trainable parameters and their AdamW state are
full-precision masters.

Adapters travel under PEFT's own names (``get_peft_model_state_dict``: no adapter name in them),
the names ``adapter_model.safetensors`` holds, so the same dict is a weight sync, a checkpoint and
what an inference server loads. ``adapter_tensors`` returns them as views of the model's own
tensors: a generator copies a sync straight into them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Protocol

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from torch import Tensor, nn

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


class LoraSettings(Protocol):
    """What the ``lora`` config section provides."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]


def peft_config(settings: LoraSettings, *, random_b: bool = False) -> LoraConfig:
    """peft's LoraConfig for ``settings``. B starts at zero, so the wrapped model starts as the base;
    ``random_b`` draws it at random instead (a check whose adapter must already move the output)."""
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        init_lora_weights=not random_b,
        task_type="CAUSAL_LM",
    )


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Every target names a linear layer of ``model``; otherwise one line naming the ones it has."""
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    for target in targets:
        if target not in linear:
            raise ValueError(
                f"lora.target_modules: '{target}' is not a linear layer of the model (it has {', '.join(linear)})"
            )


def apply_lora(model: nn.Module, settings: LoraSettings, dtype: torch.dtype, *, random_b: bool = False) -> PeftModel:
    """``model`` (changed in place) as a PeftModel: its base cast to ``dtype`` and frozen, adapters
    trainable in float32, or float64 over a float64 base. Draws the A matrices from the torch RNG."""
    check_targets(model, settings.target_modules)
    model.to(dtype)
    return get_peft_model(model, peft_config(settings, random_b=random_b), autocast_adapter_dtype=True)


def adapter_tensors(model: nn.Module, state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The adapter's tensors of ``model`` (a PeftModel), under PEFT's names. ``state``: the model's
    state dict to take them from (a wrapped model's sharded one), else ``model.state_dict()``."""
    return get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False)


def model_names(model: nn.Module) -> dict[str, str]:
    """PEFT's name of each adapter tensor -> its name in ``model.state_dict()``."""
    state = model.state_dict()
    by_identity = {id(tensor): name for name, tensor in state.items()}
    return {peft_name: by_identity[id(tensor)] for peft_name, tensor in adapter_tensors(model, state).items()}


def is_lora(model: nn.Module) -> bool:
    return isinstance(model, PeftModel)


@contextlib.contextmanager
def adapter_dropout(model: nn.Module) -> Iterator[None]:
    """LoRA's dropout active inside the block, on a model kept in eval mode: the loss forward
    drops adapter inputs (``lora.dropout``); every other score runs without it."""
    dropouts = [m for name, m in model.named_modules() if ".lora_dropout." in f".{name}." and m is not None]
    for module in dropouts:
        module.train()
    try:
        yield
    finally:
        for module in dropouts:
            module.eval()
