"""The embedded runtime: every worker lives in this process behind its own thread.

Each worker gets a single-thread executor, so its calls run one at a time in submission order
while different workers (the trainer and the rollout workers) run concurrently: generation and
training overlap. Torch releases the GIL inside its kernels, which is where the time goes.

The threads are daemons and shutdown waits for a running call only up to a deadline: a call that
never returns (a hung worker) cannot keep a stopped run's process alive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from asyncrl.threads import DaemonPool

SHUTDOWN_TIMEOUT_S = 60.0  # how long shutdown waits for a worker's running call, by default


class LocalHandle:
    """``await handle.method(*args)`` runs ``worker.method(*args)`` on the worker's thread.

    A method the worker lists in ``unordered_methods`` runs on a second thread instead, beside
    the queued calls: an in-flight weight load into a generator that is generating.
    """

    def __init__(self, worker: Any, name: str) -> None:
        self.worker = worker
        self.name = name
        self._executor = DaemonPool(1, name)
        self._unordered = DaemonPool(1, f"{name}-unordered")

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

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Tell the worker to give up its running call (``abandon()``, where it has one: a train
        step or a generation batch ends at its next module or token), drop queued calls and wait
        up to ``timeout_s`` for the running ones (a call still running then is left to its daemon
        thread), then ``close()`` the worker if it has one (a generator's server); later calls
        raise RuntimeError."""
        deadline = time.monotonic() + timeout_s
        abandon = getattr(self.worker, "abandon", None)
        if callable(abandon):
            abandon()
        self._executor.shutdown(timeout_s)
        self._unordered.shutdown(max(0.0, deadline - time.monotonic()))
        close = getattr(self.worker, "close", None)
        if callable(close):
            close()


class LocalRuntime:
    """Workers as in-process objects; payloads are passed by reference, nothing is serialized.
    Implements ``asyncrl.runtime.Runtime``: a factory runs when its worker is spawned, in the
    driver's process, so its workers may share the driver's objects."""

    name = "local"
    in_process = True

    def __init__(self, shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        self.handles: list[LocalHandle] = []
        self.shutdown_timeout_s = shutdown_timeout_s  # how long shutdown waits for the workers' running calls

    def spawn(self, worker_factory: Callable[[], Any], name: str) -> LocalHandle:
        handle = LocalHandle(worker_factory(), name)
        self.handles.append(handle)
        return handle

    def spawn_generators(self, factory: Callable[[], Any], count: int) -> list[LocalHandle]:
        """``count`` rollout workers, each built by ``factory`` now."""
        return [self.spawn(factory, "rollout" if count == 1 else f"rollout {i}") for i in range(count)]

    def spawn_trainer_ranks(
        self, build_rank: Callable[[int, str | None], Callable[[], Any]], world_size: int
    ) -> list[LocalHandle]:
        """The one trainer rank this process holds, built by ``build_rank(0, None)()`` now."""
        if world_size != 1:
            raise ValueError(
                f"parallel.dp: {world_size} trainer ranks need runtime.name ray; the local runtime holds one"
            )
        return [self.spawn(build_rank(0, None), "trainer")]

    def ready(self) -> None:
        """Every worker was built when it was spawned."""

    def run_controller(self, drive: Callable[[], Any]) -> Any:
        return drive()

    def shutdown(self) -> None:
        """Shut every handle down, all of them within ``shutdown_timeout_s``."""
        deadline = time.monotonic() + self.shutdown_timeout_s
        for handle in self.handles:
            handle.shutdown(max(0.0, deadline - time.monotonic()))
        self.handles.clear()
