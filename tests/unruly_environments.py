"""Environments that misbehave as real ones do, for the environment rows of docs/reliability.md:
a step that never returns, a step that raises once, a step that always raises.

The prompts that misbehave are those whose uid ``chosen`` picks (one in ``every``, by its CRC-32),
so a test can tell which they are without running the run first; the others answer as the
``feedback`` environment does, so a run equals a ``feedback`` run where nothing misbehaved.
"""

import threading
import zlib

from pydantic import Field

from asyncrl.environments.feedback import FeedbackEnvironment


def chosen(uid: str, every: int) -> bool:
    return every > 0 and zlib.crc32(uid.encode()) % every == 0


class _Unruly(FeedbackEnvironment):
    class Options(FeedbackEnvironment.Options):
        every: int = Field(3, ge=0, description="the prompts that misbehave: one in every, by uid (0: none)")

    def __init__(self, options) -> None:
        super().__init__(options)
        self.every = options.every
        self.uid = ""

    def reset(self, prompt):
        self.uid = prompt.uid
        return super().reset(prompt)

    @property
    def misbehaves(self) -> bool:
        return chosen(self.uid, self.every)


class Hangs(_Unruly):
    """The step of a chosen prompt's episode never returns."""

    def step(self, assistant):
        if self.misbehaves:
            threading.Event().wait()
        return super().step(assistant)


class RaisesOnce(_Unruly):
    """The first step taken for each chosen prompt raises, as a sandbox that went away would.
    ``raised``: the uids it raised for, in this process."""

    stepped: set[str] = set()
    raised: list[str] = []
    lock = threading.Lock()

    def step(self, assistant):
        with self.lock:
            first = self.misbehaves and self.uid not in self.stepped
            self.stepped.add(self.uid)
            if first:
                self.raised.append(self.uid)
        if first:
            raise ConnectionError(f"the sandbox of {self.uid} went away")
        return super().step(assistant)


class AlwaysRaises(_Unruly):
    """Every step of a chosen training prompt's episode raises. Held-out prompts answer: an
    evaluation that fails stops the run whatever ``runtime.on_rollout_failure`` says, and their
    uids are the task's own (``arithmetic/1/32``) where a training prompt's carries its epoch."""

    def step(self, assistant):
        if self.misbehaves and self.uid.count("/") == 3:
            raise ConnectionError(f"the sandbox of {self.uid} is broken")
        return super().step(assistant)
