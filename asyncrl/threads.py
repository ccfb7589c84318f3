"""A pool of daemon threads: a call that never returns neither keeps the process alive nor, once
given up, holds a place in its pool.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so one call
stuck for ever (an environment's ``step``, a hung worker) would keep a stopped run's process alive
after its error was printed. Here every thread is a daemon, and ``abandon`` gives up a running call:
its thread leaves the pool (it ends if the call ever returns) and a fresh one takes its place.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any


class DaemonPool:
    """Runs calls on at most ``max_workers`` daemon threads, in submission order."""

    def __init__(self, max_workers: int, name: str) -> None:
        self.max_workers = max_workers
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0  # threads serving the queue; an abandoned call's thread is not one
        self._running: set[Future] = set()
        self._abandoned: set[Future] = set()
        self._closed = False
        self._ids = itertools.count()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: cannot take a call after shutdown")
            self._queue.put((future, fn, args, kwargs))
            if self._threads < self.max_workers:
                self._start()
        return future

    def abandon(self, future: Future) -> None:
        """Give up ``future``: cancelled if it has not started, else left running on a thread that
        no longer counts, with a fresh thread in its place."""
        if future.cancel():
            return
        with self._lock:
            if future in self._running and future not in self._abandoned:
                self._abandoned.add(future)
                self._threads -= 1
                if not self._closed:
                    self._start()

    def shutdown(self, timeout_s: float = 0.0) -> bool:
        """Cancel the queued calls and wait up to ``timeout_s`` for the running ones that were not
        abandoned; True when none of them is left running. The threads end once their calls return."""
        with self._lock:
            threads, self._closed = (0 if self._closed else self._threads), True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._queue.put(None)
        with self._lock:
            running = self._running - self._abandoned
        return not wait(running, timeout=timeout_s).not_done

    def _start(self) -> None:
        self._threads += 1
        threading.Thread(target=self._serve, name=f"{self.name}_{next(self._ids)}", daemon=True).start()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            with self._lock:
                if not future.set_running_or_notify_cancel():
                    continue
                self._running.add(future)
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:
                future.set_exception(err)
            with self._lock:
                self._running.discard(future)
                if future in self._abandoned:
                    self._abandoned.discard(future)
                    return
