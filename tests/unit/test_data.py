"""Built-in tasks, user files, chat templates and the resumable prompt loader."""

import json
import re
import socket
import sys

import pytest

from asyncrl.config import DataConfig, RunConfig, load_config
from asyncrl.data import ARITHMETIC_LEVELS, Prompt, PromptLoader, build_task, encode_prompts
from asyncrl.data.prompts import apply_chat_template
from asyncrl.data.synthetic import evaluate
from asyncrl.metrics import read_jsonl
from asyncrl.models.example import build_tokenizer as example_tokenizer
from asyncrl.models.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from asyncrl.rewards import RewardRunner


def config(task: str = "arithmetic", eval_size: int = 64, chat_template: bool = False, **options) -> DataConfig:
    """Arithmetic difficulty 1 with 64 held out, unless told otherwise: the small task most tests here
    read. ``options`` are the task's (``data.task.options``)."""
    if task in ("arithmetic", "running_sum"):
        options = {"difficulty": 1, **options}
    return DataConfig(task={"name": task, "options": options}, eval_size=eval_size, chat_template=chat_template)


def texts(prompts) -> list[str]:
    return [p.text for p in prompts]


# --- built-in tasks


@pytest.mark.parametrize("task, levels", [("arithmetic", range(1, 6)), ("running_sum", range(1, 5))])
def test_builtin_tasks_are_seeded_disjoint_unique_and_in_the_char_alphabet(task, levels):
    for difficulty in levels:
        built = build_task(config(task=task, difficulty=difficulty, eval_size=64))
        assert built == build_task(config(task=task, difficulty=difficulty, eval_size=64))
        assert len(built.heldout) == 64 and len(built.train) >= 300
        everything = [*built.train, *built.heldout]
        assert len({p.text for p in everything}) == len({p.uid for p in everything}) == len(everything)
        assert all(set(p.text + p.answer) <= set(DEFAULT_ALPHABET) for p in everything)
        assert all(re.fullmatch(built.format_pattern, p.answer) for p in everything)


def test_task_seed_chooses_other_problems_and_uids_follow_the_problem():
    first, second = build_task(config(difficulty=3)), build_task(config(difficulty=3, seed=1))
    assert texts(first.train) != texts(second.train)
    text_of = {p.uid: p.text for p in [*first.train, *first.heldout]}
    shared = [p for p in [*second.train, *second.heldout] if p.uid in text_of]
    assert shared and all(text_of[p.uid] == p.text for p in shared)


def test_arithmetic_answers_follow_operator_precedence():
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert evaluate([9, 3, 4], ["-", "-"]) == 2
    for difficulty in ARITHMETIC_LEVELS:
        task = build_task(config(difficulty=difficulty, num_problems=500, eval_size=10))
        for prompt in task.train:
            assert prompt.text.endswith("=")
            assert int(prompt.answer) == eval(prompt.text[:-1])  # the expressions are our own digits and + - *


@pytest.mark.parametrize("difficulty", sorted(ARITHMETIC_LEVELS))
def test_arithmetic_levels_set_terms_operand_range_and_operators(difficulty):
    level = ARITHMETIC_LEVELS[difficulty]
    task = build_task(config(difficulty=difficulty))
    seen_operators, largest = set(), 0
    for prompt in task.train:
        operands = [int(x) for x in re.split(r"[-+*]", prompt.text[:-1])]
        assert len(operands) == level.terms
        seen_operators |= set(re.findall(r"[-+*]", prompt.text))
        largest = max(largest, *operands)
    assert seen_operators == set(level.operators)
    assert largest == level.max_operand


def test_difficulty_one_is_the_small_arithmetic_task():
    task = build_task(config())
    assert task.name == "arithmetic"
    assert all(re.fullmatch(r"\d{1,2}\+\d{1,2}=", p.text) for p in task.train)
    assert {len(build_task(config()).train), len(task.heldout)} == {336, 64}  # all 400 sums of 0..19


def test_the_default_task_is_too_large_to_memorize_in_a_default_run():
    task = build_task(DataConfig())
    assert (task.name, len(task.heldout), len(task.train)) == ("running_sum", 256, 10_000 - 256)
    assert all(re.fullmatch(r"running sum( \d){4}:", p.text) for p in task.heldout)
    defaults = RunConfig()
    assert defaults.step.max_steps * defaults.step.prompts_per_step <= len(task.train)  # no prompt is seen twice


def test_running_sum_writes_out_every_partial_sum():
    task = build_task(config(task="running_sum", difficulty=2))
    for prompt in task.train[:50]:
        numbers = [int(x) for x in prompt.text.removeprefix("running sum ").removesuffix(":").split()]
        assert len(numbers) == 4
        partial = [sum(numbers[: i + 1]) for i in range(len(numbers))]
        assert prompt.answer == ",".join(map(str, partial))
    assert not re.fullmatch(task.format_pattern, "12")
    assert not re.fullmatch(build_task(config()).format_pattern, "3,11")


@pytest.mark.parametrize(
    "completion, credit",
    [
        ("3,11,16,17", 1.0),
        (" 3, 11,16,17\n", 1.0),
        ("3,11,15,17", 0.5),  # right up to the third sum: later ones are not credited
        ("3,12,16,17", 0.25),
        ("4,11,16,17", 0.0),
        ("3,11", 0.5),
        ("3,11,16,17,20,25", 4 / 6),  # more sums than asked for
        ("3 11 16 17", 0.0),
        ("", 0.0),
    ],
)
def test_running_sum_gives_credit_per_leading_partial_sum(completion, credit):
    task = build_task(config(task="running_sum", difficulty=2))
    assert task.score(completion, "3,11,16,17") == pytest.approx(credit)
    assert build_task(config()).score is None  # arithmetic has one answer: exact_match scores it


def test_running_sum_credit_is_the_task_reward_and_only_the_exact_chain_is_correct():
    run = load_config(None, ["rewards.functions=[task]"])
    runner = RewardRunner.from_config(run.rewards, build_task(run.data))
    result = runner.score(["3,11,15,17", "3,11,16,17"], ["3,11,16,17"] * 2)
    assert result.rewards == [0.5, 1.0] and result.correct == [False, True]
    runner.close()


def test_too_few_problems_for_the_held_out_split_is_a_config_error():
    with pytest.raises(ValueError, match=r"^data.eval_size: 400 held-out problems leave none to train on"):
        build_task(config(eval_size=400))
    with pytest.raises(ValueError, match=r"data.task.options.num_problems is 50"):
        build_task(config(num_problems=50, eval_size=50))
    small = build_task(config(difficulty=3, num_problems=100, eval_size=20))
    assert (len(small.train), len(small.heldout)) == (80, 20)


def data_error(overrides) -> str:
    """The first problem of a config's data settings: a bad name when the config loads, a task's
    settings where the run checks its parts (before anything is built)."""
    from asyncrl.parts import check_parts

    with pytest.raises(ValueError) as info:
        check_parts(load_config(None, overrides))
    return str(info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.task={name: sums}"], "data.task.name: unknown task 'sums'"),
        (
            ["data.task={name: arithmetic}", "data.task.options.difficulty=6"],
            "data.task.options.difficulty: arithmetic has levels 1-5, got 6",
        ),
        (["data.task.options.difficulty=0"], "data.task.options.difficulty"),
        (
            ["data.task.options.path=x.jsonl"],
            "data.task.options.path: unknown option of 'running_sum' (its options: difficulty, seed, num_problems)",
        ),
        (
            ["data.task.options.eval_path=x.jsonl"],
            "data.task.options.eval_path: unknown option of 'running_sum'",
        ),
        (["data.task={name: jsonl}"], "data.task.options.path: required by 'jsonl'"),
    ],
)
def test_config_rejects_inconsistent_data_settings(overrides, message):
    assert data_error(overrides).startswith(message)


# --- user files


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a dataset load tried to open a network connection")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_jsonl_holds_out_its_last_rows_with_stable_uids(tmp_path, no_network):
    rows = [{"q": f"{i}+1=", "a": i + 1, "other": "x"} for i in range(10)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    task = build_task(config(task="jsonl", path=path, prompt_field="q", answer_field="a", eval_size=3))
    assert task.name == "jsonl" and task.format_pattern is None
    assert task.train == [Prompt(f"train/{i + 1}", f"{i}+1=", str(i + 1)) for i in range(7)]
    assert task.heldout == [Prompt(f"heldout/{i + 1}", f"{i}+1=", str(i + 1)) for i in range(7, 10)]


def test_eval_path_supplies_the_held_out_split(tmp_path, no_network):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    heldout = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "c", "answer": "3"}])
    task = build_task(config(task="jsonl", path=train, eval_path=heldout, eval_size=1))
    assert texts(task.train) == ["a", "b"]
    assert task.heldout == [Prompt("heldout/1", "c", "3")]


def test_parquet_files_load_the_same_way(tmp_path, no_network):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2=", "3+3="], "answer": ["2", "4", "6"]}), path)
    task = build_task(config(task="parquet", path=str(path), eval_size=1))
    assert task.train == [Prompt("train/1", "1+1=", "2"), Prompt("train/2", "2+2=", "4")]
    assert task.heldout == [Prompt("heldout/3", "3+3=", "6")]


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"prompt": "a", "answer": "1"}, {"answer": "2"}],
            "data.task.options.prompt_field: row 2 of {f} has no field 'prompt'",
        ),
        (
            [{"prompt": "a", "answer": "1"}, {"prompt": "  ", "answer": "2"}],
            "data.task.options.prompt_field: row 2 of {f}: 'prompt' is empty",
        ),
        (
            [{"prompt": "a", "answer": "1"}, {"prompt": ["a"], "answer": "2"}],
            "data.task.options.prompt_field: row 2 of {f}: 'prompt' is list, not a string",
        ),
        (
            [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}],
            "data.task.options.answer_field: row 2 of {f} has no field 'answer'",
        ),
        (
            [{"prompt": "a", "answer": [1]}, {"prompt": "b", "answer": "2"}],
            "data.task.options.answer_field: row 1 of {f}: 'answer' is list, not a string or number",
        ),
        (
            [{"question": "a", "answer": "1"}],
            "data.task.options.prompt_field: row 1 of {f} has no field 'prompt' (its fields: question, answer)",
        ),
    ],
)
def test_bad_rows_name_the_field_row_and_file(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as info:
        build_task(config(task="jsonl", path=path, eval_size=1))
    assert str(info.value) == message.format(f=path)


def test_missing_unreadable_and_too_short_files(tmp_path):
    with pytest.raises(ValueError, match=r"^data.task.options.path: no such file '.*nope.jsonl'"):
        build_task(config(task="jsonl", path=str(tmp_path / "nope.jsonl")))
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a", "answer": "1"}] * 3)
    with pytest.raises(ValueError, match=r"^data.task.options.eval_path: no such file"):
        build_task(config(task="jsonl", path=good, eval_path=str(tmp_path / "nope.jsonl")))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "answer": 1}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"^data.task.options.path: line 2 of .*broken.jsonl: invalid JSON"):
        build_task(config(task="jsonl", path=str(broken)))
    with pytest.raises(ValueError, match=r"^data.eval_size: holding out the last 3 rows of .* leaves no train rows"):
        build_task(config(task="jsonl", path=good, eval_size=3))


# --- Hugging Face datasets on disk


def saved_splits(directory, **splits) -> str:
    """A DatasetDict of ``splits`` (name -> rows) written with save_to_disk."""
    import datasets

    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(
        str(directory)
    )
    return str(directory)


def sums(start: int, stop: int) -> list[dict]:
    return [{"q": f"{i}+1=", "a": i + 1} for i in range(start, stop)]


def hf(path, **fields) -> DataConfig:
    return config(task="hf_dataset", path=path, prompt_field="q", answer_field="a", **fields)


def test_a_saved_dataset_dict_trains_on_one_split_and_holds_out_another(tmp_path, no_network):
    path = saved_splits(tmp_path / "saved", train=sums(0, 6), test=sums(6, 8))
    task = build_task(hf(path, eval_split="test"))
    assert task.name == "hf_dataset"
    assert task.train == [Prompt(f"train/{i + 1}", f"{i}+1=", str(i + 1)) for i in range(6)]
    assert task.heldout == [Prompt(f"heldout/{i - 5}", f"{i}+1=", str(i + 1)) for i in range(6, 8)]
    held_out_of_train = build_task(hf(path, eval_size=2))  # no eval_split: the last rows of the train split
    assert texts(held_out_of_train.train) == texts(task.train[:4])
    assert held_out_of_train.heldout == [Prompt("heldout/5", "4+1=", "5"), Prompt("heldout/6", "5+1=", "6")]
    assert build_task(hf(path, split="test", eval_split="train")).train == [
        Prompt("train/1", "6+1=", "7"),
        Prompt("train/2", "7+1=", "8"),
    ]


@pytest.mark.slow
def test_a_run_trains_on_a_saved_dataset_dict(tmp_path):
    from helpers import run

    path = saved_splits(tmp_path / "saved", train=sums(0, 40), test=sums(40, 48))
    settings = [
        "data.task={name: hf_dataset}",
        f"data.task.options.path={path}",
        "data.task.options.prompt_field=q",
        "data.task.options.answer_field=a",
    ]
    summary, metrics, groups = run(tmp_path, "run", *settings, "data.task.options.eval_split=test", "step.max_steps=2")
    assert summary["steps"] == 2 and [m["num_groups"] for m in metrics] == [4, 4]
    assert all(g["prompt_uid"].startswith("train/") for g in groups)
    assert [e["num_prompts"] for e in read_jsonl(tmp_path / "run" / "eval.jsonl")] == [8, 8]


def test_data_files_named_by_split_and_a_saved_single_dataset_load_the_same_way(tmp_path, no_network):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = tmp_path / "files"
    files.mkdir()
    for name, rows in (("train", sums(0, 6)), ("test", sums(6, 8))):
        pq.write_table(pa.Table.from_pylist(rows), files / f"{name}.parquet")
    saved = saved_splits(tmp_path / "saved", train=sums(0, 6), test=sums(6, 8))
    from_files, from_saved = build_task(hf(str(files), eval_split="test")), build_task(hf(saved, eval_split="test"))
    assert (from_files.train, from_files.heldout) == (from_saved.train, from_saved.heldout)
    datasets.Dataset.from_list(sums(0, 6)).save_to_disk(str(tmp_path / "single"))
    single = build_task(hf(str(tmp_path / "single"), eval_size=2))  # one Dataset: the split train
    saved_single = build_task(hf(saved, eval_size=2))
    assert (single.train, single.heldout) == (saved_single.train, saved_single.heldout)


def test_hf_dataset_errors_name_the_split_field_or_directory(tmp_path):
    path = saved_splits(tmp_path / "saved", train=sums(0, 6), test=[{"q": "9+1="}])
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (hf(path, split="nope"), f"data.task.options.split: '{path}' has no split 'nope' (its splits: train, test)"),
        (
            hf(path, eval_split="dev"),
            f"data.task.options.eval_split: '{path}' has no split 'dev' (its splits: train, test)",
        ),
        (
            hf(path, eval_split="test"),
            f"data.task.options.answer_field: row 1 of split 'test' of {path} has no field 'a' (its fields: q)",
        ),
        (
            config(task="hf_dataset", path=path),
            f"data.task.options.prompt_field: row 1 of split 'train' of {path} has no field 'prompt' (its fields: q, a)",
        ),
        (hf(path, eval_split="train"), "data.task.options.eval_split: 'train' is split itself"),
        (hf(path, eval_size=6), f"data.eval_size: holding out the last 6 rows of split 'train' of {path} leaves"),
        (hf(str(tmp_path / "nope")), f"data.task.options.path: no such directory '{tmp_path / 'nope'}'"),
        (hf(str(empty)), f"data.task.options.path: cannot read '{empty}' as a Hugging Face dataset"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError) as info:
            build_task(cfg)
        assert str(info.value).startswith(message)


def test_a_split_that_does_not_exist_is_one_line_and_exit_2(tmp_path, capsys):
    from asyncrl.cli import main

    path = saved_splits(tmp_path / "saved", train=sums(0, 6))
    overrides = [
        f"data.task.options.path={path}",
        "data.task.options.prompt_field=q",
        "data.task.options.answer_field=a",
        "data.task.options.split=validation",
    ]
    capsys.readouterr()
    code = main(["train", "data.task={name: hf_dataset}", *overrides, "--output-dir", str(tmp_path / "run")])
    assert code == 2
    assert (
        capsys.readouterr().err
        == f"error: data.task.options.split: '{path}' has no split 'validation' (its splits: train)\n"
    )


def test_without_the_datasets_package_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(ValueError, match=r"^data.task.name: hf_dataset needs the datasets package; .*\[hf-datasets\]"):
        build_task(hf(str(tmp_path)))


def test_a_loader_over_a_reloaded_hf_dataset_resumes_where_the_saved_one_was(tmp_path):
    path = saved_splits(tmp_path / "saved", train=sums(0, 10), test=sums(10, 12))
    loader = PromptLoader(build_task(hf(path, eval_split="test")).train, shuffle_seed=1, epochs=None)
    drain(loader, 13)
    resumed = PromptLoader(build_task(hf(path, eval_split="test")).train, shuffle_seed=1, epochs=None)
    resumed.load_state_dict(loader.state_dict())
    assert drain(resumed, 9) == drain(loader, 9)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.task={name: jsonl}", "data.task.options.path=x.jsonl", "data.task.options.eval_split=test"],
            "data.task.options.eval_split: unknown option of 'jsonl' (its options: prompt_field, answer_field, path, eval_path)",
        ),
        (
            ["data.task={name: parquet}", "data.task.options.path=x.parquet", "data.task.options.split=all"],
            "data.task.options.split: unknown option of 'parquet'",
        ),
        (["data.task={name: hf_dataset}"], "data.task.options.path: required by 'hf_dataset'"),
        (
            ["data.task={name: hf_dataset}", "data.task.options.path=d", "data.task.options.eval_path=e.jsonl"],
            "data.task.options.eval_path: unknown option of 'hf_dataset'",
        ),
    ],
)
def test_split_keys_belong_to_hf_dataset(overrides, message):
    assert data_error(overrides).startswith(message)


# --- chat templates


def templated_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


def test_chat_template_wraps_every_prompt_of_both_splits(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2=", "answer": 4}, {"prompt": "3+3=", "answer": 6}])
    task = build_task(config(task="jsonl", path=path, eval_size=1, chat_template=True), templated_tokenizer())
    assert task.train == [Prompt("train/1", "user: 2+2=\nassistant: ", "4")]
    assert task.heldout == [Prompt("heldout/2", "user: 3+3=\nassistant: ", "6")]
    builtin = build_task(config(chat_template=True), templated_tokenizer())
    assert all(p.text.startswith("user: ") and p.text.endswith("=\nassistant: ") for p in builtin.train)


@pytest.mark.parametrize("tokenizer", [None, build_char_tokenizer()])
def test_chat_template_without_one_on_the_tokenizer_is_a_config_error(tokenizer):
    with pytest.raises(ValueError, match=r"^data.chat_template: the tokenizer has no chat template"):
        build_task(config(chat_template=True), tokenizer)


def test_prompts_start_with_one_bos_exactly_when_the_tokenizer_adds_one(tmp_path):
    tokenizer = example_tokenizer()
    bos = tokenizer.bos_token_id
    plain, templated = "12+30=", apply_chat_template(["12+30="], tokenizer)[0]
    assert templated.startswith(tokenizer.bos_token)
    plain_ids, templated_ids = encode_prompts([plain, templated], tokenizer)
    assert plain_ids == tokenizer(plain)["input_ids"] == [bos, *tokenizer(plain, add_special_tokens=False)["input_ids"]]
    assert templated_ids[0] == bos and bos not in templated_ids[1:]
    char = build_char_tokenizer()
    assert encode_prompts([plain], char) == [char.encode(plain)]  # no BOS: unchanged


# --- the loader


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", f"text {i}", str(i)) for i in range(n)]


def drain(loader: PromptLoader, count: int) -> list[str]:
    return [loader.next().uid for _ in range(count)]


def test_each_epoch_is_a_seeded_permutation_with_epoch_suffixed_uids():
    loader = PromptLoader(prompts(10), shuffle_seed=3, epochs=None)
    first, second = drain(loader, 10), drain(loader, 10)
    assert sorted(first) == sorted(f"p{i}/0" for i in range(10))
    assert sorted(second) == sorted(f"p{i}/1" for i in range(10))
    assert [u.split("/")[0] for u in first] != [u.split("/")[0] for u in second]  # a fresh order per epoch
    assert [u.split("/")[0] for u in first] != [f"p{i}" for i in range(10)]  # shuffled
    assert first == drain(PromptLoader(prompts(10), shuffle_seed=3, epochs=None), 10)
    assert first != drain(PromptLoader(prompts(10), shuffle_seed=4, epochs=None), 10)


def test_epochs_bound_the_stream_and_none_runs_forever():
    loader = PromptLoader(prompts(3), shuffle_seed=0, epochs=2)
    assert len(drain(loader, 6)) == 6
    assert loader.next() is None and loader.next() is None
    assert (loader.epoch, loader.position) == (2, 0)
    endless = PromptLoader(prompts(3), shuffle_seed=0, epochs=None)
    assert drain(endless, 301)[-1].endswith("/100")


def test_position_and_epoch_track_progress():
    loader = PromptLoader(prompts(4), shuffle_seed=0, epochs=None)
    assert (loader.epoch, loader.position) == (0, 0)
    drain(loader, 5)
    assert (loader.epoch, loader.position) == (1, 1)


@pytest.mark.parametrize("cut", [0, 1, 6, 7, 13, 20])
def test_a_restored_loader_continues_exactly_where_the_saved_one_was(cut):
    reference = drain(PromptLoader(prompts(7), shuffle_seed=5, epochs=3), 21)
    saved = PromptLoader(prompts(7), shuffle_seed=5, epochs=3)
    before = drain(saved, cut)
    state = json.loads(json.dumps(saved.state_dict()))  # survives a plain-JSON checkpoint
    restored = PromptLoader(prompts(7), shuffle_seed=5, epochs=3)
    restored.load_state_dict(state)
    assert before + drain(restored, 21 - cut) == reference
    assert restored.next() is None


def test_restoring_into_another_seed_or_dataset_size_is_an_error():
    state = PromptLoader(prompts(5), shuffle_seed=1, epochs=None).state_dict()
    with pytest.raises(ValueError, match=r"^data.shuffle_seed: the saved loader used 1, this one uses 2"):
        PromptLoader(prompts(5), shuffle_seed=2, epochs=None).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^data: the saved loader's train split has 5 prompts, this one has 6"):
        PromptLoader(prompts(6), shuffle_seed=1, epochs=None).load_state_dict(state)


def test_empty_split_is_rejected():
    with pytest.raises(ValueError, match="train split is empty"):
        PromptLoader([], shuffle_seed=0, epochs=None)
