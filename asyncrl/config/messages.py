"""One-line error messages: a pydantic error, an unknown key or an echoed value, each naming its field."""

from __future__ import annotations

import difflib
import re
from typing import Any, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.config.base import ConfigError, section_model
from asyncrl.config.root import RunConfig

SHOWN_CHARS = 200  # an input value echoed in an error is cut to this many characters
_NAMES_ITS_FIELD = re.compile(r"^[a-z_]+\.[a-z_]+\S*: ")  # options name their key: rewards.options.m:f.scale


def unknown_key_error(path: tuple[str, ...], key: str, valid: list[str]) -> ConfigError:
    dotted = ".".join((*path, key))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f" (did you mean '{'.'.join((*path, close[0]))}'?)" if close else f" (valid keys: {', '.join(valid)})"
    return ConfigError(f"{dotted}: unknown key{hint}")


def one_line_error(err: ValidationError) -> ConfigError:
    errors = err.errors()
    first = {**errors[0], "loc": _key_path(errors[0]["loc"])}
    loc = ".".join(str(p) for p in first["loc"])
    message = _alternatives([e["msg"] for e in errors if _key_path(e["loc"]) == first["loc"]])
    if _NAMES_ITS_FIELD.match(message):
        return ConfigError(message)  # a cross-field check already names its field
    if first["type"] == "missing" and first["loc"] and isinstance(first["loc"][-1], int):
        parent = ".".join(str(p) for p in first["loc"][:-1])
        return ConfigError(f"{parent}: too few values (got {shown(first['input'])})")
    if first["input"] is None:
        default = shown(_default(first["loc"]))
        return ConfigError(f"{loc}: cannot be null (an empty value is null); give a value, e.g. the default {default}")
    got = "" if isinstance(first["input"], dict) else f" (got {clipped(repr(first['input']))})"
    return ConfigError(f"{loc or 'config'}: {message}{got}")


def _key_path(loc: tuple) -> tuple:
    """The keys of a pydantic error's location: an error of a union's member adds the member's
    name (``constrained-int``, ``literal['auto']``), which is no key."""
    path: list = []
    model: type[BaseModel] | None = RunConfig
    mapping = False
    for part in loc:
        if model is not None and part in model.model_fields:
            field = model.model_fields[part]
            model, mapping = section_model(field.annotation), get_origin(field.annotation) is dict
        elif model is not None or not (isinstance(part, int) or mapping):
            break
        path.append(part)
    return tuple(path)


def _alternatives(messages: list[str]) -> str:
    """One message for the errors of one key: a union's members each give one, all read as one
    ``Input should be ...`` (``greater than or equal to 1 or 'auto'``)."""
    first, *others = (m.removeprefix("Value error, ") for m in messages)
    return " or ".join([first, *(m.removeprefix("Input should be ") for m in others)])


def shown(value: Any) -> str:
    """A value as it is written in YAML or an override: true, null, [0.9, 0.99], .inf; cut short
    past ``SHOWN_CHARS`` so an error message stays one readable line."""
    if isinstance(value, (list, tuple, dict)) and len(value) > SHOWN_CHARS:
        value = list(value)[:SHOWN_CHARS]  # enough to show; dumping all of a huge value is not
    return clipped(
        yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip().removesuffix("...").strip()
    )


def clipped(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _default(loc: tuple) -> Any:
    value: Any = RunConfig().model_dump(mode="json")
    for part in loc:
        value = value[part]
    return value
