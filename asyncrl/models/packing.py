"""Padding-free packing: the real tokens of a micro-batch's rows, concatenated into one row.

A padded micro-batch of B rows runs every layer over B x T columns, the longest row's width for
each; packed, the same layers run over the N real tokens alone. Each row becomes a segment of the
packed row, its positions restart at 0, and attention is confined to its segment by the attention
kernel (trainer/context_parallel.py), from each column's segment start: no mask is built.

Only the model's forward is packed. Scores come back in the rows' own layout (``unpack``), so the
loss, its weights and its counts see the same tensors as without packing; under context
parallelism every per-token tensor is packed the same way before it is shifted and sharded
(``pack``), so it follows the labels across segment boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """Where each row's real tokens go in the packed row. Rows may be right- or left-padded (any
    mask whose real tokens are the row's tokens in order); a row without a real token is an empty
    segment."""

    real: Tensor  # [B, T] bool, the real tokens
    lengths: Tensor  # [B] int64, real tokens per row: the segments' lengths

    @classmethod
    def of(cls, attention_mask: Tensor) -> Packing:
        real = attention_mask.bool()
        return cls(real=real, lengths=real.sum(1))

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def segment_ids(self) -> Tensor:
        """[N] the row each packed column comes from."""
        return torch.repeat_interleave(torch.arange(len(self.lengths), device=self.lengths.device), self.lengths)

    @property
    def segment_starts(self) -> Tensor:
        """[N] the packed column where each column's segment begins."""
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        return torch.repeat_interleave(starts, self.lengths)

    @property
    def position_ids(self) -> Tensor:
        """[1, N] positions that restart at 0 in every segment, as each row would count alone."""
        columns = torch.arange(self.num_tokens, device=self.lengths.device)
        return (columns - self.segment_starts)[None]

    def pack(self, x: Tensor) -> Tensor:
        """``x`` [B, T] aligned with the rows' tokens, or [B] per row, as [1, N] on the packed row."""
        if x.dim() == 1:
            return torch.repeat_interleave(x, self.lengths)[None]
        return x[self.real][None]

    def unpack(self, x: Tensor) -> Tensor:
        """``x`` [1, N] on the packed row back in the rows' layout [B, T], 0 off the real tokens
        (differentiable)."""
        return x.new_zeros(self.real.shape).masked_scatter(self.real, x[0])

    def first_columns(self) -> Tensor:
        """[1, N] True where a segment begins: a column that predicts nothing of its own row."""
        columns = torch.arange(self.num_tokens, device=self.lengths.device)
        return (columns == self.segment_starts)[None]
