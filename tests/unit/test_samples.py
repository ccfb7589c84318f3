"""The sample log: an episode's transcript keeps each turn with its tokens and where it was cut, tool
calls and observations; the trainer adds each sample's step and advantage; a step's samples are
spread over its groups; the writer mirrors them to TensorBoard and W&B; ``asyncrl samples`` lays
them out and refuses a bad run directory or a damaged file in one line."""

import json
import sys
import types

import pytest
import torch
from helpers import error, make_groups
from rich.console import Console

from asyncrl.cli import main
from asyncrl.config import LoggingConfig
from asyncrl.data import Prompt
from asyncrl.environments import Environment, Turn
from asyncrl.generation import GeneratorBase, SamplingParams
from asyncrl.metrics import MetricsWriter, read_jsonl
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.rollout.episode import EpisodeLimits, MultiTurn, turn_seed
from asyncrl.sample_view import at_step, read_samples, show
from asyncrl.samples import as_text, spread
from asyncrl.types import Rollout, StepData

TOKENIZER = build_char_tokenizer(chat=True)
EOS = TOKENIZER.eos_token_id


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class Scripted(GeneratorBase):
    """Turn t of the episode with seed s samples ``script[s][t]``, cut at max_new_tokens."""

    def __init__(self, script):
        self.by_seed = {turn_seed(seed, t): out for seed, turns in script.items() for t, out in enumerate(turns)}
        self.version = 3

    def generate(self, requests, params):
        outs = [self.by_seed[r.seed] for r in requests]
        return [
            Rollout(
                list(r.prompt_ids),
                out[: params.max_new_tokens],
                [-0.1] * len(out[: params.max_new_tokens]),
                "stop" if len(out) <= params.max_new_tokens else "length",
            )
            for r, out in zip(requests, outs)
        ]


class Lookup(Environment):
    """``?word`` calls the lookup tool on ``word``; its result is the word reversed."""

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    def parse(self, text):
        if text.startswith("?"):
            call = {"function": {"name": "lookup", "arguments": {"word": text[1:]}}}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
        return {"role": "assistant", "content": text}

    def step(self, assistant):
        if not assistant.get("tool_calls"):
            return Turn([], done=True, reward=1.0)
        word = assistant["tool_calls"][0]["function"]["arguments"]["word"]
        return Turn([{"role": "tool", "name": "lookup", "content": word[::-1]}], done=False)


def test_an_episodes_transcript_holds_each_turn_its_tool_calls_and_observations_and_marks_the_cut_turn():
    script = {5: [ids("?ab") + [EOS], ids("0123456789")]}  # the second turn never ends: cut at 6 tokens
    episodes = MultiTurn(Scripted(script), TOKENIZER, Lookup, stop_token_ids=[EOS], limits=EpisodeLimits(4, 200))
    try:
        [completion] = episodes.run([Prompt("p", "spell", "x")], [5], SamplingParams(max_new_tokens=6))
    finally:
        episodes.close()
    call = {"function": {"name": "lookup", "arguments": {"word": "ab"}}}
    assert completion.transcript == [
        {"role": "user", "content": "spell"},
        {"role": "assistant", "content": "", "tool_calls": [call], "tokens": 4, "finish_reason": "stop", "text": "?ab"},
        {"role": "tool", "name": "lookup", "content": "ba"},
        {"role": "assistant", "content": "012345", "tokens": 6, "finish_reason": "length"},
    ]
    assert completion.metrics["turns"] == 2 and completion.metrics["turns_cut"] == 1


def record(step=4, split="train", uid="p0", sample=0, **changes):
    messages = [
        {"role": "user", "content": "spell"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "lookup", "arguments": {"w": 1}}}],
            "tokens": 4,
            "finish_reason": "stop",
            "text": "<call w>",
        },
        {"role": "tool", "name": "lookup", "content": "ba"},
        {"role": "assistant", "content": "0123", "tokens": 6, "finish_reason": "length"},
    ]
    base = {
        "step": step,
        "split": split,
        "prompt_uid": uid,
        "sample": sample,
        "prompt": "spell",
        "answer": "x",
        "messages": messages,
        "reward": 0.5,
        "reward_parts": {"exact_match": 0.0, "format": 1.0},
        "correct": False,
        "finish_reason": "length",
        "versions": [2, 3],
        "tokens": {"prompt": 9, "response": 20, "sampled": 10},
        "advantage": -0.25 if split == "train" else None,
    }
    return {**base, **changes}


def test_the_trainer_stamps_each_sample_with_its_step_and_advantage_and_none_when_filtered():
    group = make_groups(0, count=1, n=4)[0]
    group.samples = [{"prompt_uid": group.prompt_uid, "sample": i} for i in range(2)]
    data = StepData()
    data.add(group, 6, advantages=torch.tensor([0.5, -0.5, 1.0, -1.0]))
    data.add(group, 6, advantages=None)
    assert [(r["step"], r["split"], r["sample"], r["advantage"]) for r in data.samples] == [
        (7, "train", 0, 0.5),
        (7, "train", 1, -0.5),
        (7, "train", 0, None),
        (7, "train", 1, None),
    ]


def test_a_steps_samples_are_spread_over_its_groups_first():
    samples = [{"prompt_uid": uid, "sample": i} for uid in "abc" for i in range(2)]
    assert [(r["prompt_uid"], r["sample"]) for r in spread(samples, 4)] == [("a", 0), ("b", 0), ("c", 0), ("a", 1)]


def test_samples_go_to_their_file_to_tensorboard_as_text_and_to_wandb_as_a_table(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: types.SimpleNamespace(log=lambda v, step: logged.append((v, step)), finish=lambda: 0)
    fake.Table = lambda columns, data: {"columns": columns, "data": data}
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsWriter(tmp_path, LoggingConfig(tensorboard=True, wandb=True)) as writer:
        writer.log_samples([record(uid="p0"), record(uid="p1")])
        writer.log_samples([record(split="eval", uid="e0")])
    assert read_jsonl(tmp_path / "samples.jsonl") == [
        record(uid="p0"),
        record(uid="p1"),
        record(split="eval", uid="e0"),
    ]
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    [train_text] = accumulator.Tensors("samples/train")
    assert train_text.step == 4 and as_text(record(uid="p1")) in train_text.tensor_proto.string_val[0].decode()
    [(train, step), (evaluation, _)] = logged
    assert step == 4 and train["samples/train"]["data"][1][:4] == [4, "train", "p1", 0]
    assert "0123" in train["samples/train"]["data"][1][4] and list(evaluation) == ["samples/eval"]


def test_a_resumed_run_keeps_the_samples_up_to_its_checkpoint(tmp_path):
    with MetricsWriter(tmp_path, LoggingConfig(tensorboard=False)) as writer:
        writer.log_samples([record(step=1), record(step=2), record(step=3)])
    with MetricsWriter(tmp_path, LoggingConfig(tensorboard=False), resume_step=2) as writer:
        writer.log_samples([record(step=3, uid="again")])
    assert [(r["step"], r["prompt_uid"]) for r in read_jsonl(tmp_path / "samples.jsonl")] == [
        (1, "p0"),
        (2, "p0"),
        (3, "again"),
    ]


def write_samples(run_dir, records):
    run_dir.mkdir(exist_ok=True)
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_the_view_lays_out_the_turns_tool_calls_results_and_the_cut(tmp_path):
    run_dir = write_samples(tmp_path / "run", [record(step=2), record(split="eval"), record(), record(uid="p1")])
    console = Console(record=True, width=120, force_terminal=False)
    show(at_step(read_samples(run_dir), None, str(run_dir)), console)
    text = console.export_text()
    assert text.count("step 4 train") == 2 and text.count("step 4 eval") == 1 and "step 2" not in text
    assert text.index("step 4 train") < text.index("step 4 eval")  # training samples first
    assert "advantage -0.250" in text and "exact_match 0.000, format 1.000" in text and "version 2,3" in text
    assert '-> call lookup({"w": 1})' in text and "tool lookup" in text and "<call w>" in text
    assert "assistant, 6 tokens, CUT at generation.max_new_tokens" in text
    assert "assistant, 4 tokens " in text and "assistant, 4 tokens," not in text


def test_the_samples_command_prints_the_step_asked_for(tmp_path, capsys):
    run_dir = write_samples(tmp_path / "run", [record(step=2, uid="early"), record(step=4, uid="late")])
    assert main(["samples", str(run_dir), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "early" in out and "late" not in out


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (None, "not a run directory"),
        ([], "holds no samples.jsonl"),
        (['{"step": 1}', "{broken", "{}"], "line 2 is not valid JSON"),
        ([json.dumps({**record(), "messages": "hello"})], "record 1 has no 'messages' that is a list of messages"),
        ([json.dumps(record(split="test"))], "record 1 has split 'test'"),
        ([json.dumps({**record(), "messages": [{"content": "x"}]})], "record 1 has a message that is not an object"),
        ([json.dumps(record(step=4))], "--step: "),
    ],
)
def test_a_bad_run_directory_or_samples_file_is_one_line_and_exit_code_2(tmp_path, capsys, lines, message):
    run_dir = tmp_path / "run"
    if lines is not None:
        run_dir.mkdir()
        if lines:
            (run_dir / "samples.jsonl").write_text("\n".join(lines) + "\n")
    assert message in error(capsys, "samples", str(run_dir), "--step", "3")
