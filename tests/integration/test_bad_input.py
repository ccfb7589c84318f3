"""Bad input never gives a traceback: each case exits with code 2 and one line naming the field, row or file.

Config files, dataset files (jsonl and parquet), command-line overrides and options, custom
``module:attr`` rewards and samplers, damaged and hostile checkpoints and run files, output paths,
YAML that expands, values that cannot train and text the tokenizer cannot encode, all through the
command line's entry point, and each class once through the installed console script.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import SMALL, error
from tokenizers import normalizers

from asyncrl.checkpoint import resolve_checkpoint
from asyncrl.cli import main
from asyncrl.metrics import read_jsonl


def train_error(capsys, tmp_path, *overrides) -> str:
    return error(capsys, "train", "--output-dir", str(tmp_path / "run"), *SMALL, *overrides)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path, columns) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


def rows(n: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(n)]


# --- config files


@pytest.mark.parametrize(
    "text, message",
    [
        ("trainer:\n  lrr: 0.1\n", "trainer.lrr: unknown key (did you mean 'trainer.lr'?)"),
        ("step:\n  max_stepz: 3\n", "step.max_stepz: unknown key (did you mean 'step.max_steps'?)"),
        ("step:\n  max_steps: many\n", "step.max_steps: Input should be a valid integer"),
        ("grpo:\n  max_steps: 3\n", "grpo.max_steps: moved to step.max_steps"),
        ("loss:\n  kl_coef: 0.1\n", "loss.kl_coef: moved to algorithm.options.kl_coef"),
        ("loss:\n  mode: token-mean\n", "loss.mode: moved to trainer.aggregation"),
        (
            "grpo:\n  max_stepz: 3\n",
            "grpo.max_stepz: the grpo section moved; its keys are now in step (the step's shape) and algorithm.options (baseline, scale_by_std)",
        ),
        ("generation:\n  max_new_tokens: true\n", "generation.max_new_tokens: expected a number, got true"),
        ("rewards:\n  weights: [1.0, false]\n", "rewards.weights: expected a number, got [1.0, false]"),
        ("trainer:\n  lr: -1\n", "trainer.lr: Input should be greater than 0 (got -1)"),
        ("trainer:\n  lr: .inf\n", "trainer.lr: must be a finite number (got .inf)"),
        ("trainer:\n  betas: [0.9]\n", "trainer.betas: too few values (got [0.9])"),
        (
            "step:\n  max_steps:\n",
            "step.max_steps: cannot be null (an empty value is null); give a value, e.g. the default 400",
        ),
        ("step: 3\n", "step: is a section, so it takes keys such as step.prompts_per_step, not a value (got 3)"),
        ("sampler:\n  buffer_capacity: 4\n", "sampler.buffer_capacity: 4 < 32 groups required"),
        (
            "trainer:\n  aggregation: seq-mean-token-sum-norm\n",
            "trainer.norm_constant: required when trainer.aggregation is seq-mean-token-sum-norm",
        ),
        ("data:\n  task:\n    name: jsonl\n", "data.task.options.path: required by 'jsonl'"),
        (  # the earlier layout, a task's name where its section is
            "data:\n  task: jsonl\n",
            "data.task: is a section, so it takes keys such as data.task.name, not a value (got jsonl)",
        ),
        ("data:\n  difficulty: 3\n", "data.difficulty: moved to data.task.options.difficulty"),
        ("generation:\n  backend_options: {}\n", "generation.backend_options: moved to generation.backend.options"),
    ],
)
def test_bad_config_file_names_the_field(tmp_path, capsys, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert error(capsys, "config", "--config", str(path)).startswith(message)
    assert error(capsys, "train", "--config", str(path)).startswith(message)


def test_unreadable_config_files_name_the_file_and_line(tmp_path, capsys):
    def config_error(content: bytes) -> str:
        path = tmp_path / "run.yaml"
        path.write_bytes(content)
        return error(capsys, "config", "--config", str(path))

    assert error(capsys, "train", "--config", str(tmp_path / "missing.yaml")) == (
        f"--config: no such file '{tmp_path / 'missing.yaml'}'"
    )
    assert (
        error(capsys, "config", "--config", str(tmp_path)) == f"--config: '{tmp_path}' is a directory, not a YAML file"
    )
    path = tmp_path / "run.yaml"
    assert config_error(b"seed: 1\nstep: [unclosed\n").startswith(f"--config: '{path}' line 3: invalid YAML")
    assert config_error(b"seed: 1\nseed: 2\n") == f"--config: '{path}' line 2: invalid YAML (key 'seed' is given twice)"
    assert config_error(b"seed: 1\n# caf\xe9\n") == f"--config: '{path}' line 2: not UTF-8 text; save the file as UTF-8"
    assert config_error(b"- step\n- trainer\n") == f"--config: '{path}' must hold a mapping of sections, got list"
    tagged = config_error(b"seed: !!python/object/apply:os.system ['true']\n")
    assert tagged.startswith(f"--config: '{path}' line 1: invalid YAML (could not determine a constructor")


def test_an_empty_config_file_is_the_defaults(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("# nothing set\n")
    assert main(["config", "--config", str(path)]) == 0
    assert "max_steps: 400" in capsys.readouterr().out


# --- the command line


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["step.max_steps="],
            "step.max_steps: cannot be null (an empty value is null); give a value, e.g. the default 400",
        ),
        (["trainer.max_grad_norm=", "step.max_steps=x"], "step.max_steps: Input should be a valid integer"),
        (["step=1"], "step: is a section, so it takes keys such as step.prompts_per_step, not a value (got 1)"),
        (["grpo.baseline=mean"], "grpo.baseline: moved to algorithm.options.baseline"),
        (["loss.track_entropy=false"], "loss.track_entropy: moved to trainer.track_entropy"),
        (
            ["grpo=1"],
            "grpo: the grpo section moved; its keys are now in step (the step's shape) and algorithm.options (baseline, scale_by_std)",
        ),
        (["model="], "model: is a section, so it takes keys such as model.path, not a value (got null)"),
        (["stepp.max_steps=1"], "stepp: unknown key (did you mean 'step'?)"),
        (["nonsense.key=1"], "nonsense: unknown key (valid keys: seed, model, tokenizer, data"),
        (["step.max_steps"], "override 'step.max_steps': expected key=value, e.g. step.max_steps=50"),
        (["step..max_steps=1"], "override 'step..max_steps=1': empty key"),
        (["seed.x=1"], "seed: is a value, not a section"),
        (["trainer.lr=nan"], "trainer.lr: Input should be greater than 0 (got 'nan')"),
        (["trainer.lr=inf"], "trainer.lr: must be a finite number (got .inf)"),
        (["generation.max_new_tokens=yes"], "generation.max_new_tokens: expected a number, got true"),
        (
            ["data.task={name: jsonl}", "data.task.options.path=2024"],
            "data.task.options.path: no such file '2024'",
        ),  # a file name, not a number
    ],
)
def test_bad_overrides_name_the_field(tmp_path, capsys, argv, message):
    assert train_error(capsys, tmp_path, *argv).startswith(message)


def test_unknown_options_and_missing_option_values(capsys):
    assert error(capsys, "train", "--nope") == "No such option: --nope"
    assert error(capsys, "train", "--output-dirr", "x").startswith("No such option: --output-dirr")
    assert error(capsys, "train", "--config") == "Option '--config' requires an argument."
    assert error(capsys, "not-a-command").startswith("No such command 'not-a-command'")


@pytest.mark.slow
def test_the_installed_entry_point_prints_no_traceback(tmp_path):
    broken = tmp_path / "train.jsonl"
    broken.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=" "answer": 4}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "train",
            *SMALL,
            "data.task={name: jsonl}",
            f"data.task.options.path={broken}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr
        == f"error: data.task.options.path: line 2 of {broken}: invalid JSON (Expecting ',' delimiter at column 19)\n"
    )


# --- dataset files


def jsonl_error(capsys, tmp_path, content, *overrides) -> tuple[str, str]:
    path = tmp_path / "train.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        write_jsonl(path, content)
    message = train_error(
        capsys, tmp_path, "data.task={name: jsonl}", f"data.task.options.path={path}", "data.eval_size=1", *overrides
    )
    return message, str(path)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            [{"question": "1+1=", "answer": "2"}] * 3,
            "data.task.options.prompt_field: row 1 of {f} has no field 'prompt' (its fields: question, answer)",
        ),
        ([*rows(2), {"answer": "3"}], "data.task.options.prompt_field: row 3 of {f} has no field 'prompt'"),
        ([*rows(2), {"prompt": "3+3="}], "data.task.options.answer_field: row 3 of {f} has no field 'answer'"),
        (
            [*rows(2), {"prompt": " \t", "answer": "1"}],
            "data.task.options.prompt_field: row 3 of {f}: 'prompt' is empty",
        ),
        (
            [*rows(2), {"prompt": "1+1=", "answer": ""}],
            "data.task.options.answer_field: row 3 of {f}: 'answer' is empty",
        ),
        (
            [*rows(2), {"prompt": 7, "answer": "1"}],
            "data.task.options.prompt_field: row 3 of {f}: 'prompt' is int, not a string",
        ),
        (
            [*rows(2), {"prompt": "x", "answer": {"a": 1}}],
            "data.task.options.answer_field: row 3 of {f}: 'answer' is dict, not a string or number",
        ),
        (
            [*rows(2), {"prompt": "x", "answer": True}],
            "data.task.options.answer_field: row 3 of {f}: 'answer' is bool, not a string or number",
        ),
        (
            b'{"prompt": "1+1=", "answer": 2}\n\n{"prompt": "2+2=", "answer": NaN}\n',
            "data.task.options.answer_field: row 2 of {f}: 'answer' is nan, not a finite number",
        ),
        (
            b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2=", "answer": 4\n',
            "data.task.options.path: line 2 of {f}: invalid JSON (Expecting ',' delimiter at column 31)",
        ),
        (
            b'{"prompt": "1+1=", "answer": 2}\n\n["2+2=", 4]\n',
            "data.task.options.path: line 3 of {f}: expected one JSON object per line, got an array",
        ),
        (
            b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2\xff=", "answer": 4}\n',
            "data.task.options.path: line 2 of {f}: byte 0xff at column 16 is not UTF-8; save the file as UTF-8",
        ),
        (b"", "data.task.options.path: '{f}' has no rows"),
        (b"\n  \n\n", "data.task.options.path: '{f}' has no rows"),
        (
            b'[{"prompt": "1+1=", "answer": 2}, 3]',
            "data.task.options.path: row 2 of {f}: expected a JSON object, got a number",
        ),
        (
            b'[{"prompt": "1+1=",\n "answer": 2}, {]',
            "data.task.options.path: line 2 of {f}: invalid JSON (Expecting property name enclosed in double quotes at column 17)",
        ),
    ],
)
def test_bad_jsonl_rows_name_the_field_row_or_line(tmp_path, capsys, content, message):
    got, path = jsonl_error(capsys, tmp_path, content)
    assert got == message.format(f=path)


def test_a_json_array_file_and_a_byte_order_mark_load(tmp_path):
    from asyncrl.config import DataConfig
    from asyncrl.data import build_task

    array = tmp_path / "train.json"
    array.write_text(json.dumps(rows(3), indent=2))
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in rows(3)).encode())
    for path in (array, marked):
        task = build_task(DataConfig(task={"name": "jsonl", "options": {"path": str(path)}}, eval_size=1))
        assert [(p.uid, p.text, p.answer) for p in task.train] == [("train/1", "0+1=", "1"), ("train/2", "1+1=", "2")]


def test_bad_parquet_rows_name_the_field_and_row(tmp_path, capsys):
    def parquet_error(columns) -> tuple[str, str]:
        path = write_parquet(tmp_path / "train.parquet", columns)
        return train_error(
            capsys, tmp_path, "data.task={name: parquet}", f"data.task.options.path={path}", "data.eval_size=1"
        ), path

    message, path = parquet_error({"question": ["1+1=", "2+2="], "answer": ["2", "4"]})
    assert (
        message
        == f"data.task.options.prompt_field: row 1 of {path} has no field 'prompt' (its fields: question, answer)"
    )
    message, path = parquet_error({"prompt": ["1+1=", None, "3+3="], "answer": ["2", "4", "6"]})
    assert message == f"data.task.options.prompt_field: row 2 of {path} has no field 'prompt'"
    message, path = parquet_error({"prompt": ["1+1=", "", "3+3="], "answer": ["2", "4", "6"]})
    assert message == f"data.task.options.prompt_field: row 2 of {path}: 'prompt' is empty"
    message, path = parquet_error({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())})
    assert message == f"data.task.options.path: '{path}' has no rows"
    binary = pa.array([b"1+1=", b"2+2=", b"3\xff="], pa.binary())
    not_utf8 = pa.Array.from_buffers(pa.string(), 3, binary.buffers())  # a string column holding invalid UTF-8
    message, path = parquet_error({"prompt": not_utf8, "answer": ["2", "4", "6"]})
    assert (
        message == f"data.task.options.path: row 3 of {path}: field 'prompt' is not UTF-8 text; write strings as UTF-8"
    )
    message, path = parquet_error({"prompt": binary, "answer": ["2", "4", "6"]})
    assert message == f"data.task.options.prompt_field: row 1 of {path}: 'prompt' is bytes, not a string"
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows(3))
    message = train_error(
        capsys, tmp_path, "data.task={name: parquet}", f"data.task.options.path={jsonl}", "data.eval_size=1"
    )
    assert message.startswith(f"data.task.options.path: cannot read '{jsonl}' as parquet: ")


def test_missing_files_and_splits_that_end_up_empty(tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", rows(3))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    data = ["data.task={name: jsonl}", f"data.task.options.path={good}"]
    assert train_error(
        capsys, tmp_path, "data.task={name: jsonl}", f"data.task.options.path={tmp_path / 'no.jsonl'}"
    ) == (f"data.task.options.path: no such file '{tmp_path / 'no.jsonl'}'")
    assert train_error(capsys, tmp_path, "data.task={name: jsonl}", f"data.task.options.path={tmp_path}") == (
        f"data.task.options.path: '{tmp_path}' is a directory, not a jsonl file"
    )
    assert train_error(capsys, tmp_path, *data, "data.eval_size=3") == (
        f"data.eval_size: holding out the last 3 rows of {good} leaves no train rows (it has 3); "
        "set data.task.options.eval_path or lower data.eval_size"
    )
    assert (
        train_error(capsys, tmp_path, *data, f"data.task.options.eval_path={empty}")
        == f"data.task.options.eval_path: '{empty}' has no rows"
    )
    assert train_error(capsys, tmp_path, *data, f"data.task.options.eval_path={good}").startswith(
        f"data.task.options.eval_path: '{good}' is path itself, so the held-out rows would be trained on"
    )
    assert train_error(capsys, tmp_path, "data.task.options.num_problems=8").startswith("data.eval_size: ")


def test_a_prompt_too_long_for_the_context_is_rejected_by_row(tmp_path, capsys):
    long_prompt = {"prompt": "1+" * 505 + "1=", "answer": "506"}  # 1012 characters: 1012 tokens of the char tokenizer
    path = write_jsonl(tmp_path / "train.jsonl", [*rows(2), long_prompt, *rows(2)])
    data = ["data.task={name: jsonl}", f"data.task.options.path={path}", "data.eval_size=1"]
    assert train_error(capsys, tmp_path, *data, "generation.max_new_tokens=16") == (
        f"data.task.options.prompt_field: row 3 of {path}: the prompt is 1012 tokens, and with generation.max_new_tokens 16 "
        "needs 1028 positions, but the model has 1024; shorten it or lower generation.max_new_tokens"
    )
    held_out = write_parquet(
        tmp_path / "eval.parquet", {"prompt": ["1+1=", long_prompt["prompt"]], "answer": ["2", "506"]}
    )
    parquet = write_parquet(tmp_path / "train.parquet", {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]})
    message = error(
        capsys,
        "eval",
        *SMALL,
        "data.task={name: parquet}",
        f"data.task.options.path={parquet}",
        f"data.task.options.eval_path={held_out}",
        "generation.max_new_tokens=16",
    )
    assert message.startswith(f"data.task.options.prompt_field: row 2 of {held_out}: the prompt is 1012 tokens")
    assert train_error(capsys, tmp_path, "generation.max_new_tokens=1024") == (
        "generation.max_new_tokens: 1024 leaves no room for a prompt in the model's 1024 positions; set it below 1024"
    )
    assert train_error(capsys, tmp_path, "generation.max_new_tokens=1019").startswith(
        "data.task.name: prompt 'arithmetic/1/"
    )
    episodes = ["environment.name=feedback", "generation.max_new_tokens=8"]
    assert train_error(capsys, tmp_path, *episodes, "environment.max_tokens=1024") == (
        "environment.max_tokens: 1024 (with generation.max_new_tokens 8) leaves no room for a prompt in the model's "
        "1024 positions; set it below 1016"
    )
    assert (
        "the templated opening is 11 tokens, and with environment.max_tokens 1006 + generation.max_new_tokens 8 "
        "needs 1025 positions" in train_error(capsys, tmp_path, *episodes, "environment.max_tokens=1006")
    )


def test_a_prompt_that_just_fits_is_accepted():
    from asyncrl.config import load_config
    from asyncrl.data import Prompt, Task, check_prompt_lengths
    from asyncrl.models.tokenizer import build_char_tokenizer
    from asyncrl.rollout.context import first_requests

    config, tokenizer = load_config(None, ["generation.max_new_tokens=4"]), build_char_tokenizer()
    fits = Task("t", train=[Prompt("train/1", "x" * 1020, "1")], heldout=[Prompt("heldout/2", "y", "1")])
    check_prompt_lengths(first_requests(fits, None, tokenizer), fits, config, 1024)
    check_prompt_lengths(first_requests(fits, None, tokenizer), fits, config, None)  # a model without a position limit
    too_long = Task("t", train=fits.train, heldout=[Prompt("heldout/2", "y" * 1021, "1")])
    with pytest.raises(ValueError, match=r"^data.task.name: prompt 'heldout/2' of t: the prompt is 1021 tokens"):
        check_prompt_lengths(first_requests(too_long, None, tokenizer), too_long, config, 1024)


# --- custom module:attr rewards and samplers


PLUGINS = """
import asyncio

from asyncrl.control.sampler import WindowedSampler


def score(completion, answer):
    return float(completion == answer)


def by_length(completion, answer, *, num_tokens):
    return -num_tokens


by_length.uses_num_tokens = True


def one_argument(completion):
    return 1.0


async def awaited(completion, answer):
    return 1.0


class Scorer:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, completion, answer):
        return 1.0


class NoLag(WindowedSampler):
    def __init__(self, prompts_per_step):
        super().__init__(prompts_per_step, 0)
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    (tmp_path / "bad_input_plugins.py").write_text(PLUGINS)
    (tmp_path / "bad_input_broken.py").write_text("raise RuntimeError('needs a GPU')\n")
    (tmp_path / "bad_input_typo.py").write_text("def score(completion, answer)\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "bad_input_plugins"


@pytest.mark.parametrize(
    "reward, message",
    [
        (
            "no_such_module_abc:score",
            "cannot load 'no_such_module_abc:score' (ModuleNotFoundError: No module named 'no_such_module_abc'); is its directory on PYTHONPATH?",
        ),
        (
            "bad_input_plugins:missing",
            "cannot load 'bad_input_plugins:missing' (AttributeError: module 'bad_input_plugins' has no attribute 'missing')",
        ),
        ("bad_input_broken:score", "cannot load 'bad_input_broken:score' (RuntimeError: needs a GPU)"),
        ("bad_input_typo:score", "cannot load 'bad_input_typo:score' (SyntaxError: expected ':'"),
        (
            "bad_input_plugins:one_argument",
            "'bad_input_plugins:one_argument' must accept (completion, answer), the two strings it is called with",
        ),
        (
            "bad_input_plugins:awaited",
            "'bad_input_plugins:awaited' is async; rewards are called, not awaited: use a plain def",
        ),
        (
            "bad_input_plugins:Scorer",
            "'bad_input_plugins:Scorer' is a class that must be constructible as Scorer()",
        ),
        ("bad_input_plugins:asyncio", "'bad_input_plugins:asyncio' is not callable"),
    ],
)
def test_bad_custom_rewards_are_rejected_at_load_time(tmp_path, capsys, plugins, reward, message):
    assert train_error(capsys, tmp_path, f"rewards.functions=[exact_match, '{reward}']").startswith(
        f"rewards.functions: {message}"
    )


def test_a_good_custom_reward_loads(plugins):
    from asyncrl.rewards import RewardRunner, resolve_reward

    assert resolve_reward("bad_input_plugins:score")("4", "4") == 1.0
    with RewardRunner([("by_length", resolve_reward("bad_input_plugins:by_length"))]) as runner:
        assert runner.score(["4"], ["4"], num_tokens=[3]).rewards == [-3.0]


@pytest.mark.parametrize(
    "sampler, message",
    [
        (
            "no_such_module_abc:Sampler",
            "cannot load 'no_such_module_abc:Sampler' (ModuleNotFoundError: No module named 'no_such_module_abc'); is its directory on PYTHONPATH?",
        ),
        ("bad_input_broken:Sampler", "cannot load 'bad_input_broken:Sampler' (RuntimeError: needs a GPU)"),
        (
            "bad_input_plugins:Nope",
            "cannot load 'bad_input_plugins:Nope' (AttributeError: module 'bad_input_plugins' has no attribute 'Nope')",
        ),
        ("bad_input_plugins:score", "'bad_input_plugins:score' is not a class"),
        (
            "bad_input_plugins:NoLag",
            "'bad_input_plugins:NoLag' must be constructible as NoLag(prompts_per_step, max_lag)",
        ),
    ],
)
def test_bad_custom_samplers_are_rejected_when_the_config_loads(capsys, plugins, sampler, message):
    assert error(capsys, "config", f"sampler.name={sampler}") == f"sampler.name: {message}"


PARSER_BUILTINS = "built-ins are hermes, or give package.module:attr"


@pytest.mark.parametrize("command", ["config", "train"])
@pytest.mark.parametrize("environment", ["calculator", "dictionary_tools:Dictionary"])
@pytest.mark.parametrize(
    "override, message",
    [
        ("parser=nosuch", f"environment.options.parser: unknown tool_parser 'nosuch'; {PARSER_BUILTINS}"),
        (
            "parser=dictionary_tools:Parser",
            "environment.options.parser: cannot load 'dictionary_tools:Parser' "
            "(AttributeError: module 'dictionary_tools' has no attribute 'Parser')",
        ),
        (
            "parser_options={strict: true}",
            "environment.options.parser_options.strict: unknown option; 'hermes' takes no options",
        ),
    ],
    ids=["unknown parser", "missing parser", "parser option"],
)
def test_a_part_named_in_an_environments_options_is_checked_with_the_config(
    tmp_path, capsys, command, environment, override, message
):
    argv = ["config"] if command == "config" else ["train", "--output-dir", str(tmp_path / "run"), *SMALL]
    overrides = [f"environment.name={environment}", f"environment.options.{override}", "data.chat_template=false"]
    assert error(capsys, *argv, *overrides) == message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["config", "train"])
def test_an_environments_tools_are_checked_with_the_config(tmp_path, capsys, command):
    argv = ["config"] if command == "config" else ["train", "--output-dir", str(tmp_path / "run"), *SMALL]
    message = error(capsys, *argv, "environment.name=dictionary_tools:Undocumented", "data.chat_template=false")
    assert message == (
        "environment.options: 'dictionary_tools:Undocumented': tool undocumented: DocstringParsingException: "
        "Cannot generate JSON schema for undocumented because it has no docstring!"
    )


# --- files read back: checkpoints, the run directory


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished small run with checkpoints at steps 1 and 2 (latest)."""
    from helpers import run

    root = tmp_path_factory.mktemp("trained")
    run(
        root, "run", "step.max_steps=2", "checkpoint.every_steps=1", "logging.eval_every_steps=null", "data.eval_size=2"
    )
    return root / "run"


@pytest.fixture
def run_dir(trained, tmp_path):
    """A copy of the trained run to damage."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def resume_error(capsys, run_dir, *overrides) -> str:
    return error(capsys, "train", "--resume", str(run_dir), *overrides)


def eval_error(capsys, checkpoint, *overrides) -> str:
    return error(capsys, "eval", "--checkpoint", str(checkpoint), *SMALL, "data.eval_size=2", *overrides)


def intact_hint(run_dir, option="--resume") -> str:
    older = run_dir / "checkpoints" / "step-000001"
    return f"; the newest intact checkpoint is step-000001: continue from it with {option} {older}"


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_names_the_file_and_the_intact_one_resumes(run_dir, capsys):
    newest = run_dir / "checkpoints" / "step-000002"
    state = newest / "state.pt"
    saved = state.stat().st_size
    state.write_bytes(b"")
    damaged = f"checkpoint {newest}: state.pt is damaged (0 bytes; manifest.json says {saved} were saved)"
    assert resume_error(capsys, run_dir) == f"--resume: {damaged}{intact_hint(run_dir)}"
    assert eval_error(capsys, run_dir) == f"--checkpoint: {damaged}{intact_hint(run_dir, '--checkpoint')}"
    assert main(["train", "--resume", str(run_dir / "checkpoints" / "step-000001")]) == 0  # on request
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["step"] == 2
    assert resolve_checkpoint(run_dir).name == "step-000002-1"  # step 2 again; the damaged one is gone
    assert not newest.exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-100]),
            "model.safetensors is damaged (",
        ),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing (manifest.json lists it)"),
        (lambda d: (d / "tokenizer.json").write_text("{}"), "tokenizer.json is damaged (2 bytes; manifest.json says "),
        (
            lambda d: (d / "config.json").write_bytes(
                bytes([(d / "config.json").read_bytes()[0] ^ 1]) + (d / "config.json").read_bytes()[1:]
            ),
            "config.json is damaged (its SHA-256 differs from the one manifest.json holds)",
        ),
        (
            lambda d: (d / "manifest.json").write_text("not json"),
            "manifest.json is damaged (not a manifest of file sizes and checksums as asyncrl writes it)",
        ),
        (
            lambda d: (d / "manifest.json").unlink(),
            "manifest.json is missing, so the checkpoint's files cannot be checked",
        ),
    ],
)
def test_damaged_checkpoint_files_are_named(run_dir, capsys, damage, message):
    newest = run_dir / "checkpoints" / "step-000002"
    damage(newest)
    assert resume_error(capsys, run_dir).startswith(f"--resume: checkpoint {newest}: {message}")
    assert eval_error(capsys, newest).startswith(f"--checkpoint: checkpoint {newest}: {message}")


def test_checkpoint_paths_that_hold_none_name_the_option(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        eval_error(capsys, empty)
        == f"--checkpoint: no checkpoint found in '{empty}' (expected state.pt or checkpoints/step-*)"
    )
    assert (
        resume_error(capsys, empty)
        == f"--resume: no checkpoint found in '{empty}' (expected state.pt or checkpoints/step-*)"
    )


def test_a_checkpoint_of_another_model_shape_names_the_tensor(run_dir, capsys):
    weights = run_dir / "checkpoints" / "step-000002" / "model.safetensors"
    message = resume_error(capsys, run_dir, "model.hidden_size=64")
    assert message.startswith(f"{weights}: does not fit the configured model: model.embed_tokens.weight is [")
    assert message.endswith("set model.* as in the run that saved it")
    assert eval_error(capsys, run_dir, "model.hidden_size=64").startswith(
        f"{weights}: does not fit the configured model"
    )


class RunsCode:
    """Unpickling this would create ``marker``: torch.load(weights_only=True) must refuse it unrun."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (str(self.marker),)


def plant_hostile_state(checkpoint, marker) -> None:
    """A state.pt that runs code when unpickled, with a manifest that vouches for it."""
    torch.save({"trainer": {}, "run": {"payload": RunsCode(marker)}}, checkpoint / "state.pt")
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def test_a_state_file_that_would_run_code_is_refused_unrun(run_dir, tmp_path, capsys):
    newest = run_dir / "checkpoints" / "step-000002"
    marker = tmp_path / "code-ran"
    plant_hostile_state(newest, marker)
    message = resume_error(capsys, run_dir)
    assert message == (
        f"{newest / 'state.pt'}: holds os.makedirs, from module os, which torch blocks because loading it could run "
        "code; refused, and nothing in it was run"
    )
    assert "weights_only" not in message and not marker.exists()


def test_an_output_dir_that_is_a_file_is_refused_before_anything_is_built(tmp_path, capsys):
    file = tmp_path / "taken"
    file.write_text("x")
    for output_dir in (file, file / "run"):
        assert error(capsys, "train", "--output-dir", str(output_dir), *SMALL) == (
            f"logging.output_dir: '{file}' is a file, not a directory"
        )


def test_damaged_run_files_read_back_on_resume_are_named(run_dir, capsys):
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n[1, 2]\n{"step": 2}\n')
    assert resume_error(capsys, run_dir) == f"{metrics}: line 2 is not a record (a JSON object with an integer step)"
    metrics.write_bytes(b'{"step": 1}\n\xff\n')
    assert resume_error(capsys, run_dir) == f"{metrics}: byte 12 is not UTF-8; the file is damaged"


# --- inputs that expand, values that cannot run, text the tokenizer cannot encode


def alias_bomb(levels: int) -> str:
    """A few hundred bytes of YAML whose aliases expand to 9**levels strings."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nseed: *a{levels - 1}\n"


@pytest.mark.parametrize("levels", [6, 9])
def test_yaml_aliases_that_expand_are_refused_with_bounded_output_and_memory(tmp_path, capsys, levels):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(levels))
    assert path.stat().st_size < 500
    tracemalloc.start()
    try:
        message = error(capsys, "config", "--config", str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message == f"--config: '{path}' is refused: its aliases expand it past 100000 values"
    assert peak < 20 * 2**20
    assert error(capsys, "config", "seed=[&a [1, 1, 1, 1], [*a, *a, *a, *a], [*a, *a]]").startswith("seed: ")
    self_nested = tmp_path / "self.yaml"
    self_nested.write_text("seed: &a [1, *a]\n")
    assert error(capsys, "config", "--config", str(self_nested)).endswith("an alias refers to a value that contains it")


def test_a_long_value_is_cut_short_in_the_message(capsys):
    message = error(capsys, "config", f"seed={'x' * 5000}")
    assert (
        message == f"seed: Input should be a valid integer, unable to parse string as an integer (got '{'x' * 199}...)"
    )


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "generation.temperature=1e-40",
            "generation.temperature: 1e-40 is so small that logits / temperature can overflow float32",
        ),
        (
            "generation.temperature=0",
            "generation.temperature: temperature 0 (greedy) makes the samples of a prompt identical, so every advantage is 0",
        ),
        (
            "generation.top_k=1",
            "generation.top_k: top_k 1 makes the samples of a prompt identical, so every advantage is 0",
        ),
        ("step.generations_per_prompt=1", "step.generations_per_prompt: 1 sample per prompt makes every advantage 0"),
        ("rewards.weights=[0.0]", "rewards.weights: all 0, so every reward and every advantage is 0"),
    ],
)
def test_values_that_cannot_train_are_rejected(tmp_path, capsys, override, message):
    assert error(capsys, "config", override).startswith(message)
    assert train_error(capsys, tmp_path, override).startswith(message)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.logprob_chunk_tokens=0"],
            "trainer.logprob_chunk_tokens: Input should be greater than or equal to 1 or 'auto' (got 0)",
        ),
        (
            ["trainer.logprob_chunk_tokens="],
            "trainer.logprob_chunk_tokens: cannot be null (an empty value is null); give a value, e.g. the default auto",
        ),
        (["seed=-1"], "seed: Input should be greater than or equal to 0 (got -1)"),
        (["faults.load_errors=[2, -1]"], "faults.load_errors.1: Input should be greater than or equal to 0 (got -1)"),
        (["data.task.options.seed=-1"], "data.task.options.seed: Input should be greater than or equal to 0"),
        (["algorithm.options.clip_low=1"], "algorithm.options.clip_low: Input should be less than 1"),
        (
            ["environment.name=calculator", "data.chat_template=false", "environment.options.tool_timeout_s=0"],
            "environment.options.tool_timeout_s: Input should be greater than 0",
        ),
    ],
)
def test_numbers_out_of_range_stop_before_anything_is_built(tmp_path, capsys, overrides, message):
    assert error(capsys, "config", *overrides) == message
    assert train_error(capsys, tmp_path, *overrides) == message
    assert not (tmp_path / "run").exists()


def test_text_the_tokenizer_cannot_encode_is_rejected_by_row_and_character(tmp_path, capsys):
    path = write_jsonl(tmp_path / "train.jsonl", [*rows(2), {"prompt": "caf+1=", "answer": "café"}, *rows(2)])
    assert jsonl_error(capsys, tmp_path, [*rows(2), {"prompt": "caf+1=", "answer": "café"}, *rows(2)])[0] == (
        f"data.task.options.answer_field: row 3 of {path}: 'é' (U+00E9) at character 4 is not in the tokenizer's vocabulary; "
        "remove it, or set tokenizer.path to a tokenizer that has it"
    )
    assert jsonl_error(capsys, tmp_path, [*rows(3), {"prompt": "hi \U0001f600 1+1=", "answer": "2"}, *rows(1)])[0] == (
        f"data.task.options.prompt_field: row 4 of {path}: '\U0001f600' (U+1F600) at character 4 is not in the tokenizer's vocabulary; "
        "remove it, or set tokenizer.path to a tokenizer that has it"
    )


def test_a_tokenizer_that_changes_the_text_is_named_by_row_and_character():
    from asyncrl.data import Prompt, Task, check_encodable
    from asyncrl.models.tokenizer import build_char_tokenizer

    lowering = build_char_tokenizer()
    lowering.backend_tokenizer.normalizer = normalizers.Lowercase()
    task = Task(
        "t",
        train=[Prompt("train/1", "1+1=", "2"), Prompt("train/2", "Ab=", "1")],
        heldout=[Prompt("heldout/3", "x", "1")],
        sources={"train": "rows.jsonl", "heldout": "held.jsonl"},
    )
    with pytest.raises(ValueError) as err:
        check_encodable(task, lowering)
    assert str(err.value) == (
        "data.task.options.prompt_field: row 2 of rows.jsonl: the tokenizer does not reproduce the text: it changes 'A' (U+0041) "
        "at character 1; the model would see other text than the row's"
    )
    check_encodable(task, build_char_tokenizer())


# --- each class once more, through the installed `asyncrl` console script


def hostile_resume(run_dir, tmp_path):
    plant_hostile_state(run_dir / "checkpoints" / "step-000002", tmp_path / "code-ran")
    return ["train", "--resume", str(run_dir)], "state.pt: holds os.makedirs, from module os, which torch blocks"


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        lambda run_dir, tmp_path: (
            (run_dir / "checkpoints" / "step-000002" / "state.pt").write_bytes(b""),
            (["eval", "--checkpoint", str(run_dir)], "state.pt is damaged (0 bytes;"),
        )[1],
        hostile_resume,
        lambda run_dir, tmp_path: (["train", "--output-dir", str(run_dir / "config.yaml")], "logging.output_dir: "),
        lambda run_dir, tmp_path: (
            (tmp_path / "bomb.yaml").write_text(alias_bomb(9)),
            (["config", "--config", str(tmp_path / "bomb.yaml")], "its aliases expand it past 100000 values"),
        )[1],
        lambda run_dir, tmp_path: (
            ["config", "generation.temperature=1e-40"],
            "generation.temperature: 1e-40 is so small",
        ),
        lambda run_dir, tmp_path: (
            [
                "train",
                "--output-dir",
                str(tmp_path / "out"),
                *SMALL,
                "data.task={name: jsonl}",
                "data.eval_size=1",
                f"data.task.options.path={write_jsonl(tmp_path / 'e.jsonl', [*rows(2), {'prompt': 'x', 'answer': 'é'}])}",
            ],
            "data.task.options.answer_field: row 3 of",
        ),
    ],
    ids=[
        "damaged-checkpoint",
        "hostile-checkpoint",
        "output-path",
        "yaml-aliases",
        "degenerate-value",
        "tokenizer-text",
    ],
)
def test_each_class_through_the_installed_console_script(run_dir, tmp_path, case):
    argv, expected = case(run_dir, tmp_path)
    proc = subprocess.run([shutil.which("asyncrl"), *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and len(proc.stderr) < 2100
    assert expected in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "code-ran").exists()


def test_a_damaged_tokenizer_directory_or_warm_start_cache_is_named(tmp_path, capsys):
    from asyncrl.models.tokenizer import build_char_tokenizer

    tokenizer_dir = tmp_path / "tokenizer"
    build_char_tokenizer().save_pretrained(tokenizer_dir)
    tokenizer_json = tokenizer_dir / "tokenizer.json"
    tokenizer_json.write_bytes(tokenizer_json.read_bytes()[:100])
    assert train_error(capsys, tmp_path, f"tokenizer.path={tokenizer_dir}").startswith(
        f"{tokenizer_dir}: cannot be loaded as a tokenizer (JSONDecodeError: "
    )
    cache = tmp_path / "cache"
    warm = [
        *SMALL,
        "warm_start.steps=1",
        "warm_start.batch_size=2",
        f"warm_start.cache_dir={cache}",
        "data.eval_size=1",
    ]
    assert main(["eval", *warm]) == 0
    (cached,) = cache.iterdir()
    cached.write_bytes(cached.read_bytes()[:50])
    assert error(capsys, "eval", *warm) == (
        f"warm_start.cache_dir: the cached weights {cached} cannot be loaded (SafetensorError); delete the file to warm-start again"
    )


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "cannot be read as JSON (JSONDecodeError: "),
        ('{"eos_token_id": "end"}', "eos_token_id must be a token id or a list of token ids"),
    ],
)
def test_a_damaged_generation_config_is_named(tmp_path, capsys, content, message):
    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.models.tokenizer import build_char_tokenizer

    model_dir = tmp_path / "model"
    tokenizer = build_char_tokenizer()
    build_tiny_model(len(tokenizer), seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (model_dir / "generation_config.json").write_text(content)
    capsys.readouterr()
    assert train_error(capsys, tmp_path, f"model.path={model_dir}").startswith(
        f"{model_dir / 'generation_config.json'}: {message}"
    )
