"""The configuration reference, docs/configuration.md, rendered from the models' own descriptions;
and every key with its type and default, the data tests/data/config_keys.json freezes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from asyncrl.config.base import section_model
from asyncrl.config.root import RunConfig

MARKDOWN_BAR = " \\| "  # a Literal's choices in a Markdown table cell

# (where its options are set, e.g. ``algorithm.options``; the part's name; its Options model)
PartOptions = tuple[str, str, type[BaseModel]]


def _type_name(annotation: Any, bar: str = " | ", limits: str | None = None) -> str:
    """The type as the reference names it; with ``limits`` (None: no ranges), a number's range
    after it (``int >= 1 or null``, ``list[int >= 0]``)."""
    if get_origin(annotation) is Annotated:
        base, *constraints = get_args(annotation)
        return _type_name(base, bar, None if limits is None else _range(constraints))
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return bar.join(str(a) for a in args)
    if get_origin(annotation) is dict:
        return "mapping"
    if args:
        inner = [_type_name(a, bar, limits) for a in args if a is not type(None)]
        suffix = " or null" if type(None) in args else ""
        if get_origin(annotation) in (list, tuple):
            return f"{get_origin(annotation).__name__}[{', '.join(inner)}]"
        return " or ".join(inner) + suffix
    name = getattr(annotation, "__name__", str(annotation))
    return f"{name} {limits}" if limits and annotation in (int, float) else name


_BOUNDS = {"ge": (">=", "["), "gt": (">", "("), "le": ("<=", "]"), "lt": ("<", ")")}


def _range(constraints: Sequence[Any]) -> str:
    """The range pydantic constraints allow a number, as ``>= 1``, ``> 0`` or ``in (0, 1]``; empty
    when they set none."""
    items = [m for c in constraints for m in (c.metadata if isinstance(c, FieldInfo) else [c])]
    bounds = [(key, getattr(m, key)) for m in items for key in _BOUNDS if hasattr(m, key)]
    low = [b for b in bounds if b[0] in ("ge", "gt")]
    high = [b for b in bounds if b[0] in ("le", "lt")]
    if low and high:
        (low_key, low_value), (high_key, high_value) = low[0], high[0]
        return f"in {_BOUNDS[low_key][1]}{_number(low_value)}, {_number(high_value)}{_BOUNDS[high_key][1]}"
    if not bounds:
        return ""
    key, value = bounds[0]
    return f"{_BOUNDS[key][0]} {_number(value)}"


def _number(value: float) -> str:
    """A bound as written: 0, 1e-06, and a large power of two as one (2**63)."""
    if isinstance(value, int) and value >= 2**32 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return f"{value:g}"


def _sections() -> list[tuple[str, type[BaseModel]]]:
    """Each section of ``RunConfig``, by name, in order; ``seed`` is the one key outside them."""
    found = [(name, section_model(field.annotation)) for name, field in RunConfig.model_fields.items()]
    return [(name, section) for name, section in found if section is not None]


def config_keys(parts: Sequence[PartOptions] = ()) -> dict[str, dict[str, Any]]:
    """Every key, dotted (``sync.mode``), with its type and JSON default as the reference gives them;
    and each option of the ``parts`` given (``plugins.builtin_options``), under the part's name
    (``algorithm.options[grpo].clip_low``)."""
    defaults = RunConfig().model_dump(mode="json")
    keys = {"seed": {"type": _type_name(RunConfig.model_fields["seed"].annotation), "default": defaults["seed"]}}
    tables = [(name, section, defaults[name]) for name, section in _sections()]
    tables += [(f"{where}[{name}]", model, _option_defaults(model)) for where, name, model in parts]
    for name, model, model_defaults in tables:
        for key, field, default in _fields(model, model_defaults):
            keys[f"{name}.{key}"] = {"type": _type_name(field.annotation), "default": default}
    return keys


def _fields(section: type[BaseModel], defaults: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key inside the section, field, default) of every value; a nested section's values
    are listed under its name (``staleness.action``) rather than as one value."""
    found = []
    for key, field in section.model_fields.items():
        nested = section_model(field.annotation)
        if nested is not None:
            found += _fields(nested, defaults[key], f"{prefix}{key}.")
        else:
            found.append((f"{prefix}{key}", field, defaults[key]))
    return found


def config_reference(parts: Sequence[PartOptions] = ()) -> str:
    """Every section and key with its type, default and meaning, as Markdown (docs/configuration.md),
    then the options of each of ``parts``, the built-ins that declare some (``plugins.builtin_options``)."""
    defaults, seed = RunConfig().model_dump(mode="json"), RunConfig.model_fields["seed"]
    lines = [
        "# Configuration reference",
        "",
        "Generated by `asyncrl config --reference`; every key can be set in YAML or overridden on the",
        "command line as `section.key=value`; a part's options too, one at a time, as",
        "`section.options.key=value` (e.g. `environment.options.latency_median_s=0.05`: the file's other",
        "options stay). Unknown keys, wrong types, out-of-range values and inconsistent combinations",
        "are rejected before anything is built, with a one-line error naming the field.",
        "",
        f"- `seed` ({_type_name(seed.annotation, MARKDOWN_BAR, _range(seed.metadata))}, "
        f"default `{defaults['seed']}`): {seed.description}",
    ]
    for name, section in _sections():
        lines += [
            "",
            f"## `{name}`",
            "",
            section.__doc__.strip(),
            "",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
        ]
        lines += _rows(section, defaults[name])
    if parts:
        lines += [
            "",
            "## Options of the built-in parts",
            "",
            "Set under the key given, e.g. `algorithm.options.clip_low=0.1`.",
        ]
    for where, name, model in parts:
        doc = (model.__doc__ or "").strip()
        lines += ["", f"### `{where}` of `{name}`", "", *([doc, ""] if doc else [])]
        lines += [
            "| key | type | default | meaning |",
            "|---|---|---|---|",
            *_rows(model, _option_defaults(model)),
        ]
    return "\n".join(lines) + "\n"


def _option_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """A part's option defaults as JSON values; an option without one reads "(required)"."""
    values = {
        key: "(required)" if field.is_required() else field.get_default(call_default_factory=True)
        for key, field in model.model_fields.items()
    }
    return json.loads(json.dumps(values, default=str))


def _rows(model: type[BaseModel], defaults: dict) -> list[str]:
    """One Markdown table row per key of ``model``."""
    rows = []
    for key, sub, value in _fields(model, defaults):
        default = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        type_name = _type_name(sub.annotation, MARKDOWN_BAR, _range(sub.metadata))
        rows.append(f"| `{key}` | {type_name} | `{default}` | {sub.description} |")
    return rows
