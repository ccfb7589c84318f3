"""PolicyTrainer: split-step state machine, exact abort, checkpoints, schedule, weight export."""

import copy
from dataclasses import replace

import pytest
import torch
from helpers import updates_of

from asyncrl.algorithms import grpo
from asyncrl.algorithms.grpo import GRPO, GRPOOptions
from asyncrl.config import TrainerConfig
from asyncrl.generation.base import SampleRequest, SamplingParams
from asyncrl.generation.hf import HFGenerator
from asyncrl.models import SampledDistribution, build_tiny_model
from asyncrl.tools.verify import random_batch
from asyncrl.trainer import PolicyTrainer, StepInProgressError
from asyncrl.trainer.optim import lr_factor
from asyncrl.trainer.snapshot import FileStore, HostStore
from asyncrl.types import RolloutGroup, TrainBatch

VOCAB = 40


def make_trainer(seed: int = 0, **trainer_overrides) -> PolicyTrainer:
    model = build_tiny_model(
        VOCAB, seed=seed, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    cfg = TrainerConfig(lr=1e-2, **trainer_overrides)
    return PolicyTrainer(model, cfg, GRPO(GRPOOptions(), "tis"), total_steps=10)


def batch_for(trainer: PolicyTrainer, seed: int):
    return random_batch(trainer.model, num_groups=3, group_size=4, vocab_size=VOCAB, seed=seed)


def snapshot(trainer: PolicyTrainer) -> dict:
    return copy.deepcopy(
        {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "version": trainer.version,
        }
    )


def assert_bit_identical(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_bit_identical(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def run_steps(trainer, batches, fail_at=None, fail_in="microbatch"):
    """Three micro-batches per step; optionally fail once in step ``fail_at`` and rerun it."""
    for step, batch in enumerate(batches):
        micro = batch.split([4, 4, 4])
        if step == fail_at:
            trainer.begin_train_step()
            trainer.train_microbatch(micro[0])
            if fail_in == "microbatch":
                hook = trainer.model.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("injected")))
                with pytest.raises(RuntimeError, match="injected"):
                    trainer.train_microbatch(micro[1])
                hook.remove()
            else:
                trainer.train_microbatch(micro[1])
                trainer.train_microbatch(micro[2])
                trainer._step_totals = lambda state: (_ for _ in ()).throw(RuntimeError("injected in finish"))
                with pytest.raises(RuntimeError, match="injected in finish"):
                    trainer.finish_train_step()
                del trainer._step_totals
            trainer.abort_train_step()
            trainer.abort_train_step()  # idempotent
        trainer.begin_train_step()
        for m in micro:
            trainer.train_microbatch(m)
        trainer.finish_train_step()


@pytest.mark.parametrize("fail_in", ["microbatch", "finish"])
def test_abort_then_rerun_is_bit_identical_to_no_failure(fail_in):
    clean, faulty = make_trainer(), make_trainer()
    batches = [batch_for(clean, seed) for seed in (1, 2, 3)]
    run_steps(clean, batches)
    run_steps(faulty, batches, fail_at=1, fail_in=fail_in)
    assert clean.version == faulty.version == 3
    assert_bit_identical(snapshot(clean), snapshot(faulty))


@pytest.mark.parametrize("store", [HostStore(pin=False), FileStore()], ids=["host", "file"])
def test_aborting_after_updates_restores_the_step_start_kept_off_the_device(store):
    """The first step too, whose optimizer state did not exist when the snapshot was taken."""
    clean, faulty = make_trainer(), make_trainer()
    faulty._step_start.store = store
    batches = [batch_for(clean, seed) for seed in (1, 2)]
    for batch in batches:
        updates_of(clean, batch)
        updates_of(faulty, batch, fail_after=2)
        assert not faulty.step_open and faulty._step_start.keys is None
        updates_of(faulty, batch)
    assert_bit_identical(snapshot(clean), snapshot(faulty))


@pytest.mark.parametrize("poison", ["gradient", "loss"])
def test_a_non_finite_step_is_skipped_with_weights_and_optimizer_untouched(poison):
    trainer = make_trainer()
    trainer.train_step(batch_for(trainer, 1))
    before = snapshot(trainer)
    batch = batch_for(trainer, 2)
    if poison == "loss":
        batch.advantages[0] = float("nan")
    trainer.begin_train_step()
    trainer.train_microbatch(batch)
    if poison == "gradient":
        next(iter(trainer.model.parameters())).grad[0, 0] = float("inf")
    result = trainer.finish_train_step()
    assert result.skipped and result.version == trainer.version == 2
    assert not trainer.step_open and all(p.grad is None for p in trainer.model.parameters())
    after = snapshot(trainer)
    assert after["version"] == before["version"] + 1
    for key in ("model", "optimizer", "scheduler"):
        assert_bit_identical(before[key], after[key], key)
    assert not trainer.train_step(batch_for(trainer, 3)).skipped


def test_retrying_inside_the_failed_step_is_detected():
    """Negative twin: re-feeding micro-batches into the failed step (no abort) double-counts."""
    clean, faulty = make_trainer(), make_trainer()
    micro = batch_for(clean, 1).split([4, 4, 4])
    clean.begin_train_step()
    faulty.begin_train_step()
    faulty.train_microbatch(micro[0])
    for m in micro:
        clean.train_microbatch(m)
        faulty.train_microbatch(m)
    clean.finish_train_step()
    faulty.finish_train_step()
    with pytest.raises(AssertionError):
        assert_bit_identical(snapshot(clean), snapshot(faulty))


def test_step_state_machine_errors():
    trainer = make_trainer()
    batch = batch_for(trainer, 0)
    with pytest.raises(StepInProgressError, match="no open step"):
        trainer.train_microbatch(batch)
    with pytest.raises(StepInProgressError, match="no open step"):
        trainer.finish_train_step()
    with pytest.raises(ValueError, match="does not match trainer version 0"):
        trainer.begin_train_step(3)
    trainer.begin_train_step(0)
    with pytest.raises(StepInProgressError, match="still open"):
        trainer.begin_train_step()
    with pytest.raises(StepInProgressError, match="open step"):
        trainer.state_dict()
    trainer.abort_train_step()
    assert not trainer.step_open and trainer.version == 0


def test_train_step_aborts_itself_on_failure():
    trainer = make_trainer()
    before = snapshot(trainer)
    hook = trainer.model.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train_step(batch_for(trainer, 0))
    hook.remove()
    assert not trainer.step_open
    assert all(p.grad is None for p in trainer.model.parameters())
    assert_bit_identical(before, snapshot(trainer))


def test_step_result_counts_and_metrics():
    trainer = make_trainer()
    batch = batch_for(trainer, 0)
    result = trainer.train_step(batch)
    assert result.version == trainer.version == 1
    assert result.num_sequences == 12
    assert result.num_tokens == int(batch.response_mask.sum())
    assert result.num_microbatches == 1
    assert 0.0 <= result.metrics["clip_fraction"] <= 1.0
    assert result.metrics["is_weight_max"] <= 2.0  # tis cap
    assert result.metrics["is_weight_min"] > 0.0
    assert result.metrics["entropy"] > 0.0
    assert "kl" not in result.metrics


def test_gradient_clipping_caps_the_norm():
    trainer = make_trainer(max_grad_norm=1e-3)
    result = trainer.train_step(batch_for(trainer, 0))
    assert result.grad_norm > 1e-3
    clipped = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in trainer.model.parameters() if p.grad is not None))
    assert clipped.item() == pytest.approx(1e-3, rel=1e-4)


def test_state_dict_round_trip_resumes_bit_identically():
    a = make_trainer()
    batches = [batch_for(a, seed) for seed in (1, 2, 3)]
    a.train_step(batches[0])
    state = copy.deepcopy(a.state_dict())
    a.train_step(batches[1])
    a.train_step(batches[2])

    b = make_trainer(seed=7)
    b.load_state_dict(state)
    assert b.version == 1
    b.train_step(batches[1])
    b.train_step(batches[2])
    assert_bit_identical(snapshot(a), snapshot(b))


def test_export_weights_is_a_versioned_snapshot():
    trainer = make_trainer()
    version, weights = trainer.export_weights()
    assert version == 0
    trainer.train_step(batch_for(trainer, 0))
    new_version, new_weights = trainer.export_weights()
    assert new_version == 1
    name = next(n for n, _ in trainer.model.named_parameters())
    assert not torch.equal(weights[name], new_weights[name])
    assert torch.equal(new_weights[name], trainer.model.state_dict()[name])


def test_exported_views_share_the_weights_memory_and_snapshots_do_not():
    trainer = make_trainer()
    name = next(n for n, _ in trainer.model.named_parameters())
    _, views = trainer.export_weights(copy=False)
    _, snapshot = trainer.export_weights()
    parameter = dict(trainer.model.named_parameters())[name]
    assert views[name].data_ptr() == parameter.data_ptr() and snapshot[name].data_ptr() != parameter.data_ptr()
    trainer.train_step(batch_for(trainer, 0))
    assert torch.equal(views[name], parameter.detach()) and not torch.equal(snapshot[name], parameter.detach())


def test_compute_logprobs_matches_across_micro_batch_sizes():
    trainer = make_trainer()
    batch = batch_for(trainer, 0)
    whole = trainer.compute_logprobs(batch, micro_batch_size=len(batch))
    pieces = trainer.compute_logprobs(batch, micro_batch_size=5)
    assert whole.shape == batch.input_ids.shape
    torch.testing.assert_close(whole, pieces, rtol=1e-5, atol=1e-6)
    assert torch.all(whole[batch.attention_mask == 0] == 0)
    with pytest.raises(ValueError, match="no reference model"):
        trainer.compute_logprobs(batch, reference=True)


def test_kl_penalty_requires_a_reference_model():
    model = build_tiny_model(
        VOCAB, seed=0, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    with pytest.raises(ValueError, match="scores against a reference, but no reference model"):
        PolicyTrainer(model, TrainerConfig(), GRPO(GRPOOptions(kl_coef=0.1), "none"), total_steps=1)


def test_lr_schedule_warmup_constant_and_cosine():
    common = dict(warmup_steps=2, total_steps=12, min_lr_ratio=0.1)
    assert [lr_factor(s, schedule="constant", **common) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    cosine = [lr_factor(s, schedule="cosine", **common) for s in range(13)]
    assert cosine[2] == pytest.approx(1.0)
    assert cosine[7] == pytest.approx(0.55)
    assert cosine[12] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(cosine[2:], cosine[3:]))


def test_scheduler_drives_the_optimizer_lr():
    trainer = make_trainer(warmup_steps=1)
    first = trainer.train_step(batch_for(trainer, 0))
    second = trainer.train_step(batch_for(trainer, 1))
    assert first.lr == pytest.approx(1e-2 / 2)
    assert second.lr == pytest.approx(1e-2)


def with_dropout(trainer: PolicyTrainer) -> PolicyTrainer:
    """Dropout on the embeddings, so every micro-batch draws from the RNG."""
    embed = trainer.model.get_input_embeddings()
    embed.register_forward_hook(lambda _m, _i, out: torch.nn.functional.dropout(out, 0.1, training=True))
    return trainer


@pytest.mark.parametrize("restore_rng", [True, False])
def test_abort_restores_the_rng_so_dropout_reruns_identically(restore_rng, monkeypatch):
    clean, faulty = with_dropout(make_trainer()), with_dropout(make_trainer())
    if not restore_rng:  # the negative twin: an abort that forgets the RNG
        monkeypatch.setattr(faulty, "_set_rng_state", lambda state: None)
    batches = [batch_for(clean, seed) for seed in (1, 2)]
    torch.manual_seed(0)
    run_steps(clean, batches)
    torch.manual_seed(0)
    run_steps(faulty, batches, fail_at=1)
    if restore_rng:
        assert_bit_identical(snapshot(clean), snapshot(faulty))
    else:
        with pytest.raises(AssertionError):
            assert_bit_identical(snapshot(clean), snapshot(faulty))


def design_weights(batch, mode: str, norm_constant: float) -> torch.Tensor:
    """docs/loss.md's per-token weight table, written out directly (no local/D factoring)."""
    n_i = batch.response_mask.sum(1, keepdim=True)
    num_seqs, num_tokens = len(batch), batch.response_mask.sum()
    per_token = {
        "token-mean": 1 / num_tokens * torch.ones_like(n_i),
        "seq-mean-token-mean": 1 / (num_seqs * n_i),
        "seq-mean-token-sum": 1 / num_seqs * torch.ones_like(n_i),
        "seq-mean-token-sum-norm": 1 / (num_seqs * norm_constant) * torch.ones_like(n_i),
    }[mode]
    return per_token * batch.response_mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_step_loss_and_gradient_equal_the_design_formula(mode):
    from asyncrl.algorithms import grpo
    from asyncrl.models import token_logprobs

    model = build_tiny_model(
        VOCAB,
        seed=0,
        dtype=torch.float64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
    )
    trainer_cfg = TrainerConfig(
        max_grad_norm=None, aggregation=mode, norm_constant=3.0 if mode.endswith("norm") else None
    )
    trainer = PolicyTrainer(copy.deepcopy(model), trainer_cfg, GRPO(importance_sampling="tis"), total_steps=1)
    batch = random_batch(model, num_groups=3, group_size=4, vocab_size=VOCAB, seed=5).to("cpu", torch.float64)
    trainer.begin_train_step()
    for micro in batch.split([5, 7]):
        trainer.train_microbatch(micro)
    result = trainer.finish_train_step()

    logprobs, entropy = token_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
    per_token, _ = grpo.token_loss(
        logprobs,
        batch.prox_logprobs,
        batch.behaviour_logprobs,
        batch.advantages[:, None],
        cfg=trainer.algorithm.options,
        is_mode="tis",
        entropy=entropy,
    )
    expected = (design_weights(batch, mode, 3.0) * per_token).sum()
    expected.backward(retain_graph=True)
    assert result.loss == pytest.approx(expected.item(), rel=1e-12)
    # Loose only because HF's RMSNorm runs in float32 even in a float64 model, so back-propagating a
    # loss scaled by 1/D (here) instead of scaling the gradient (the trainer) rounds differently.
    for q, p in zip(trainer.model.parameters(), model.parameters()):
        assert (q.grad - p.grad).abs().max() <= 1e-6 * p.grad.abs().max()
    # Another mode's weights give another gradient, so the comparison above can fail.
    other = "token-mean" if mode != "token-mean" else "seq-mean-token-mean"
    model.zero_grad()
    (design_weights(batch, other, 3.0) * per_token).sum().backward()
    assert any(
        (q.grad - p.grad).abs().max() > 1e-3 * p.grad.abs().max()
        for q, p in zip(trainer.model.parameters(), model.parameters())
    )


def test_bfloat16_policy_trains_with_float32_loss_arithmetic():
    model = build_tiny_model(
        VOCAB,
        seed=0,
        dtype=torch.bfloat16,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
    )
    before = [p.detach().float() for p in model.parameters()]
    trainer = PolicyTrainer(model, TrainerConfig(dtype="bfloat16"), GRPO(GRPOOptions(), "tis"), total_steps=1)
    assert trainer.compute_dtype == torch.float32  # the masters are float32 (tests/test_precision.py)
    result = trainer.train_step(batch_for(make_trainer(), 0))
    assert result.version == 1 and torch.isfinite(torch.tensor(result.loss)) and result.grad_norm > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_behaviour_clip_takes_the_ratio_to_the_generator_and_one_update_alone_never_clips():
    def step(loss_cfg, importance_sampling, prox):
        model = build_tiny_model(
            VOCAB, seed=0, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
        )
        trainer = PolicyTrainer(model, TrainerConfig(lr=1e-2), GRPO(loss_cfg, importance_sampling), total_steps=10)
        batch = batch_for(trainer, 5)
        batch.prox_logprobs = batch.behaviour_logprobs.clone() if prox else None
        return trainer.train_step(batch)

    bypass = step(GRPOOptions(clip_against="behaviour"), "none", prox=False)
    as_proximal = step(GRPOOptions(), "none", prox=True)
    assert bypass.loss == as_proximal.loss and bypass.grad_norm == as_proximal.grad_norm
    assert bypass.metrics["clip_fraction"] > 0 and bypass.metrics["mismatch_kl"] > 0
    assert step(GRPOOptions(), "tis", prox=False).metrics["clip_fraction"] == 0  # ratio identically 1


# ---- truncated sampling is scored as sampled -------------------------------------------------------

TRUNCATIONS = [{"top_p": 0.9}, {"top_k": 5}, {"top_k": 5, "top_p": 0.9}]


def on_policy_batch(model, temperature: float, truncation: dict) -> TrainBatch:
    """Three groups of four samples the transformers generator draws from ``model`` itself."""
    generator = HFGenerator(copy.deepcopy(model), stop_token_ids=[1], pad_token_id=0, batch_size=16)
    params = SamplingParams(max_new_tokens=10, temperature=temperature, **truncation)
    groups = []
    for g in range(3):
        requests = [SampleRequest([2 + g, 7, 11 + g], seed=4 * g + i) for i in range(4)]
        rollouts = [
            replace(rollout, reward=float(i % 2)) for i, rollout in enumerate(generator.generate(requests, params))
        ]
        groups.append(RolloutGroup.from_rollouts(f"p{g}", rollouts, pad_id=0, start_version=0))
    return TrainBatch.from_groups(groups, [grpo.group_advantages(group.rewards) for group in groups])


@pytest.mark.parametrize("truncation", TRUNCATIONS)
@pytest.mark.parametrize("clip_against", ["proximal", "behaviour"])
def test_on_policy_truncated_samples_have_unit_weights_and_nothing_clipped(truncation, clip_against):
    """At lag 0 the trainer scores the truncated distribution the generator sampled from: weights
    and ratios are 1 up to the float32 a rollout group stores behaviour logprobs in."""
    model = build_tiny_model(
        VOCAB, seed=0, dtype=torch.float64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64
    )
    batch = on_policy_batch(model, 0.8, truncation)
    distribution = SampledDistribution(0.8, truncation.get("top_k", 0), truncation.get("top_p", 1.0))
    for scored_as, on_policy in [(distribution, True), (SampledDistribution(0.8), False)]:
        trainer = PolicyTrainer(
            copy.deepcopy(model),
            TrainerConfig(lr=1e-2, dtype="float64"),
            GRPO(GRPOOptions(clip_against=clip_against), "tis" if clip_against == "proximal" else "none"),
            total_steps=10,
            distribution=scored_as,
        )
        metrics = trainer.train_step(copy.deepcopy(batch)).metrics
        unit = max(abs(metrics["is_weight_min"] - 1), abs(metrics["is_weight_max"] - 1), abs(metrics["ratio_mean"] - 1))
        if on_policy:
            assert unit <= 1e-6 and metrics["clip_fraction"] == 0, metrics
        else:  # the twin: scored untruncated, the ratio to the generator is the kept mass, below 1
            assert unit > 1e-3, metrics
            if clip_against == "behaviour" and "top_k" in truncation:  # 5 of 40 tokens keep less than 0.8
                assert metrics["clip_fraction"] > 0, metrics
