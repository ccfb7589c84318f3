"""data.task.name reasoning_gym: seeded disjoint splits, the dataset's own checker as the task reward, input errors."""

import json
import pickle
import sys

import pytest
from helpers import SMALL

from asyncrl.checkpoint import load_state
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.data import PromptLoader, build_task
from asyncrl.data.reasoning_gym import EntryAnswer
from asyncrl.metrics import read_jsonl
from asyncrl.models.tokenizer import DEFAULT_ALPHABET
from asyncrl.parts import check_parts
from asyncrl.rewards import RewardRunner
from asyncrl.run import train

pytest.importorskip("reasoning_gym")  # in the test extra; the missing-package error is tested below

CHAIN_SUM = [
    "data.task={name: reasoning_gym}",
    "data.task.options.dataset=chain_sum",
    "data.task.options.dataset_config={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
    "rewards.functions=[task]",
    "data.task.options.num_problems=600",
    "data.eval_size=100",
]


def chain_sum(*overrides):
    return load_config(None, [*CHAIN_SUM, *overrides])


@pytest.mark.parametrize("dataset", ["chain_sum", "basic_arithmetic", "count_bits", "leg_counting", "spell_backward"])
def test_splits_are_seeded_disjoint_and_in_the_char_alphabet(dataset):
    overrides = [
        f"data.task.options.dataset={dataset}",
        "data.task.options.dataset_config={}",
        "data.task.options.num_problems=200",
        "data.eval_size=40",
    ]
    task = build_task(chain_sum(*overrides).data)
    again = build_task(chain_sum(*overrides).data)
    assert (task.train, task.heldout) == (again.train, again.heldout)
    assert len(task.heldout) == 40 and len(task.train) > 100
    everything = [*task.train, *task.heldout]
    assert len({p.text for p in everything}) == len({p.uid for p in everything}) == len(everything)
    assert all(p.uid.startswith(f"{dataset}/") and isinstance(p.answer, EntryAnswer) for p in everything)
    assert all(set(p.text + p.answer) <= set(DEFAULT_ALPHABET) for p in everything)
    other_seed = build_task(chain_sum(*overrides, "data.task.options.seed=1").data)
    assert [p.text for p in other_seed.heldout] != [p.text for p in task.heldout]


def test_enum_settings_are_given_by_value_or_name():
    siblings = build_task(
        chain_sum(
            "data.task.options.dataset=aiw",
            "data.task.options.dataset_config={task_types: [siblings], task_type_weights: [1.0]}",
        ).data
    )
    assert all(" brother" in p.text and p.text.endswith("have?") for p in siblings.train)
    upper = build_task(
        chain_sum(
            "data.task.options.dataset=word_sorting", "data.task.options.dataset_config={transformation: UPPERCASE}"
        ).data
    )
    assert all(p.answer == p.answer.upper() for p in upper.train)


def test_repeated_questions_are_dropped_so_no_held_out_question_is_trained_on():
    task = build_task(
        chain_sum(
            "data.task.options.dataset_config={min_terms: 2, max_terms: 2, max_digits: 1}", "data.eval_size=50"
        ).data
    )
    assert len(task.train) + len(task.heldout) <= 10 * 10 * 2  # two one-digit terms, + or -
    assert not {p.text for p in task.heldout} & {p.text for p in task.train}
    with pytest.raises(
        ValueError, match=r"^data.eval_size: 300 held-out problems leave none to train on \(chain_sum gave"
    ):
        build_task(
            chain_sum(
                "data.task.options.dataset_config={min_terms: 2, max_terms: 2, max_digits: 1}", "data.eval_size=300"
            ).data
        )


@pytest.mark.slow
def test_the_task_reward_is_the_datasets_own_checker_inside_the_runner():
    config = chain_sum()
    task = build_task(config.data)
    prompt = task.train[0]
    runner = RewardRunner.from_config(config.rewards, task)
    copy = pickle.loads(pickle.dumps(runner))  # as sent to a Ray actor, answers included
    answer = pickle.loads(pickle.dumps(prompt.answer))
    for scorer, reference in ((runner, prompt.answer), (copy, answer)):
        result = scorer.score([f" {prompt.answer}\n", "7" + prompt.answer, "x"], [reference] * 3)
        assert result.per_function["task"][0] == 1.0 and result.correct == [True, False, False]
        assert 0.0 < result.per_function["task"][1] < 1.0  # reasoning-gym's partial credit for a contained answer
        assert result.errors == 0
    plain = runner.score([prompt.answer], [str(prompt.answer)])
    assert plain.rewards == [0.0] and plain.errors == 1 and runner.counts["task"].errors == 1
    runner.close()
    copy.close()


def test_the_loader_resumes_a_reasoning_gym_split():
    train = build_task(chain_sum().data).train
    first = PromptLoader(train, shuffle_seed=3, epochs=None)
    for _ in range(700):
        first.next()
    second = PromptLoader(build_task(chain_sum().data).train, shuffle_seed=3, epochs=None)
    second.load_state_dict(first.state_dict())
    assert [second.next() for _ in range(20)] == [first.next() for _ in range(20)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.task={name: reasoning_gym}", "rewards.functions=[task]"],
            "data.task.options.dataset: required by 'reasoning_gym'",
        ),
        (
            ["data.task.options.dataset=chain_sum"],
            "data.task.options.dataset: unknown option of 'running_sum'",
        ),
        (
            ["data.task.options.dataset_config={max_terms: 2}"],
            "data.task.options.dataset_config: unknown option of 'running_sum'",
        ),
        (
            ["data.task={name: reasoning_gym}", "data.task.options.dataset=chain_sum"],
            "rewards.functions: data.task.name reasoning_gym is scored by",
        ),
        (
            ["data.task={name: arithmetic}", "data.task.options.difficulty=1", "rewards.functions=[task]"],
            "rewards.functions: the task reward needs a task with its own checker",
        ),
        (
            [*CHAIN_SUM, "data.task.options.path=x.jsonl"],
            "data.task.options.path: unknown option of 'reasoning_gym'",
        ),
    ],
)
def test_config_rejects_inconsistent_reasoning_gym_settings(overrides, message):
    with pytest.raises(ValueError) as info:  # the task's settings, checked where the run checks its parts
        check_parts(load_config(None, overrides))
    assert str(info.value).startswith(message)


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    return err


def test_unknown_dataset_bad_settings_and_a_missing_package_are_one_line_errors(capsys, monkeypatch, tmp_path):
    train = ["train", "--output-dir", str(tmp_path / "run"), *SMALL, *CHAIN_SUM]
    assert "data.task.options.dataset: unknown reasoning-gym dataset 'chain_sums'" in one_line_error(
        capsys, [*train, "data.task.options.dataset=chain_sums"]
    )
    bad = one_line_error(capsys, [*train, "data.task.options.dataset_config={min_termz: 2}"])
    assert bad.startswith("error: data.task.options.dataset_config: invalid settings for chain_sum")
    enum = one_line_error(
        capsys, [*train, "data.task.options.dataset=aiw", "data.task.options.dataset_config={task_types: [sibling]}"]
    )
    assert "invalid settings for aiw (task_types: 'sibling' is not one of siblings, friends, colleagues)" in enum
    generation = one_line_error(
        capsys,
        [*train, "data.task.options.dataset=simple_equations", "data.task.options.dataset_config={operators: ['+']}"],
    )  # valid as a config, but the dataset's default operator weights are three
    assert generation.startswith(
        "error: data.task.options.dataset_config: simple_equations failed to generate entry 0 with these settings (ValueError: "
    )
    quotes = one_line_error(
        capsys, [*train, "data.task.options.dataset=letter_counting", "data.task.options.dataset_config={}"]
    )
    assert "of letter_counting: '\"' (U+0022)" in quotes and "not in the tokenizer's vocabulary" in quotes
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    missing = one_line_error(capsys, train)
    assert (
        missing
        == "error: data.task.name: reasoning_gym needs the reasoning-gym package; run pip install 'asyncrl[reasoning-gym]'\n"
    )


@pytest.mark.slow
def test_a_short_run_is_scored_by_the_task_reward(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--output-dir",
                str(run_dir),
                *SMALL,
                *CHAIN_SUM,
                "generation.max_new_tokens=6",
                "data.eval_size=16",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(row["reward_errors"] == row["reward_timeouts"] == 0 for row in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and 0.0 <= summary["final_eval_accuracy"] <= 1.0
    capsys.readouterr()


@pytest.mark.slow
def test_a_run_stopped_while_a_batch_generates_resumes_and_finishes(tmp_path, capsys):
    """The stop's checkpoint holds the prompts still generating, as plain text; the resumed run
    takes each one's dataset entry back from the split, so the task reward still scores them."""
    run_dir = tmp_path / "run"
    failing = "faults.generate_errors=[" + ", ".join(map(str, range(40))) + "]"
    train = ["train", "--output-dir", str(run_dir), *SMALL, *CHAIN_SUM, "generation.max_new_tokens=6"]
    stop = "runtime.on_rollout_failure=stop"
    assert main([*train, "data.eval_size=16", "runtime.max_rollout_retries=0", stop, failing]) == 1
    assert "generation failed 1 times" in capsys.readouterr().err
    checkpoint = run_dir / "checkpoints" / "step-000000"
    pending = load_state(checkpoint)["run"]["pending"]
    assert pending and all(type(job["prompt"]["answer"]) is str for job in pending)
    assert main(["train", "--resume", str(run_dir), "faults.generate_errors=[]"]) == 0, capsys.readouterr().err
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 4 and sum(row["reward_errors"] for row in rows) == 0


BASIC_SUMS = [  # "Calculate 0 + 4 + 8." -> "12": 1,268 distinct questions from 4,000 entries
    "data.task={name: reasoning_gym}",
    "data.task.options.dataset=basic_arithmetic",
    "data.task.options.dataset_config={min_terms: 3, max_terms: 3, min_digits: 1, max_digits: 1, operators: ['+'], "
    "allow_parentheses: false, allow_negation: false}",
    "rewards.functions=[task]",
    "data.task.options.num_problems=4000",
    "data.eval_size=256",
    "generation.max_new_tokens=4",
]


SPELL_BACKWARD = [  # "Spell this word backward (example: sun -> nus): cat" -> "tac": 3,503 distinct words
    "data.task={name: reasoning_gym}",
    "data.task.options.dataset=spell_backward",
    "data.task.options.dataset_config={min_word_len: 3, max_word_len: 4}",
    "rewards.functions=[task,exact_match]",  # credit per letter in place, and 1 more for the exact word
    "data.task.options.num_problems=5000",
    "data.eval_size=256",
    "generation.max_new_tokens=6",
    "warm_start.steps=1000",
    "warm_start.batch_size=32",
]


def held_out_rise(tmp_path, overrides: list[str], steps: int) -> tuple[float, float]:
    """(accuracy, mean score) on the held-out questions after ``steps`` GRPO steps at a constant lr,
    minus those of the warm start."""
    train(
        load_config(
            None,
            [
                *overrides,
                f"step.max_steps={steps}",
                f"logging.eval_every_steps={steps}",
                "trainer.lr_schedule=constant",
                f"warm_start.cache_dir={tmp_path / 'warm_start'}",
                f"logging.output_dir={tmp_path / 'run'}",
                "logging.progress=false",
                "logging.tensorboard=false",
            ],
        )
    )
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == steps and sum(row["reward_errors"] for row in rows) == 0
    first, last = read_jsonl(tmp_path / "run" / "eval.jsonl")
    assert (first["step"], last["step"]) == (0, steps)
    return last["accuracy"] - first["accuracy"], last["reward_mean"] - first["reward_mean"]


@pytest.mark.slow
def test_the_default_model_learns_reasoning_gym_sums_in_a_short_run(tmp_path):
    """The embedded default model, its warm start, then 100 GRPO steps scored by the dataset's
    checker. Where the warm start lands swings with the CPU's float rounding, and 30 steps were a
    lottery across CPU kinds: +0.141 (0.375 -> 0.516) on one, +0.055 and +0.0 on two others. 100
    steps from the warm start of an AMD EPYC rose by 0.098 (0.297 -> 0.395) with one torch thread
    and 0.105 with two, the held-out accuracy near 0.39-0.42 from step 50 on. docs/data.md records
    earlier 50-step runs from the warm starts seeded 0, 1 and 2."""
    accuracy, _ = held_out_rise(tmp_path, BASIC_SUMS, steps=100)
    assert accuracy >= 0.04


@pytest.mark.slow
def test_the_default_model_learns_to_spell_words_backward_in_a_short_run(tmp_path):
    """The same for spell_backward, from a warm start of 1,000 steps of 32 examples (600 steps of 64
    learn to reverse words from some seeds and not others), in 60 steps. The held-out score (letters
    in place plus 1 for the exact word, 0 to 2) rose by 0.205 in 30 steps on one CPU kind, by 0.10
    on another; on an AMD EPYC with two torch threads by 0.183 after 30 steps and 0.189 after 60
    (accuracy 0.543 -> 0.672), and on a CI machine's CPU by 0.116 after 60 steps while its exact-word
    accuracy stayed where it was. So the rise asserted is the score's, with half its smallest
    measured rise as the margin; the accuracy is not. docs/data.md records earlier 50-step runs from
    the warm starts seeded 0, 1 and 2 (the last rose least)."""
    _, score = held_out_rise(tmp_path, SPELL_BACKWARD, steps=60)
    assert score >= 0.05
