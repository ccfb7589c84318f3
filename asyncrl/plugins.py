"""The parts a config names: a built-in name or custom code as ``package.module:attribute``.

Every kind of part (sampler, reward, task, generation backend, algorithm, environment, tool-call
parser) is found one way: ``resolve``
looks a built-in name up in ``BUILTINS``, which points at the built-in's own ``module:attribute``,
and imports it exactly as it imports a user's path. Built-ins are paths, not objects, so naming a
kind imports nothing heavy until a part of it is used. ``import_attribute`` is the only way user
code is loaded (docs/security.md).

A part declares its settings as a pydantic model in its ``Options`` attribute; ``validate_options``
checks the config's ``options`` mapping against it and returns that model's instance, and
``build_part`` is the one way every kind is built: the arguments its kind gives, then that instance
whole, so a part reads its settings as attributes and never rebuilds its model. A part without
``Options`` takes no options and gets no options argument. An ``Options`` field that names another
part (a tool environment's parser) is typed ``Annotated[str, PartRef(kind, options=...)]``:
``validate_options`` resolves it and checks its options too, so a nested part is checked with the
part that names it, and built like any other with an instance of its own ``Options``. A part with
a ``check_options`` classmethod is given its checked options to check what its model cannot (a
tool environment's tool schemas). What a part can do beyond its kind's contract, it declares as an
attribute too (docs/plugins.md), so no caller compares names.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

BUILTINS: dict[str, dict[str, str]] = {
    "sampler": {
        "in_order": "asyncrl.control.sampler:InOrderSampler",
        "weight_fifo": "asyncrl.control.sampler:WeightFifoSampler",
        "windowed": "asyncrl.control.sampler:WindowedSampler",
    },
    "reward": {
        "exact_match": "asyncrl.rewards.functions:exact_match",
        "numeric_match": "asyncrl.rewards.functions:numeric_match",
        "math": "asyncrl.rewards.functions:MathReward",
        "format": "asyncrl.rewards.functions:FormatReward",
        "overlong": "asyncrl.rewards.functions:OverlongPenalty",
        "task": "asyncrl.rewards.functions:TaskReward",
    },
    "task": {
        "arithmetic": "asyncrl.data.tasks:SyntheticTaskSource",
        "running_sum": "asyncrl.data.tasks:SyntheticTaskSource",
        "jsonl": "asyncrl.data.tasks:FileTaskSource",
        "parquet": "asyncrl.data.tasks:FileTaskSource",
        "hf_dataset": "asyncrl.data.tasks:HFDatasetTaskSource",
        "reasoning_gym": "asyncrl.data.tasks:ReasoningGymTaskSource",
        "products": "asyncrl.environments.calculator:ProductsTask",
        "search": "asyncrl.environments.search:SearchTask",
    },
    "backend": {
        "hf": "asyncrl.generation.hf:build_hf_generator",
        "vllm": "asyncrl.generation.vllm:build_vllm_generator",
    },
    "algorithm": {"grpo": "asyncrl.algorithms.grpo:build_grpo"},
    "environment": {
        "feedback": "asyncrl.environments.feedback:FeedbackEnvironment",
        "calculator": "asyncrl.environments.calculator:CalculatorEnvironment",
        "search": "asyncrl.environments.search:SearchEnvironment",
        "skyrl_gym": "asyncrl.environments.skyrl:SkyRLGymEnvironment",
    },
    "tool_parser": {"hermes": "asyncrl.environments.parsers:HermesParser"},
}


# where a run config sets the options of a part of each kind; a reward's are keyed by its name
OPTIONS_AT = {
    "sampler": "sampler.options",
    "reward": "rewards.options.{name}",
    "task": "data.task.options",
    "backend": "generation.backend.options",
    "algorithm": "algorithm.options",
    "environment": "environment.options",
}


@dataclass(frozen=True)
class PartRef:
    """Marks an ``Options`` field as naming a part of ``kind``, whose options are the field ``options``."""

    kind: str
    options: str


def import_attribute(name: str, field: str) -> Any:
    """The attribute ``name`` points at; any failure is one ValueError naming ``field``."""
    module_name, _, attribute = name.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except Exception as err:  # a missing module or attribute, or the module's own code raising on import
        hint = "; is its directory on PYTHONPATH?" if isinstance(err, ModuleNotFoundError) else ""
        raise ValueError(f"{field}: cannot load '{name}' ({type(err).__name__}: {err}){hint}") from None


def check_spec(kind: str, spec: str, field: str) -> None:
    """A built-in name of ``kind`` or a ``package.module:attribute`` path, without importing it."""
    if spec not in BUILTINS[kind] and ":" not in spec:
        builtins = ", ".join(BUILTINS[kind])
        raise ValueError(f"{field}: unknown {kind} '{spec}'; built-ins are {builtins}, or give package.module:attr")


def loads_at_once(kind: str, spec: str) -> bool:
    """Whether resolving ``spec`` here cannot block: asyncrl's own code, or a module this process
    has imported already. Any other user module is loaded elsewhere first (``check_loads``)."""
    return spec in BUILTINS[kind] or spec.partition(":")[0] in sys.modules


def resolve(kind: str, spec: str, field: str) -> Any:
    """The part ``spec`` names: a built-in of ``kind`` or a user's ``package.module:attribute``."""
    check_spec(kind, spec, field)
    return import_attribute(BUILTINS[kind].get(spec, spec), field)


def checked_options(part: Any, spec: str, options: Mapping[str, Any], field: str) -> BaseModel | None:
    """``options`` validated by the part's ``Options`` model, as that model's instance (None for a
    part without one); the first problem is one ValueError naming ``field.<key>``."""
    model = getattr(part, "Options", None)
    if model is None:
        if options:
            raise ValueError(f"{field}.{next(iter(options))}: unknown option; '{spec}' takes no options")
        return None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ValueError(f"{field}: '{spec}'.Options must be a pydantic model class")
    for key in options:
        if key not in model.model_fields:
            known = ", ".join(model.model_fields) or "none"
            raise ValueError(f"{field}.{key}: unknown option of '{spec}' (its options: {known})")
    try:
        return model.model_validate(dict(options))
    except ValidationError as err:
        first = err.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if not first["loc"] and message.partition(": ")[0] in model.model_fields:
            raise ValueError(f"{field}.{message}") from None  # a check across options names the one it is about
        where = ".".join(str(p) for p in (field, *first["loc"]))
        if first["type"] == "missing":
            message = f"required by '{spec}'"
        raise ValueError(f"{where}: {message}") from None


def validate_options(part: Any, spec: str, options: Mapping[str, Any], field: str) -> BaseModel | None:
    """``options`` checked by the part's ``Options`` model (``checked_options``), the parts its
    ``PartRef`` fields name and the part's own ``check_options`` included: what it is built with."""
    validated = checked_options(part, spec, options, field)
    if validated is None:
        return None
    _check_nested_parts(validated, field)
    check = getattr(part, "check_options", None)
    if check is not None:
        try:
            check(validated)
        except ValueError as err:
            raise ValueError(f"{field}: '{spec}': {err}") from None
    return validated


def _check_nested_parts(options: BaseModel, field: str) -> None:
    """Each part a ``PartRef`` field of ``options`` names, resolved and its own options checked."""
    for key, info in type(options).model_fields.items():
        for ref in (m for m in info.metadata if isinstance(m, PartRef)):
            spec = getattr(options, key)
            nested = resolve(ref.kind, spec, f"{field}.{key}")
            validate_options(nested, spec, getattr(options, ref.options) or {}, f"{field}.{ref.options}")


def build_part(build: Callable[..., Any], options: BaseModel | None, *arguments: Any, **keywords: Any) -> Any:
    """``build(*arguments, options, **keywords)``: every kind's part is built this way, given the
    arguments its kind defines, then its validated ``Options`` instance whole (none for a part
    without ``Options``), then the keywords of the capabilities it declares."""
    return build(*arguments, **keywords) if options is None else build(*arguments, options, **keywords)


def refused_arguments(build: Callable[..., Any], options: BaseModel | None, **arguments: Any) -> str | None:
    """None when ``build_part(build, options, *arguments.values())`` binds to ``build``'s signature
    (or it has none to inspect: a class implemented in C); else the arguments it must take, named
    as an error shows them (``prompts_per_step, max_lag, options``)."""
    given = [*arguments.values(), *([] if options is None else [options])]
    try:
        inspect.signature(build).bind(*given)
    except TypeError:
        return ", ".join([*arguments, *([] if options is None else ["options"])])
    except ValueError:
        pass
    return None


def builtin_options() -> list[tuple[str, str, type[BaseModel]]]:
    """(where its options are set, name, Options model) of every built-in part that declares options,
    for the configuration reference and the frozen keys; a tool parser's are set inside its environment's."""
    found = []
    for kind, where in OPTIONS_AT.items():
        for name in BUILTINS[kind]:
            model = getattr(resolve(kind, name, kind), "Options", None)
            if model is not None:
                found.append((where.format(name=name), name, model))
    return found
