"""RewardRunner: every configured reward on every completion, each call under a wall-clock timeout.

Python cannot stop a thread, so a reward call that never returns can only be left behind. Calls
run on a pool of daemon worker threads; all calls of one ``score`` are queued at once and up to
``threads`` of them run together. The caller waits until each call has returned or has run for
``timeout_s``, whichever comes first. A call past its timeout scores 0 and is counted; its thread
is abandoned (it exits if the call ever returns) and a fresh thread takes its place, so the pool
keeps its size and the next ``score`` runs normally. Scoring n completions with a reward that
hangs on all of them therefore takes about one timeout while n <= threads.

Abandoned threads are bounded: while ``max_hung_threads`` of them are still stuck, ``score``
raises instead of starting more. A reward that hangs that often is broken, and a thread leaked
per call would eventually exhaust the process.

Calls share the interpreter lock: a slow pure-Python reward's wall time includes the work of the
calls running beside it, so ``timeout_s`` should cover a batch's compute (or lower ``threads``).
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.rewards.functions import RewardFn, resolve_reward

if TYPE_CHECKING:
    from asyncrl.config import RewardConfig
    from asyncrl.data import Task

logger = logging.getLogger(__name__)


@dataclass
class RewardResult:
    rewards: list[float]  # weighted sum over functions, per completion
    correct: list[bool]  # the first configured function scored >= 1.0
    per_function: dict[str, list[float]]
    item_errors: list[int]  # per completion: calls that raised or returned a non-finite / non-number value
    item_timeouts: list[int]  # per completion: calls that exceeded the timeout

    @property
    def errors(self) -> int:
        return sum(self.item_errors)

    @property
    def timeouts(self) -> int:
        return sum(self.item_timeouts)


@dataclass
class RewardCounts:
    """Cumulative over the runner's life, per function, for metrics."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0


class _Call:
    """One function applied to one completion; a worker fills in the outcome."""

    def __init__(self, name: str, fn: RewardFn, completion: str, answer: str, num_tokens: int | None) -> None:
        self.name, self.fn, self.completion, self.answer = name, fn, completion, answer
        self.kwargs = {"num_tokens": num_tokens} if getattr(fn, "uses_num_tokens", False) else {}
        self.started: float | None = None
        self.worker: threading.Thread | None = None
        self.done = False
        self.abandoned = False
        self.value: object = None
        self.error: BaseException | None = None


class RewardRunner:
    def __init__(
        self,
        functions: Sequence[tuple[str, RewardFn]],
        *,
        weights: Sequence[float] | None = None,
        timeout_s: float = 5.0,
        threads: int = 32,
        max_hung_threads: int = 64,
    ) -> None:
        names = [name for name, _ in functions]
        if not names:
            raise ValueError("rewards.functions: at least one reward function is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"rewards.functions: names must be unique, got {names}")
        weights = [1.0] * len(names) if weights is None else [float(w) for w in weights]
        if len(weights) != len(names):
            raise ValueError(f"rewards.weights: {len(weights)} weights for {len(names)} functions")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"rewards.weights: must be finite, got {weights}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"rewards.timeout_s: must be a positive number of seconds, got {timeout_s}")
        if threads < 1 or max_hung_threads < 1:
            raise ValueError("rewards.threads: threads and max_hung_threads must be at least 1")
        self.names = names
        self.weights = weights
        self.timeout_s = timeout_s
        self.threads = threads
        self.max_hung_threads = max_hung_threads
        self.counts = {name: RewardCounts() for name in names}
        self._functions = [fn for _, fn in functions]
        self._tasks: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._progress = threading.Condition()  # guards everything below; notified on every call start and end
        self._workers: set[threading.Thread] = set()
        self._hung: dict[threading.Thread, str] = {}  # abandoned thread -> the reward it is stuck in
        self._pending = 0  # calls queued or running, neither returned nor abandoned
        self._warned: set[tuple[str, str]] = set()
        self._thread_ids = itertools.count()
        self._closed = False

    @classmethod
    def from_config(
        cls, cfg: RewardConfig, task: Task | None = None, max_new_tokens: int | None = None
    ) -> RewardRunner:
        """``task`` supplies the format reward's pattern when ``rewards.format_pattern`` is not set,
        and the ``task`` reward, its own checker; ``max_new_tokens`` (generation.max_new_tokens) is
        the overlong reward's L_max."""
        pattern = cfg.format_pattern
        if pattern is None and task is not None:
            pattern = task.format_pattern
        settings = {
            "format_pattern": pattern,
            "task_score": task.score if task is not None else None,
            "max_new_tokens": max_new_tokens,
            "overlong_cache": cfg.overlong_cache,
        }
        functions = [(name, resolve_reward(name, **settings)) for name in cfg.functions]
        return cls(
            functions,
            weights=cfg.weights,
            timeout_s=cfg.timeout_s,
            threads=cfg.threads,
            max_hung_threads=cfg.max_hung_threads,
        )

    def __getstate__(self) -> dict:
        """Configuration and counters only: a copy (say, sent to a Ray actor) starts its own threads."""
        return {
            "functions": list(zip(self.names, self._functions)),
            "weights": self.weights,
            "timeout_s": self.timeout_s,
            "threads": self.threads,
            "max_hung_threads": self.max_hung_threads,
            "counts": self.counts,
        }

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        counts = state.pop("counts")
        self.__init__(state.pop("functions"), **state)
        self.counts = counts

    @property
    def hung_threads(self) -> int:
        """Abandoned threads whose call has still not returned."""
        with self._progress:
            return len(self._hung)

    def score(
        self, completions: Sequence[str], answers: Sequence[str], num_tokens: Sequence[int] | None = None
    ) -> RewardResult:
        """``num_tokens``: each response's length in tokens, which rewards with ``uses_num_tokens`` need."""
        if len(completions) != len(answers):
            raise ValueError(f"RewardRunner.score: {len(completions)} completions for {len(answers)} answers")
        if num_tokens is None:
            needing = [name for name, fn in zip(self.names, self._functions) if getattr(fn, "uses_num_tokens", False)]
            if needing:
                raise ValueError(f"RewardRunner.score: {', '.join(needing)} needs num_tokens, the responses' lengths")
            num_tokens = [None] * len(completions)
        elif len(num_tokens) != len(completions):
            raise ValueError(f"RewardRunner.score: {len(num_tokens)} lengths for {len(completions)} completions")
        calls = {
            name: [_Call(name, fn, c, a, n) for c, a, n in zip(completions, answers, num_tokens)]
            for name, fn in zip(self.names, self._functions)
        }
        every_call = [call for row in calls.values() for call in row]
        with self._progress:
            self._check_usable()
            for call in every_call:
                self._tasks.put(call)
            self._pending += len(every_call)
            self._grow()
            self._wait(every_call)
            per_function, errors, timeouts = self._collect(calls, len(completions))
        first = per_function[self.names[0]]
        rewards = [
            sum(w * per_function[name][i] for name, w in zip(self.names, self.weights)) for i in range(len(first))
        ]
        return RewardResult(rewards, [s >= 1.0 for s in first], per_function, errors, timeouts)

    def close(self) -> None:
        """Let idle workers exit; threads stuck in a call are daemons and die with the process."""
        with self._progress:
            if self._closed:
                return
            self._closed = True
            for _ in self._workers:
                self._tasks.put(None)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("RewardRunner.score: the runner is closed")
        if len(self._hung) >= self.max_hung_threads:
            stuck = ", ".join(sorted(set(self._hung.values())))
            raise RuntimeError(
                f"rewards.max_hung_threads: {len(self._hung)} reward threads are stuck in calls past "
                f"rewards.timeout_s (in {stuck}); no more are started. Fix the reward or raise the limit"
            )

    def _grow(self) -> None:
        while len(self._workers) < min(self.threads, self._pending):
            worker = threading.Thread(target=self._work, name=f"asyncrl-reward-{next(self._thread_ids)}", daemon=True)
            self._workers.add(worker)
            worker.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while (call := self._tasks.get()) is not None:
            with self._progress:
                call.started, call.worker = time.monotonic(), me
                self._progress.notify_all()
            try:
                call.value = call.fn(call.completion, call.answer, **call.kwargs)
            except BaseException as err:  # a reward's failure is scored, never propagated into the pool
                call.error = err
            with self._progress:
                if call.abandoned:  # replaced long ago: leave the pool
                    del self._hung[me]
                    return
                call.done = True
                self._pending -= 1
                self._progress.notify_all()

    def _wait(self, calls: list[_Call]) -> None:
        """Until every call has returned or been abandoned at its deadline (lock held)."""
        while True:
            now = time.monotonic()
            for call in calls:
                if not call.done and call.started is not None and now - call.started >= self.timeout_s:
                    self._abandon(call)
            calls = [call for call in calls if not (call.done or call.abandoned)]
            if not calls:
                return
            deadlines = [call.started + self.timeout_s for call in calls if call.started is not None]
            self._progress.wait(min(deadlines) - now if deadlines else None)

    def _abandon(self, call: _Call) -> None:
        call.abandoned = True
        self._pending -= 1
        self._workers.discard(call.worker)
        self._hung[call.worker] = call.name
        self._grow()

    def _collect(self, calls: dict[str, list[_Call]], size: int) -> tuple[dict[str, list[float]], list[int], list[int]]:
        """Scores per function, and per completion the number of calls that failed or timed out."""
        per_function: dict[str, list[float]] = {}
        errors, timeouts = [0] * size, [0] * size
        for name, row in calls.items():
            counts, scores = self.counts[name], []
            for i, call in enumerate(row):
                counts.calls += 1
                if call.abandoned:
                    counts.timeouts += 1
                    timeouts[i] += 1
                    self._warn_once(name, "timeout", f"a call ran past rewards.timeout_s={self.timeout_s}s")
                    scores.append(0.0)
                    continue
                score, problem = _as_score(call)
                if problem is not None:
                    counts.errors += 1
                    errors[i] += 1
                    self._warn_once(name, "error", problem)
                scores.append(score)
            per_function[name] = scores
        return per_function, errors, timeouts

    def _warn_once(self, name: str, kind: str, detail: str) -> None:
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            logger.warning("reward %s: %s; it scores 0 (later ones are only counted)", name, detail)


def _as_score(call: _Call) -> tuple[float, str | None]:
    """(score, None), or (0.0, what went wrong)."""
    if call.error is not None:
        return 0.0, f"raised {type(call.error).__name__}: {call.error}"
    value = call.value
    if not isinstance(value, numbers.Real):
        return 0.0, f"returned {type(value).__name__}, not a number"
    if not math.isfinite(value):
        return 0.0, f"returned {value}"
    return float(value), None
