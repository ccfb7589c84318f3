"""Padding-free packing (models/packing.py, trainer.packing) and token-budget micro-batches
(trainer.micro_batch_tokens): packed rows score and train exactly as the padded rows do, on one
rank and on dp x cp ranks, and attention that leaks across packed sequences is caught."""

import copy

import pytest
import torch
from helpers import run
from transformers import AttentionInterface

from asyncrl.algorithms.grpo import GRPO
from asyncrl.config import StepConfig, TrainerConfig
from asyncrl.models import SampledDistribution, build_tiny_model, token_logprobs
from asyncrl.models.packing import Packing
from asyncrl.tools.verify import CP_PLANTS, PACKED_LEAK, Case, _packed_leak, check_layout, verify, verify_parallel
from asyncrl.trainer import PolicyTrainer, context_parallel
from asyncrl.trainer.context_parallel import ATTN_IMPLEMENTATION, blockwise_attention, enable_context_parallel_attention
from asyncrl.trainer.normalization import AGG_MODES
from asyncrl.trainer.recompute import checkpoint_activations
from asyncrl.trainer.worker import TrainerWorker
from asyncrl.types import RolloutGroup

SEQUENCE = {"ratio_level": "sequence"}  # grpo's sequence ratio (GSPO)


def padded(lengths: list[int], width: int, *, left: bool = False, vocab: int = 48, seed: int = 0):
    """Rows of ``lengths`` real tokens in ``width`` columns, right- (or left-) padded."""
    ids = torch.randint(1, vocab, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    if left:
        mask = mask.flip(1)
    return ids * mask, mask


def test_packing_concatenates_real_tokens_and_restarts_positions_per_row():
    ids, mask = padded([3, 0, 2, 4], 5)
    left_ids, left_mask = padded([3, 0, 2, 4], 5, left=True)
    for x, m in ((ids, mask), (left_ids, left_mask)):
        packing = Packing.of(m)
        packed = packing.pack(x)
        assert packed.tolist() == [x[m.bool()].tolist()]
        assert packing.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
        assert packing.segment_starts.tolist() == [0, 0, 0, 3, 3, 5, 5, 5, 5]
        assert packing.first_columns().tolist() == [[c in (0, 3, 5) for c in range(9)]]
        assert torch.equal(packing.unpack(packed), x)
        assert packing.pack(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [[1.0] * 3 + [3.0] * 2 + [4.0] * 4]


def packed_model(model):
    packed = copy.deepcopy(model)
    enable_context_parallel_attention(packed)
    return packed


@pytest.mark.parametrize("left", [False, True])
def test_packed_scores_and_gradients_equal_the_padded_rows(left):
    """Logprobs, entropies under a truncated distribution, and the gradient of their sum: the same
    from one packed row as from padded rows (float64). The twin attends across the packed
    sequences and scores every later sequence differently."""
    model = build_tiny_model(48, seed=0, dtype=torch.float64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    ids, mask = padded([7, 3, 12, 1, 5], 12, left=left)
    scoring = {"with_entropy": True, "distribution": SampledDistribution(0.8, top_k=20, top_p=0.9), "chunk_tokens": 5}
    plain, plain_entropy = token_logprobs(model, ids, mask, **scoring)
    packed = packed_model(model)
    logprobs, entropy = token_logprobs(packed, ids, mask, packed=True, **scoring)
    scored = mask.bool() & (mask.cumsum(1) > 1)  # real tokens with a real token before them
    torch.testing.assert_close(logprobs[scored], plain[scored], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy[scored], plain_entropy[scored], rtol=1e-12, atol=1e-12)
    assert not logprobs[~scored].any() and not entropy[~scored].any()
    ((plain + plain_entropy) * scored).sum().backward()
    ((logprobs + entropy) * scored).sum().backward()
    for (name, a), b in zip(model.named_parameters(), packed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    packed.set_attn_implementation(PACKED_LEAK)
    with torch.no_grad():
        leaked, _ = token_logprobs(packed, ids, mask, packed=True, **scoring)
    assert (leaked - plain)[scored].abs().max() > 1e-3


def test_a_packed_forward_and_its_recomputation_read_the_segments_to_the_host_once(monkeypatch):
    """Every layer gets the same segment starts; reading them to the host (a device sync) happens
    once per micro-batch, not once per layer and again in the backward's recomputation. The
    blockwise path (windows, softcaps, CP) walks its query blocks once per shard the same way."""
    reads = []
    for name in ("_segment_starts", "_runs"):
        real = getattr(context_parallel, name)
        monkeypatch.setattr(context_parallel, name, lambda *a, real=real, name=name: reads.append(name) or real(*a))
    model = build_tiny_model(48, seed=0, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2)
    packed = packed_model(model)
    checkpoint_activations(packed)
    ids, mask = padded([7, 3, 12], 12)
    logprobs, _ = token_logprobs(packed, ids, mask, packed=True, chunk_tokens=5)
    logprobs.sum().backward()
    assert reads == ["_segment_starts"]
    reads.clear()
    q, kv = torch.randn(1, 4, 22, 8), torch.randn(1, 2, 22, 8)
    columns, segments = torch.arange(22), Packing.of(mask).segment_starts
    options = {"window": 4, "softcap": None, "scaling": 0.3, "block": 5}
    first = blockwise_attention(q, kv, kv, columns, columns, segments=segments, **options)
    torch.testing.assert_close(blockwise_attention(q, kv, kv, columns, columns, segments=segments, **options), first)
    assert reads == ["_runs"]
    blockwise_attention(q, kv, kv, columns, columns, segments=segments.clone(), **options)  # another packed row
    assert reads == ["_runs", "_runs"]


def test_verify_packed_split_steps_match_and_a_leak_across_sequences_fails():
    for result in verify(AGG_MODES, micro_batches=4, packing=True):
        assert result.passed and result.worst_error[0] < 1e-9, result
    for result in verify(("token-mean",), micro_batches=2, packing=True, updates=2, options=SEQUENCE):
        assert result.passed, result
    for result in verify(("token-mean", "seq-mean-token-sum"), micro_batches=4, packing=True, plant="packed-leak"):
        assert not result.passed and result.worst_error[0] > 1e-3, result
    with pytest.raises(ValueError, match="--plant: packed-leak .* needs --packing"):
        check_layout(1, 1, 4, ["packed-leak"])


@pytest.mark.slow
def test_packed_rows_on_dp2_x_cp2_match_and_their_planted_mistakes_fail():
    """Packed rows sharded by CP: every mode, the sequence ratio (summed per packed segment over the
    group), LoRA; the leak across sequences, the per-shard sequence sum and every other CP mistake
    must fail on packed rows too."""
    cases = (
        [Case(mode, packing=True) for mode in AGG_MODES]
        + [Case("seq-mean-token-mean", options=SEQUENCE, packing=True)]
        + [Case("token-mean", lora=True, packing=True)]
        + [Case(mode, plant="packed-leak", packing=True) for mode in AGG_MODES]
        + [Case("token-mean", plant="cp-shard-mean", options=SEQUENCE, packing=True)]
        + [Case("token-mean", plant=plant, packing=True) for plant in CP_PLANTS if plant != "cp-shard-mean"]
    )
    results = verify_parallel(cases, dp=2, cp=2, micro_batches=2)
    for result in results:
        if result.case.plant is None:
            assert result.passed and result.worst_error[0] < 1e-9, (result.case, result.worst_error)
        else:
            assert not result.passed and result.worst_error[0] > 1e-3, (result.case, result.worst_error)


def test_a_model_whose_attention_ignores_the_segments_is_refused_when_the_trainer_is_built(monkeypatch):
    """What an architecture whose layers drop the attention keywords would do: the trainer's probe
    compares a packed forward with the rows' and refuses it in one line."""
    model = build_tiny_model(48, seed=0, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    PolicyTrainer(copy.deepcopy(model), TrainerConfig(packing=True), GRPO(), total_steps=1)
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_IMPLEMENTATION, _packed_leak)
    with pytest.raises(ValueError, match=r"^trainer\.packing: a 'qwen2' model scores packed sequences differently"):
        PolicyTrainer(model, TrainerConfig(packing=True), GRPO(), total_steps=1)


# ---- token-budget micro-batches ------------------------------------------------------------------


def group_of(lengths: list[int], seed: int) -> RolloutGroup:
    ids, mask = padded(lengths, max(lengths), seed=seed)
    response = (mask.cumsum(1) > 2).float() * mask
    return RolloutGroup(
        prompt_uid=f"p{seed}",
        input_ids=ids,
        attention_mask=mask,
        response_mask=response,
        behaviour_logprobs=-response,
        rewards=torch.arange(len(lengths), dtype=torch.float32),
        finish_reasons=["stop"] * len(lengths),
        start_version=0,
        end_version=0,
    )


def worker(**trainer_options) -> tuple[TrainerWorker, list[list[int]]]:
    """A worker over a float64 tiny trainer, and the real-token lengths of each micro-batch it trains."""
    model = build_tiny_model(48, seed=0, dtype=torch.float64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    config = TrainerConfig(lr=1e-3, dtype="float64", **trainer_options)
    trainer = PolicyTrainer(model, config, GRPO(), total_steps=4)
    trained: list[list[int]] = []
    train = trainer.train_microbatch

    def record(batch):
        trained.append(batch.attention_mask.sum(1).tolist())
        return train(batch)

    trainer.train_microbatch = record
    return TrainerWorker(trainer, StepConfig(), tokenizer=None), trained


GROUPS = [[9, 4, 6, 3], [12, 2, 5, 5], [3, 3, 3, 30]]


def train(step_worker: TrainerWorker):
    step_worker.begin_step(0)
    for seed, lengths in enumerate(GROUPS):
        step_worker.train_groups([group_of(lengths, seed)])
    return step_worker.finish_step().result


def test_a_token_budget_closes_micro_batches_before_they_pass_it_and_trains_the_same_step():
    budget, by_rows = worker(micro_batch_size=5)
    budgeted, by_tokens = worker(micro_batch_size=5, micro_batch_tokens=20, packing=True)
    plain, packed = train(budget), train(budgeted)
    assert by_rows == [[9, 4, 6, 3, 12], [2, 5, 5, 3, 3], [3, 30]]
    assert by_tokens == [[9, 4, 6], [3, 12, 2], [5, 5, 3, 3, 3], [30]]  # 30 > 20 trains alone
    assert plain.num_microbatches == 3 and packed.num_microbatches == 4
    assert packed.loss == pytest.approx(plain.loss, rel=1e-10)
    assert packed.grad_norm == pytest.approx(plain.grad_norm, rel=1e-10)


@pytest.mark.slow
def test_a_packed_run_with_a_token_budget_trains_like_the_padded_run(tmp_path):
    """The small run packed, micro-batches of at most 40 real tokens: every step runs, with more
    micro-batches, and the first step (the same rollouts) trains to the same loss."""
    _, plain, _ = run(tmp_path, "plain")
    _, packed, _ = run(tmp_path, "packed", "trainer.packing=true", "trainer.micro_batch_tokens=40")
    assert len(packed) == len(plain)
    assert packed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-4, abs=1e-6)
    assert packed[0]["reward_mean"] == plain[0]["reward_mean"]
    assert all(p["num_microbatches"] > q["num_microbatches"] for p, q in zip(packed, plain))
