"""The size of exported weights, for the sync's report and the object store's payloads."""

from __future__ import annotations

from typing import Any


def state_dict_bytes(state: Any) -> int:
    """Bytes of exported weights: a state dict, or a reference to one that knows its size (``nbytes``)."""
    if hasattr(state, "nbytes"):
        return state.nbytes
    return sum(t.numel() * t.element_size() for t in state.values())
