"""Interrupts: SIGINT and SIGTERM during a run, caught so that the run stops with a checkpoint.

The first signal is noted, shown and announced on ``Changes``; the loops stop at their next safe
point (``check``) and every long wait (``interruptible``) is abandoned at once, so the stop
checkpoint never waits for running generation. A second signal is not caught any more, so it ends
the process the default way. Signals are caught only on the main thread, where asyncio can.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from asyncrl.control.changes import Changes
from asyncrl.errors import RunInterrupted

T = TypeVar("T")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    def __init__(self, changes: Changes, status: Callable[[str], None]) -> None:
        self.signum: int | None = None  # the signal that arrived, once one has
        self._changes = changes
        self._status = status

    def check(self, version: int) -> None:
        """``RunInterrupted`` at step ``version`` once a signal has arrived."""
        if self.signum is not None:
            raise RunInterrupted(self.signum, version)

    async def interruptible(self, awaitable: Awaitable[T], version: int) -> T:
        """``awaitable``'s result, or ``RunInterrupted`` as soon as a signal arrives. For the waits
        that can last as long as a generation batch (a weight sync, a checkpoint's drain, an
        evaluation queued behind a batch)."""
        work = asyncio.ensure_future(awaitable)
        signalled = asyncio.ensure_future(self._changes.wait_for(lambda: self.signum is not None))
        try:
            await asyncio.wait([work, signalled], return_when=asyncio.FIRST_COMPLETED)
        finally:
            signalled.cancel()
            signal_came_first = not work.done()
            if signal_came_first:
                work.cancel()
        if signal_came_first:
            self.check(version)
        return work.result()

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """Catch the signals on the running loop for the block (on the main thread)."""
        loop = asyncio.get_running_loop()
        handled = threading.current_thread() is threading.main_thread()
        if handled:
            for sig in _SIGNALS:
                loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            if handled and self.signum is None:
                for sig in _SIGNALS:
                    loop.remove_signal_handler(sig)

    def _on_signal(self, signum: int) -> None:
        loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)
        self.signum = signum
        self._status(f"{signal.Signals(signum).name}: checkpointing, then stopping (again to quit now)")
        self._changes.notify()
