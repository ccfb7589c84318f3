"""The parts a run config names, checked before anything is built.

Loading a config checks names and shapes only (``plugins.check_spec``): it never builds a part or
imports a user's module, so a config can be read anywhere (a worker, ``asyncrl config``, a test)
without running code. ``check_parts`` is the one place that does, where a run starts and where
``asyncrl config`` checks a file: the sampler, each reward, the environment (against the task it
reads) and the task are resolved and their options validated, a user's module in a fresh process
under its startup deadline (it may block or crash at import) before this process imports it; the
generation backend's options are checked (a backend is imported where the generator is built, in
the run's process, anyway); the task part is built, which checks its settings; and what the task
declares is checked against the rewards (a task scored by its own checker must list the ``task``
reward).
Every problem is one ValueError naming the field.

``RunParts`` are the parts built from the config alone that several places of one process use (the
warm start, the request bound, the rollout worker's episodes, the trainer's loss): each process of
a run (the driver, a Ray actor, ``asyncrl eval``) builds them once and hands them on, so the
algorithm is built and the environment resolved once per process.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.algorithms import Algorithm, build_algorithm
from asyncrl.config import RunConfig
from asyncrl.data.tasks import task_source
from asyncrl.environments.base import EnvironmentPart, environment_class
from asyncrl.plugins import checked_options, resolve, validate_options
from asyncrl.rewards.processes import check_loads


@dataclass(frozen=True)
class RunParts:
    """The run's algorithm, and its environment's class with checked options (None: single turn)."""

    algorithm: Algorithm
    environment: EnvironmentPart | None


def build_run_parts(config: RunConfig) -> RunParts:
    """The config's algorithm and environment, built and resolved once for this process; call it
    after ``check_parts``, which loads a user's environment module in a fresh process first."""
    return RunParts(build_algorithm(config), environment_class(config))


def check_parts(config: RunConfig) -> None:
    """Every part ``config`` names, resolved and its options checked (module docstring)."""
    _check_sampler(config)
    _check_rewards(config)
    _check_environment(config)
    _check_backend(config)
    _check_task(config)


def _check_sampler(config: RunConfig) -> None:
    sampler = config.sampler
    check = (sampler.name, "asyncrl.control.sampler:sampler_part", (sampler.name, sampler.options))
    setting, process = "sampler.startup_timeout_s", "a process loading the sampler"
    check_loads("sampler", [check], "sampler.name", setting, sampler.startup_timeout_s, process)


def _check_rewards(config: RunConfig) -> None:
    rewards = config.rewards
    checks = [
        (name, "asyncrl.rewards.functions:reward_part", (name, rewards.options.get(name))) for name in rewards.functions
    ]
    setting, process = "rewards.startup_timeout_s", "a reward process"
    check_loads("reward", checks, "rewards.functions", setting, rewards.startup_timeout_s, process)


def _check_environment(config: RunConfig) -> None:
    environment = config.environment
    if environment.name is None:
        return
    arguments = (environment.name, environment.options, config.data.task.name)
    check = (environment.name, "asyncrl.environments.base:environment_part", arguments)
    setting, process = "environment.startup_timeout_s", "a process loading the environment"
    check_loads("environment", [check], "environment.name", setting, environment.startup_timeout_s, process)


def _check_backend(config: RunConfig) -> None:
    spec = config.generation.backend.name
    backend = resolve("backend", spec, "generation.backend.name")
    validate_options(backend, spec, config.generation.backend.options, "generation.backend.options")


def _check_task(config: RunConfig) -> None:
    """The task part built (its settings checked; its prompts are read only when the run builds
    the task), and its checker against the rewards."""
    task = config.data.task
    check = (task.name, "asyncrl.data.tasks:task_source", (config.data,))
    check_loads(
        "task",
        [check],
        "data.task.name",
        "data.task.startup_timeout_s",
        task.startup_timeout_s,
        "a process loading the task",
    )
    source = task_source(config.data)  # here too: what it declares is read below
    functions, task = config.rewards.functions, task.name
    if getattr(source, "checker_required", False) and "task" not in functions:
        raise ValueError(
            f"rewards.functions: data.task.name {task} is scored by its own checker; list task (rewards.functions=[task])"
        )
    if not getattr(source, "has_checker", False) and "task" in functions:
        raise ValueError(
            f"rewards.functions: the task reward needs a task with its own checker; data.task.name '{task}' has none"
        )


def with_defaults(config: RunConfig) -> RunConfig:
    """``config`` with every part's options as its ``Options`` model fills them in, defaults
    included: what ``asyncrl config`` prints, so a part's defaults are seen without reading its
    code. Call after ``check_parts`` (a user's module is then known to load)."""
    data, generation, rewards = config.data, config.generation, config.rewards
    task = data.task.model_copy(update={"options": _filled("task", data.task, "data.task")})
    backend = generation.backend.model_copy(
        update={"options": _filled("backend", generation.backend, "generation.backend")}
    )
    update = {
        "sampler": config.sampler.model_copy(update={"options": _filled("sampler", config.sampler, "sampler")}),
        "algorithm": config.algorithm.model_copy(
            update={"options": _filled("algorithm", config.algorithm, "algorithm")}
        ),
        "data": data.model_copy(update={"task": task}),
        "generation": generation.model_copy(update={"backend": backend}),
        "rewards": rewards.model_copy(update={"options": _reward_options(config)}),
    }
    if config.environment.name is not None:
        filled = _filled("environment", config.environment, "environment")
        update["environment"] = config.environment.model_copy(update={"options": filled})
    return config.model_copy(update=update)


def _filled(kind: str, section, field: str) -> dict:
    """A part's options with its defaults, as plain data; as given for a part without ``Options``."""
    model = checked_options(
        resolve(kind, section.name, f"{field}.name"), section.name, section.options, f"{field}.options"
    )
    return section.options if model is None else model.model_dump(mode="json")


def _reward_options(config: RunConfig) -> dict:
    """Each listed reward class's options with their defaults; a reward function takes none."""
    given, filled = config.rewards.options, {}
    for name in config.rewards.functions:
        part = resolve("reward", name, "rewards.functions")
        model = (
            checked_options(part, name, given.get(name, {}), f"rewards.options.{name}")
            if isinstance(part, type)
            else None
        )
        if model is not None:
            filled[name] = model.model_dump(mode="json")
    return filled
