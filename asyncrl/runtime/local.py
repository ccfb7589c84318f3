"""The embedded runtime: every worker lives in this process behind its own thread.

Each worker gets a single-thread executor, so its calls run one at a time in submission order
while different workers (the trainer and the rollout workers) run concurrently: generation and
training overlap. Torch releases the GIL inside its kernels, which is where the time goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class LocalHandle:
    """``await handle.method(*args)`` runs ``worker.method(*args)`` on the worker's thread.

    A method the worker lists in ``unordered_methods`` runs on a second thread instead, beside
    the queued calls: an in-flight weight load into a generator that is generating.
    """

    def __init__(self, worker: Any, name: str) -> None:
        self.worker = worker
        self.name = name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._unordered = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-unordered")

    def __getattr__(self, method: str) -> Callable[..., asyncio.Future]:
        target = getattr(self.worker, method)
        if not callable(target):
            raise AttributeError(f"{self.name}.{method} is not a method")
        executor = self._unordered if method in getattr(self.worker, "unordered_methods", ()) else self._executor

        def submit(*args: Any, **kwargs: Any) -> asyncio.Future:
            return asyncio.wrap_future(executor.submit(target, *args, **kwargs))

        return submit

    @property
    def loads_while_generating(self) -> bool:
        return "load_weights" in getattr(self.worker, "unordered_methods", ())

    def shutdown(self) -> None:
        """Drop queued calls and wait for the running ones, then ``close()`` the worker if it has
        one (a generator's server); later calls raise RuntimeError."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._unordered.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.worker, "close", None)
        if callable(close):
            close()


class LocalRuntime:
    """Workers as in-process objects; payloads are passed by reference, nothing is serialized."""

    name = "local"

    def __init__(self) -> None:
        self.handles: list[LocalHandle] = []

    def spawn(self, worker_factory: Callable[[], Any], name: str) -> LocalHandle:
        handle = LocalHandle(worker_factory(), name)
        self.handles.append(handle)
        return handle

    def shutdown(self) -> None:
        for handle in self.handles:
            handle.shutdown()
        self.handles.clear()
