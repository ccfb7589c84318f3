"""Reading a run config: YAML file, dotted ``a.b=value`` overrides, the checks pydantic leaves out
(unknown keys with a suggestion, booleans where a number belongs, non-finite floats), validation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.config.base import ConfigError, section_model
from asyncrl.config.messages import one_line_error, shown, unknown_key_error
from asyncrl.config.moved import moved_key_error
from asyncrl.config.root import RunConfig
from asyncrl.config.safe_yaml import TooLarge, load_yaml


def _numeric(annotation: Any) -> bool:
    """int or float, optional or not, bounded or not, or a list or tuple of them; a number or a
    word (``int | Literal["auto"]``) too."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) is Annotated:
        return _numeric(get_args(annotation)[0])
    args = [a for a in get_args(annotation) if a is not type(None) and a is not Ellipsis]
    numbers = [a for a in args if get_origin(a) is not Literal]
    return bool(numbers) and all(_numeric(a) for a in numbers)


def _textual(annotation: Any) -> bool:
    """str, optional or not."""
    return annotation is str or set(get_args(annotation)) == {str, type(None)}


def _scalars(value: Any) -> list:
    """A list or tuple value's items; any other value alone."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _check_keys(model: type[BaseModel], data: Any, path: tuple[str, ...] = ()) -> None:
    """Reject unknown keys anywhere in the tree (suggesting the closest valid one), a value where a
    section belongs, and true / false where a number belongs (pydantic would read them as 1 / 0)."""
    fields = model.model_fields
    for key, value in data.items():
        if key not in fields:
            raise moved_key_error((*path, str(key)), value) or unknown_key_error(path, str(key), list(fields))
        dotted = ".".join((*path, key))
        annotation = fields[key].annotation
        section = section_model(annotation)
        if section is not None:
            if not isinstance(value, dict):
                example = f"{dotted}.{next(iter(section.model_fields))}"
                raise ConfigError(
                    f"{dotted}: is a section, so it takes keys such as {example}, not a value (got {shown(value)})"
                )
            _check_keys(section, value, (*path, key))
        elif _numeric(annotation) and any(isinstance(v, bool) for v in _scalars(value)):
            raise ConfigError(f"{dotted}: expected a number, got {shown(value)}")


def _check_finite(config: BaseModel, path: tuple[str, ...] = ()) -> None:
    """No float anywhere is inf or nan: every one is a size, a rate or a limit (null disables a limit)."""
    for key, value in config:
        dotted = (*path, key)
        if isinstance(value, BaseModel):
            _check_finite(value, dotted)
        elif any(isinstance(v, float) and not math.isfinite(v) for v in _scalars(value)):
            raise ConfigError(f"{'.'.join(dotted)}: must be a finite number (got {shown(value)})")


def _set_dotted(data: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override '{override}': expected key=value, e.g. step.max_steps=50")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override '{override}': empty key")
    model: type[BaseModel] = RunConfig
    node = data
    for depth, key in enumerate(keys):
        fields = model.model_fields
        if key not in fields:
            raise moved_key_error(tuple(keys)) or unknown_key_error(tuple(keys[:depth]), key, list(fields))
        if depth == len(keys) - 1:
            value = _override_value(dotted.strip(), raw)
            if _textual(fields[key].annotation) and isinstance(value, (int, float)):
                value = raw.strip()  # model.path=2024 names a directory, not a number
            node[key] = value
            return
        if get_origin(fields[key].annotation) is dict:  # a part's options: environment.options.max_turns=3
            _set_in_mapping(node, keys[depth:], _override_value(dotted.strip(), raw), dotted.strip())
            return
        section = section_model(fields[key].annotation)
        if section is None:
            raise ConfigError(f"{'.'.join(keys[: depth + 1])}: is a value, not a section")
        model = section
        if node.get(key) is None:
            node[key] = {}
        if not isinstance(node[key], dict):
            raise ConfigError(f"{'.'.join(keys[: depth + 1])}: expected a section (a mapping), got {node[key]!r}")
        node = node[key]


def _override_value(dotted: str, raw: str) -> Any:
    """An override's value as YAML reads it (empty: null); text YAML cannot read stays text."""
    try:
        return load_yaml(raw) if raw.strip() else None
    except TooLarge as err:
        raise ConfigError(f"{dotted}: the value is refused: {err}") from None
    except (yaml.YAMLError, RecursionError):
        return raw


def parse_options(items: list[str], flag: str) -> dict[str, Any]:
    """``key=value`` command-line items as a part's options, each value read as YAML (``--option kl_coef=0.1``)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} '{item}': expected key=value, e.g. {flag} ratio_level=sequence")
        options[key.strip()] = _override_value(f"{flag} {key.strip()}", raw)
    return options


def _set_in_mapping(node: dict, keys: list[str], value: Any, dotted: str) -> None:
    """Set ``value`` at ``keys`` inside a mapping field (its options), making the mappings on the way."""
    names = dotted.split(".")
    offset = len(names) - len(keys)
    for depth, key in enumerate(keys[:-1]):
        if node.get(key) is None:
            node[key] = {}
        if not isinstance(node[key], dict):
            raise ConfigError(f"{'.'.join(names[: offset + depth + 1])}: expected a mapping, got {shown(node[key])}")
        node = node[key]
    node[keys[-1]] = value


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Validate a plain mapping into a RunConfig, raising a one-line ConfigError."""
    _check_keys(RunConfig, data)
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as err:
        raise one_line_error(err) from None
    _check_finite(config)
    return config


def _read_yaml(path: Path) -> dict[str, Any]:
    """A config file's mapping; every problem with the file itself is a one-line --config error."""
    if path.is_dir():
        raise ConfigError(f"--config: '{path}' is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"--config: no such file '{path}'")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"--config: cannot read '{path}' ({err.strerror or err})") from None
    try:
        data = load_yaml(raw.decode("utf-8"))
    except TooLarge as err:
        raise ConfigError(f"--config: '{path}' is refused: {err}") from None
    except RecursionError:
        raise ConfigError(f"--config: '{path}' is nested too deeply to be a run config") from None
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"--config: '{path}' line {line}: not UTF-8 text; save the file as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None)
        raise ConfigError(f"--config: '{path}'{where}: invalid YAML" + (f" ({problem})" if problem else "")) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: '{path}' must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load YAML (or the defaults when ``path`` is None), then apply ``a.b=value`` overrides."""
    data = _read_yaml(Path(path)) if path is not None else {}
    for override in overrides:
        _set_dotted(data, override)
    return config_from_dict(data)


def dump_config(config: RunConfig, run_dir: Path | None = None) -> str:
    """The fully resolved configuration as YAML (written next to every run's outputs), with the
    directory the run writes to, when given, as its ``logging.output_dir``."""
    data = config.model_dump(mode="json")
    if run_dir is not None:
        data["logging"]["output_dir"] = str(run_dir)
    return yaml.safe_dump(data, sort_keys=False)
