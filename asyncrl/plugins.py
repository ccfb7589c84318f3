"""Custom code named in a config as ``package.module:attribute``: the only way user code is loaded."""

from __future__ import annotations

import importlib
from typing import Any


def import_attribute(name: str, field: str) -> Any:
    """The attribute ``name`` points at; any failure is one ValueError naming ``field``."""
    module_name, _, attribute = name.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except Exception as err:  # a missing module or attribute, or the module's own code raising on import
        hint = "; is its directory on PYTHONPATH?" if isinstance(err, ModuleNotFoundError) else ""
        raise ValueError(f"{field}: cannot load '{name}' ({type(err).__name__}: {err}){hint}") from None
