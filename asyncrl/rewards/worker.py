"""The reward process: a fresh interpreter that RewardRunner starts, and kills when a call runs
past its timeout.

It is never forked from the run's process (whose threads a fork would copy mid-operation) and
never imports the run's main module. It says it has started, loads the reward functions the runner
then sends it, one pickle each (saying which it is loading, so a module that blocks at import can
be named), then scores the chunks of calls it is handed, sending each call's outcome as soon as it
has one. Run as ``check()``, it is where the config check loads user code instead (``check_loads``
in processes.py), so a module that blocks or crashes at import never does so in the run's process.
"""

from __future__ import annotations

import ctypes
import json
import math
import numbers
import os
import pickle
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from asyncrl.plugins import import_attribute
from asyncrl.rewards.functions import RewardFn

Outcome = tuple[float, str | None]  # a call's score, and what went wrong or None

_PR_SET_PDEATHSIG = 1


def main(caller: Callable[..., Any] | None = None) -> None:
    """``python -c 'from asyncrl.rewards.worker import main; main()' FD PARENT_PID``.

    ``caller`` runs one call, ``caller(function, *arguments)``: ``call`` (a reward's score) by
    default, ``call_tool`` in a tool process (asyncrl/environments/tools.py)."""
    caller = call if caller is None else caller
    conn = _connect()
    try:
        functions = []
        for pickled in pickle.loads(conn.recv_bytes()):
            conn.send(("loading", len(functions)))  # the runner names this one if it never loads
            functions.append(pickle.loads(pickled))
    except Exception as err:  # a function that imports in the run but not here
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    try:
        conn.send(("ready", None))
        while True:
            for f, *arguments in conn.recv():
                conn.send(("scored", caller(functions[f], *arguments)))
    except (EOFError, BrokenPipeError):  # the runner is gone
        return


def check() -> None:
    """``python -c 'from asyncrl.rewards.worker import check; check()' FD PARENT_PID``.

    Runs the checks the runner sends, ``[("module:function", arguments)]``, one by one, saying
    which; a ValueError, a config error naming its field, goes back as ("invalid", its message)."""
    conn = _connect()
    try:
        for index, (target, arguments) in enumerate(pickle.loads(conn.recv_bytes())):
            conn.send(("loading", index))
            import_attribute(target, "check")(*arguments)
    except ValueError as err:
        conn.send(("invalid", str(err)))
        return
    except Exception as err:  # a check that fails otherwise: named by the runner, never a traceback
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))


def _connect() -> Connection:
    """The pipe to the runner, once this process dies with it; says it has started."""
    conn, parent = Connection(int(sys.argv[1])), int(sys.argv[2])
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle; it then closes the pool
    conn.send(("started", None))
    return conn


def call(fn: RewardFn, completion: str, answer: str, num_tokens: int | None) -> Outcome:
    """(score, None), or (0.0, what went wrong)."""
    kwargs = {"num_tokens": num_tokens} if getattr(fn, "uses_num_tokens", False) else {}
    try:
        value = fn(completion, answer, **kwargs)
    except BaseException as err:  # a reward's failure is scored, never propagated
        return 0.0, f"raised {type(err).__name__}: {err}"
    if not isinstance(value, numbers.Real):
        return 0.0, f"returned {type(value).__name__}, not a number"
    if not math.isfinite(value):
        return 0.0, f"returned {value}"
    return float(value), None


def call_tool(fn: Callable[..., Any], arguments: dict[str, Any]) -> tuple[str, str | None]:
    """(the result as the model reads it, None), or ("", what went wrong): a tool's failure is
    an observation, never propagated. A str is the result as is, anything else its JSON."""
    try:
        value = fn(**arguments)
        return (value if isinstance(value, str) else json.dumps(value)), None
    except BaseException as err:
        return "", f"raised {type(err).__name__}: {err}"


def _die_with(parent: int) -> None:
    """On Linux, be killed when the run's process dies, even by kill -9 and even mid-call: a call
    stuck in C code would otherwise keep this process spinning."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before that took effect
        os._exit(0)
