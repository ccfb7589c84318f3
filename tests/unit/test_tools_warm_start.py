"""The warm start learns an environment's demonstrations: assistant turns trained, prompt and tool results masked."""

from __future__ import annotations

import torch
from helpers import ROOT

import asyncrl.warm_start as warm_start_module
from asyncrl.config import load_config
from asyncrl.data import Prompt
from asyncrl.environments.base import environment_class
from asyncrl.environments.calculator import CalculatorEnvironment
from asyncrl.models import build_char_tokenizer, build_tiny_model
from asyncrl.warm_start import demonstrations, encode_conversation, warm_start

PROMPT = Prompt("products/2/0", "12*34=", "408")


def test_a_demonstration_is_encoded_as_the_episode_lays_it_out_with_only_assistant_turns_trained():
    tokenizer = build_char_tokenizer(chat=True)
    messages = CalculatorEnvironment.demonstration(PROMPT)
    ids, mask = encode_conversation(tokenizer, messages, CalculatorEnvironment.schemas())
    whole = tokenizer.apply_chat_template(messages, tools=CalculatorEnvironment.schemas(), tokenize=False)
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    masked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>'
    assert trained == f"{call}<eos>408<eos>"
    assert masked == "S:tools calc(expr)\nU:12*34=\nA:R:408\nA:"


def tiny_chat_model():
    tokenizer = build_char_tokenizer(chat=True)
    return build_tiny_model(
        len(tokenizer), seed=0, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1
    ), tokenizer


def warm_started(tmp_path, demonstration):
    model, tokenizer = tiny_chat_model()
    cfg = load_config(None, ["warm_start.steps=2", "warm_start.batch_size=2", f"warm_start.cache_dir={tmp_path}"])
    warm_start(model, tokenizer, [PROMPT], cfg.warm_start, demonstration=demonstration, tools=[])
    return model.state_dict()


def test_tool_result_tokens_are_masked_out_of_the_warm_start(tmp_path):
    def ending_on(result, call="12*34"):
        def demonstration(prompt):
            return [*CalculatorEnvironment.demonstration(prompt)[:2], {"role": "tool", "content": result}]

        return demonstration

    base = warm_started(tmp_path / "a", ending_on("408"))
    other_result = warm_started(tmp_path / "b", ending_on("999"))
    assert all(torch.equal(base[name], other_result[name]) for name in base)

    def other_call(prompt):
        return CalculatorEnvironment.demonstration(Prompt(prompt.uid, "56*78=", prompt.answer))[:3]

    changed = warm_started(tmp_path / "c", other_call)
    assert not all(torch.equal(base[name], changed[name]) for name in base)


def test_a_run_warm_starts_on_its_environments_demonstrations_when_it_has_them():
    tool_use = demonstrations(environment_class(load_config(ROOT / "configs" / "tool-use.yaml", [])))
    assert tool_use["tools"] == CalculatorEnvironment.schemas()
    assert tool_use["demonstration"](PROMPT) == CalculatorEnvironment.demonstration(PROMPT)
    assert demonstrations(environment_class(load_config(None, []))) == {}  # single turn: the prompt and its answer


def test_only_the_demonstrations_a_batch_draws_are_rendered_each_once(tmp_path, monkeypatch):
    rendered = []
    encode = warm_start_module.encode_conversation

    def counting(tokenizer, messages, tools):
        rendered.append(messages[0]["content"])
        return encode(tokenizer, messages, tools)

    monkeypatch.setattr(warm_start_module, "encode_conversation", counting)
    model, tokenizer = tiny_chat_model()
    prompts = [Prompt(f"products/2/{i}", f"{10 + i}*34=", str((10 + i) * 34)) for i in range(200)]
    cfg = load_config(None, ["warm_start.steps=3", "warm_start.batch_size=4", f"warm_start.cache_dir={tmp_path}"])
    warm_start(model, tokenizer, prompts, cfg.warm_start, demonstration=CalculatorEnvironment.demonstration, tools=[])
    assert 0 < len(rendered) <= 3 * 4 and len(set(rendered)) == len(rendered), rendered
