"""``asyncrl bench integrity``: what the integrity guard costs a run (docs/integrity.md), as the
ratio of step time with the guard to step time without it, measured in one bench run.

Runs of the same config alternate, guard on and guard off, pair by pair, and the order within a
pair alternates too, so drift of a shared machine falls on both sides alike. A run's step time
is the median of its steps' ``time/step_s`` after the first (which holds start-up); the figure is
the median over pairs of on / off. docs/performance.md reports it against the goal: under 3 % on
the default run.

A busy machine moves step times by more than 3 % from run to run, so the guarded runs also time
the guard's own work, every call of the functions that check a promise (``GUARD_WORK``), and
report it as a share of their step time: a figure the machine's noise hardly moves.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.bench.common import QUICK_RUN
from asyncrl.config import load_config
from asyncrl.generation import HFGenerator
from asyncrl.integrity.group_checks import GroupChecks
from asyncrl.integrity.sync_checks import SyncChecks
from asyncrl.metrics import read_jsonl
from asyncrl.run import train
from asyncrl.trainer import worker as trainer_worker
from asyncrl.trainer.policy import PolicyTrainer
from asyncrl.trainer.worker import TrainerWorker

# Every function a guarded run adds to a step: the group checks of each group and of the step,
# the trainer's count of what each update must sum and its check before each update; the weight
# sync's fingerprints (the trainer's sample of its export, its digests, the generator's
# read-back) and its checks, the sampling probe included (``SyncChecks.__call__``, a coroutine).
GUARD_WORK = (
    (GroupChecks, "vouched_for"),
    (GroupChecks, "failures"),
    (TrainerWorker, "_expect_counts"),
    (PolicyTrainer, "_check_counts"),
    (trainer_worker, "sample"),
    (TrainerWorker, "exported_fingerprints"),
    (HFGenerator, "fingerprint"),
    (SyncChecks, "__call__"),
    (SyncChecks, "check_versions"),
)

GOAL_RATIO = 1.03  # step time with the guard over step time without it, on the default run


def settings(
    *, config: Path | None, overrides: list[str], quick: bool, pairs: int, steps: int | None
) -> dict[str, Any]:
    """What the benchmark trains, as written into its result: ``--quick`` is a tiny model, three
    steps and one pair."""
    return {
        "config": str(config) if config is not None else None,
        "overrides": (QUICK_RUN if quick else []) + overrides,
        "pairs": 1 if quick else pairs,
        "steps": steps or (3 if quick else 20),
    }


def run(settings: dict[str, Any], config_path: Path | None) -> dict[str, Any]:
    """Each pair's step times and ratio, and their medians."""
    pairs = []
    for index in range(settings["pairs"]):
        order = (True, False) if index % 2 == 0 else (False, True)
        runs = {guard: _timed_run(config_path, settings["overrides"], settings["steps"], guard) for guard in order}
        (on_s, guard_share), (off_s, _) = runs[True], runs[False]
        pairs.append({"on_s": on_s, "off_s": off_s, "ratio": on_s / off_s, "guard_share": guard_share})
    ratio = statistics.median(pair["ratio"] for pair in pairs)
    return {
        "pairs": pairs,
        "guard_share": statistics.median(pair["guard_share"] for pair in pairs),
        "step_s_on": statistics.median(pair["on_s"] for pair in pairs),
        "step_s_off": statistics.median(pair["off_s"] for pair in pairs),
        "ratio": ratio,
        "overhead_percent": 100 * (ratio - 1),
        "goal_ratio": GOAL_RATIO,
        "goal_met": ratio < GOAL_RATIO,
    }


def _timed_run(config_path: Path | None, overrides: list[str], steps: int, guard: bool) -> tuple[float, float]:
    """(the median step time of one run without its first step, the guard's work over the run's
    step time)."""
    spent: list[float] = []
    originals = [(owner, name, getattr(owner, name)) for owner, name in GUARD_WORK]
    for owner, name, function in originals:
        setattr(owner, name, _timing(function, spent))
    try:
        step_s, total_s = _step_time(config_path, overrides, steps, guard)
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)
    return step_s, sum(spent) / total_s


def _timing(function: Callable, spent: list[float]) -> Callable:
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def awaited(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await function(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        return awaited

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return timed


def _step_time(config_path: Path | None, overrides: list[str], steps: int, guard: bool) -> tuple[float, float]:
    """(the median step time of one run without its first step, the sum of all its step times)."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-integrity-") as run_dir:
        config = load_config(
            config_path,
            [
                *overrides,
                f"step.max_steps={steps}",
                f"integrity.enabled={str(guard).lower()}",
                f"logging.output_dir={run_dir}",
                "logging.eval_every_steps=null",
                "checkpoint.every_steps=null",
                "logging.tensorboard=false",
                "logging.progress=false",
            ],
        )
        train(config)
        records = read_jsonl(Path(run_dir) / "metrics.jsonl")
    step_times = [record["time/step_s"] for record in records]
    return statistics.median(step_times[1:]), sum(step_times)
