"""Abandoning a model's running forward or backward from another thread, between its modules.

A stop (SIGINT, SIGTERM) must not wait for a micro-batch or a generation call that takes minutes
on a real model, and work running on a worker's thread cannot be cancelled from outside it. So
the model checks a switch itself: a forward pre-hook on each of its modules, and, for backward, a
gradient hook on each module's output. Once the switch is set, the next check raises
``Abandoned`` and the call unwinds within about one module's compute.

Forward checks fire only under ``watching()`` on the calling thread, so a copy of the model that
carries the hooks (``copy.deepcopy`` copies them) or another thread's forward is never abandoned
by this switch; gradient hooks are added only to outputs computed under ``watching()``. Nothing a
check can interrupt changes a weight: an optimizer update runs no forward and no backward, so an
abandoned step leaves only gradients and accumulators for its abort to drop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn


class Abandoned(RuntimeError):
    """The running call was abandoned on request (``AbandonSwitch.set``)."""


class AbandonSwitch:
    def __init__(self, what: str) -> None:
        self.what = what  # named in the error: "the train step", "generation"
        self._event = threading.Event()
        self._local = threading.local()

    def attach(self, model: nn.Module) -> None:
        """Check the switch before the forward of each of ``model``'s modules, and in backward at
        the gradient of each module's output."""

        # Plain functions, not bound methods: ``copy.deepcopy`` copies a function by reference, so a
        # copy of the model stays copyable (the switch holds locks) and carries inert hooks.
        def before_forward(module: nn.Module, args: tuple) -> None:
            self._before_forward()

        def after_forward(module: nn.Module, args: tuple, output: object) -> None:
            self._after_forward(output)

        for module in model.modules():
            module.register_forward_pre_hook(before_forward)
            module.register_forward_hook(after_forward)

    def set(self) -> None:
        """Abandon the watched call running now, and every watched call until ``clear``."""
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Run the block's forwards and backwards (on this thread) under the switch."""
        outer = self._watched()
        self._local.watching = True
        try:
            yield
        finally:
            self._local.watching = outer

    def _watched(self) -> bool:
        return getattr(self._local, "watching", False)

    def _before_forward(self) -> None:
        if self._watched() and self._event.is_set():
            raise Abandoned(f"{self.what} was abandoned: the run is stopping")

    def _after_forward(self, output: object) -> None:
        if not (self._watched() and torch.is_grad_enabled()):
            return
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._in_backward)

    def _in_backward(self, grad: torch.Tensor) -> None:
        # Backward may run on autograd's device threads, which are not watching: the hook was
        # added under watch, so the event alone decides.
        if self._event.is_set():
            raise Abandoned(f"{self.what} was abandoned in backward: the run is stopping")
