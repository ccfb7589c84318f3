"""DaemonPool and the local runtime's handles: a call that never returns keeps no place in its pool
once abandoned, no shutdown waits for it past its deadline, and no thread of it keeps the process
alive."""

import asyncio
import threading

from asyncrl.runtime.local import LocalHandle
from asyncrl.threads import DaemonPool

NEVER = threading.Event()  # never set: a call waiting on it never returns


def test_an_abandoned_call_gives_its_place_to_the_next_one():
    pool = DaemonPool(1, "test-pool")
    stuck = pool.submit(NEVER.wait)
    queued = pool.submit(lambda: "answered")
    pool.abandon(stuck)
    assert queued.result(timeout=60) == "answered"
    assert pool.shutdown(timeout_s=0.0)  # the abandoned call is not waited on
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-pool"))


class _Stuck:
    def __init__(self) -> None:
        self.closed = False

    def hang(self) -> None:
        NEVER.wait()

    def close(self) -> None:
        self.closed = True


def test_a_handle_shuts_down_within_its_deadline_and_closes_its_worker_while_a_call_never_returns():
    worker = _Stuck()
    handle = LocalHandle(worker, "stuck-worker")

    async def start_the_call() -> None:
        handle.hang()
        await asyncio.sleep(0)

    asyncio.run(start_the_call())
    shutdown = threading.Thread(target=handle.shutdown, args=(0.2,), daemon=True)
    shutdown.start()
    shutdown.join(timeout=60)
    assert not shutdown.is_alive(), "shutdown waited on a call that never returns"
    assert worker.closed
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("stuck-worker"))
