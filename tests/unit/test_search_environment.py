"""The built-in search environment: the search task, the replies, the reward, and a warm start
that teaches the answer format with no strategy in it."""

from __future__ import annotations

import pytest
from helpers import ROOT

from asyncrl.config import DataConfig, TaskConfig, load_config
from asyncrl.data.prompts import Prompt
from asyncrl.data.tasks import task_source
from asyncrl.environments.search import SearchEnvironment, SearchTask
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.plugins import resolve
from asyncrl.warm_start import encode_conversation


def search_task(difficulty=10, num_problems=100, eval_size=20) -> SearchTask:
    return SearchTask(
        DataConfig(eval_size=eval_size), SearchTask.Options(difficulty=difficulty, num_problems=num_problems)
    )


def search_environment(**options) -> SearchEnvironment:
    return SearchEnvironment(SearchEnvironment.Options(**options))


def test_the_task_hides_every_number_of_the_range_equally_often_in_both_splits():
    task = search_task().build()
    assert len(task.train) == 80 and len(task.heldout) == 20
    assert {p.text for p in [*task.train, *task.heldout]} == {"0-9"}
    assert sorted(int(p.answer) for p in task.heldout) == sorted(list(range(10)) * 2)
    assert not {p.uid for p in task.train} & {p.uid for p in task.heldout}


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"difficulty": 1}, "^data.task.options.difficulty: Input should be greater than or equal to 2"),
        ({"num_problems": 20, "eval_size": 20}, "^data.eval_size: 20 held-out problems leave none to train on"),
    ],
)
def test_the_task_refuses_a_range_of_one_number_and_an_empty_train_split(settings, problem):
    config = load_config(None, ["data.task={name: search}", "environment.name=search"])
    eval_size = settings.pop("eval_size", config.data.eval_size)
    data = config.data.model_copy(update={"eval_size": eval_size, "task": TaskConfig(name="search", options=settings)})
    with pytest.raises(ValueError, match=problem):
        task_source(data)


def test_each_wrong_guess_is_told_up_or_down_and_the_solve_scores_by_its_guesses():
    env = search_environment(bonus=0.5)
    assert env.reset(Prompt("p", "0-9", "6")) == [{"role": "user", "content": "0-9"}]
    replies = [env.step({"role": "assistant", "content": guess}) for guess in ("4", "8", "seven", "6")]
    assert [t.messages[0]["content"] for t in replies[:3]] == ["up", "down", "?"]
    assert [t.done for t in replies] == [False, False, False, True]
    assert replies[-1].reward == pytest.approx(1 + 0.5 / 4)
    assert [t.metrics.get("invalid_guesses", 0.0) for t in replies] == [0.0, 0.0, 1.0, 0.0]
    assert sum(t.metrics["solved"] for t in replies) == 1.0


def test_range_replies_give_the_range_the_number_is_now_known_to_be_in():
    env = search_environment(reply="range")
    env.reset(Prompt("p", "0-9", "6"))
    replies = [env.step({"role": "assistant", "content": guess}).messages for guess in ("4", "8", "x", "7")]
    assert [m[0]["content"] for m in replies] == ["5-9", "5-7", "?", "5-6"]


def test_a_prompt_that_is_not_a_range_and_a_number_is_refused_naming_it():
    with pytest.raises(ValueError, match="prompt q: the search environment needs a range"):
        search_environment().reset(Prompt("q", "12*34=", "408"))


def test_a_first_guess_that_hits_scores_the_most():
    env = search_environment(bonus=0.5)
    env.reset(Prompt("p", "0-9", "3"))
    assert env.step({"role": "assistant", "content": " 3 "}).reward == 1.5


def test_the_demonstrations_guess_at_random_among_the_numbers_the_replies_allow():
    """The format and the rules, not the strategy: every guess fits the replies so far, but it is
    drawn uniformly from the numbers still possible, not halving them (binary search's guess)."""
    env = search_environment()
    halving = guesses = 0
    firsts = set()
    for j in range(200):
        messages = env.demonstration(Prompt(f"search/10/{j}", "0-9", str(j % 10)))
        assert messages[0] == {"role": "user", "content": "0-9"} and messages[-1]["role"] == "assistant"
        turns = [int(m["content"]) for m in messages if m["role"] == "assistant"]
        replies = [m["content"] for m in messages[1:] if m["role"] == "user"]
        assert turns[-1] == j % 10 and len(replies) == len(turns) - 1
        firsts.add(turns[0])
        low, high = 0, 9
        for k, guess in enumerate(turns):
            assert low <= guess <= high
            halving += low < high and guess == (low + high) // 2
            guesses += low < high
            if k < len(replies):
                low, high = (guess + 1, high) if replies[k] == "up" else (low, guess - 1)
    assert firsts == set(range(10))
    assert halving / guesses < 0.4


def test_a_demonstration_encodes_with_only_the_guesses_trained():
    tokenizer = build_char_tokenizer(chat=True)
    messages = search_environment().demonstration(Prompt("search/10/1", "0-9", "1"))
    ids, mask = encode_conversation(tokenizer, messages, None)
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    guesses = [m["content"] for m in messages if m["role"] == "assistant"]
    assert trained == "<eos>".join(guesses) + "<eos>"


def test_the_config_names_the_built_in_task_and_environment():
    config = load_config(ROOT / "configs" / "search.yaml")
    assert resolve("task", config.data.task.name, "data.task.name") is SearchTask
    assert resolve("environment", config.environment.name, "environment.name") is SearchEnvironment
