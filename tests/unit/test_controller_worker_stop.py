"""A rollout worker that raises ``RunStopped`` (a reward process that cannot start) stops the run
at once: the controller retries a generation batch that failed, never one whose worker stopped
the run, and checkpoints first as for any stop."""

import asyncio
from pathlib import Path

import pytest

from asyncrl.config import RunConfig
from asyncrl.control.buffer import ReplayBuffer
from asyncrl.control.controller import SingleController
from asyncrl.control.sampler import InOrderSampler
from asyncrl.data import Prompt, PromptLoader, Task
from asyncrl.errors import RunStopped
from asyncrl.types import EvalResult

CHECKPOINT = Path("run/checkpoints/step-000000")


class WorkerStop(RunStopped):
    exit_code = 2


class StopsOnGenerate:
    """Evaluates; every generation batch stops the run."""

    def __init__(self) -> None:
        self.generate_calls = 0

    async def generate(self, jobs):
        self.generate_calls += 1
        raise WorkerStop("rewards.functions: a reward process did not start")

    async def evaluate(self, prompts):
        return EvalResult(num_prompts=len(prompts), accuracy=0.0, reward_mean=0.0, response_length_mean=1.0, seconds=0)

    async def load_weights(self, weights, version): ...


class IdleTrainer:
    """Exports no weights, opens and aborts steps; a checkpoint is a path."""

    async def export_weights(self):
        return 0, {}

    async def begin_step(self, step): ...

    async def abort_step(self): ...

    async def abandon(self): ...

    async def save_checkpoint(self, run_dir, step, run_state, keep_last):
        return CHECKPOINT


class Quiet:
    def __getattr__(self, name):
        return lambda *args: None


def test_a_worker_that_stops_the_run_is_not_retried():
    config = RunConfig(
        step={"prompts_per_step": 2, "generations_per_prompt": 2, "max_steps": 2},
        generation={"batch_size": 4},
        runtime={"max_rollout_retries": 2},
        logging={"tensorboard": False, "progress": False},
        data={"eval_size": 2},
    )
    prompts = [Prompt(uid=f"p{i}", text=f"q{i}", answer="0") for i in range(8)]
    worker = StopsOnGenerate()
    controller = SingleController(
        config,
        trainer=IdleTrainer(),
        rollout_workers=[worker],
        task=Task(name="stop", train=prompts, heldout=prompts[:2]),
        loader=PromptLoader(prompts, shuffle_seed=0, epochs=None),
        sampler=InOrderSampler(2, 0),
        buffer=ReplayBuffer(4),
        metrics=Quiet(),
        progress=Quiet(),
        run_dir="run",
    )
    with pytest.raises(WorkerStop) as caught:
        asyncio.run(asyncio.wait_for(controller.run(), 60))
    assert worker.generate_calls == 1
    assert caught.value.checkpoint == CHECKPOINT
