"""LoRA (lora section, models/lora.py): a frozen base, float32 adapters that alone train and sync."""

import copy

import pytest
import torch
from helpers import SMALL

from asyncrl.config import load_config
from asyncrl.generation import SampleRequest, SamplingParams, build_generator
from asyncrl.metrics import read_jsonl
from asyncrl.models import build_model, build_tokenizer, token_logprobs
from asyncrl.models.lora import base_sha256
from asyncrl.run import train
from asyncrl.tools.verify import random_batch
from asyncrl.trainer import PolicyTrainer

LORA = ["trainer.device=cpu", "lora.rank=4"]  # over the small run of helpers


def trainer_and_base(*overrides):
    """(config, tokenizer, an untouched copy of the base, the LoRA trainer built on the base)."""
    config = load_config(None, [*SMALL, *LORA, *overrides])
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    base = copy.deepcopy(model)
    return config, tokenizer, base, PolicyTrainer.from_config(config, model)


def a_step(trainer, tokenizer, seed=0):
    torch.manual_seed(seed)
    batch = random_batch(trainer.model, num_groups=2, group_size=4, vocab_size=len(tokenizer), seed=seed)
    return trainer.train_step(batch)


def test_the_base_stays_frozen_in_the_trainer_dtype_and_only_float32_adapters_train():
    config, tokenizer, _, trainer = trainer_and_base("trainer.dtype=bfloat16")
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert frozen and {p.dtype for p in frozen.values()} == {torch.bfloat16}
    assert all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {p.dtype for p in trained.values()} == {torch.float32}
    result = a_step(trainer, tokenizer)
    assert result.num_updates == 1
    state = trainer.optimizer.state_dict()["state"]
    assert len(state) == len(trained)  # AdamW moments for the adapters alone
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in frozen.items())
    assert any(not torch.equal(after[n], p) for n, p in trained.items())


def test_a_target_module_the_model_lacks_is_a_one_line_error_naming_the_field():
    with pytest.raises(ValueError, match=r"lora.target_modules: 'qkv' is not a linear layer of the model \(it has"):
        trainer_and_base("lora.target_modules=[q_proj,qkv]")


def test_the_adapter_alone_syncs_and_the_generator_then_samples_the_trainers_policy():
    config, tokenizer, base, trainer = trainer_and_base("trainer.dtype=float64", "generation.max_new_tokens=6")
    generator = build_generator(config, base, tokenizer)
    a_step(trainer, tokenizer)
    version, weights = trainer.export_weights()
    full = sum(p.numel() for p in trainer.model.parameters())
    assert version == 1 and all(".lora_A." in n or ".lora_B." in n for n in weights)
    assert sum(t.numel() for t in weights.values()) * 5 < full
    requests = [SampleRequest(prompt_ids=tokenizer.encode(p), seed=i) for i, p in enumerate(["1+2=", "13+4="])]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    before = generator.generate(requests, params)
    generator.load_weights(weights, version)
    after = generator.generate(requests, params)
    assert generator.version == 1
    assert [r.logprobs for r in before] != [r.logprobs for r in after]  # B was zero: the sync moved the policy
    for rollout in after:
        ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
        with torch.no_grad():
            scored, _ = token_logprobs(trainer.model, ids, torch.ones_like(ids))
        expected = scored[0, len(rollout.prompt_ids) :]
        torch.testing.assert_close(torch.tensor(rollout.logprobs, dtype=torch.float64), expected, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_a_lora_run_syncs_adapter_bytes_only(tmp_path):
    config = load_config(None, [*SMALL, *LORA, f"logging.output_dir={tmp_path / 'run'}"])
    summary = train(config)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert summary["steps"] == 4
    # rank 4 over the 7 projections (in, out) of 2 layers: (in + out) * 4 float32 each
    shapes = [(32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64), (64, 32)]
    adapter = 2 * 4 * 4 * sum(i + o for i, o in shapes)
    assert {m["sync_bytes"] for m in metrics} == {adapter}
    assert all(m["integrity/weights"] == 0 and m["integrity/sampling"] <= 0.01 for m in metrics)


@pytest.mark.slow
def test_lora_trains_multi_turn_episodes_in_mini_batches(tmp_path):
    """Adapters with two mini-batch updates a step, on feedback episodes whose replies are masked."""
    episodes = ["environment.name=feedback", "environment.max_turns=3", "environment.max_tokens=40"]
    overrides = [*SMALL, *LORA, *episodes, "step.num_minibatches=2", "warm_start.steps=60", "warm_start.lr=0.01"]
    summary = train(load_config(None, [*overrides, f"logging.output_dir={tmp_path / 'run'}", "step.max_steps=2"]))
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert summary["steps"] == 2
    assert [m["num_updates"] for m in metrics] == [2, 2]
    assert max(m["episode/turns"] for m in metrics) > 1 and all(m["episode/masked_tokens"] > 0 for m in metrics)
    assert len({m["sync_bytes"] for m in metrics}) == 1 and metrics[0]["sync_bytes"] < 100_000  # the adapter alone


def test_lora_dropout_acts_in_the_loss_forward_only():
    _, tokenizer, _, trainer = trainer_and_base("lora.dropout=0.5")
    torch.manual_seed(0)
    batch = random_batch(trainer.model, num_groups=2, group_size=4, vocab_size=len(tokenizer), seed=0)
    a_step(trainer, tokenizer)  # B moves off zero, so the adapters' inputs matter
    batch.prox_logprobs = trainer.compute_logprobs(batch)
    assert torch.equal(batch.prox_logprobs, trainer.compute_logprobs(batch))  # scoring: no dropout
    trainer.begin_train_step()
    trainer.train_microbatch(batch)
    ratio_mean = trainer.finish_train_step().metrics["ratio_mean"]
    assert abs(ratio_mean - 1.0) > 1e-4  # the loss forward dropped adapter inputs


def dropout_gradients(recompute: bool, seed: int) -> dict[str, torch.Tensor]:
    """The adapters' gradients of one micro-batch with lora.dropout on, the RNG seeded with ``seed``."""
    _, tokenizer, _, trainer = trainer_and_base(
        "lora.dropout=0.5", "trainer.dtype=float64", f"trainer.activation_checkpointing={recompute}"
    )
    a_step(trainer, tokenizer)  # B moves off zero, so dropped adapter inputs change every gradient
    batch = random_batch(trainer.model, num_groups=2, group_size=4, vocab_size=len(tokenizer), seed=1)
    torch.manual_seed(seed)
    trainer.begin_train_step()
    trainer.train_microbatch(batch)
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.abort_train_step()
    return grads


def test_lora_dropout_under_activation_checkpointing_gives_the_gradients_of_the_plain_model():
    plain, recomputed = dropout_gradients(False, seed=0), dropout_gradients(True, seed=0)
    assert plain.keys() == recomputed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-12, atol=1e-14)
    other_masks = dropout_gradients(False, seed=1)  # the check is not vacuous: dropout moves the gradients
    assert any(not torch.allclose(other_masks[name], grad) for name, grad in plain.items())


def started_workers(tmp_path, monkeypatch, *overrides):
    """The local runtime's workers for a SMALL run: (its generator, its trainer)."""
    from asyncrl import run as run_module
    from asyncrl import workers
    from asyncrl.runtime.local import LocalRuntime

    built = []
    monkeypatch.setattr(
        workers, "build_generator", lambda *args, **kwargs: built.append(build_generator(*args, **kwargs)) or built[-1]
    )
    config = load_config(None, [*SMALL, "trainer.device=cpu", *overrides])
    runtime = LocalRuntime()
    trainer, _ = run_module._start_workers(runtime, config, run_module.RunContext(tmp_path), run_module._build(config))
    runtime.shutdown()
    return config, built[0], trainer.worker.trainer


def storage(model):
    """Each parameter's data pointer, under its name in the plain model (peft's wrapping taken off)."""
    return {
        name.removeprefix("base_model.model.").replace(".base_layer.", "."): p.data_ptr()
        for name, p in model.named_parameters()
    }


def test_the_in_process_generator_shares_the_frozen_base_and_keeps_its_own_adapter(tmp_path, monkeypatch):
    config, generator, trainer = started_workers(tmp_path, monkeypatch, "lora.rank=4", "trainer.dtype=float64")
    tokenizer = build_tokenizer(config)
    ours, theirs = storage(generator.model), storage(trainer.model)
    base = [name for name in theirs if "lora_" not in name]
    assert set(ours) == set(theirs) and base
    assert all(ours[name] == theirs[name] for name in base)
    assert all(ours[name] != theirs[name] for name in theirs if "lora_" in name)
    untouched = build_model(config, tokenizer).to(torch.float64).state_dict()
    a_step(trainer, tokenizer)
    version, weights = trainer.export_weights()
    generator.load_weights(weights, version)
    requests = [SampleRequest(prompt_ids=tokenizer.encode(p), seed=i) for i, p in enumerate(["1+2=", "13+4="])]
    for rollout in generator.generate(requests, SamplingParams(max_new_tokens=4, temperature=1.0)):
        ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
        with torch.no_grad():
            scored, _ = token_logprobs(trainer.model, ids, torch.ones_like(ids))
        expected = scored[0, len(rollout.prompt_ids) :]
        torch.testing.assert_close(torch.tensor(rollout.logprobs, dtype=torch.float64), expected, rtol=1e-9, atol=1e-9)
    assert base_sha256(trainer.model.state_dict()) == base_sha256(untouched)


def test_a_shared_bfloat16_base_stays_shared_and_unchanged_through_a_step_and_a_sync(tmp_path, monkeypatch):
    config, generator, trainer = started_workers(tmp_path, monkeypatch, "lora.rank=4", "trainer.dtype=bfloat16")
    tokenizer = build_tokenizer(config)
    untouched = build_model(config, tokenizer).to(torch.bfloat16).state_dict()
    a_step(trainer, tokenizer)
    version, weights = trainer.export_weights()
    generator.load_weights(weights, version)
    ours, theirs = storage(generator.model), storage(trainer.model)
    assert all(ours[name] == theirs[name] for name in theirs if "lora_" not in name)
    assert base_sha256(trainer.model.state_dict()) == base_sha256(untouched)


def test_full_fine_tuning_gives_the_in_process_generator_its_own_copy(tmp_path, monkeypatch):
    _, generator, trainer = started_workers(tmp_path, monkeypatch)
    ours, theirs = storage(generator.model), storage(trainer.model)
    assert set(ours) == set(theirs) and not set(ours.values()) & set(theirs.values())


def test_the_initial_adapters_depend_on_the_run_config_not_on_the_global_rng():
    first = trainer_and_base()[3]
    torch.rand(1000)
    second = trainer_and_base()[3]
    other_seed = trainer_and_base("seed=1")[3]
    adapters = [dict(t.model.named_parameters()) for t in (first, second, other_seed)]
    names = [n for n in adapters[0] if ".lora_A." in n]
    assert names and all(torch.equal(adapters[0][n], adapters[1][n]) for n in names)
    assert not any(torch.equal(adapters[0][n], adapters[2][n]) for n in names)
