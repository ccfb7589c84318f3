"""A reward and tool module that never finishes importing in a fresh process, as one that waits at
import for a lock, a server or a device would.

It blocks in a process started as ``python -c ...`` (a reward, tool or config check process) that
has not imported pytest (a pytest-xdist worker is started as ``python -c ...`` too), and in any
process when ``BLOCKING_REWARD_EVERYWHERE`` is set (then the ``asyncrl`` command's own process
blocks too if it imports it); elsewhere it imports at once. A process that blocks first
creates the file ``BLOCKING_REWARD_MARKER`` names, if set: a test then knows it is blocked.
"""

import os
import sys
import threading
from pathlib import Path

from asyncrl.environments.tool_env import ToolEnvironment

if (sys.argv[0] == "-c" and "pytest" not in sys.modules) or os.environ.get("BLOCKING_REWARD_EVERYWHERE"):
    if marker := os.environ.get("BLOCKING_REWARD_MARKER"):
        Path(marker).touch()
    threading.Event().wait()


def never_loads(completion: str, answer: str) -> float:
    return 1.0


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: any text
    """
    return text


class NeverLoads(ToolEnvironment):
    """A tool environment whose module never finishes importing."""

    functions = (echo,)

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]
