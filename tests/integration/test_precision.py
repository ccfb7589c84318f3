"""What the trainer optimizes and how precisely: float32 masters under bfloat16 compute (one rank
and FSDP2 ranks), scoring at the sampling temperature, dropout off in the loss forward, activation
checkpointing, and an entropy metric outside autograd."""

import copy
import io

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from asyncrl.algorithms import build_algorithm
from asyncrl.algorithms.grpo import GRPO
from asyncrl.config import ParallelConfig, TrainerConfig, load_config
from asyncrl.generation import build_generator
from asyncrl.generation.hf import sample_next
from asyncrl.models import SampledDistribution, build_model, build_tiny_model, build_tokenizer, token_logprobs
from asyncrl.tools.verify import random_batch, rank_micro_batches
from asyncrl.trainer import PolicyTrainer, policy, recompute
from asyncrl.trainer.parallel import init_parallel, launch

VOCAB = 48
STEPS = 10


def trainer_for(model, dtype, parallel=None, **trainer_fields):
    cfg = TrainerConfig(lr=1e-6, max_grad_norm=None, dtype=dtype, aggregation="seq-mean-token-mean", **trainer_fields)
    return PolicyTrainer(model, cfg, GRPO(), total_steps=STEPS, parallel=parallel)


def relative_updates(dtype, parallel=None) -> dict[str, float]:
    """||w_10 - w_0|| / ||w_0|| per master parameter after 10 steps at lr 1e-6 (||w_10 - w_0||
    for a tensor that starts at 0, such as a bias)."""
    model = build_tiny_model(VOCAB, seed=0, hidden_size=32, num_heads=4, num_layers=1, intermediate_size=64)
    before = {name: p.detach().clone().float() for name, p in model.named_parameters()}
    batch = random_batch(model, num_groups=4, group_size=4, vocab_size=VOCAB, seed=0)
    batch.prox_logprobs = None
    if dtype == "bfloat16-without-masters":  # what a model loaded in bfloat16 trained as before
        model, dtype = model.to(torch.bfloat16), "bfloat16"
    trainer = trainer_for(model, dtype, parallel)
    if parallel is not None:
        batch = rank_micro_batches(batch, dp=parallel.dp, dp_rank=parallel.dp_rank, micro_batches=1, seed=0)[0]
    for _ in range(STEPS):
        trainer.begin_train_step()
        trainer.train_microbatch(batch)
        trainer.finish_train_step()
    after = {name: policy._full(p).detach().float() for name, p in trainer.model.named_parameters()}
    return {name: float((after[name] - w).norm() / (w.norm() if w.any() else 1)) for name, w in before.items()}


def moved_like(updates, reference) -> list[str]:
    """Tensors whose relative update is not within a factor 1.5 of the reference's."""
    return [name for name, ref in reference.items() if not ref / 1.5 <= updates[name] <= ref * 1.5]


@pytest.mark.slow
def test_bfloat16_trains_float32_masters_that_move_like_a_float32_run(monkeypatch):
    fp32 = relative_updates("float32")
    bf16 = relative_updates("bfloat16")
    assert moved_like(bf16, fp32) == []
    assert all(bf16[name] > 0 for name in bf16 if "norm" in name)
    # the planted twin: bfloat16 parameters and AdamW state, no float32 masters
    monkeypatch.setattr(policy, "_upcast_low_precision", lambda model: None)
    bare = relative_updates("bfloat16-without-masters")
    assert len(moved_like(bare, fp32)) > len(fp32) / 2
    assert all(bare[name] == 0 for name in bare if "norm" in name)


@pytest.mark.parametrize("packing", [False, True])
def test_a_bfloat16_trainer_attends_in_bfloat16_though_rotary_embeddings_upcast_the_query(monkeypatch, packing):
    """Under autocast the rotary tables (float32, like the residual stream) upcast the query and key;
    sdpa would then run its float32 kernels. The trainer's attention casts them back."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), query.dtype, key.dtype, value.dtype))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = build_tiny_model(VOCAB, seed=0, hidden_size=32, num_heads=4, num_layers=1, intermediate_size=64)
    batch = random_batch(model, num_groups=2, group_size=2, vocab_size=VOCAB, seed=0)
    trainer_for(model, "bfloat16", packing=packing).train_step(batch)
    assert {tuple(dtypes) for autocast, *dtypes in seen if autocast} == {(torch.bfloat16,) * 3}  # the train forwards
    seen.clear()
    model = build_tiny_model(VOCAB, seed=0, hidden_size=32, num_heads=4, num_layers=1, intermediate_size=64)
    trainer_for(model, "float32", packing=packing).train_step(batch)
    assert {tuple(dtypes) for _, *dtypes in seen} == {(torch.float32,) * 3}


def test_bfloat16_trainer_keeps_float32_state_and_exports_bfloat16():
    model = build_tiny_model(
        VOCAB, seed=0, dtype=torch.bfloat16, hidden_size=32, num_heads=4, num_layers=1, intermediate_size=64
    )
    trainer = trainer_for(model, "bfloat16")
    batch = random_batch(trainer.model, num_groups=2, group_size=2, vocab_size=VOCAB, seed=1)
    trainer.train_step(batch)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {t.dtype for state in trainer.optimizer.state.values() for t in state.values() if t.numel() > 1} == {
        torch.float32
    }
    _, weights = trainer.export_weights()
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_a_bfloat16_run_builds_float32_masters_a_bfloat16_generator_and_corrects_the_difference():
    config = load_config(None, ["model.num_layers=1", "trainer.dtype=bfloat16", "sampler.max_lag=0"])
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    generator = build_generator(config, copy.deepcopy(model), tokenizer)
    trainer = PolicyTrainer.from_config(config, model)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert {p.dtype for p in generator.model.parameters()} == {torch.bfloat16}
    assert trainer.algorithm.importance_sampling == "tis"


def fsdp_updates(rank: int, world_size: int) -> bytes:
    out = {dtype: relative_updates(dtype, init_parallel(ParallelConfig(dp=2))) for dtype in ("float32", "bfloat16")}
    model = dropout_model()
    batch = random_batch(model, num_groups=2, group_size=4, vocab_size=VOCAB, seed=0)
    batch = rank_micro_batches(batch, dp=2, dp_rank=rank, micro_batches=1, seed=0)[0]
    for name, fields in (("plain", {}), ("recomputed", {"activation_checkpointing": True})):
        out[name] = gradients(copy.deepcopy(model), batch, init_parallel(ParallelConfig(dp=2)), **fields)
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


@pytest.mark.slow
def test_on_two_fsdp_ranks_bfloat16_trains_float32_masters_and_recomputation_keeps_gradients():
    for payload in launch(fsdp_updates, 2):
        out = torch.load(io.BytesIO(payload))
        assert moved_like(out["bfloat16"], out["float32"]) == []
        assert all(out["bfloat16"][name] > 0 for name in out["bfloat16"] if "norm" in name)
        assert out["plain"].keys() == out["recomputed"].keys()
        for name, grad in out["plain"].items():
            torch.testing.assert_close(out["recomputed"][name], grad, rtol=1e-12, atol=1e-14)


# ---- the sampling temperature --------------------------------------------------------------------


def test_trainer_scores_the_distribution_the_generator_samples_from():
    model = build_tiny_model(
        VOCAB, seed=0, dtype=torch.float64, hidden_size=32, num_heads=4, num_layers=1, intermediate_size=64
    )
    ids = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -1]
        tokens, sampled = sample_next(logits, 0.7, 0, 1.0, torch.rand(3, dtype=torch.float64))
        scored, _ = token_logprobs(
            model, torch.cat([ids, tokens[:, None]], 1), torch.ones(3, 7), distribution=SampledDistribution(0.7)
        )
        untempered, _ = token_logprobs(model, torch.cat([ids, tokens[:, None]], 1), torch.ones(3, 7))
    torch.testing.assert_close(scored[:, -1], sampled, rtol=1e-12, atol=1e-12)
    assert (untempered[:, -1] - sampled).abs().max() > 1e-2  # the twin: scoring at temperature 1


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_the_trainer_takes_the_sampling_temperature_and_truncation(temperature):
    sampling = [f"generation.temperature={temperature}", "generation.top_k=5", "generation.top_p=0.9"]
    config = load_config(None, ["model.num_layers=1", *sampling])
    trainer = PolicyTrainer.from_config(config, build_model(config, build_tokenizer(config)))
    assert trainer.distribution == SampledDistribution(temperature, top_k=5, top_p=0.9)


@pytest.mark.slow
def test_an_on_policy_run_at_temperature_0_7_needs_no_correction(tmp_path):
    from helpers import run

    _, metrics, _ = run(
        tmp_path,
        "t07",
        "sampler.max_lag=0",
        "generation.temperature=0.7",
        "algorithm.options.importance_sampling=tis",
        "step.max_steps=3",
    )
    assert len(metrics) == 3
    for record in metrics:
        assert abs(record["is_weight_mean"] - 1) <= 1e-3, record
        assert record["mismatch_kl"] < 1e-6, record


@pytest.mark.parametrize(
    "overrides, mode",
    [
        ([], "none"),
        (["generation.temperature=0.7"], "none"),
        (["sampler.max_lag=1"], "tis"),
        (["generation.top_p=0.9"], "none"),  # the trainer scores the truncated distribution
        (["generation.top_k=20"], "none"),
        (["trainer.dtype=bfloat16"], "tis"),
        (["trainer.dtype=bfloat16", "algorithm.options.importance_sampling=icepop"], "icepop"),
    ],
)
def test_auto_importance_sampling_is_on_whenever_the_distributions_can_differ(overrides, mode):
    config = load_config(None, ["sampler.max_lag=0", *overrides])
    assert build_algorithm(config).importance_sampling == mode


# ---- dropout, activation checkpointing, entropy ------------------------------------------------


def dropout_model():
    model = build_tiny_model(
        VOCAB, seed=0, dtype=torch.float64, hidden_size=32, num_heads=4, num_layers=2, intermediate_size=64
    )
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    return model


def on_policy_step(train_mode: bool):
    trainer = trainer_for(dropout_model(), "float64")
    batch = random_batch(trainer.model, num_groups=2, group_size=4, vocab_size=VOCAB, seed=0)
    batch.prox_logprobs = trainer.compute_logprobs(batch)
    trainer.model.train(train_mode)
    return trainer.train_step(batch)


def test_an_on_policy_step_has_ratio_exactly_one_with_dropout_configured():
    result = on_policy_step(train_mode=False)
    assert result.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert result.metrics["clip_fraction"] == 0.0
    # the twin: a loss forward in train mode, dropout on, has ratios off 1 by noise (the noise is
    # about zero-mean, so their mean can land within 1e-4 of 1, never within 1e-12 of it)
    assert abs(on_policy_step(train_mode=True).metrics["ratio_mean"] - 1) > 1e-8


def gradients(model, batch, parallel=None, **trainer_fields):
    """Each parameter's whole gradient after one micro-batch (gathered from FSDP shards)."""
    trainer = trainer_for(model, "float64", parallel, **trainer_fields)
    trainer.begin_train_step()
    trainer.train_microbatch(batch)
    grads = {name: policy._full(p.grad).clone() for name, p in trainer.model.named_parameters()}
    trainer.abort_train_step()
    return grads


def test_activation_checkpointing_gives_the_same_gradients(monkeypatch):
    model = dropout_model()
    batch = random_batch(model, num_groups=2, group_size=4, vocab_size=VOCAB, seed=0)
    plain = gradients(copy.deepcopy(model), batch)
    checkpointed = []

    def counting_checkpoint(*args, **kwargs):
        checkpointed.append(args[1])
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(recompute, "checkpoint", counting_checkpoint)
    recomputed = gradients(copy.deepcopy(model), batch, activation_checkpointing=True)
    assert len(checkpointed) == len(model.model.layers)  # every block, once: the check is not vacuous
    assert plain.keys() == recomputed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-12, atol=1e-14)


def test_the_entropy_metric_is_computed_outside_autograd_unless_it_is_trained():
    model = build_tiny_model(VOCAB, seed=0, hidden_size=32, num_heads=4, num_layers=1, intermediate_size=64)
    ids, mask = torch.randint(1, VOCAB, (2, 5)), torch.ones(2, 5)
    _, metric = token_logprobs(model, ids, mask, with_entropy=True, entropy_grad=False)
    _, trained = token_logprobs(model, ids, mask, with_entropy=True)
    assert metric.grad_fn is None and trained.grad_fn is not None
    torch.testing.assert_close(metric, trained.detach())
