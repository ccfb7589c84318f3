"""Trainer ranks behind one handle: how the controller talks to all of them.

A run with ``parallel.dp * parallel.cp`` trainer ranks places one process per rank (the Ray runtime:
one actor each); inside each, ``asyncrl.workers.build_trainer_rank`` joins the ranks' process group
and builds that rank's ``TrainerWorker``. The controller holds a ``TrainerGroup`` over the ranks' handles: every
call goes to every rank, in the order it was made, and answers with rank 0's result, which
describes the whole step (trainer/worker.py). See docs/parallelism.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.errors import RunStopped


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

    def abandon(self) -> Awaitable[None]:
        return self._call("abandon")

    def export_weights(self) -> Awaitable[tuple[int, dict]]:
        return self._call("export_weights")

    def exported_fingerprints(self, dtypes: Sequence[str]) -> Awaitable[dict[str, str]]:
        return self._call("exported_fingerprints", dtypes)

    def probe_gap(self, group: Any) -> Awaitable[Any]:
        return self._call("probe_gap", group)

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
