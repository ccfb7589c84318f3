"""Where a training step's wall time goes, for asyncrl and TRL alike: the functions that do each
phase (generation, rewards, forward, backward, optimizer, sync) are wrapped for the length of a
run and every call is timed on its own thread.

Time is charged exclusively: a phase called inside another (the rewards inside an evaluation) is
charged to the inner one, so one thread's phases never count a second twice. Threads do overlap
(asyncrl's ``max_lag`` 1 generates while it trains), so a window's report has three totals: the
phases summed over threads, ``busy_s`` (when at least one phase ran anywhere: their union), and
``untimed_s`` (the window minus ``busy_s``: Python glue, batching, waits and idle, when no timed
phase ran). ``overlap_s`` is the sum minus the union: seconds saved by running phases at once.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

EVALUATION = "evaluation"  # the phase that brackets the measured window (see ``StepProfile.window``)


@dataclass
class _Calls:
    """What the wrappers record: exclusive segments and whole calls, each ``(phase, start, end)``."""

    segments: list[tuple[str, float, float]] = field(default_factory=list)
    calls: list[tuple[str, float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    local: threading.local = field(default_factory=threading.local)

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        stack = self._stack()
        if stack:
            self._charge(stack[-1][0], now)
        stack.append([phase, now, now])  # phase, call start, start of its current segment

    def leave(self) -> None:
        now = time.perf_counter()
        stack = self._stack()
        phase, started, _ = stack[-1]
        self._charge(phase, now)
        stack.pop()
        with self.lock:
            self.calls.append((phase, started, now))
        if stack:
            stack[-1][2] = now

    def _charge(self, phase: str, now: float) -> None:
        top = self._stack()[-1]
        with self.lock:
            self.segments.append((phase, top[2], now))
        top[2] = now

    def _stack(self) -> list[list[Any]]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack


class StepProfile:
    """``phases``: name -> the ``(owner, attribute)`` functions that do it, a class's method or a
    module's function, patched on the owner while the profile is entered. A function must be
    synchronous: a coroutine function would be timed only while it builds its coroutine."""

    def __init__(self, phases: Mapping[str, Sequence[tuple[Any, str]]]) -> None:
        self.phases = {name: list(targets) for name, targets in phases.items()}
        self._record = _Calls()
        self._saved: list[tuple[Any, str, Any]] = []  # owner, attribute, its own value (None: inherited)

    def __enter__(self) -> StepProfile:
        try:
            for name, targets in self.phases.items():
                for owner, attribute in targets:
                    if isinstance(inspect.getattr_static(owner, attribute), (staticmethod, classmethod)):
                        raise TypeError(f"StepProfile: {owner.__name__}.{attribute} is not a plain function")
                    self._saved.append((owner, attribute, vars(owner).get(attribute)))
                    setattr(owner, attribute, self._timed(name, getattr(owner, attribute)))
        except BaseException:
            self.__exit__()  # what was patched before the refusal is put back
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attribute, own in reversed(self._saved):
            if own is None:
                delattr(owner, attribute)  # it was inherited: the base's serves again
            else:
                setattr(owner, attribute, own)
        self._saved.clear()

    def _timed(self, phase: str, function: Any) -> Any:
        record = self._record

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            record.enter(phase)
            try:
                return function(*args, **kwargs)
            finally:
                record.leave()

        return timed

    def window(self, steps: int) -> dict[str, Any]:
        """Seconds per step between the end of the first ``evaluation`` call and the start of the
        last one (a call nested in another counts as the outer one), so a run evaluated only before
        its first step and after its last has all of its ``steps`` steps inside and no evaluation."""
        evaluations = _merged(sorted((a, b) for phase, a, b in self._record.calls if phase == EVALUATION))
        if len(evaluations) < 2:
            raise ValueError("StepProfile.window: the run made fewer than two evaluation calls")
        return summarize(self._record.segments, evaluations[0][1], evaluations[-1][0], steps)


def summarize(segments: Sequence[tuple[str, float, float]], start: float, end: float, steps: int) -> dict[str, Any]:
    """The report of ``segments`` clipped to ``[start, end]``, in seconds per step."""
    clipped = [(phase, max(a, start), min(b, end)) for phase, a, b in segments if b > start and a < end]
    phases: dict[str, float] = {}
    for phase, a, b in clipped:
        phases[phase] = phases.get(phase, 0.0) + b - a
    busy = _union(sorted((a, b) for _, a, b in clipped))
    wall = end - start
    return {
        "steps": steps,
        "step_s": wall / steps,
        "phases_s": {phase: seconds / steps for phase, seconds in sorted(phases.items())},
        "busy_s": busy / steps,
        "untimed_s": (wall - busy) / steps,
        "overlap_s": (sum(phases.values()) - busy) / steps,
    }


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted intervals with those that overlap joined: an evaluation that calls another is one."""
    merged: list[tuple[float, float]] = []
    for a, b in intervals:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _union(intervals: Sequence[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in intervals:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total
