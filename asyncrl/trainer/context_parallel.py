"""Context parallelism: the tokens of one sequence split across the ranks of a CP group.

Layout (load-balanced head-tail). A row of width T is right-padded to Tp, a multiple of 2·cp, and
cut into 2·cp chunks; rank r holds chunks r and 2·cp-1-r. Causal attention work grows with the
column, so pairing an early chunk with a late one gives every rank the same work. Padding columns
follow every real token and carry loss weight 0. With cp = 1 the layout is the identity and adds
no padding.

Shift before shard. Column t predicts the token at column t+1. Labels and every loss-side tensor
(loss mask, loss weights, advantages, proximal, reference and behaviour logprobs) are shifted left
by one on the full row, then every per-token tensor is taken at this rank's columns with the same
index. Shifting after sharding would pair the last column of a chunk with the first column of the
next chunk *held locally*, which is a different part of the sequence.

Slot order. A shard's loss side is rotated right by one slot, so slot j holds the token that slot
j-1 predicts. The loss is elementwise, so the rotation changes nothing but the order of sums; with
cp = 1 it makes every tensor coincide with the unsharded layout, and the CP path is bit-identical
to the plain one.

Attention. Each rank projects Q, K, V for its own columns, applying RoPE at the global positions;
K and V are all-gathered over the CP group (backward: all-reduce the gradient, then keep this
rank's slice). Rows are right-padded, so causality by global column keeps every real token from
the padding and no padding mask exists. The gathered keys are put in column order and the queries
go in blocks of consecutive columns (a shard's two chunks, cut to ``QUERY_BLOCK``), each over its
causal prefix with sdpa and a block-local mask under ``torch.utils.checkpoint``: a layer keeps
its inputs for the backward, nothing of size T², and a block's mask lives only while the block
runs. A sliding-window layer starts its prefix a window back, on the same global columns; a layer
with attention logit softcapping (Gemma 2) computes its block's softcapped scores itself, as sdpa
cannot. One rank with neither takes sdpa's causal path. A packed row (``trainer.packing``) is
sharded like any row; its attention stays within each sequence, from the segment starts the
shard passes, and its per-token tensors are packed before the shift (``Shard``). Only collectives
that gloo and NCCL both have are used, so it runs on CPU and GPU alike.

Reductions. Logprobs and entropies are computed from local hidden states, a chunk of tokens at a
time (models/logprobs.py). Token counts and metric sums are counted on shards and summed over
DP × CP; sequence counts are counted on unsharded rows, so only CP rank 0 contributes them. A
per-sequence term that needs the whole sequence goes through ``sequence_sum``, an all-reduce
whose backward is again an all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from asyncrl.models.attention import autocast_inputs
from asyncrl.models.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    SampledDistribution,
    model_logprobs,
    position_ids_from_mask,
    right_padded,
)
from asyncrl.models.packing import Packing
from asyncrl.types import TokenLossInputs, TrainBatch

ATTN_IMPLEMENTATION = "asyncrl_context_parallel"


# ---- collectives with their exact backward ------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """Concatenate every rank's slice along ``dim``; the gradient is summed over ranks, then sliced."""

    @staticmethod
    def forward(ctx, local: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim, ctx.size = group, dim, local.shape[dim]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.size
        return grad.narrow(ctx.dim, start, ctx.size), None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks, replicated on each; every rank's loss uses it, so the gradient is a sum too."""

    @staticmethod
    def forward(ctx, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def gather_sequence(local: Tensor, group: dist.ProcessGroup | None, dim: int) -> Tensor:
    """All ranks' slices concatenated in rank order along ``dim`` (identity without a group)."""
    return local if group is None else _GatherSequence.apply(local, group, dim)


# ---- attention ----------------------------------------------------------------------------------

QUERY_BLOCK = 1024  # queries per block: a block's transient mask is QUERY_BLOCK x its key prefix


def context_parallel_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    context_parallel_group: dist.ProcessGroup | None = None,
    context_parallel_columns: tuple[Tensor, Tensor] | None = None,
    packed_segments: Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """Causal attention over the keys and values of the whole CP group, by global column.

    Rows are right-padded, so causality alone keeps every real token from the padding: there is no
    padding mask. A packed row (models/packing.py) gives ``packed_segments``, the global column
    where each column's segment starts, and no query sees a key before it. One rank with neither
    a sliding window nor a softcap takes sdpa's causal path (once per segment of a packed row).
    Otherwise ``blockwise_attention`` runs: a layer's sliding window (Mistral, Gemma, Phi-3) and
    its logit softcapping (Gemma 2) are applied there, on the global columns that
    ``context_parallel_columns`` (the shard's query columns, the gathered keys' columns) give.
    Without them the queries are the last columns of the keys, as in a cached decode.
    """
    if attention_mask is not None:
        raise ValueError("context-parallel attention: rows are right-padded and need no attention mask")
    query, key, value = autocast_inputs(query, key, value)
    key = gather_sequence(key, context_parallel_group, dim=2)
    value = gather_sequence(value, context_parallel_group, dim=2)
    if context_parallel_group is None and sliding_window is None and softcap is None:
        attend = partial(sdpa_attention_forward, module, scaling=scaling, dropout=dropout, **kwargs)
        if packed_segments is None:
            return attend(query, key, value, None)
        return per_segment(attend, query, key, value, packed_segments), None
    if context_parallel_columns is None:
        if context_parallel_group is not None:
            raise ValueError("context-parallel attention: a CP group needs the shard's columns")
        keys = torch.arange(key.shape[2], device=key.device)
        context_parallel_columns = (keys[key.shape[2] - query.shape[2] :], keys)
    output = blockwise_attention(
        query,
        key,
        value,
        *context_parallel_columns,
        segments=packed_segments,
        window=sliding_window,
        softcap=softcap,
        scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
        dropout=dropout if module.training else 0.0,
    )
    return output.transpose(1, 2).contiguous(), None


T = TypeVar("T")
_ON_HOST = WeakIdKeyDictionary()  # an index tensor -> what was read from it to the host


def once_per_tensor(tensor: Tensor, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()`` once per (``tensor``, ``key``) while ``tensor`` lives. Every layer of a
    forward, and the backward's recomputation, gets the same index tensors (a shard's columns, a
    packed row's segment starts); reading them to the host syncs the device and walks the
    columns in Python, so a micro-batch pays it once instead of twice per layer. A tensor in ``key``
    is held with the value, so its identity cannot be reused while the entry lives."""
    memo = _ON_HOST.setdefault(tensor, {})
    held = tuple(id(k) if isinstance(k, Tensor) else k for k in key) if isinstance(key, tuple) else key
    if held not in memo:
        memo[held] = (key, compute())
    return memo[held][1]


def _segment_starts(segments: Tensor) -> list[int]:
    return (segments == torch.arange(len(segments), device=segments.device)).nonzero().flatten().tolist()


def per_segment(attend, query: Tensor, key: Tensor, value: Tensor, segments: Tensor) -> Tensor:
    """``attend`` (sdpa's causal path) over each segment of a packed row alone, outputs concatenated
    along the sequence ([B, T, H, D], as sdpa's forward returns them)."""
    starts = once_per_tensor(segments, "starts", lambda: _segment_starts(segments))
    bounds = zip(starts, [*starts[1:], len(segments)])
    return torch.cat([attend(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None)[0] for a, b in bounds], dim=1)


def blockwise_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    query_columns: Tensor,
    key_columns: Tensor,
    *,
    window: int | None,
    softcap: float | None,
    scaling: float,
    dropout: float = 0.0,
    block: int | None = None,
    segments: Tensor | None = None,
) -> Tensor:
    """Causal attention of ``query`` [B, H, Q, D] at ``query_columns`` over ``key`` and ``value``
    [B, KV heads, K, D] at ``key_columns`` (a permutation of 0..K-1), as [B, H, Q, D].

    Keys are put in column order; queries go in blocks of at most ``block`` consecutive columns
    of one segment (``segments``: each column's segment start; None: one segment), each over its
    causal prefix from the segment's start (from a window back, with a window) under
    ``torch.utils.checkpoint``, so that a layer keeps only its inputs for the backward and a
    block's mask (and softcapped scores) live only while the block runs. A dense mask over the
    gathered keys would be [B, 1, Q, K]: every layer would keep a float copy of it.
    """
    order = key_columns.argsort()
    key, value = key[:, :, order], value[:, :, order]
    starts = None if segments is None else once_per_tensor(segments, "columns", segments.tolist)
    block = block or QUERY_BLOCK
    runs = once_per_tensor(query_columns, ("runs", block, segments), lambda: _runs(query_columns, block, starts))
    outputs = []
    for start, end, column in runs:
        stop = column + end - start
        first = 0 if starts is None else starts[column]
        if window is not None:
            first = max(first, column - window + 1)
        outputs.append(
            checkpoint(
                _attend_block,
                query[:, :, start:end],
                key[:, :, first:stop],
                value[:, :, first:stop],
                column - first,
                window,
                softcap,
                scaling,
                dropout,
                use_reentrant=False,
            )
        )
    return torch.cat(outputs, dim=2)


def _runs(columns: Tensor, block: int, segments: list[int] | None = None) -> list[tuple[int, int, int]]:
    """(first slot, end slot, first column) of each run of at most ``block`` slots whose columns
    follow one another in one segment: a head-tail shard has two runs of consecutive columns, cut
    into blocks and at the segment starts of a packed row."""
    cols = columns.tolist()
    runs, start = [], 0
    for slot in range(1, len(cols) + 1):
        if (
            slot == len(cols)
            or cols[slot] != cols[slot - 1] + 1
            or slot - start == block
            or (segments is not None and segments[cols[slot]] == cols[slot])
        ):
            runs.append((start, slot, cols[start]))
            start = slot
    return runs


def _attend_block(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    offset: int,
    window: int | None,
    softcap: float | None,
    scaling: float,
    dropout: float,
) -> Tensor:
    """Query i of the block sits ``offset + i`` keys in: it sees keys up to there (and fewer than
    ``window`` back). Scores are softcapped as Gemma 2's eager attention does (softmax in float32)."""
    query_at = torch.arange(offset, offset + query.shape[2], device=query.device)
    distance = query_at[:, None] - torch.arange(key.shape[2], device=query.device)
    visible = distance >= 0 if window is None else (distance >= 0) & (distance < window)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if softcap is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, dropout_p=dropout, scale=scaling)
    scores = softcap * torch.tanh(query @ key.transpose(2, 3) * scaling / softcap)
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return F.dropout(weights, p=dropout) @ value


AttentionInterface.register(ATTN_IMPLEMENTATION, context_parallel_attention)


def enable_context_parallel_attention(model: nn.Module) -> None:
    """Route the model's attention through ``context_parallel_attention``."""
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


# ---- layout -------------------------------------------------------------------------------------


def head_tail_columns(width: int, size: int, rank: int) -> Tensor:
    """Columns of a row held by ``rank``: chunks rank and 2·size-1-rank (``width``: a multiple of 2·size)."""
    if size == 1:
        return torch.arange(width)
    chunk = width // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat([head, tail])


def _shift_left(x: Tensor) -> Tensor:
    """Column t takes column t+1's value; the last column gets 0 (it predicts nothing)."""
    return F.pad(x[:, 1:], (0, 1))


class Shard:
    """This rank's columns of a micro-batch, ready for the model and the loss.

    ``packed``: the rows' real tokens are first concatenated into one row (models/packing.py),
    which is then padded and sharded like any row; every per-token tensor is packed the same way,
    with a segment's first column, which nothing of its row predicts, set to 0 as an unpacked
    row's column 0 drops out. Padding columns are segments of their own."""

    def __init__(self, cp: ContextParallel, batch: TrainBatch, packed: bool = False) -> None:
        if not packed and not right_padded(batch.attention_mask):
            raise ValueError("context parallelism: rows must be right-padded (real tokens first)")
        self.packing = Packing.of(batch.attention_mask) if packed else None
        ids = batch.input_ids if self.packing is None else self.packing.pack(batch.input_ids)
        self.width = ids.shape[1]
        self.padded_width = cp.padded_width(self.width)
        self.columns = head_tail_columns(self.padded_width, cp.size, cp.rank).to(ids.device)
        # K/V arrive gathered in rank order, each rank's columns in its own order
        self.key_columns = torch.cat([head_tail_columns(self.padded_width, cp.size, r) for r in range(cp.size)]).to(
            self.columns.device
        )
        self.input_ids = self._pad(ids)[:, self.columns]
        self.attention_mask = None  # causal attention by global column: padding follows every real token
        if self.packing is None:
            self.position_ids = position_ids_from_mask(self._pad(batch.attention_mask))[:, self.columns]
            self.segments = None
        else:
            self.position_ids = self._pad(self.packing.position_ids)[:, self.columns]
            own = torch.arange(self.width, self.padded_width, device=ids.device)
            self.segments = torch.cat([self.packing.segment_starts, own])
        self.labels = self.loss_side(batch.input_ids)

    def _pad(self, x: Tensor) -> Tensor:
        return F.pad(x, (0, self.padded_width - self.width))

    def _row(self, x: Tensor) -> Tensor:
        """A per-token tensor [B, T] on this layout's row(s) (packed: its segments' first columns 0)."""
        if self.packing is None:
            return x
        return self.packing.pack(x).masked_fill(self.packing.first_columns(), 0)

    def loss_side(self, x: Tensor) -> Tensor:
        """A per-token tensor aligned with ``input_ids``, shifted on the full row, then sharded."""
        return _shift_left(self._pad(self._row(x)))[:, self.columns]

    def unshard(self, by_label: Tensor) -> Tensor:
        """Scores of the whole (padded) row by label column back as the batch's rows, aligned with
        ``input_ids`` (0 at each sequence's first token)."""
        aligned = F.pad(by_label[:, : self.width - 1], (1, 0))
        if self.packing is None:
            return aligned
        return self.packing.unpack(aligned.masked_fill(self.packing.first_columns(), 0.0))

    def segment_ids(self) -> Tensor | None:
        """[1, L] on the loss side (as ``loss_side`` places it): 1 + the row of the token each slot
        predicts, 0 where it predicts none; None unpacked."""
        if self.packing is None:
            return None
        rows = torch.arange(1, len(self.packing.lengths) + 1, device=self.columns.device)
        return self.loss_side(rows[:, None].expand_as(self.packing.real))


class ContextParallel:
    """One rank's view of its CP group (``group`` None: a single rank, no collectives)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    @property
    def _collective_group(self) -> dist.ProcessGroup | None:
        """The group to gather and reduce over; None for a single rank, whose collectives are identities."""
        return self.group if self.size > 1 else None

    def padded_width(self, width: int) -> int:
        """The smallest multiple of 2·cp that holds ``width`` columns (``width`` itself for cp = 1)."""
        if self.size == 1:
            return width
        return -(-width // (2 * self.size)) * (2 * self.size)

    def shard(self, batch: TrainBatch, packed: bool = False) -> Shard:
        return Shard(self, batch, packed)

    def logprobs(
        self,
        model: nn.Module,
        shard: Shard,
        *,
        with_entropy: bool,
        entropy_grad: bool = True,
        distribution: SampledDistribution = SampledDistribution(),
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probability (and entropy) of each local label under ``distribution``, from local
        hidden states only, ``chunk_tokens`` at a time: truncation acts on one position's
        vocabulary, which a shard holds whole."""
        return model_logprobs(
            model,
            shard.labels,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            distribution=distribution,
            chunk_tokens=chunk_tokens,
            input_ids=shard.input_ids,
            attention_mask=shard.attention_mask,
            position_ids=shard.position_ids,
            context_parallel_group=self._collective_group,
            context_parallel_columns=(shard.columns, shard.key_columns),
            packed_segments=shard.segments,
        )

    def counts(self, batch: TrainBatch, response_mask: Tensor) -> tuple[Tensor, Tensor]:
        """(tokens in this shard, sequences of the unsharded rows on CP rank 0 only): both are
        then summed over DP × CP, which counts every token and every sequence once."""
        sequences = (batch.response_lengths > 0).sum().to(response_mask.dtype)
        return response_mask.sum(), sequences if self.rank == 0 else torch.zeros_like(sequences)

    def loss_inputs(
        self,
        model: nn.Module,
        batch: TrainBatch,
        weights: Tensor,
        *,
        with_entropy: bool,
        entropy_grad: bool = True,
        distribution: SampledDistribution = SampledDistribution(),
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        packed: bool = False,
    ) -> TokenLossInputs:
        """Everything the trainer's loss needs for this rank's shard of ``batch`` (``packed``: of
        its rows packed into one, see ``Shard``)."""
        shard = self.shard(batch, packed)
        logprobs, entropy = self.logprobs(
            model,
            shard,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            distribution=distribution,
            chunk_tokens=chunk_tokens,
        )

        def loss_side(x: Tensor | None) -> Tensor | None:  # rotated one slot right: "Slot order" above
            return None if x is None else shard.loss_side(x).roll(1, dims=-1)

        response_mask = loss_side(batch.response_mask)
        num_tokens, num_sequences = self.counts(batch, response_mask)
        return TokenLossInputs(
            logprobs=logprobs.roll(1, dims=-1),
            entropy=None if entropy is None else entropy.roll(1, dims=-1),
            old_logprobs=loss_side(batch.prox_logprobs),
            behaviour_logprobs=loss_side(batch.behaviour_logprobs),
            advantages=loss_side(batch.advantages[:, None].expand_as(batch.response_mask)),
            ref_logprobs=loss_side(batch.ref_logprobs),
            response_mask=response_mask,
            weights=loss_side(weights),
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            sequence_sum=self.sequence_sum if shard.packing is None else partial(self.segment_sum, shard),
        )

    @torch.no_grad()
    def full_logprobs(
        self,
        model: nn.Module,
        batch: TrainBatch,
        *,
        distribution: SampledDistribution = SampledDistribution(),
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        packed: bool = False,
    ) -> Tensor:
        """Logprobs of the whole rows of ``batch``, aligned with ``input_ids`` (0 at column 0), on
        every rank of the group: each scores its shard, then the shards are gathered and unpermuted."""
        shard = self.shard(batch, packed)
        local, _ = self.logprobs(model, shard, with_entropy=False, distribution=distribution, chunk_tokens=chunk_tokens)
        gathered = gather_sequence(local, self._collective_group, dim=1)
        by_label = torch.empty_like(gathered)
        by_label[:, shard.key_columns] = gathered
        return shard.unshard(by_label)

    def sequence_sum(self, values: Tensor) -> Tensor:
        """Each token's sum of ``values`` [B, L] over its whole sequence (row), on every rank of the
        group, differentiable: the building block of per-sequence terms such as sequence-level IS
        masks."""
        return self.reduce_shard_sums(values.sum(-1, keepdim=True)).expand_as(values)

    def segment_sum(self, shard: Shard, values: Tensor) -> Tensor:
        """``sequence_sum`` on a packed shard's loss side [1, L]: sums by segment, reduced over the
        group, given back to each slot of the segment (slots that predict nothing get segment 0's)."""
        ids = shard.segment_ids().roll(1, dims=-1)[0]  # the loss side's slot order
        local = values.new_zeros(len(shard.packing.lengths) + 1).index_add(0, ids, values[0])
        return self.reduce_shard_sums(local)[ids][None]

    def reduce_shard_sums(self, local: Tensor) -> Tensor:
        """This shard's per-sequence sums summed over the group (differentiable): every rank holds a
        part of each sequence."""
        return local if self._collective_group is None else _AllReduceSum.apply(local, self.group)
