"""LoRA checkpoints: the adapter in PEFT's format resumes exactly, is checked against its base,
merges into a plain HF model (``asyncrl merge``), and evaluates (``asyncrl eval --checkpoint``)."""

import json

import pytest
import torch
from helpers import SMALL, deterministic, error, run
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from asyncrl.checkpoint import resolve_checkpoint
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.environments.base import environment_class
from asyncrl.models import build_model, build_tokenizer
from asyncrl.warm_start import warm_start_policy

LORA = [
    "lora.rank=4",
    "trainer.device=cpu",
    "rewards.functions=[reward_functions:digits]",
]  # rewards that vary in a group


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 4-step LoRA run, and one stopped after 2 steps and resumed to 4."""
    tmp = tmp_path_factory.mktemp("lora")
    full = run(tmp, "full", *LORA, "checkpoint.every_steps=2")
    run(tmp, "part", *LORA, "step.max_steps=2")
    resumed = run(tmp, "part", *LORA, resume=tmp / "part")
    return tmp, full, resumed


def base_model(*overrides):
    """The run's base: built and warm-started from its config, as train, eval and merge build it."""
    config = load_config(None, [*SMALL, *LORA, *overrides])
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    warm_start_policy(model, tokenizer, config, environment_class(config))
    return model


@pytest.mark.slow
def test_a_resumed_lora_run_matches_the_uninterrupted_one(runs):
    tmp, (_, full, full_groups), (summary, resumed, resumed_groups) = runs
    assert summary["steps"] == 4
    assert deterministic(resumed) == deterministic(full)
    assert resumed_groups == full_groups
    full_adapter = load_file(resolve_checkpoint(tmp / "full") / "adapter_model.safetensors")
    resumed_adapter = load_file(resolve_checkpoint(tmp / "part") / "adapter_model.safetensors")
    assert full_adapter.keys() == resumed_adapter.keys()
    assert all(torch.equal(full_adapter[name], resumed_adapter[name]) for name in full_adapter)
    assert any(name.endswith("lora_B.weight") and tensor.abs().sum() > 0 for name, tensor in full_adapter.items())


@pytest.mark.slow
def test_peft_loads_the_checkpoint_over_its_base(runs):
    checkpoint = resolve_checkpoint(runs[0] / "full")
    assert not (checkpoint / "model.safetensors").exists()
    model = PeftModel.from_pretrained(base_model(), checkpoint)
    saved = load_file(checkpoint / "adapter_model.safetensors")
    state = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name.replace(".weight", ".default.weight")], tensor)


def merged_matches_base_and_adapter(run_dir, out, *overrides):
    """``asyncrl merge`` of the run's checkpoint gives the logits of base + adapter, not the base's."""
    assert main(["merge", str(run_dir), str(out)]) == 0
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    adapted = PeftModel.from_pretrained(base_model(*overrides), resolve_checkpoint(run_dir))
    ids = torch.tensor([[3, 5, 7, 9, 11, 2]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(ids).logits, base_model(*overrides)(ids).logits, atol=1e-4)


@pytest.mark.slow
def test_merge_writes_an_hf_model_with_the_logits_of_base_and_adapter(runs, capsys):
    merged_matches_base_and_adapter(runs[0] / "full", runs[0] / "merged")
    assert "already exists" in error(capsys, "merge", str(runs[0] / "full"), str(runs[0] / "merged"))


WARM = ["warm_start.steps=20", "environment.name=feedback", "environment.max_turns=2", "environment.max_tokens=40"]


@pytest.mark.slow
def test_merge_and_eval_rebuild_the_warm_started_base_of_the_run(tmp_path, capsys):
    """The run warm-starts on its environment's demonstrations; merge and eval must do the same."""
    run(tmp_path, "warm", *LORA, *WARM, "step.max_steps=2")
    cold, warm = base_model().state_dict(), base_model(*WARM).state_dict()
    assert any(not torch.equal(cold[name], warm[name]) for name in cold)  # the warm start moved the base
    merged_matches_base_and_adapter(tmp_path / "warm", tmp_path / "merged", *WARM)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "warm")]) == 0  # under the run's own config
    assert json.loads(capsys.readouterr().out)["num_prompts"] == 8


@pytest.mark.slow
def test_eval_takes_a_lora_checkpoint(runs, capsys):
    assert main(["eval", "--checkpoint", str(runs[0] / "full"), *SMALL, *LORA]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_prompts"] == 8 and 0.0 <= result["accuracy"] <= 1.0


@pytest.mark.slow
def test_an_adapter_over_another_base_is_refused_in_one_line(runs, capsys):
    other = "model.init_seed=7"
    message = error(capsys, "train", "--resume", str(runs[0] / "full"), other)
    assert "lora_base.json: the adapter was trained over another base" in message
    assert "lora_base.json" in error(capsys, "eval", "--checkpoint", str(runs[0] / "full"), *SMALL, *LORA, other)
    assert "lora_base.json" in error(capsys, "merge", str(runs[0] / "full"), str(runs[0] / "other"), other)


def test_merge_names_a_bad_checkpoint_in_one_line(tmp_path, capsys):
    assert "no checkpoint found" in error(capsys, "merge", str(tmp_path / "none"), str(tmp_path / "out"))


def test_the_frozen_base_is_hashed_once_until_a_base_tensor_changes(tmp_path, monkeypatch):
    from asyncrl.models import lora

    config = load_config(None, [*SMALL, *LORA])
    model = lora.apply_lora(build_model(config, build_tokenizer(config)), config.lora, torch.float32)
    real, hashed = lora.base_sha256, []
    monkeypatch.setattr(lora, "base_sha256", lambda state: hashed.append(1) or real(state))

    def saved_digest(name):
        lora.save_adapter(model, tmp_path / name, model.state_dict())
        return json.loads((tmp_path / name / "lora_base.json").read_text())["sha256"]

    first = saved_digest("a")
    assert saved_digest("b") == first and len(hashed) == 1  # the same frozen tensors: not hashed again
    assert first == real(model.state_dict())
    with torch.no_grad():
        next(p for p in model.parameters() if not p.requires_grad).add_(1.0)
    changed = saved_digest("c")
    assert changed != first and len(hashed) == 2 and changed == real(model.state_dict())
