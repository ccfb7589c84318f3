"""Interrupts: SIGINT and SIGTERM during a run, caught so that the run stops with a checkpoint.

The first signal is noted, shown and announced on ``Changes``; the loops stop at their next safe
point (``check``) and every long wait (``interruptible``) is abandoned at once, so the stop
checkpoint never waits for running generation; a train step's call in flight is told to give up
(``abandonable``), so it does not wait for a micro-batch either. A second signal is not caught any
more, so it ends the process the default way. Signals are caught only on the main thread, where
asyncio can.
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
        await self._done_or_signalled(work)
        if not work.done():
            work.cancel()
            self.check(version)
        return work.result()

    async def abandonable(
        self, awaitable: Awaitable[T], abandon: Callable[[], Awaitable[None]], version: int, timeout_s: float
    ) -> T:
        """``awaitable``'s result, for work a signal should not wait for (a train step's call that
        runs for minutes on a real model). On a signal ``abandon()`` asks the worker to drop it,
        and the work's own outcome decides: work that finished anyway returns its result (a
        trainer's optimizer update is never abandoned, so the version it made is kept), work that
        raised, or still runs after ``timeout_s``, gives ``RunInterrupted``."""
        work = asyncio.ensure_future(awaitable)
        await self._done_or_signalled(work)
        if not work.done():
            try:
                async with asyncio.timeout(timeout_s):
                    await abandon()
                    await asyncio.wait([work])
            except TimeoutError:
                pass
            if not work.done():
                work.cancel()
                self.check(version)
        if work.cancelled() or work.exception() is not None:
            self.check(version)  # else it failed on its own, before any signal: raised as it is
        return work.result()

    async def _done_or_signalled(self, work: asyncio.Future) -> None:
        """Return once ``work`` is done or a signal has arrived; cancelled, cancel ``work`` too."""
        signalled = asyncio.ensure_future(self._changes.wait_for(lambda: self.signum is not None))
        try:
            await asyncio.wait([work, signalled], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()
            raise
        finally:
            signalled.cancel()

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
