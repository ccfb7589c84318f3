"""The trainer's normalization contract: how every algorithm's per-token loss is aggregated.

Normalization contract (docs/loss.md). For token t of sequence i in a step, with loss term l_it,
response mask m_it, response length n_i, G sequences with n_i > 0 and N = sum_i n_i, the step
loss is L = sum_it w_it * m_it * l_it, where w_it depends on the aggregation mode:

    mode                       w_it          = local_it  /  D
    token-mean                 1/N             1            N
    seq-mean-token-mean        1/(G n_i)       1/n_i        G
    seq-mean-token-sum         1/G             1            G
    seq-mean-token-sum-norm    1/(G C)         1/C          G     (C: a configured constant)

``local_it`` depends only on sequence i itself (``local_token_weights``), and ``D`` only on counts
summed over the whole step (``step_normalizer``). Each micro-batch, data-parallel rank and
context-parallel shard back-propagates its own sum_it local_it * m_it * l_it, gradients are
SUMMED over all of them, and the trainer divides once by D. No piece ever divides by a count of
its own, so any split of the step gives the same L. n_i is counted on the full sequence before
any sharding and is never recounted from a shard's mask.

The aggregation is the trainer's, the same for every algorithm (asyncrl/algorithms): an algorithm
returns a per-token loss, and the trainer weighs and normalizes it.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor

from asyncrl.config import AggMode

AGG_MODES: tuple[str, ...] = get_args(AggMode)


def local_token_weights(
    response_mask: Tensor, response_lengths: Tensor, mode: AggMode, norm_constant: float | None = None
) -> Tensor:
    """local_it * m_it as [B, T] in the mask's dtype: the part of w_it known from sequence i alone.

    ``response_lengths`` is n_i of the full sequence, which a shard's mask may only partly cover.
    Rows with n_i = 0 are padding: their mask is 0, and so is their weight.
    """
    lengths = response_lengths.to(response_mask.dtype)
    if mode in ("token-mean", "seq-mean-token-sum"):
        per_sequence = torch.ones_like(lengths)
    elif mode == "seq-mean-token-mean":
        per_sequence = 1 / lengths.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if norm_constant is None or norm_constant <= 0:
            raise ValueError(f"norm_constant: seq-mean-token-sum-norm needs a value > 0, got {norm_constant}")
        per_sequence = torch.full_like(lengths, 1 / norm_constant)
    else:
        raise ValueError(f"mode: '{mode}' is not one of {', '.join(AGG_MODES)}")
    return response_mask * per_sequence[:, None]


def step_normalizer(mode: AggMode, num_response_tokens: int | float, num_sequences: int | float) -> float:
    """D, the step's one divisor: N response tokens for token-mean, else G sequences with n_i > 0.

    Both counts are step-global: summed over every micro-batch and data-parallel rank.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode: '{mode}' is not one of {', '.join(AGG_MODES)}")
    normalizer = float(num_response_tokens if mode == "token-mean" else num_sequences)
    if normalizer <= 0:
        raise ValueError("empty step: no response tokens")
    return normalizer
