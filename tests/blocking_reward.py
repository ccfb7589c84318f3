"""A reward module that never finishes importing in a reward process, as one that waits at import
for a lock, a server or a device would.

A reward process runs ``python -c ...``; anywhere else (the run's own process, which checks the
reward when it builds the run) the module imports at once. A process that blocks first creates
the file ``BLOCKING_REWARD_MARKER`` names, if set: a test then knows it is blocked.
"""

import os
import sys
import threading
from pathlib import Path

if sys.argv[0] == "-c":
    if marker := os.environ.get("BLOCKING_REWARD_MARKER"):
        Path(marker).touch()
    threading.Event().wait()


def never_loads(completion: str, answer: str) -> float:
    return 1.0
