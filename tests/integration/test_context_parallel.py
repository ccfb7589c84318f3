"""Context-parallel layout, shift-before-shard and the cp = 1 identity with the plain trainer path."""

import copy
import io
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from asyncrl.config import ParallelConfig
from asyncrl.models import SampledDistribution, position_ids_from_mask, token_logprobs
from asyncrl.tools.verify import DISTRIBUTION, StepOutcome, UntruncatedCP, build_problem, uneven_split
from asyncrl.trainer import PolicyTrainer
from asyncrl.trainer.context_parallel import (
    ATTN_IMPLEMENTATION,
    ContextParallel,
    blockwise_attention,
    enable_context_parallel_attention,
    head_tail_columns,
)
from asyncrl.trainer.parallel import init_parallel, launch


def layout_view(size: int, rank: int) -> ContextParallel:
    """A group's layout as rank ``rank`` sees it, without collectives (shards only, no forward)."""
    cp = ContextParallel()
    cp.size, cp.rank = size, rank
    return cp


def test_head_tail_pairs_an_early_chunk_with_a_late_one():
    assert head_tail_columns(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert head_tail_columns(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert head_tail_columns(16, 4, 3).tolist() == [6, 7, 8, 9]
    for size in (1, 2, 4):
        columns = torch.cat([head_tail_columns(24, size, r) for r in range(size)])
        assert sorted(columns.tolist()) == list(range(24))
    assert head_tail_columns(7, 1, 0).tolist() == list(range(7))


def test_padding_to_a_multiple_of_two_cp_only_when_there_are_several_ranks():
    assert layout_view(2, 0).padded_width(13) == 16
    assert layout_view(4, 1).padded_width(17) == 24
    assert layout_view(4, 1).padded_width(16) == 16
    assert ContextParallel().padded_width(13) == 13


@pytest.mark.parametrize("size", [2, 4])
def test_shards_shift_on_the_full_row_and_reassemble_it(size):
    model, batch, *_ = build_problem("token-mean", torch.float64, 0)
    width = batch.input_ids.shape[1]
    padded = layout_view(size, 0).padded_width(width)
    labels = torch.zeros(len(batch), padded, dtype=torch.long)
    loss_mask = torch.zeros(len(batch), padded, dtype=batch.response_mask.dtype)
    for rank in range(size):
        shard = layout_view(size, rank).shard(batch)
        assert shard.input_ids.shape[1] == padded // size
        labels[:, shard.columns] = shard.labels
        loss_mask[:, shard.columns] = shard.loss_side(batch.response_mask)
        assert torch.equal(shard.input_ids, F.pad(batch.input_ids, (0, padded - width))[:, shard.columns])
        assert shard.attention_mask is None  # right-padded rows: causality by global column is enough
    assert torch.equal(labels[:, : width - 1], batch.input_ids[:, 1:])
    assert torch.equal(loss_mask[:, : width - 1], batch.response_mask[:, 1:])
    assert loss_mask[:, width - 1 :].sum() == 0  # padding columns carry weight 0
    assert loss_mask.sum() == batch.response_mask.sum()


def test_positions_are_global_so_rope_sees_the_unsharded_sequence():
    model, batch, *_ = build_problem("token-mean", torch.float64, 0)
    shard = layout_view(2, 1).shard(batch)
    real = F.pad(batch.attention_mask, (0, shard.padded_width - shard.width))[:, shard.columns].bool()
    assert torch.equal(shard.position_ids[real], shard.columns.expand_as(real)[real])


def test_a_response_spans_both_chunks_of_a_rank():
    """The verification batch puts a response across a rank's chunk seam, so the shift is tested there."""
    model, batch, *_ = build_problem("token-mean", torch.float64, 0)
    for size in (2, 4):
        spans = []
        for rank in range(size):
            shard = layout_view(size, rank).shard(batch)
            mask = shard.loss_side(batch.response_mask)
            half = mask.shape[1] // 2
            spans.append(((mask[:, :half].sum(1) > 0) & (mask[:, half:].sum(1) > 0)).any())
        assert any(spans), size


def test_the_model_attends_through_the_context_parallel_implementation(single_rank_group):
    model, *_ = build_problem("token-mean", torch.float64, 0)
    parallel = replace(init_parallel(ParallelConfig()), context=ContextParallel(None))
    reference = copy.deepcopy(model)
    parallel.parallelize(model, reference)
    assert model.config._attn_implementation == reference.config._attn_implementation == ATTN_IMPLEMENTATION


@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run_step(model, batch, algorithm, trainer_cfg, parallel):
    """At a sampling temperature of 0.7 with top-k and top-p: every path scores the truncated
    distribution, the shards' too."""
    trainer = PolicyTrainer(
        copy.deepcopy(model),
        trainer_cfg,
        algorithm,
        total_steps=10,
        reference_model=copy.deepcopy(model),
        parallel=parallel,
        distribution=SampledDistribution(0.7, top_k=8, top_p=0.9),
    )
    trainer.begin_train_step()
    for micro in uneven_split(batch, 3, torch.Generator().manual_seed(1)):
        trainer.train_microbatch(micro)
    outcome = StepOutcome.of(trainer, trainer.finish_train_step())
    return outcome, trainer.compute_logprobs(batch), trainer.compute_logprobs(batch, reference=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("padded", [True, False])
def test_cp1_through_the_context_parallel_path_is_bit_identical(single_rank_group, dtype, padded):
    model, batch, algorithm, trainer_cfg = build_problem("seq-mean-token-mean", dtype, 0)
    if not padded:
        batch = replace(batch, attention_mask=torch.ones_like(batch.attention_mask))
    through_cp = replace(init_parallel(ParallelConfig()), context=ContextParallel(dist.group.WORLD))
    plain, plain_lp, plain_ref = run_step(model, batch, algorithm, trainer_cfg, None)
    sharded, sharded_lp, sharded_ref = run_step(model, batch, algorithm, trainer_cfg, through_cp)
    assert (sharded.loss, sharded.grad_norm, sharded.metrics) == (plain.loss, plain.grad_norm, plain.metrics)
    for name in plain.grads:
        assert torch.equal(sharded.grads[name], plain.grads[name]), name
        assert torch.equal(sharded.params[name], plain.params[name]), name
    assert torch.equal(sharded_lp, plain_lp) and torch.equal(sharded_ref, plain_ref)


def test_shifting_after_sharding_pairs_tokens_across_the_chunk_seam():
    from asyncrl.tools.verify import ShiftAfterShardCP

    model, batch, *_ = build_problem("token-mean", torch.float64, 0)
    right, wrong = layout_view(2, 0).shard(batch), ShiftAfterShardCP()
    wrong.size, wrong.rank = 2, 0
    wrong = wrong.shard(batch)
    seam = right.columns.shape[0] // 2 - 1  # last slot of the head chunk
    assert torch.equal(right.labels[:, :seam], wrong.labels[:, :seam])
    assert not torch.equal(right.labels[:, seam], wrong.labels[:, seam])


def _truncated_shard_scores(rank: int, world_size: int) -> bytes:
    """Whole-row logprobs and this rank's shard of the entropies, under truncation, from two CP
    ranks, and the same from shards that forget the truncation; rank 0 returns them all."""
    model, batch, *_ = build_problem("token-mean", torch.float64, 0)
    enable_context_parallel_attention(model)
    scores = {}
    for name, cp in [("right", ContextParallel(dist.group.WORLD)), ("untruncated", UntruncatedCP(dist.group.WORLD))]:
        with torch.no_grad():
            inputs = cp.loss_inputs(model, batch, batch.response_mask, with_entropy=True, distribution=DISTRIBUTION)
            logprobs = cp.full_logprobs(model, batch, distribution=DISTRIBUTION)
        entropy = torch.zeros(len(batch), cp.padded_width(batch.input_ids.shape[1]), dtype=torch.float64)
        entropy[:, cp.shard(batch).columns] = inputs.entropy.roll(-1, dims=-1)
        gathered = [torch.zeros_like(entropy) for _ in range(world_size)]
        dist.all_gather(gathered, entropy)
        scores[name] = (logprobs, sum(gathered))
    buffer = io.BytesIO()
    torch.save(scores if rank == 0 else None, buffer)
    return buffer.getvalue()


@pytest.mark.slow
def test_two_cp_ranks_score_the_truncated_distribution_as_a_whole_row_does():
    model, batch, *_ = build_problem("token-mean", torch.float64, 0)
    scores = torch.load(io.BytesIO(launch(_truncated_shard_scores, 2)[0]))
    expected, entropy = token_logprobs(
        model, batch.input_ids, batch.attention_mask, with_entropy=True, distribution=DISTRIBUTION
    )
    real = F.pad(batch.attention_mask[:, 1:], (1, 0)).bool() & batch.attention_mask.bool()
    width = batch.input_ids.shape[1]
    logprobs, shard_entropy = scores["right"]
    torch.testing.assert_close(logprobs[real], expected[real], rtol=1e-12, atol=1e-12)
    # column t of a shard's entropy predicts token t + 1, as entropy[:, t + 1] of the whole row
    torch.testing.assert_close(
        shard_entropy[:, : width - 1][real[:, 1:]], entropy[:, 1:][real[:, 1:]], rtol=1e-12, atol=1e-12
    )
    untruncated, _ = scores["untruncated"]
    assert (untruncated - expected)[real].abs().max() > 1e-2  # the twin: shards that skip top-k / top-p


def dense_attention(
    query, key, value, query_columns, key_columns, *, window=None, softcap=None, scaling=0.5, segments=None
):
    """The reference: every score materialized, one mask over global columns (and segments), float64 softmax."""
    distance = query_columns[:, None] - key_columns[None, :]
    visible = (distance >= 0) & (distance < (window or distance.shape[1] + 1))
    if segments is not None:
        visible &= segments[query_columns][:, None] == segments[key_columns][None, :]
    groups = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(groups, 1).transpose(2, 3) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return scores.masked_fill(~visible, -torch.inf).softmax(-1) @ value.repeat_interleave(groups, 1)


# a packed row of 24 columns: segments of 2, 9, 1, 7 and 5 columns (each column's segment start)
SEGMENTS = torch.tensor([0] * 2 + [2] * 9 + [11] + [12] * 7 + [19] * 5)


@pytest.mark.parametrize("segments", [None, SEGMENTS], ids=["rows", "packed"])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 2.0), (5, 2.0)])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_blockwise_attention_is_causal_attention_by_global_column(size, window, softcap, segments):
    """Every rank's queries, in blocks of 3 that cut its chunks, over keys gathered in head-tail
    order, with GQA: outputs and gradients equal the dense masked attention's; on a packed row no
    query sees a key of another segment. Gemma 2's softcapped softmax runs in float32, hence its
    tolerance."""
    width, gen = 24, torch.Generator().manual_seed(0)
    key_columns = torch.cat([head_tail_columns(width, size, r) for r in range(size)])
    key, value = (torch.randn(2, 2, width, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    tolerance = 1e-12 if softcap is None else 1e-6
    for rank in range(size):
        columns = head_tail_columns(width, size, rank)
        query = torch.randn(2, 4, len(columns), 4, generator=gen, dtype=torch.float64, requires_grad=True)
        args = (query, key, value, columns, key_columns)
        out = blockwise_attention(*args, window=window, softcap=softcap, scaling=0.5, block=3, segments=segments)
        expected = dense_attention(*args, window=window, softcap=softcap, segments=segments)
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
        upstream = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        grads = torch.autograd.grad(out, (query, key, value), upstream)
        for grad, want in zip(grads, torch.autograd.grad(expected, (query, key, value), upstream)):
            torch.testing.assert_close(grad, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_blockwise_attention_keeps_nothing_quadratic_for_the_backward(softcap):
    """Autograd keeps tensors no larger than the queries or the gathered keys: no [Q, K] mask or
    scores. Its twin, sdpa with the dense mask over global columns, keeps a [Q, K] float mask."""
    width = 64
    columns, key_columns = head_tail_columns(width, 2, 0), torch.cat([head_tail_columns(width, 2, r) for r in (0, 1)])
    query = torch.randn(1, 4, len(columns), 2, requires_grad=True)
    key, value = (torch.randn(1, 2, width, 2, requires_grad=True) for _ in "kv")

    def largest_saved(attend) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            attend()
        return max(sizes)

    linear = max(query.numel(), key.numel())
    args = (query, key, value, columns, key_columns)
    assert (
        largest_saved(lambda: blockwise_attention(*args, window=None, softcap=softcap, scaling=0.5, block=8)) <= linear
    )
    visible = columns[:, None] >= key_columns[None, :]

    def dense():
        key_heads, value_heads = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
        return F.scaled_dot_product_attention(query, key_heads, value_heads, attn_mask=visible)

    assert largest_saved(dense) >= len(columns) * width > linear


def test_context_parallel_refuses_left_padded_rows():
    model, batch, *_ = build_problem("token-mean", torch.float64, 0)
    left = replace(batch, attention_mask=batch.attention_mask.flip(1))
    with pytest.raises(ValueError, match="right-padded"):
        layout_view(2, 0).shard(left)


def test_right_padded_rows_are_scored_without_a_mask_and_left_padded_rows_with_one(monkeypatch):
    """Right padding needs no mask (causality keeps real tokens from it): sdpa gets none and every
    real token scores as under the padding mask. Left-padded rows keep theirs."""
    model, batch, *_ = build_problem("token-mean", torch.float64, 0)
    masks = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", spy)
    ids, mask = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        unmasked, _ = token_logprobs(model, ids, mask)
        assert masks and all(m is None for m in masks)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    masked = F.pad(logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    real = F.pad(mask[:, 1:], (1, 0)).bool() & mask.bool()
    torch.testing.assert_close(unmasked[real], masked[real], rtol=0, atol=1e-12)
    masks.clear()
    with torch.no_grad():
        token_logprobs(model, ids.flip(1), mask.flip(1))
    assert all(m is not None for m in masks)
