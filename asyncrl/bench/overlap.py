"""``asyncrl bench overlap``: how close the asynchronous loop gets to perfect overlap.

The real controller, sampler, buffer, weight sync and runtime drive fixed-delay workers: a step's
worth of groups takes g seconds to generate and t seconds to train. The synchronous loop a user
would otherwise run (generate the whole step, then train it: ``max_lag: 0`` and
``min_groups_per_chunk: P``) can do no better than g + t per step; an overlapped one no better than
max(g, t). asyncrl's runs stream groups into the trainer as they land (``min_groups_per_chunk:
1``), so even ``max_lag: 0`` overlaps within a step. Reported per (g, t) and max_lag:
``step_time_over_ideal`` = step time / max(g, t), ``sync_step_time_over_ideal`` = the synchronous
loop's step time / (g + t), and ``speedup_over_sync`` = synchronous step time / step time.
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
from typing import Any

from asyncrl.bench.common import runtime_session, spawn_pair
from asyncrl.bench.fake_workers import DelayRolloutWorker, DelayTrainerWorker, NullMetrics, NullProgress
from asyncrl.config import RunConfig, config_from_dict
from asyncrl.control.buffer import ReplayBuffer
from asyncrl.control.controller import SingleController
from asyncrl.data import Prompt, PromptLoader, Task
from asyncrl.run_sampler import build_run_sampler

SHAPES = ((1.0, 1.0), (2.0, 1.0), (1.0, 2.0))  # (g, t) in units of ``scale`` seconds
LAGS = (0, 1, 2)
PROMPTS_PER_STEP = 8
GROUP_SIZE = 4
GOAL = 1.05  # step_time_over_ideal at max_lag >= 1


def bench_config(
    *, max_lag: int, steps: int, runtime: str = "local", batch_groups: int = 2, chunk_groups: int = 1
) -> RunConfig:
    step = {
        "prompts_per_step": PROMPTS_PER_STEP,
        "generations_per_prompt": GROUP_SIZE,
        "max_steps": steps,
        "min_groups_per_chunk": chunk_groups,
    }
    return config_from_dict(
        {
            "step": step,
            "generation": {"batch_size": batch_groups * GROUP_SIZE},
            "sampler": {"name": "in_order", "max_lag": max_lag},
            "runtime": {"name": runtime, "watchdog_s": None},
            "logging": {"eval_every_steps": None, "tensorboard": False, "progress": False},
            "checkpoint": {"every_steps": None},
            "warm_start": {"steps": 0},
            "integrity": {"sampling": {"every_syncs": 0}},  # the fake generators hold no model to probe
        }
    )


def fake_task(num_prompts: int) -> Task:
    prompts = [Prompt(f"bench/{i}", f"prompt {i}", "0") for i in range(num_prompts)]
    return Task("bench", train=prompts, heldout=prompts[:1])


def build_controller(config: RunConfig, trainer: Any, rollout_workers: list[Any], run_dir: str) -> SingleController:
    """A controller over any handles, with the run's own sampler and buffer and null sinks."""
    task = fake_task(config.step.prompts_per_step * (config.step.max_steps + config.sampler.max_lag + 2))
    sampler, capacity = build_run_sampler(config)
    return SingleController(
        config,
        trainer=trainer,
        rollout_workers=rollout_workers,
        task=task,
        loader=PromptLoader(task.train, shuffle_seed=0, epochs=None),
        sampler=sampler,
        buffer=ReplayBuffer(capacity),
        metrics=NullMetrics(),
        progress=NullProgress(),
        run_dir=run_dir,
    )


def measure_step_time(
    runtime_name: str, generate_s: float, train_s: float, max_lag: int, steps: int, warmup: int, *, sync: bool = False
) -> float:
    """Mean wall seconds per step after ``warmup`` steps, with g = generate_s and t = train_s;
    ``sync``: the plain synchronous loop (whole-step chunks, max_lag 0)."""
    chunk_groups = PROMPTS_PER_STEP if sync else 1
    config = bench_config(max_lag=max_lag, steps=steps + warmup, runtime=runtime_name, chunk_groups=chunk_groups)
    runtime, trainer, generator = spawn_pair(
        runtime_name,
        functools.partial(DelayTrainerWorker, train_s / PROMPTS_PER_STEP),
        functools.partial(DelayRolloutWorker, generate_s / PROMPTS_PER_STEP, GROUP_SIZE),
    )
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as run_dir:
            controller = build_controller(config, trainer, [generator], run_dir)
            asyncio.run(controller.run())
    finally:
        runtime.shutdown()
    walls = [record["time/wall_s"] for record in controller.metrics.steps]
    return (walls[-1] - walls[warmup - 1]) / steps


def run(*, scale: float, steps: int, warmup: int, runtimes: tuple[str, ...]) -> list[dict]:
    with runtime_session(runtimes):
        return [row for runtime_name in runtimes for row in _rows(runtime_name, scale, steps, warmup)]


def _rows(runtime_name: str, scale: float, steps: int, warmup: int) -> list[dict]:
    rows = []
    for g, t in SHAPES:
        generate_s, train_s = g * scale, t * scale
        sync_s = measure_step_time(runtime_name, generate_s, train_s, 0, steps, warmup, sync=True)
        times = {lag: measure_step_time(runtime_name, generate_s, train_s, lag, steps, warmup) for lag in LAGS}
        for lag in LAGS:
            rows.append(
                {
                    "runtime": runtime_name,
                    "g_s": generate_s,
                    "t_s": train_s,
                    "max_lag": lag,
                    "step_time_s": times[lag],
                    "step_time_over_ideal": times[lag] / max(generate_s, train_s),
                    "sync_step_time_s": sync_s,
                    "sync_step_time_over_ideal": sync_s / (generate_s + train_s),
                    "speedup_over_sync": sync_s / times[lag],
                    "goal_met": None if lag == 0 else times[lag] / max(generate_s, train_s) <= GOAL,
                }
            )
    return rows
