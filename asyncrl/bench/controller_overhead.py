"""``asyncrl bench controller``: what the controller itself costs per group.

No-op workers answer every call at once, inside the event loop (``InlineHandle``), so the run's
wall time is the controller's bookkeeping (admission, buffer, sampler, gate, sync, metrics) plus
the workers' own calls, which are timed and subtracted. A second measurement puts the same
workers behind the local runtime's threads, adding the cost of a handle call. cProfile names the
top costs of the inline run on the controller's side (not worker code).
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import pstats
import tempfile
import time
from collections.abc import Callable
from typing import Any

from asyncrl.bench.fake_workers import DelayRolloutWorker, DelayTrainerWorker
from asyncrl.bench.overlap import GROUP_SIZE, PROMPTS_PER_STEP, bench_config, build_controller
from asyncrl.runtime import LocalRuntime

GOAL_US = 50.0


class InlineHandle:
    """``await handle.method(*args)`` runs the call right away, in the event loop, and times it."""

    loads_while_generating = False

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.seconds = 0.0

    def __getattr__(self, method: str) -> Callable[..., asyncio.Future]:
        target = getattr(self.worker, method)

        def call(*args: Any, **kwargs: Any) -> asyncio.Future:
            future = asyncio.get_running_loop().create_future()
            start = time.perf_counter()
            try:
                future.set_result(target(*args, **kwargs))
            except Exception as err:
                future.set_exception(err)
            self.seconds += time.perf_counter() - start
            return future

        return call


Handles = Callable[[], tuple[Any, list[Any], Callable[[], float], Callable[[], None]]]


def _run(steps: int, handles: Handles, profiler: cProfile.Profile | None = None) -> dict:
    config = bench_config(max_lag=1, steps=steps, batch_groups=PROMPTS_PER_STEP // 2)
    trainer, generators, worker_seconds, close = handles()
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as run_dir:
            controller = build_controller(config, trainer, generators, run_dir)
            start = time.perf_counter()
            with profiler or contextlib.nullcontext():
                asyncio.run(controller.run())
            wall = time.perf_counter() - start
    finally:
        close()
    groups = steps * PROMPTS_PER_STEP
    controller_s = wall - worker_seconds()
    return {
        "groups": groups,
        "wall_s": wall,
        "controller_s": controller_s,
        "controller_us_per_group": 1e6 * controller_s / groups,
        "groups_per_s": groups / wall,
    }


def _inline() -> tuple[Any, list[Any], Callable[[], float], Callable[[], None]]:
    trainer = InlineHandle(DelayTrainerWorker(0.0))
    generator = InlineHandle(DelayRolloutWorker(0.0, GROUP_SIZE))
    return trainer, [generator], lambda: trainer.seconds + generator.seconds, lambda: None


def _threads() -> tuple[Any, list[Any], Callable[[], float], Callable[[], None]]:
    runtime = LocalRuntime()
    trainer = runtime.spawn(lambda: DelayTrainerWorker(0.0), "trainer")
    generator = runtime.spawn(lambda: DelayRolloutWorker(0.0, GROUP_SIZE), "rollout")
    return trainer, [generator], lambda: 0.0, runtime.shutdown


def run(*, steps: int, top: int) -> dict:
    inline = _run(steps, _inline)
    threads = _run(steps, _threads)
    profiler = cProfile.Profile()
    _run(steps, _inline, profiler)
    stats = pstats.Stats(profiler)
    # The controller's side only: the fake workers' calls are not its cost.
    rows = sorted(
        ((key, value) for key, value in stats.stats.items() if _controller_side(key[0])),
        key=lambda item: item[1][2],
        reverse=True,
    )  # by own time
    groups = steps * PROMPTS_PER_STEP
    top_costs = [
        {
            "function": f"{_short_path(file)}:{line}({name})",
            "calls": calls,
            "own_us_per_group": 1e6 * own / groups,
            "cumulative_us_per_group": 1e6 * cumulative / groups,
        }
        for (file, line, name), (_, calls, own, cumulative, _) in rows[:top]
    ]
    return {
        "inline": {**inline, "goal_us_per_group": GOAL_US, "goal_met": inline["controller_us_per_group"] <= GOAL_US},
        "local_threads": threads,
        "profile_top_by_own_time": top_costs,
    }


def _controller_side(file: str) -> bool:
    """The controller, buffer, samplers, gate and the event loop; not worker code or torch."""
    worker_code = ("/asyncrl/trainer/", "/asyncrl/types.py", "/asyncrl/bench/")
    return ("/asyncrl/" in file or "/asyncio/" in file) and not any(part in file for part in worker_code)


def _short_path(file: str) -> str:
    return "/".join(file.split("/")[-2:])
