"""RewardRunner: every configured reward on every completion, each call under a wall-clock timeout.

A reward can hold the interpreter lock for as long as it runs: C code such as sympy raising a huge
power or a regex backtracking never lets another thread in, so neither a timeout nor the rest of
the run could act. Calls therefore run in a small pool of reward processes (``processes``, fresh
interpreters started on the first ``score``; ``asyncrl.rewards.worker``), where a call past its
timeout is ended by killing its process.

All calls of one ``score`` are handed out at once, in chunks: an idle process takes its share of
the calls still waiting, so few messages carry many cheap calls and a slow process leaves the rest
to the others. A process reports each call's outcome as it finishes, so the runner knows which
call is running and since when. A call that runs for ``timeout_s`` scores 0 and is counted; its
process is killed, the calls it had not started go back to the waiting ones, and a fresh process
takes its place. A call whose process dies scores 0 and is counted as an error. Either way every
call returns its value or scores 0, and the next ``score`` runs normally.

A process that does not start (its interpreter does not come up, a reward does not load there, or
not within ``startup_timeout_s``: a module that blocks at import) is killed and stops the run with a
``RewardStartError`` naming the reward it was loading: that is the config's or the reward's fault,
and no retry would fix it. The config check loads user rewards the same way, in a process of
its own under the same deadline (``check_loads``, asyncrl/rewards/processes.py), so the run's process never imports a module
that would block there. ``close`` wakes a ``score`` waiting on its processes, so it never waits
for a process to start or a call to end.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import pickle
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from asyncrl.errors import RunStopped
from asyncrl.rewards.functions import RewardFn, resolve_reward
from asyncrl.rewards.processes import Worker, not_started
from asyncrl.rewards.worker import Outcome

if TYPE_CHECKING:
    from asyncrl.config import RewardConfig
    from asyncrl.data import Task

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0  # launch to functions loaded (rewards.startup_timeout_s): ample for importing torch


class RewardStartError(RunStopped):
    """A reward process did not start: a reward does not load there, or not within the start
    deadline. The config or the reward's module is at fault, so the CLI exits with code 2."""

    exit_code = 2


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


_TIMED_OUT: Outcome = (0.0, "timed out")  # told apart by identity: no outcome a process sends is it


class RewardRunner:
    def __init__(
        self,
        functions: Sequence[tuple[str, RewardFn]],
        *,
        weights: Sequence[float] | None = None,
        timeout_s: float = 5.0,
        processes: int = 4,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
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
        if processes < 1:
            raise ValueError(f"rewards.processes: must be at least 1, got {processes}")
        if not (math.isfinite(startup_timeout_s) and startup_timeout_s > 0):
            raise ValueError(
                f"rewards.startup_timeout_s: must be a positive number of seconds, got {startup_timeout_s}"
            )
        self.names = names
        self.weights = weights
        self.timeout_s = timeout_s
        self.processes = processes
        self.startup_timeout_s = startup_timeout_s
        self.counts = {name: RewardCounts() for name in names}
        self._functions = [fn for _, fn in functions]
        # One pickle per function: a process loads them one by one and says which it is loading.
        self._payload = pickle.dumps([_pickled(name, fn) for name, fn in functions])
        self._pool: list[Worker] = []
        self._lock = threading.Lock()  # one score at a time owns the pool
        self._wake, self._wake_sender = multiprocessing.Pipe(duplex=False)  # close() ends a score's wait
        self._warned: set[tuple[str, str]] = set()
        self._closed = False

    @classmethod
    def from_config(
        cls, cfg: RewardConfig, task: Task | None = None, max_new_tokens: int | None = None
    ) -> RewardRunner:
        """``task`` supplies the format reward's pattern when its options give none, and the
        ``task`` reward, its own checker; ``max_new_tokens`` (generation.max_new_tokens) is the
        overlong reward's L_max."""
        settings = {
            "format_pattern": task.format_pattern if task is not None else None,
            "task_score": task.score if task is not None else None,
            "max_new_tokens": max_new_tokens,
        }
        functions = [(name, resolve_reward(name, cfg.options.get(name), **settings)) for name in cfg.functions]
        return cls(
            functions,
            weights=cfg.weights,
            timeout_s=cfg.timeout_s,
            processes=cfg.processes,
            startup_timeout_s=cfg.startup_timeout_s,
        )

    def __getstate__(self) -> dict:
        """Configuration and counters only: a copy (say, sent to a Ray actor) starts its own processes."""
        return {
            "functions": list(zip(self.names, self._functions)),
            "weights": self.weights,
            "timeout_s": self.timeout_s,
            "processes": self.processes,
            "startup_timeout_s": self.startup_timeout_s,
            "counts": self.counts,
        }

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        counts = state.pop("counts")
        self.__init__(state.pop("functions"), **state)
        self.counts = counts

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
        calls = [
            (f, completion, answer, n)
            for f in range(len(self.names))
            for completion, answer, n in zip(completions, answers, num_tokens)
        ]
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardRunner.score: the runner is closed")
            outcomes = self._run(calls)
        per_function, errors, timeouts = self._collect(outcomes, len(completions))
        first = per_function[self.names[0]]
        rewards = [
            sum(w * per_function[name][i] for name, w in zip(self.names, self.weights)) for i in range(len(first))
        ]
        return RewardResult(rewards, [s >= 1.0 for s in first], per_function, errors, timeouts)

    def close(self) -> None:
        """Stop the worker processes; idempotent. A ``score`` waiting on them is woken and raises,
        so this never waits for a process to start or a call to end."""
        if not self._closed:
            self._closed = True
            self._wake_sender.send_bytes(b"")
        with self._lock:
            while self._pool:
                self._pool.pop().kill()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, calls: list[tuple]) -> list[Outcome]:
        """Every call's outcome, each within ``timeout_s`` of its start (lock held)."""
        outcomes: list[Outcome | None] = [None] * len(calls)
        waiting = deque(range(len(calls)))
        try:
            while waiting or any(worker.calls for worker in self._pool):
                for worker in [w for w in self._pool if not w.calls and w.process.poll() is not None]:
                    self._retire(worker, waiting)  # it died while idle
                while len(self._pool) < min(self.processes, len(waiting) + self._running()):
                    self._pool.append(Worker())
                self._hand_out(waiting, calls)
                self._wait()
                for worker in list(self._pool):
                    self._receive(worker, outcomes, waiting)
                now = time.monotonic()
                for worker in [w for w in self._pool if not w.ready and now - w.started >= self.startup_timeout_s]:
                    self._retire(worker, waiting)
                    raise RewardStartError(f"rewards.functions: {self._start_problem(worker)}")
                for worker in [w for w in self._pool if w.running and now - w.since >= self.timeout_s]:
                    outcomes[worker.calls.popleft()] = _TIMED_OUT
                    self._retire(worker, waiting)
        finally:  # on an error, processes left mid-chunk are not reused
            for worker in [w for w in self._pool if w.calls]:
                self._retire(worker, waiting)
        return outcomes

    def _wait(self) -> None:
        """Until a process sends something, a deadline (a running call's, a starting process's)
        passes, or ``close`` is called."""
        deadlines = [worker.since + self.timeout_s for worker in self._pool if worker.running]
        deadlines += [worker.started + self.startup_timeout_s for worker in self._pool if not worker.ready]
        timeout = min(deadlines) - time.monotonic() if deadlines else None
        wait([self._wake, *(worker.conn for worker in self._pool)], timeout)
        if self._closed:
            raise RuntimeError("RewardRunner.score: the runner was closed while scoring")

    def _start_problem(self, worker: Worker) -> str:
        """What a process that did not start within ``startup_timeout_s`` was doing."""
        loading = None if worker.loading is None else self._loading(worker)
        return not_started("a reward process", "rewards.startup_timeout_s", self.startup_timeout_s, loading)

    def _running(self) -> int:
        return sum(len(worker.calls) for worker in self._pool)

    def _hand_out(self, waiting: deque[int], calls: list[tuple]) -> None:
        """Each idle process takes its share of the waiting calls, the larger the more are left."""
        for worker in self._pool:
            if waiting and worker.ready and not worker.calls:
                worker.calls.extend(waiting.popleft() for _ in range(-(-len(waiting) // self.processes)))
                worker.conn.send([calls[i] for i in worker.calls])
                worker.since = time.monotonic()

    def _receive(self, worker: Worker, outcomes: list[Outcome | None], waiting: deque[int]) -> None:
        """Every message the process has sent; one that died is retired, its running call an error."""
        try:
            while worker.conn.poll():
                kind, body = worker.conn.recv()
                if kind == "failed":
                    self._retire(worker, waiting)
                    raise RewardStartError(
                        f"rewards.functions: {self._loading(worker)} does not load in a reward process ({body})"
                    )
                if kind == "started":
                    worker.conn.send_bytes(self._payload)  # read at once: the process waits for it
                elif kind == "loading":
                    worker.loading = body
                elif kind == "ready":
                    worker.ready = True
                else:
                    outcomes[worker.calls.popleft()] = body
                worker.since = time.monotonic()
        except (EOFError, OSError):
            code = worker.process.wait()
            if worker.calls:
                outcomes[worker.calls.popleft()] = (0.0, f"its process died (exit code {code})")
            self._retire(worker, waiting)
            if not worker.ready:
                raise RewardStartError(
                    f"rewards.functions: a reward process exited while loading {self._loading(worker)} (exit code {code})"
                ) from None

    def _loading(self, worker: Worker) -> str:
        return "the reward functions" if worker.loading is None else f"'{self.names[worker.loading]}'"

    def _retire(self, worker: Worker, waiting: deque[int]) -> None:
        """Kill the process; the calls it had not finished wait for another."""
        waiting.extendleft(reversed(worker.calls))
        worker.calls.clear()
        worker.kill()
        self._pool.remove(worker)

    def _collect(self, outcomes: list[Outcome], size: int) -> tuple[dict[str, list[float]], list[int], list[int]]:
        """Scores per function, and per completion the number of calls that failed or timed out."""
        per_function: dict[str, list[float]] = {}
        errors, timeouts = [0] * size, [0] * size
        for f, name in enumerate(self.names):
            counts, scores = self.counts[name], []
            for i, outcome in enumerate(outcomes[f * size : (f + 1) * size]):
                counts.calls += 1
                score, problem = outcome
                if outcome is _TIMED_OUT:
                    counts.timeouts += 1
                    timeouts[i] += 1
                    self._warn_once(name, "timeout", f"a call ran past rewards.timeout_s={self.timeout_s}s")
                elif problem is not None:
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


def _pickled(name: str, fn: RewardFn) -> bytes:
    """``fn`` pickled: a process receives the functions by pickle (a module-level function travels
    as its import path)."""
    try:
        return pickle.dumps(fn)
    except Exception as err:
        raise ValueError(
            f"rewards.functions: '{name}' cannot be sent to a reward process ({type(err).__name__}: {err}); "
            "give a module-level function or a picklable object"
        ) from None
