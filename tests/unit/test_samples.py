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
from asyncrl.samples import as_text, scores, spread
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


def step_record_of(data: StepData) -> dict:
    from asyncrl import metrics
    from asyncrl.types import StepReport, StepResult, SyncReport

    report = StepReport(
        StepResult(version=3, loss=0.0, grad_norm=0.0, lr=1e-3, num_sequences=0, num_tokens=0, num_microbatches=0), data
    )
    sync = SyncReport(version=3, pause_s=0.0, transfer_s=0.0, bytes=0, transport="in_process")
    return metrics.step_record(report, sync, metrics.RunCounters(0, 0, 0, 0, 0, 0), metrics.StepClock(), 1.0, 1.0, 1)


def test_a_failed_group_is_marked_failed_and_left_out_of_the_step_s_reward_and_accuracy():
    scored, failed = make_groups(0, count=2, n=4)
    scored.rewards, failed.rewards = torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.zeros(4)
    scored.correct, failed.correct = scored.rewards.clone(), torch.zeros(4)
    for group in (scored, failed):
        group.samples = [{"prompt_uid": group.prompt_uid, "sample": 0}]
    data = StepData()
    data.add(scored, 2, advantages=torch.tensor([0.5, 0.5, -1.5, 0.5]))
    data.add(failed, 2, advantages=None, failed=True)
    assert [g["failed"] for g in data.groups] == [False, True]
    assert [r["failed"] for r in data.samples] == [False, True]
    step = step_record_of(data)
    assert step["reward_mean"] == step["accuracy"] == 0.75  # the failed group's zeros are not scores
    view = scores(record(advantage=None, failed=True))
    assert "failed (a reward raised: not trained)" in view and "filtered" not in view
    data = StepData()
    data.add(failed, 2, advantages=None, failed=True)
    step = step_record_of(data)
    assert step["reward_mean"] is None and step["accuracy"] is None


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


def with_message(index, **changes):
    """A record as JSON whose message ``index`` (0-based) has ``changes``."""
    base = record()
    base["messages"][index] = {**base["messages"][index], **changes}
    return json.dumps(base)


CALLS_SHAPE = "not a list of tool calls (objects whose function is an object with a string name)"


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
        (
            [json.dumps(record()), with_message(1, tool_calls=5)],
            f"record 2 message 2: 'tool_calls' is {CALLS_SHAPE}",
        ),
        (
            [with_message(1, tool_calls=[{"function": "lookup"}])],
            f"record 1 message 2: 'tool_calls' is {CALLS_SHAPE}",
        ),
        ([with_message(1, tool_calls=[{"function": {"name": 3}}])], "message 2: 'tool_calls' is not a list"),
        ([with_message(1, tool_calls=["lookup"])], "record 1 message 2: 'tool_calls' is not a list"),
        ([with_message(2, content={"text": "ba"})], "record 1 message 3: 'content' is not a string or null"),
        ([with_message(3, tokens="6")], "record 1 message 4: 'tokens' is not an integer"),
        ([with_message(3, finish_reason=None)], "record 1 message 4: 'finish_reason' is not a string"),
        ([with_message(1, text=["<call w>"])], "record 1 message 2: 'text' is not a string"),
        ([with_message(2, name=7)], "record 1 message 3: 'name' is not a string or null"),
        ([json.dumps(record(sample="0"))], "record 1: 'sample' is not an integer"),
        ([json.dumps(record(answer=7))], "record 1: 'answer' is not a string"),
        (
            [json.dumps(record(reward_parts={"format": "1"}))],
            "record 1: 'reward_parts' is not an object of numbers",
        ),
        ([json.dumps(record(reward_parts=[1.0]))], "record 1: 'reward_parts' is not an object of numbers"),
        ([json.dumps(record(correct="yes"))], "record 1: 'correct' is not true or false"),
        ([json.dumps(record(advantage="-0.25"))], "record 1: 'advantage' is not a number or null"),
        ([json.dumps(record(failed=1))], "record 1: 'failed' is not true or false"),
        ([json.dumps(record(versions=3))], "record 1: 'versions' is not a list of integers"),
        ([json.dumps(record(tokens={"prompt": "9"}))], "record 1: 'tokens' is not an object of integers"),
        ([json.dumps(record(reward=True))], "record 1 has no 'reward' that is a number"),
    ],
)
def test_a_bad_run_directory_or_samples_file_is_one_line_and_exit_code_2(tmp_path, capsys, lines, message):
    run_dir = tmp_path / "run"
    if lines is not None:
        run_dir.mkdir()
        if lines:
            (run_dir / "samples.jsonl").write_text("\n".join(lines) + "\n")
    shown = error(capsys, "samples", str(run_dir), "--step", "3")
    assert message in shown
    if "record" in message:
        assert shown.startswith(f"{run_dir / 'samples.jsonl'}: record ")


def test_the_records_of_a_run_keep_the_shape_the_view_reads_and_odd_calls_still_mirror_as_text(tmp_path):
    run_dir = write_samples(tmp_path / "run", [record(), record(advantage=None, failed=True, reward_parts={})])
    assert len(read_samples(run_dir)) == 2
    odd = record(messages=[{"role": "assistant", "content": None, "tool_calls": 5}])
    assert "-> call" not in as_text(odd)  # an environment's message mirrored as it came
    calls = [{"function": "lookup"}, "search", {"name": "calc", "arguments": "1+1"}]
    text = as_text(record(messages=[{"role": "assistant", "content": "", "tool_calls": calls}]))
    assert "-> call lookup" in text and "-> call search" in text and "-> call calc(1+1)" in text
