"""reasoning-gym datasets as a task: procedural problems written outside asyncrl, each with its own checker.

``data.task.name: reasoning_gym`` takes ``data.task.options.dataset`` (a reasoning-gym dataset name) and
``data.task.options.dataset_config`` (that dataset's settings). ``data.task.options.num_problems`` entries are generated from
seed ``data.task.options.seed``; an entry whose question repeats an earlier one is dropped, the first
``data.eval_size`` distinct questions are held out and the rest are trained on, so the two splits
never share a question. The same settings always give the same splits, so the loader resumes as it
does for any other task. A prompt's uid is ``dataset/index``.

An entry's reference answer is an ``EntryAnswer``: the answer text (what the warm start trains on
and exact_match compares against) that also carries its entry, so the ``task`` reward can call the
dataset's own ``score_answer(completion, entry)`` inside the reward runner, under its timeout and
error counting. A checkpoint stores only its text (it holds plain values alone); a resumed run takes
the entry back from the regenerated split by the prompt's uid. The package is imported only when
such a task is built.
"""

from __future__ import annotations

import enum
import typing
from typing import Any

from asyncrl.data.prompts import Prompt, Task

INSTALL_HINT = "pip install 'asyncrl[reasoning-gym]'"


class EntryAnswer(str):
    """The answer text of a reasoning-gym entry, carrying the entry for its dataset's checker."""

    entry: dict[str, Any]

    def __new__(cls, entry: dict[str, Any]) -> EntryAnswer:
        answer = super().__new__(cls, entry["answer"])
        answer.entry = entry
        return answer

    def __reduce__(self):
        return EntryAnswer, (self.entry,)


def _package():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"data.task.name: reasoning_gym needs the reasoning-gym package; run {INSTALL_HINT}") from None
    return reasoning_gym


def create_dataset(name: str, settings: dict[str, Any], *, seed: int, size: int):
    """The reasoning-gym dataset ``name``; an unknown name or setting is a one-line error."""
    package = _package()
    datasets = package.factory.DATASETS
    if name not in datasets:
        raise ValueError(
            f"data.task.options.dataset: unknown reasoning-gym dataset '{name}' ({len(datasets)} exist, e.g. chain_sum)"
        )
    try:
        settings = _with_enums(datasets[name][1], settings)
        return package.create_dataset(name, **settings, seed=seed, size=size)
    except (TypeError, ValueError, AssertionError) as err:
        raise ValueError(f"data.task.options.dataset_config: invalid settings for {name} ({_one_line(err)})") from None


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _enum_type(hint: Any) -> type[enum.Enum] | None:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    return next(filter(None, map(_enum_type, typing.get_args(hint))), None)


def _enum_member(kind: type[enum.Enum], key: str, item: Any) -> enum.Enum:
    if isinstance(item, kind):
        return item
    for member in kind:
        if item in (member.value, member.name):
            return member
    raise ValueError(f"{key}: {item!r} is not one of {', '.join(str(member.value) for member in kind)}")


def _with_enums(config_class: type, settings: dict[str, Any]) -> dict[str, Any]:
    """Settings with each enum-typed value given by its value or name (YAML has no enums), e.g. aiw's
    ``task_types: [siblings]``; an unknown one is a ValueError listing the valid ones."""
    hints = typing.get_type_hints(config_class)
    converted = dict(settings)
    for key, value in settings.items():
        kind = _enum_type(hints.get(key))
        if kind is not None:
            items = value if isinstance(value, list) else [value]
            members = [_enum_member(kind, key, item) for item in items]
            converted[key] = members if isinstance(value, list) else members[0]
    return converted


class ReasoningGymScore:
    """The ``task`` reward of a reasoning-gym task: the dataset's ``score_answer`` on the stripped
    completion. Only the dataset's name and settings are pickled; a copy rebuilds the checker."""

    def __init__(self, name: str, settings: dict[str, Any]) -> None:
        self.name, self.settings = name, dict(settings)
        self._dataset = create_dataset(name, self.settings, seed=0, size=1)

    def __call__(self, completion: str, answer: str) -> float:
        if not isinstance(answer, EntryAnswer):
            raise TypeError(f"the task reward scores {self.name} entries; got a plain answer {answer!r}")
        return float(self._dataset.score_answer(completion.strip(), answer.entry))

    def __reduce__(self):
        return ReasoningGymScore, (self.name, self.settings)


def reasoning_gym_task(name: str, settings: dict[str, Any], *, seed: int, num_problems: int, eval_size: int) -> Task:
    """``eval_size`` held-out entries and the distinct rest of ``num_problems`` generated ones."""
    dataset = create_dataset(name, settings, seed=seed, size=num_problems)
    prompts, seen = [], set()
    for index in range(num_problems):
        try:
            entry = dataset[index]
        except Exception as err:  # the dataset's own code, run on the user's settings
            raise ValueError(
                f"data.task.options.dataset_config: {name} failed to generate entry {index} with these settings "
                f"({type(err).__name__}: {_one_line(err)})"
            ) from None
        if entry["question"] not in seen:
            seen.add(entry["question"])
            prompts.append(Prompt(f"{name}/{index}", entry["question"], EntryAnswer(entry)))
    if len(prompts) <= eval_size:
        raise ValueError(
            f"data.eval_size: {eval_size} held-out problems leave none to train on "
            f"({name} gave {len(prompts)} distinct questions out of data.task.options.num_problems={num_problems})"
        )
    return Task(name, train=prompts[eval_size:], heldout=prompts[:eval_size], score=ReasoningGymScore(name, settings))
