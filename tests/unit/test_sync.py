"""Local runtime handles, the rollout gate and WeightSync."""

import asyncio
import threading
import time

import pytest
import torch

from asyncrl.control import weight_sync as sync_module
from asyncrl.control.changes import Changes
from asyncrl.control.gate import RolloutGate
from asyncrl.control.weight_sync import WeightSync
from asyncrl.errors import SyncTimeoutError
from asyncrl.runtime import LocalRuntime
from asyncrl.weights.fingerprint import fingerprint, sample


class Recorder:
    """A worker that records the order in which its calls ran, and on which thread."""

    def __init__(self, log: list, delay: float = 0.0) -> None:
        self.log = log
        self.delay = delay
        self.version = 0

    def generate(self, tag: str) -> str:
        time.sleep(self.delay)
        self.log.append(("generate", tag, self.version, threading.current_thread().name))
        return tag

    def load_weights(self, weights: dict, version: int) -> None:
        self.log.append(("load", version, threading.current_thread().name))
        self.version = version

    def export_weights(self):
        return 1, {"w": torch.zeros(4, dtype=torch.float32)}

    def fail(self):
        raise KeyError("boom")


def test_handle_runs_calls_in_submission_order_on_the_worker_thread():
    log: list = []

    async def main():
        runtime = LocalRuntime()
        handle = runtime.spawn(lambda: Recorder(log, delay=0.05), "rollout")
        first = handle.generate("a")  # submitted now, before the load below
        load = handle.load_weights({}, 7)
        second = handle.generate("b")
        assert await asyncio.gather(first, load, second) == ["a", None, "b"]
        with pytest.raises(KeyError, match="boom"):
            await handle.fail()
        runtime.shutdown()

    asyncio.run(main())
    assert [entry[:-1] for entry in log] == [("generate", "a", 0), ("load", 7), ("generate", "b", 7)]
    assert {entry[-1].split("_")[0] for entry in log} == {"rollout"}


def test_closing_gate_waits_until_the_rollout_loop_settles():
    async def main():
        changes = Changes()
        gate = RolloutGate(0, changes, wait_for_admissions=True)
        closer = asyncio.create_task(gate.close())
        await asyncio.sleep(0.01)
        assert not closer.done() and gate.admitting  # closing: admissions still allowed
        gate.settled()
        await asyncio.wait_for(closer, 1)
        assert not gate.admitting
        gate.open(1)
        assert gate.admitting and gate.version == 1

    asyncio.run(main())


def test_ungated_close_is_immediate_and_drain_waits_for_in_flight():
    async def main():
        gate = RolloutGate(0, Changes(), wait_for_admissions=False)
        await asyncio.wait_for(gate.close(), 1)
        gate.add_in_flight(2)
        drained = asyncio.create_task(gate.drained())
        await asyncio.sleep(0.01)
        assert not drained.done()
        gate.add_in_flight(-2)
        await asyncio.wait_for(drained, 1)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["drain", "inflight"])
def test_sync_loads_every_generator_and_reports(mode):
    log: list = []

    async def main():
        runtime = LocalRuntime()
        trainer = runtime.spawn(lambda: Recorder([]), "trainer")
        generators = [runtime.spawn(lambda: Recorder(log), f"gen{i}") for i in range(2)]
        gate = RolloutGate(0, Changes(), wait_for_admissions=False)
        report = await WeightSync(trainer, generators, gate, mode=mode, timeout_s=5).sync()
        runtime.shutdown()
        return gate, report

    gate, report = asyncio.run(main())
    assert report.version == 1 and report.bytes == 16 and report.pause_s >= report.transfer_s >= 0
    assert gate.version == 1 and gate.admitting and not gate.loading
    assert sorted(entry[:2] for entry in log) == [("load", 1), ("load", 1)]


class Fingerprinting(Recorder):
    """A generator that answers a load with the fingerprint of what it holds; ``skips``: it keeps its weights."""

    def __init__(self, skips: bool = False) -> None:
        super().__init__([])
        self.held = {"w": torch.ones(4)}
        self.skips = skips

    def load_weights(self, weights: dict, version: int) -> str:
        if not self.skips:
            self.held = {name: tensor.clone() for name, tensor in weights.items()}
        return fingerprint(self.held)


class Exporter(Recorder):
    def exported_fingerprints(self, dtypes) -> dict[str, str]:
        assert list(dtypes) == ["float32"]  # the dtype the generators reported, alone
        return {dtype: sample(self.export_weights()[1]).digest(dtype) for dtype in dtypes}


def test_the_report_carries_every_generators_fingerprint_and_verify_runs_before_the_gate_reopens():
    seen = []

    async def main():
        runtime = LocalRuntime()
        trainer = runtime.spawn(lambda: Exporter([]), "trainer")
        generators = [runtime.spawn(Fingerprinting, "loads"), runtime.spawn(lambda: Fingerprinting(True), "skips")]
        gate = RolloutGate(0, Changes(), wait_for_admissions=False)

        async def verify(report):
            seen.append((report.fingerprint_mismatches(), gate.admitting, gate.sent))
            if report.fingerprint_mismatches():
                raise RuntimeError("refused")

        with pytest.raises(RuntimeError, match="refused"):
            await WeightSync(trainer, generators, gate, mode="drain", timeout_s=5, verify=verify).sync()
        runtime.shutdown()
        return gate

    gate = asyncio.run(main())
    # the generator that kept its weights, seen while the gate was closed; version 1 counts as handed
    # to the generators from its load on, as a group generated in flight may report it before this check
    assert seen == [([1], False, 1)]
    assert not gate.admitting and gate.version == 0


class Clock:
    """WeightSync's clock, moved only by the test: what it measures is what the test held."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("mode", ["drain", "inflight"])
def test_generation_longer_than_the_timeout_does_not_fail_the_sync(mode, monkeypatch):
    """The sync waits out a batch that runs for three timeouts, then succeeds. On the sync's clock
    that wait is all of its pause and none of its transfer. Once the batch ends the timeout is made
    ample, so that a busy machine cannot fail the export and the load."""
    clock = Clock()
    monkeypatch.setattr(sync_module, "time", clock)
    timeout_s, held_s = 0.1, 1000.0

    async def main():
        runtime = LocalRuntime()
        trainer = runtime.spawn(lambda: Recorder([]), "trainer")
        generator = runtime.spawn(lambda: Recorder([]), "gen")
        gate = RolloutGate(0, Changes(), wait_for_admissions=False)
        gate.add_in_flight(1)
        gate.add_running(1)  # a batch still generating
        weight_sync = WeightSync(trainer, [generator], gate, mode=mode, timeout_s=timeout_s)
        sync = asyncio.create_task(weight_sync.sync())
        await gate.changes.wait_for(lambda: not gate.admitting)  # the sync has started: its pause runs
        await asyncio.wait([sync], timeout=3 * timeout_s)
        assert not sync.done() and gate.loading == (mode == "inflight")
        clock.now += held_s
        weight_sync.timeout_s = 60.0
        gate.add_running(-1)
        gate.add_in_flight(-1)
        report = await asyncio.wait_for(sync, 60)
        runtime.shutdown()
        return report

    report = asyncio.run(main())
    assert (report.version, report.transfer_s, report.pause_s) == (1, 0.0, held_s)


def test_a_gate_held_closing_by_the_in_flight_limit_does_not_fail_the_sync():
    """Closing waits for room under the in-flight limit, which only a finished batch makes: that
    wait is generation, not the sync. The same wait with room to spare does count: it times out."""

    async def main(in_flight):
        runtime = LocalRuntime()
        trainer = runtime.spawn(lambda: Recorder([]), "trainer")
        generator = runtime.spawn(lambda: Recorder([]), "gen")
        gate = RolloutGate(0, Changes(), wait_for_admissions=True, max_in_flight=2)
        gate.add_in_flight(in_flight)
        weight_sync = WeightSync(trainer, [generator], gate, mode="inflight", timeout_s=0.1)
        sync = asyncio.create_task(weight_sync.sync())
        try:
            if in_flight < gate.max_in_flight:
                return await asyncio.wait_for(asyncio.gather(sync, return_exceptions=True), 60)
            await asyncio.wait([sync], timeout=0.3)  # three timeouts
            if sync.done():
                return sync.exception()
            weight_sync.timeout_s = 60.0  # the export and the load, however busy the machine
            gate.add_in_flight(-1)  # a batch finished: the rollout loop admits what it may, then settles
            gate.settled()
            return await asyncio.wait_for(sync, 60)
        finally:
            runtime.shutdown()

    assert asyncio.run(main(in_flight=2)).version == 1
    assert isinstance(asyncio.run(main(in_flight=1))[0], SyncTimeoutError)


class SlowLoad(Recorder):
    def load_weights(self, weights: dict, version: int) -> None:
        time.sleep(0.5)


class SlowExport(Recorder):
    def export_weights(self):
        time.sleep(0.5)
        return super().export_weights()


@pytest.mark.parametrize(
    "trainer_cls, generator_cls, phase, healthy",
    [
        (Recorder, SlowLoad, "loading weights version 1", True),
        (SlowExport, Recorder, "exporting trainer weights", False),
    ],
)
def test_a_slow_export_or_load_fails_the_sync_naming_its_phase(trainer_cls, generator_cls, phase, healthy):
    async def main():
        runtime = LocalRuntime()
        trainer = runtime.spawn(lambda: trainer_cls([]), "trainer")
        generator = runtime.spawn(lambda: generator_cls([]), "gen")
        gate = RolloutGate(0, Changes(), wait_for_admissions=False)
        sync = WeightSync(trainer, [generator], gate, mode="inflight", timeout_s=0.1)
        with pytest.raises(SyncTimeoutError, match=rf"sync.timeout_s=0.1s while {phase}") as err:
            await sync.sync()
        runtime.shutdown()
        return err.value

    assert asyncio.run(main()).trainer_healthy == healthy


def test_sync_mode_is_validated():
    with pytest.raises(ValueError, match="sync.mode"):
        WeightSync(None, [], RolloutGate(0, Changes(), wait_for_admissions=False), mode="eager", timeout_s=1)


class LoadsWhileGenerating(Recorder):
    unordered_methods = ("load_weights",)


@pytest.mark.parametrize("worker_cls, overlaps", [(LoadsWhileGenerating, True), (Recorder, False)])
def test_an_inflight_sync_loads_beside_a_running_batch_only_into_a_generator_that_takes_loads_so(worker_cls, overlaps):
    async def main():
        runtime = LocalRuntime()
        trainer = runtime.spawn(lambda: Recorder([]), "trainer")
        generator = runtime.spawn(lambda: worker_cls([]), "gen")
        gate = RolloutGate(0, Changes(), wait_for_admissions=False)
        gate.add_running(1)  # a batch still generating, until the test ends it below
        sync = asyncio.create_task(WeightSync(trainer, [generator], gate, mode="inflight", timeout_s=5).sync())
        # a sync that loads beside the batch finishes on its own; one that waits for it cannot
        await asyncio.wait([sync], timeout=5 if overlaps else 0.3)
        done_while_running = sync.done()
        gate.add_running(-1)
        report = await asyncio.wait_for(sync, 5)
        runtime.shutdown()
        return done_while_running, report

    done_while_running, report = asyncio.run(main())
    assert done_while_running == overlaps and report.version == 1
