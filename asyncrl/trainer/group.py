"""Trainer ranks behind one handle: how a runtime builds each rank, and how the controller talks to all.

A run with ``parallel.dp * parallel.cp`` trainer ranks places one process per rank (the Ray runtime:
one actor each). Inside each, ``build_trainer_rank`` joins the ranks' process group and builds that
rank's ``TrainerWorker``. The controller holds a ``TrainerGroup`` over the ranks' handles: every
call goes to every rank, in the order it was made, and answers with rank 0's result, which
describes the whole step (trainer/worker.py). See docs/parallelism.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch import nn

from asyncrl.checkpoint import load_state
from asyncrl.config import RunConfig
from asyncrl.errors import RunStopped
from asyncrl.faults import inject_trainer_faults
from asyncrl.models.factory import build_model, build_tokenizer, resolve_device
from asyncrl.trainer.parallel import init_parallel, start_rank
from asyncrl.trainer.policy import PolicyTrainer
from asyncrl.trainer.worker import TrainerWorker
from asyncrl.warm_start import warm_start_policy


def build_trainer_rank(
    config: RunConfig, rank: int, init_method: str | None, checkpoint_dir: str | None = None
) -> TrainerWorker:
    """This process's trainer rank, ready for the controller's calls.

    ``init_method`` (``tcp://host:port`` or ``file://...``) is where the ranks meet; None when the
    run has a single rank or this process already belongs to the ranks' process group. Every rank
    builds the same model and applies the warm start, which the driver has cached beforehand; the
    ranks then take rank 0's weights, so they start identical whatever their caches held. A CUDA
    rank uses its current device (one visible GPU per rank). ``checkpoint_dir``: resume from it.
    The ``faults`` section, when set, wraps the worker (asyncrl/faults.py).
    """
    device = resolve_device(config.trainer.device)
    parallel = None
    if config.parallel.world_size > 1:
        if init_method is not None:
            parallel = start_rank(config.parallel, rank=rank, init_method=init_method, device=device)
        elif dist.is_initialized():
            parallel = init_parallel(config.parallel, device)
        else:
            raise ValueError(f"parallel.dp: {config.parallel.world_size} trainer ranks need an init_method to meet at")
    torch.manual_seed(config.seed)
    transformers.utils.logging.disable_progress_bar()
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    warm_start_policy(model, tokenizer, config)
    if parallel is not None:
        _take_rank0_weights(model)
    trainer = PolicyTrainer.from_config(config, model, parallel=parallel)
    worker = TrainerWorker(trainer, config.grpo, tokenizer, rank=rank, seed=config.seed)
    if checkpoint_dir is not None:
        worker.load_checkpoint(checkpoint_dir, load_state(Path(checkpoint_dir))["trainer"])
    return inject_trainer_faults(worker, config.faults)


def _take_rank0_weights(model: nn.Module) -> None:
    """Broadcast every parameter and buffer from rank 0 (before any wrapping shards them)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


class TrainerRankError(RuntimeError):
    """A call failed on one trainer rank; the rank's own exception is the cause."""

    def __init__(self, rank: int, method: str, error: BaseException) -> None:
        super().__init__(f"trainer rank {rank}: {method} failed: {type(error).__name__}: {error}")
        self.rank = rank
        self.method = method


class TrainerGroup:
    """The TrainerWorker methods the controller and the weight sync call, on every rank at once.

    ``ranks``: one handle per rank, in rank order, whose method calls submit the call at once and
    return an awaitable (``runtime.local.LocalHandle``, a Ray actor wrapper). A call is submitted to
    every rank before anything is awaited, so every rank sees the same calls in the same order.
    The awaitable gives rank 0's result, or raises ``TrainerRankError`` as soon as a rank fails
    (a ``RunStopped`` from a rank, such as a dead rank's, is raised as it is).
    """

    def __init__(self, ranks: Sequence[Any]) -> None:
        if not ranks:
            raise ValueError("TrainerGroup: at least one trainer rank is needed")
        self.ranks = list(ranks)

    def begin_step(self, step: int) -> Awaitable[None]:
        return self._call("begin_step", step)

    def train_groups(self, groups: Sequence[Any]) -> Awaitable[int]:
        return self._call("train_groups", groups)

    def finish_step(self) -> Awaitable[Any]:
        return self._call("finish_step")

    def abort_step(self) -> Awaitable[None]:
        return self._call("abort_step")

    def export_weights(self) -> Awaitable[tuple[int, dict]]:
        return self._call("export_weights")

    def save_checkpoint(self, run_dir: str, step: int, run_state: dict, keep_last: int) -> Awaitable[Path]:
        return self._call("save_checkpoint", run_dir, step, run_state, keep_last)

    def load_checkpoint(self, checkpoint_dir: str | Path, trainer_state: dict) -> Awaitable[None]:
        return self._call("load_checkpoint", checkpoint_dir, trainer_state)

    def _call(self, method: str, *args: Any) -> Awaitable[Any]:
        calls = [asyncio.ensure_future(getattr(rank, method)(*args)) for rank in self.ranks]
        return self._rank0_result(method, calls)

    async def _rank0_result(self, method: str, calls: list[asyncio.Future]) -> Any:
        for call in calls:  # a rank that fails after we have raised is not reported twice
            call.add_done_callback(_failure)
        pending = set(calls)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for rank, call in enumerate(calls):
                if call in done and (error := _failure(call)) is not None:
                    if isinstance(error, RunStopped):  # e.g. a dead rank: already says which and why
                        raise error
                    raise TrainerRankError(rank, method, error) from error
        return calls[0].result()


def _failure(call: asyncio.Future) -> BaseException | None:
    """What a finished call raised (cancelled counts), or None."""
    return asyncio.CancelledError() if call.cancelled() else call.exception()
