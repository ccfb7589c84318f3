"""Runtimes turn plain worker objects into handles whose method calls the controller awaits.

A handle call submits the work immediately and returns an awaitable, so calls to one worker run
in the order they were made. That ordering is what the weight sync relies on: a weight load
submitted after a generation batch runs after it. The controller is identical on every runtime.
"""

from collections.abc import Callable
from typing import Any, Protocol

from asyncrl.config import RunConfig
from asyncrl.runtime.local import SHUTDOWN_TIMEOUT_S, LocalHandle, LocalRuntime

__all__ = ["LocalHandle", "LocalRuntime", "Runtime", "build_runtime"]


class Runtime(Protocol):
    """Where a run's workers live, as the driver sees it; ``LocalRuntime`` and ``RayRuntime``.

    The driver spawns rollout workers and trainer ranks from factories (asyncrl/workers.py), waits
    until they are ``ready``, runs the controller through ``run_controller`` when it runs in a
    runtime's own process, and shuts everything down; no code asks which runtime it holds."""

    in_process: bool  # workers live in the driver's process and may share its objects (workers.Shared)

    def spawn_generators(self, factory: Callable[[], Any], count: int) -> list[Any]:
        """``count`` rollout worker handles, each worker built by ``factory()``."""
        ...

    def spawn_trainer_ranks(
        self, build_rank: Callable[[int, str | None], Callable[[], Any]], world_size: int
    ) -> list[Any]:
        """One handle per trainer rank; rank r is built by ``build_rank(r, init_method)()``."""
        ...

    def ready(self) -> None:
        """Every spawned worker is built (a factory's error is raised here) and connected."""
        ...

    def run_controller(self, drive: Callable[[], Any]) -> Any:
        """``drive()``'s result, run where the runtime keeps its controller."""
        ...

    def shutdown(self) -> None: ...


def build_runtime(config: RunConfig) -> Runtime:
    """The runtime ``runtime.name`` selects; Ray is imported only when it is the one."""
    if config.runtime.name == "ray":
        from asyncrl.runtime.ray import RayRuntime

        cfg, ranks, generators = config.runtime, config.parallel.world_size, config.generation.num_workers
        broadcast = (
            (config.broadcast_backend, config.sync.timeout_s) if config.weight_transport == "broadcast" else None
        )
        return RayRuntime(
            cfg,
            num_cpus=ranks * cfg.trainer_cpus + generators * cfg.generator_cpus,
            num_gpus=ranks * cfg.trainer_gpus + generators * cfg.generator_gpus,
            broadcast=broadcast,
        )
    # a stop waits for a hung call no longer than for progress, and never more than a minute
    return LocalRuntime(min(SHUTDOWN_TIMEOUT_S, config.runtime.watchdog_s or SHUTDOWN_TIMEOUT_S))
