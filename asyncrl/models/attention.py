"""Attention in autocast's dtype.

Under autocast (``trainer.dtype: bfloat16`` on one rank) the projections run in bfloat16, but the
rotary embedding multiplies them by float32 cos / sin tables, whose dtype follows the float32
residual stream, so the query and key reach attention in float32. Autocast does not cast sdpa, and
in float32 sdpa runs neither the flash kernel nor bfloat16's tensor-core throughput: on an H100 a
long step's attention took the slower float32 kernels. The trainer's attention casts them back.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

AUTOCAST_SDPA = "asyncrl_autocast_sdpa"


def autocast_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors in autocast's dtype when the forward runs under autocast, else as they are."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def autocast_sdpa_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs
) -> tuple[Tensor, None]:
    """transformers' sdpa attention, on inputs in autocast's dtype."""
    return sdpa_attention_forward(module, *autocast_inputs(query, key, value), attention_mask, **kwargs)


AttentionInterface.register(AUTOCAST_SDPA, autocast_sdpa_attention)


def use_autocast_attention(model: nn.Module) -> None:
    """Give a model on transformers' sdpa attention the autocast-aware one; other implementations
    (eager for a softcap, the trainer's own for packing and context parallelism) are kept."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(AUTOCAST_SDPA)
