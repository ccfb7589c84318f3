"""Each subsystem at a released model's tensor sizes: short runs on ``real_size_model`` (conftest),
a 2-layer ``LlamaForCausalLM`` with SmolLM2-135M's shapes, whose tied 49,152 x 576 embedding
(28,311,552 elements, over 2**24) is larger than its tokenizer's vocabulary, as a padded embedding
is. Built from a config, nothing downloaded. The built-in tiny model never has a tensor that big,
and a float32 rounding of the fingerprint's positions crashed the first real run at its first
weight sync: here the integrity guard, chunked and packed scoring, LoRA with merge and eval,
checkpoint and resume, the Ray runtime with both weight transports, and context parallelism each
run for two steps of 2 prompts x 2 samples (docs/models.md, "At real tensor sizes")."""

import json

import pytest
import torch
from helpers import error
from safetensors.torch import load_file
from test_ray import DIGITS, RAY, close, deterministic

from asyncrl.checkpoint import resolve_checkpoint
from asyncrl.cli import main
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.slow

EMBEDDING = 49_152 * 576  # elements of the tied embedding
TIED, HEAD, Q = "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight"
PROBE = "integrity/sampling"  # the probe's measured rounding: another layout rounds otherwise (each below 1e-5)


def overrides(model) -> list[str]:
    return [
        f"model.path={model}",
        "data.task.name=arithmetic",
        "data.task.options.difficulty=1",
        "data.chat_template=true",
        "data.eval_size=2",
        "step.prompts_per_step=2",
        "step.generations_per_prompt=2",
        "step.max_steps=2",
        "generation.max_new_tokens=4",
        DIGITS,  # the untrained model's groups vary: real gradients, weights that move
        "trainer.lr_schedule=constant",  # a run resumed from step 1 then matches exactly
        "integrity.sampling.every_syncs=1",  # the sampling probe at every sync
        "warm_start.steps=0",
        "logging.eval_every_steps=null",
        "logging.tensorboard=false",
        "logging.progress=false",
        "runtime.torch_threads=1",
    ]


def train(run_dir, model, *extra) -> list[dict]:
    """``asyncrl train`` of the short run in ``run_dir``: its metrics.jsonl."""
    assert main(["train", "--output-dir", str(run_dir), *overrides(model), *extra]) == 0
    return read_jsonl(run_dir / "metrics.jsonl")


@pytest.fixture(scope="module")
def plain(real_size_model, tmp_path_factory):
    """The reference: the short run on the local runtime, full fine-tuning, the guard on."""
    return train(tmp_path_factory.mktemp("plain") / "run", real_size_model)


def test_the_model_embeds_more_rows_than_its_tokenizer_has(real_size_model):
    from transformers import AutoTokenizer

    config = json.loads((real_size_model / "config.json").read_text())
    assert config["vocab_size"] * config["hidden_size"] == EMBEDDING > 2**24 and config["tie_word_embeddings"]
    assert len(AutoTokenizer.from_pretrained(real_size_model)) < config["vocab_size"]


def test_weight_fingerprints_and_the_sampling_probe_pass_at_every_sync(plain):
    assert [m["step"] for m in plain] == [1, 2] and all(m["grad_norm"] > 0 for m in plain)  # the weights move
    assert [m["integrity/weights"] for m in plain] == [0, 0]
    assert all(0 <= m[PROBE] < 1e-5 for m in plain)  # the probe ran at both syncs
    assert all(m["sync_bytes"] >= 4 * EMBEDDING for m in plain)  # the float32 embedding travelled


def test_chunked_and_packed_scoring_matches_the_plain_run(plain, real_size_model, tmp_path):
    """The 49,152-wide logits scored 4 tokens at a time, each micro-batch's rows as one packed row."""
    chunked = train(tmp_path / "run", real_size_model, "trainer.logprob_chunk_tokens=4", "trainer.packing=true")
    assert len(chunked) == 2 and all(m[PROBE] < 1e-5 for m in chunked)
    assert all(close(a, b) for a, b in zip(deterministic(chunked, PROBE), deterministic(plain, PROBE)))


def test_lora_refuses_an_adapter_on_the_tied_embedding(real_size_model, tmp_path, capsys):
    """docs/lora.md: adapters go on linear layers; the embedding is not one."""
    targets = "lora.target_modules=[q_proj,embed_tokens]"
    message = error(capsys, "train", "--output-dir", str(tmp_path), *overrides(real_size_model), "lora.rank=4", targets)
    assert message.startswith("lora.target_modules: 'embed_tokens' is not a linear layer of the model")


def test_a_resumed_lora_run_with_an_adapted_tied_head_merges_into_a_model_that_evaluates_as_it(
    real_size_model, tmp_path, capsys
):
    """An adapter on lm_head, the output side of the tied embedding: its checkpoint holds the
    adapter alone and resumes; merged, the head gets B A and the input embedding stays the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, lora = tmp_path / "lora", ["lora.rank=4", "lora.target_modules=[q_proj,v_proj,lm_head]", "trainer.lr=0.01"]
    train(run_dir, real_size_model, *lora, "step.max_steps=1")
    assert main(["train", "--resume", str(run_dir), "step.max_steps=2"]) == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["integrity/weights"] for m in metrics] == [0, 0] and all(m["grad_norm"] > 0 for m in metrics)
    assert all(0 < m["sync_bytes"] < EMBEDDING for m in metrics)  # the adapter alone
    assert main(["merge", str(run_dir), str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run_dir)]) == 0
    of_checkpoint = json.loads(capsys.readouterr().out)
    assert main(["eval", *overrides(tmp_path / "merged")]) == 0
    of_merged = json.loads(capsys.readouterr().out)
    assert of_checkpoint.pop("checkpoint") and of_merged.pop("checkpoint") is None
    assert of_merged == of_checkpoint and of_checkpoint["num_prompts"] == 2, of_checkpoint
    base, merged = (load_file(path / "model.safetensors") for path in (real_size_model, tmp_path / "merged"))
    assert torch.equal(merged[TIED], base[TIED].float()) and not torch.equal(merged[HEAD], merged[TIED])
    assert not torch.equal(merged[Q], base[Q].float())
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(real_size_model, dtype=torch.float32), resolve_checkpoint(run_dir)
    )
    ids = torch.arange(1, 40).reshape(3, 13)
    with torch.no_grad():
        expected = adapted(ids).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_run_resumed_from_step_1_writes_the_metrics_of_the_uninterrupted_one(plain, real_size_model, tmp_path):
    train(tmp_path / "run", real_size_model, "step.max_steps=1")
    assert main(["train", "--resume", str(tmp_path / "run"), "step.max_steps=2"]) == 0
    assert deterministic(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == deterministic(plain)


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_ray_run_matches_the_local_one_over_each_weight_transport(
    ray_cluster, plain, real_size_model, tmp_path, transport
):
    metrics = train(tmp_path / "run", real_size_model, RAY, f"sync.transport={transport}")
    assert [m["sync_transport"] for m in metrics] == [transport] * 2
    assert deterministic(metrics) == deterministic(plain)  # fingerprints and probe included


def test_two_context_parallel_ranks_match_the_single_rank_run(ray_cluster, plain, real_size_model, tmp_path):
    metrics = train(tmp_path / "run", real_size_model, RAY, "parallel.cp=2", "sync.transport=object_store")
    assert [m["integrity/weights"] for m in metrics] == [0, 0]
    assert len(metrics) == 2 and all(m[PROBE] < 1e-5 for m in metrics)
    assert all(close(a, b) for a, b in zip(deterministic(metrics, PROBE), deterministic(plain, PROBE)))
