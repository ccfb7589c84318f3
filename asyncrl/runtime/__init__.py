"""Runtimes turn plain worker objects into handles whose method calls the controller awaits.

A handle call submits the work immediately and returns an awaitable, so calls to one worker run
in the order they were made. That ordering is what the weight sync relies on: a weight load
submitted after a generation batch runs after it. The controller is identical on every runtime.
"""

from asyncrl.config import RunConfig
from asyncrl.runtime.local import SHUTDOWN_TIMEOUT_S, LocalHandle, LocalRuntime

__all__ = ["LocalHandle", "LocalRuntime", "build_runtime"]


def build_runtime(config: RunConfig):
    """The runtime ``runtime.name`` selects; Ray is imported only when it is the one."""
    if config.runtime.name == "ray":
        from asyncrl.runtime.ray import RayRuntime

        cfg, ranks, generators = config.runtime, config.parallel.world_size, config.generation.num_workers
        return RayRuntime(
            cfg,
            num_cpus=ranks * cfg.trainer_cpus + generators * cfg.generator_cpus,
            num_gpus=ranks * cfg.trainer_gpus + generators * cfg.generator_gpus,
        )
    # a stop waits for a hung call no longer than for progress, and never more than a minute
    return LocalRuntime(min(SHUTDOWN_TIMEOUT_S, config.runtime.watchdog_s or SHUTDOWN_TIMEOUT_S))
