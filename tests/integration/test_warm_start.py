"""The warm start runs by default only on the built-in tiny model, every run seed starts from the same
warm-started weights, and its cache key never copies a checkpoint's weights to host memory."""

import os

import pytest
import torch
from helpers import ROOT, SMALL

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.data import Prompt, build_task
from asyncrl.models import (
    build_char_tokenizer,
    build_model,
    build_tiny_model,
    build_tokenizer,
    load_model,
    load_tokenizer,
)
from asyncrl.models.example import write_example_checkpoint
from asyncrl.warm_start import _cache_key, warm_start

PROMPTS = [Prompt("a", "1+1=", "2")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_example_checkpoint(tmp_path_factory.mktemp("example"))


def test_warm_start_steps_default_to_600_on_the_tiny_model_and_to_none_with_a_checkpoint():
    assert load_config(None, []).warm_start.steps == 600
    assert load_config(None, ["model.path=/models/x"]).warm_start.steps == 0
    assert load_config(None, ["model.path=/models/x", "warm_start.steps=7"]).warm_start.steps == 7
    assert load_config(None, ["warm_start.steps=0"]).warm_start.steps == 0


def warm_started(tmp_path, *overrides):
    config = load_config(None, [*SMALL, "warm_start.steps=3", f"warm_start.cache_dir={tmp_path}", *overrides])
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    warm_start(model, tokenizer, build_task(config.data, tokenizer).train, config.warm_start)
    return model.state_dict()


def test_every_run_seed_starts_from_the_same_warm_start_and_its_own_seed_changes_it(tmp_path):
    first = warm_started(tmp_path / "a", "seed=0")
    assert len(list((tmp_path / "a").glob("*.safetensors"))) == 1
    other_run_seed = warm_started(tmp_path / "b", "seed=1")
    other_warm_start = warm_started(tmp_path / "c", "seed=0", "warm_start.seed=1")
    names = list(first)
    assert all(torch.equal(first[name], other_run_seed[name]) for name in names)
    assert not all(torch.equal(first[name], other_warm_start[name]) for name in names)


def test_a_checkpoint_is_keyed_by_its_files_and_the_tiny_model_by_its_weights(checkpoint):
    cfg = load_config(None, ["warm_start.steps=5"]).warm_start
    tokenizer = load_tokenizer(checkpoint)
    model, other = load_model(checkpoint), load_model(checkpoint)
    with torch.no_grad():
        other.model.norm.weight.add_(1.0)
    key = _cache_key(model, str(checkpoint), tokenizer, PROMPTS, cfg)
    assert _cache_key(other, str(checkpoint), tokenizer, PROMPTS, cfg) == key  # weights' bytes are not read
    assert _cache_key(load_model(checkpoint, dtype=torch.float32), str(checkpoint), tokenizer, PROMPTS, cfg) != key
    stat = (checkpoint / "model.safetensors").stat()
    os.utime(checkpoint / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert _cache_key(model, str(checkpoint), tokenizer, PROMPTS, cfg) != key

    char = build_char_tokenizer()
    tiny = build_tiny_model(len(char), seed=0, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)
    tiny_key = _cache_key(tiny, None, char, PROMPTS, cfg)
    with torch.no_grad():
        tiny.model.norm.weight.add_(1.0)
    assert _cache_key(tiny, None, char, PROMPTS, cfg) != tiny_key


def test_demonstrations_are_keyed_by_their_messages_tools_and_template_and_rendered_only_on_a_miss(
    checkpoint, tmp_path, monkeypatch
):
    import asyncrl.warm_start as module

    cfg = load_config(None, ["warm_start.steps=1", "warm_start.batch_size=1", f"warm_start.cache_dir={tmp_path}"])
    cfg = cfg.warm_start
    tokenizer = load_tokenizer(checkpoint)
    model = load_model(checkpoint)
    talk = [[{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    key = _cache_key(model, str(checkpoint), tokenizer, PROMPTS, cfg, talk, tools)
    other_reply = [[talk[0][0], {"role": "assistant", "content": "3"}]]
    assert _cache_key(model, str(checkpoint), tokenizer, PROMPTS, cfg, other_reply, tools) != key
    assert _cache_key(model, str(checkpoint), tokenizer, PROMPTS, cfg, talk, None) != key
    monkeypatch.setattr(tokenizer, "chat_template", tokenizer.chat_template + " ")
    assert _cache_key(model, str(checkpoint), tokenizer, PROMPTS, cfg, talk, tools) != key
    monkeypatch.undo()

    rendered = []
    real = module.encode_conversation
    monkeypatch.setattr(module, "encode_conversation", lambda *args: rendered.append(1) or real(*args))
    tokenizer = load_tokenizer(checkpoint)
    for _ in range(2):
        warm_start(
            load_model(checkpoint), tokenizer, PROMPTS, cfg, model_path=str(checkpoint), demonstration=lambda p: talk[0]
        )
    assert rendered == [1]  # the second warm start loads the cache without templating its demonstrations


@pytest.mark.slow
def test_the_example_checkpoint_trains_through_model_path_and_warm_starts_only_when_asked(checkpoint, tmp_path, capsys):
    quick = [*SMALL[5:], f"model.path={checkpoint}", "step.max_steps=2", "data.chat_template=true"]
    plain = ["train", "--output-dir", str(tmp_path / "plain"), *quick, f"warm_start.cache_dir={tmp_path / 'warm'}"]
    plain.remove("warm_start.steps=0")
    assert main(plain) == 0
    assert not (tmp_path / "warm").exists()

    example = [
        "train",
        "--config",
        str(ROOT / "configs" / "example-checkpoint.yaml"),
        "--output-dir",
        str(tmp_path / "example"),
        *quick,
    ]
    example += ["warm_start.steps=3", "warm_start.batch_size=4", f"warm_start.cache_dir={tmp_path / 'warm'}"]
    assert main(example) == 0
    assert "after 2 steps" in capsys.readouterr().out
    assert len(list((tmp_path / "warm").glob("*.safetensors"))) == 1
    config = load_config(tmp_path / "example" / "config.yaml")
    assert (config.generation.temperature, config.generation.top_p, config.rewards.functions) == (0.7, 0.95, ["math"])
