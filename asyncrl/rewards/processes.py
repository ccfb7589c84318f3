"""The processes user code is loaded in: fresh interpreters, never forks of the run's process.

A reward process, a tool process and the config check's process are each a ``Worker``: started
with the run's ``sys.path``, told what to load, and killed when it is not done by its deadline.
``start_loaded`` starts one and waits until it has loaded what it was sent; ``check_loads`` is
the config check of user parts, run here when they load at once and else in such a process, so a
module that blocks or crashes at import is one error naming it, never a hang of the command.
Nothing here imports torch: the config check uses it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence

from asyncrl.plugins import import_attribute, loads_at_once

_START_WORKER = "from asyncrl.rewards.worker import main; main()"
_START_CHECK = "from asyncrl.rewards.worker import check; check()"


class Worker:
    """One process loading user code (a reward, tool or check process) and the calls handed to it,
    in order: the first is the one running."""

    def __init__(self, start: str = _START_WORKER) -> None:
        """``start``: the Python code the process runs (a tool process's calls ``main(call_tool)``)."""
        self.conn, child = multiprocessing.Pipe()
        command = [sys.executable, "-c", start, str(child.fileno()), str(os.getpid())]
        path = {"PYTHONPATH": os.pathsep.join(sys.path)}  # the run's imports resolve the same way there
        self.process = subprocess.Popen(
            command, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, env={**os.environ, **path}
        )
        child.close()
        self.started = time.monotonic()
        self.loading: int | None = None  # the function it loads; None until its interpreter is up
        self.ready = False
        self.calls: deque[int] = deque()
        self.since = 0.0  # when the running call started: the hand-over, or the last message

    @property
    def running(self) -> bool:
        return self.ready and bool(self.calls)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


def not_started(process: str, setting: str, timeout_s: float, loading: str | None) -> str:
    """Why ``process`` was killed at its start deadline ``setting``: what it was loading, if anything."""
    within = f"{process} did not start within {setting}={timeout_s:g}s"
    if loading is None:
        return f"{within}: its interpreter never came up; it was killed"
    return f"{within}: loading {loading} never finished (does its module block at import?); it was killed"


class StartFailed(Exception):
    """A process loading user code did not get there. ``loading``: the index of what it was loading
    (None before its interpreter came up); ``problem``: what it reported, None when the deadline
    passed; ``exit_code``: set when it exited."""

    def __init__(self, loading: int | None, problem: str | None = None, exit_code: int | None = None) -> None:
        super().__init__(problem)
        self.loading, self.problem, self.exit_code = loading, problem, exit_code


def start_loaded(start: str, payload: bytes, timeout_s: float) -> Worker:
    """A fresh process running ``start``, sent ``payload``, once it says it has loaded all of it,
    within ``timeout_s`` of its launch; else it is killed and ``StartFailed`` says what it was
    doing. A check's config error comes back as the ValueError it was."""
    process = Worker(start)
    deadline = process.started + timeout_s
    try:
        while process.conn.poll(max(0.0, deadline - time.monotonic())):
            kind, body = process.conn.recv()
            if kind == "started":
                process.conn.send_bytes(payload)
            elif kind == "loading":
                process.loading = body
            elif kind == "invalid":
                raise ValueError(body)
            elif kind == "failed":
                raise StartFailed(process.loading, body)
            elif kind == "ready":
                process.ready = True
                return process
        raise StartFailed(process.loading)
    except (EOFError, OSError):
        raise StartFailed(process.loading, exit_code=process.process.wait()) from None
    finally:
        if not process.ready:
            process.kill()


def check_loads(
    kind: str, checks: Sequence[tuple[str, str, tuple]], field: str, setting: str, timeout_s: float, process: str
) -> None:
    """Run the config checks of parts of ``kind``, ``(spec, "module:function", arguments)``: here
    for a part that loads at once, else in a fresh process (``process`` in messages) within
    ``timeout_s``, the value of ``setting``: a module that blocks or crashes at import is then one
    ValueError naming ``field`` and the part."""
    here = [check for check in checks if loads_at_once(kind, check[0])]
    for _, target, arguments in here:
        import_attribute(target, field)(*arguments)
    elsewhere = [check for check in checks if check not in here]
    if not elsewhere:
        return
    try:
        start_loaded(_START_CHECK, pickle.dumps([check for _, *check in elsewhere]), timeout_s).kill()
    except StartFailed as failed:
        loading = None if failed.loading is None else f"'{elsewhere[failed.loading][0]}'"
        if failed.exit_code is not None:
            raise ValueError(
                f"{field}: {process} exited while loading {loading or 'its code'} (exit code {failed.exit_code})"
            ) from None
        if failed.problem is not None:
            raise ValueError(f"{field}: {loading} does not load in a fresh process ({failed.problem})") from None
        before = "" if loading else " before loading " + ", ".join(f"'{spec}'" for spec, *_ in elsewhere)
        raise ValueError(f"{field}: {not_started(process, setting, timeout_s, loading)}{before}") from None
