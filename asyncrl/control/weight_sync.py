"""WeightSync: move the trainer's weights into every generator, under the rollout gate.

The gate (``RolloutGate``, gate.py) is the only place admission and weight versions meet. The
rollout loop (rollout_loop.py) stamps each admitted prompt with ``gate.version`` and dispatches it
at once, so "admitted" and "dispatched" never drift apart. A sync then:

1. closes the gate. With a gated sampler (``in_order``, ``weight_fifo``) it first lets the rollout
   loop admit everything the sampler still allows under the old version: that is what makes a
   group with target step t use weights max(0, t - max_lag) exactly, however the loops are timed;
2. ``drain``: waits until no dispatched group is still generating (failed batches are retried
   meanwhile); ``inflight``: does not, the trainer exports while the running batches finish on the
   old weights;
3. exports the trainer's weights once and loads them into every generator with their version.
   A load waits until no generation batch is running (it would queue behind one anyway), except
   under ``inflight`` when every generator takes weights while it generates
   (``RolloutHandle.loads_while_generating``, the vLLM backend): a running batch then continues on
   the new weights, and each of its tokens records the version that produced it;
   Each load answers with the generator's fingerprint of what it now serves, which the report
   carries beside the trainer's of what it exported (weights/fingerprint.py);
4. hands the report to ``verify`` (the integrity guard's checks, asyncrl/integrity/sync_checks.py),
   then reopens the gate at the new version.

``sync.timeout_s`` bounds the sync's own phases, each on its own: closing the gate, the export,
the loads and the checks; the run's first load (``first_load``) has the same bounds. Waiting for running generation is not the sync: a long batch does not fail it, nor does
a gate that stays closing while the rollout loop waits for room under the in-flight limit (room
comes only when a batch finishes); a generation that hangs is the watchdog's to stop
(``runtime.watchdog_s``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

from asyncrl.control.gate import RolloutGate
from asyncrl.control.handles import RolloutHandle, TrainerHandle
from asyncrl.errors import SyncTimeoutError, WeightLoadError
from asyncrl.types import SyncReport
from asyncrl.weights.size import state_dict_bytes


class WeightSync:
    def __init__(
        self,
        trainer: TrainerHandle,
        generators: Sequence[RolloutHandle],
        gate: RolloutGate,
        *,
        mode: Literal["drain", "inflight"],
        timeout_s: float,
        verify: Callable[[SyncReport], Awaitable[None]] | None = None,
    ) -> None:
        """``verify``: called with the sync's report after every load, before the gate reopens (the
        integrity guard's checks of what the generators serve); what it raises ends the sync."""
        if mode not in ("drain", "inflight"):
            raise ValueError(f"sync.mode: '{mode}' is not drain or inflight")
        self.trainer = trainer
        self.generators = list(generators)
        self.gate = gate
        self.mode = mode
        self.timeout_s = timeout_s
        self.verify = verify

    async def sync(self) -> SyncReport:
        """Bring every generator to the trainer's current version; see the module docstring."""
        start = time.perf_counter()
        await self._close_gate()
        if self.mode == "drain":
            await self.gate.drained()
        self.gate.loading = True
        export = asyncio.ensure_future(self._export())
        if not (self.mode == "inflight" and all(g.loads_while_generating for g in self.generators)):
            try:
                await self.gate.generators_idle()
            except BaseException:
                export.cancel()
                raise
        version, weights, export_s = await export
        load_start = time.perf_counter()
        self.gate.sent = version
        served = await self._load(version, weights)
        transfer_s = export_s + time.perf_counter() - load_start
        report = SyncReport(
            version=version,
            pause_s=0.0,
            transfer_s=transfer_s,
            bytes=state_dict_bytes(weights),
            transport=getattr(weights, "transport", "in_process"),
            served=served,
            exported=await self._exported(served),
        )
        if self.verify is not None:
            await self._phase(f"checking what the generators serve of version {version}", self.verify(report))
        self.gate.open(version)
        return replace(report, pause_s=time.perf_counter() - start)

    async def first_load(self) -> int:
        """Give every generator the trainer's weights (warm-started or resumed) before the first
        rollout, the export and the loads each within ``sync.timeout_s`` as in every sync: a
        generator that never answers stops the run instead of hanging it. Returns the version."""
        version, weights, _ = await self._export()
        self.gate.sent = version
        await self._load(version, weights)
        return version

    async def _load(self, version: int, weights: Any) -> tuple[str | None, ...]:
        """Load ``version`` into every generator; what each serves after it (its fingerprint)."""
        loads = asyncio.gather(*(g.load_weights(weights, version) for g in self.generators))
        try:
            return tuple(await self._phase(f"loading weights version {version} into the generators", loads))
        except SyncTimeoutError:
            raise
        except Exception as err:
            raise WeightLoadError(
                f"loading weights version {version} into the generators failed: {type(err).__name__}: {err}"
            ) from err

    async def _exported(self, served: tuple[str | None, ...]) -> dict[str, str]:
        """The export's fingerprints in the dtypes the generators hold (``"<dtype>:<hex>"``), asked
        of the trainer only when a generator told its own."""
        dtypes = sorted({fingerprint.split(":", 1)[0] for fingerprint in served if fingerprint is not None})
        if not dtypes:
            return {}
        return await self._phase("fingerprinting the exported weights", self.trainer.exported_fingerprints(dtypes))

    async def _close_gate(self) -> None:
        """Close the gate within ``sync.timeout_s``, not counting the time the rollout loop waits
        for running generation to make room under the in-flight limit."""
        self.gate.request_close()
        budget = self.timeout_s
        while self.gate.admitting:
            waiting_for_generation = self.gate.closing_waits_for_generation
            started = time.perf_counter()
            try:
                async with asyncio.timeout(None if waiting_for_generation else budget):
                    await self.gate.changes.next()
            except TimeoutError:
                raise SyncTimeoutError(
                    f"weight sync exceeded sync.timeout_s={self.timeout_s:g}s while closing the rollout gate"
                ) from None
            if not waiting_for_generation:
                budget -= time.perf_counter() - started

    async def _export(self) -> tuple[int, Any, float]:
        start = time.perf_counter()
        version, weights = await self._phase("exporting trainer weights", self.trainer.export_weights(), trainer=True)
        return version, weights, time.perf_counter() - start

    async def _phase(self, phase: str, awaitable: Any, *, trainer: bool = False) -> Any:
        """``awaitable`` within ``sync.timeout_s``; past it, a ``SyncTimeoutError`` naming the phase."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await awaitable
        except TimeoutError:
            raise SyncTimeoutError(
                f"weight sync exceeded sync.timeout_s={self.timeout_s:g}s while {phase}", trainer_healthy=not trainer
            ) from None
