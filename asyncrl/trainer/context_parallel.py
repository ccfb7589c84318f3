"""Context parallelism: the tokens of one sequence split across the ranks of a CP group.

Layout (load-balanced head-tail). A row of width T is right-padded to Tp, a multiple of 2·cp, and
cut into 2·cp chunks; rank r holds chunks r and 2·cp-1-r. Causal attention work grows with the
column, so pairing an early chunk with a late one gives every rank the same work. Padding columns
are masked tokens with loss weight 0. With cp = 1 the layout is the identity and adds no padding.

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
rank's slice), and a boolean mask over global columns (key column <= query column, key is a real
token) makes attention causal across the gathered keys. A sliding-window layer also drops keys a
window or more columns back, measured on the same global columns; a layer with attention logit
softcapping (Gemma 2) computes its softcapped scores itself, as sdpa cannot. Only collectives that
gloo and NCCL both have are used, so it runs on CPU and GPU alike; the kernel is transformers' sdpa.

Reductions. Logprobs and entropies are computed from local logits. Token counts and metric sums
are counted on shards and summed over DP × CP; sequence counts are counted on unsharded rows, so
only CP rank 0 contributes them. A per-sequence term that needs the whole sequence goes through
``sequence_sum``, an all-reduce whose backward is again an all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from asyncrl.models.logprobs import SampledDistribution, logits_logprobs, position_ids_from_mask
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


def context_parallel_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    context_parallel_group: dist.ProcessGroup | None = None,
    context_parallel_columns: tuple[Tensor, Tensor] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """sdpa over the keys and values of the whole CP group; the mask is over global columns.

    ``context_parallel_columns`` (the shard's query columns, the gathered keys' columns) place a
    layer's sliding window (Mistral, Gemma, Phi-3) on the global columns; a layer with attention
    logit softcapping (Gemma 2) runs the softcapped attention that sdpa lacks. Called without a
    group (generation, export, a single rank) it is plain sdpa, or softcapped attention.
    """
    key = gather_sequence(key, context_parallel_group, dim=2)
    value = gather_sequence(value, context_parallel_group, dim=2)
    if sliding_window is not None:
        if context_parallel_columns is None:
            raise ValueError("context-parallel attention: a sliding-window layer needs the shard's columns")
        attention_mask = _windowed(attention_mask, *context_parallel_columns, sliding_window)
    if softcap is not None:
        return _softcapped_attention(module, query, key, value, attention_mask, softcap=softcap, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _windowed(mask: Tensor | None, query_columns: Tensor, key_columns: Tensor, window: int) -> Tensor:
    """``mask`` (None: plain causal) restricted to keys fewer than ``window`` columns back, as
    transformers' sliding-window mask is: the padding and causality stay those of ``mask``."""
    distance = query_columns[:, None] - key_columns[None, :]
    near = ((distance >= 0) & (distance < window))[None, None]
    return near if mask is None else mask & near


def _softcapped_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    softcap: float,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, Tensor]:
    """Attention with scores squashed to (-softcap, softcap) by tanh before the mask and softmax,
    computed as Gemma 2's own eager attention computes it (softmax in float32)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:  # causal, the queries being the last columns
        queries, keys = query.shape[2], key.shape[2]
        attention_mask = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)[
            None, None
        ]
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


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
    """This rank's columns of a micro-batch, ready for the model and the loss."""

    def __init__(self, cp: ContextParallel, batch: TrainBatch) -> None:
        self.width = batch.input_ids.shape[1]
        self.padded_width = cp.padded_width(self.width)
        self.columns = head_tail_columns(self.padded_width, cp.size, cp.rank).to(batch.input_ids.device)
        # K/V arrive gathered in rank order, each rank's columns in its own order
        self.key_columns = torch.cat([head_tail_columns(self.padded_width, cp.size, r) for r in range(cp.size)]).to(
            self.columns.device
        )
        full_mask = self._pad(batch.attention_mask)
        self.input_ids = self._pad(batch.input_ids)[:, self.columns]
        self.position_ids = position_ids_from_mask(full_mask)[:, self.columns]
        if cp.size == 1 and bool(full_mask.all()):
            self.attention_mask = None  # plain causal attention: sdpa's causal kernel, as without CP
        else:
            causal = self.key_columns[None, :] <= self.columns[:, None]
            self.attention_mask = (causal[None] & full_mask[:, None, self.key_columns].bool())[:, None]
        self.labels = self.loss_side(batch.input_ids)

    def _pad(self, x: Tensor) -> Tensor:
        return F.pad(x, (0, self.padded_width - self.width))

    def loss_side(self, x: Tensor) -> Tensor:
        """A per-token tensor aligned with ``input_ids``, shifted on the full row, then sharded."""
        return _shift_left(self._pad(x))[:, self.columns]


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

    def shard(self, batch: TrainBatch) -> Shard:
        return Shard(self, batch)

    def logprobs(
        self,
        model: nn.Module,
        shard: Shard,
        *,
        with_entropy: bool,
        entropy_grad: bool = True,
        distribution: SampledDistribution = SampledDistribution(),
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probability (and entropy) of each local label under ``distribution``, from local
        logits only: truncation acts on one position's vocabulary, which a shard holds whole."""
        logits = model(
            input_ids=shard.input_ids,
            attention_mask=shard.attention_mask,
            position_ids=shard.position_ids,
            use_cache=False,
            context_parallel_group=self._collective_group,
            context_parallel_columns=(shard.columns, shard.key_columns),
        ).logits
        return logits_logprobs(
            logits, shard.labels, with_entropy=with_entropy, entropy_grad=entropy_grad, distribution=distribution
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
    ) -> TokenLossInputs:
        """Everything the trainer's loss needs for this rank's shard of ``batch``."""
        shard = self.shard(batch)
        logprobs, entropy = self.logprobs(
            model, shard, with_entropy=with_entropy, entropy_grad=entropy_grad, distribution=distribution
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
            sequence_sum=self.sequence_sum,
        )

    @torch.no_grad()
    def full_logprobs(
        self, model: nn.Module, batch: TrainBatch, *, distribution: SampledDistribution = SampledDistribution()
    ) -> Tensor:
        """Logprobs of the whole rows of ``batch``, aligned with ``input_ids`` (0 at column 0), on
        every rank of the group: each scores its shard, then the shards are gathered and unpermuted."""
        shard = self.shard(batch)
        local, _ = self.logprobs(model, shard, with_entropy=False, distribution=distribution)
        gathered = gather_sequence(local, self._collective_group, dim=1)
        by_label = torch.empty_like(gathered)
        by_label[:, shard.key_columns] = gathered
        return F.pad(by_label[:, : shard.width - 1], (1, 0))

    def sequence_sum(self, values: Tensor) -> Tensor:
        """Per-row sum of ``values`` [B, L] over the whole sequence, on every rank of the group,
        differentiable: the building block of per-sequence terms such as sequence-level IS masks."""
        local = values.sum(-1)
        return local if self._collective_group is None else _AllReduceSum.apply(local, self.group)
