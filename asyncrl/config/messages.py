"""One-line error messages: a pydantic error, an unknown key or an echoed value, each naming its field."""

from __future__ import annotations

import difflib
import re
from typing import Any

import yaml
from pydantic import ValidationError

from asyncrl.config.base import ConfigError
from asyncrl.config.root import RunConfig

SHOWN_CHARS = 200  # an input value echoed in an error is cut to this many characters
_NAMES_ITS_FIELD = re.compile(r"^[a-z_]+\.[a-z_]+\S*: ")  # options name their key: rewards.options.m:f.scale


def unknown_key_error(path: tuple[str, ...], key: str, valid: list[str]) -> ConfigError:
    dotted = ".".join((*path, key))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f" (did you mean '{'.'.join((*path, close[0]))}'?)" if close else f" (valid keys: {', '.join(valid)})"
    return ConfigError(f"{dotted}: unknown key{hint}")


def one_line_error(err: ValidationError) -> ConfigError:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
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
