"""Weight broadcast: trainer rank 0 sends each new version to every generator over one process group.

The group is trainer rank 0 (its rank 0) and the generators (ranks 1..n). It is built from its own
``TCPStore`` hosted by rank 0, never through ``init_process_group``, so the trainer ranks' default
group is untouched: NCCL between GPUs, gloo otherwise.

Weights travel as one flat buffer per dtype (a few large collectives instead of one per tensor),
described by a ``Layout`` that the receivers unflatten with views. Rank 0 copies each version
into its buffers and only starts the broadcast, so its call returns before any generator has
joined; the generators join when their ``receive`` call runs (after the batches queued before it).
The copy is kept until the next version: a generator that missed the broadcast (it died, or
restarted) loads that version from it through the object store instead.

The vLLM backend's collective weight transfer uses the same group, of two members: the process
that holds the weights and the server's worker. The server runs in vLLM's own environment and
loads this file by path (generation/vllm_server.py), so it imports only torch and the standard
library.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

STOP_KEY = "stop"
POLL_S = (1e-4, 0.01)  # a waiting receiver checks for completion and the stop signal this often: first, at most


class BroadcastError(RuntimeError):
    """This process cannot take part in the weight broadcast (it was never in the group, or the
    version it asks for is no longer held)."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # the buffer it lives in
    shape: tuple[int, ...]
    offset: int  # elements into that buffer


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a version lies in the flat per-dtype buffers."""

    entries: tuple[Entry, ...]
    sizes: tuple[tuple[str, int], ...]  # (dtype, elements) per buffer, in broadcast order

    @classmethod
    def of(cls, weights: dict[str, Tensor]) -> Layout:
        return cls.describe(
            (name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)) for name, tensor in weights.items()
        )

    @classmethod
    def describe(cls, tensors: Iterable[tuple[str, str, Sequence[int]]]) -> Layout:
        """The layout of ``(name, dtype, shape)`` in this order: what a receiver rebuilds from ``meta``."""
        entries, sizes = [], {}
        for name, dtype, shape in tensors:
            offset = sizes.get(dtype, 0)
            entries.append(Entry(name, dtype, tuple(shape), offset))
            sizes[dtype] = offset + math.prod(shape)
        return cls(tuple(entries), tuple(sizes.items()))

    def meta(self) -> dict[str, list]:
        """Names, dtypes and shapes as JSON lists, the form vLLM's weight-transfer update info takes."""
        return {
            "names": [entry.name for entry in self.entries],
            "dtype_names": [entry.dtype for entry in self.entries],
            "shapes": [list(entry.shape) for entry in self.entries],
        }

    def empty(self, device: torch.device | str) -> dict[str, Tensor]:
        return {dtype: torch.empty(size, dtype=getattr(torch, dtype), device=device) for dtype, size in self.sizes}

    def pack(self, weights: dict[str, Tensor], buffers: dict[str, Tensor]) -> None:
        for entry in self.entries:
            self._view(entry, buffers).copy_(weights[entry.name])

    def unpack(self, buffers: dict[str, Tensor]) -> dict[str, Tensor]:
        """Views of ``buffers``, one tensor per name: valid while the buffers are not reused."""
        return {entry.name: self._view(entry, buffers) for entry in self.entries}

    @staticmethod
    def _view(entry: Entry, buffers: dict[str, Tensor]) -> Tensor:
        return buffers[entry.dtype][entry.offset : entry.offset + math.prod(entry.shape)].view(entry.shape)


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the members meet; rank 0 hosts the store at ``host:port``."""

    host: str
    port: int
    world_size: int
    backend: str  # "nccl" or "gloo"
    timeout_s: float

    @property
    def device(self) -> str:
        """Where the buffers live: NCCL moves GPU memory, gloo moves CPU memory."""
        return "cuda" if self.backend == "nccl" else "cpu"


class BroadcastMember:
    """One process's end of the group: ``send`` on rank 0, ``receive`` on the generators."""

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, rank == 0, timeout)
        if rendezvous.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, rendezvous.world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, rendezvous.world_size, timeout)
        self.store = store  # rank 0 serves it; it also carries the stop signal
        self.rank = rank
        self.device = rendezvous.device
        self.layout: Layout | None = None
        self.buffers: dict[str, Tensor] = {}
        self.version: int | None = None  # rank 0: the version its buffers hold
        self.pending: list[Any] = []  # rank 0: the broadcasts of that version still in progress
        self.aborted = False

    def send(self, weights: dict[str, Tensor], version: int) -> Layout:
        """Copy ``weights`` into the buffers and start broadcasting them; returns at once.

        The previous version's broadcast is finished first (its receivers have all loaded it by
        the time the next sync exports; one that failed was reported by its receiver)."""
        self.drain()
        layout = Layout.of(weights)
        if layout != self.layout:
            self.layout, self.buffers = layout, layout.empty(self.device)
        self.version = None
        layout.pack(weights, self.buffers)
        self.version = version
        self.pending = [self.group.broadcast(self.buffers[dtype], 0) for dtype, _ in layout.sizes]
        return layout

    def drain(self) -> None:
        """Wait for the broadcasts rank 0 started; a failed one was reported by its receiver."""
        pending, self.pending = self.pending, []
        for work in pending:
            try:
                work.wait()
            except RuntimeError:
                pass

    def receive(self, layout: Layout) -> dict[str, Tensor]:
        """Join the broadcast of ``layout``'s version; the weights, as views of this member's buffers.

        While it waits it watches for the stop signal: a member that will never send or receive
        (it died) would otherwise hold the others until the group's timeout."""
        if layout != self.layout:
            self.layout, self.buffers = layout, layout.empty(self.device)
        works = [self.group.broadcast(self.buffers[dtype], 0) for dtype, _ in layout.sizes]
        delay, longest = POLL_S
        while not all(work.is_completed() for work in works):
            if self.stopped():
                raise BroadcastError("the weight broadcast was stopped while this generator waited for it")
            time.sleep(delay)
            delay = min(2 * delay, longest)
        for work in works:
            work.wait()
        if self.device == "cuda":
            torch.cuda.current_stream().synchronize()
        return layout.unpack(self.buffers)

    def held(self, version: int) -> dict[str, Tensor]:
        """Rank 0's copy of ``version``, for a generator that missed its broadcast."""
        self.stopped()
        if self.version != version or self.layout is None:
            raise BroadcastError(
                f"weight version {version} is no longer held by trainer rank 0 (it holds {self.version})"
            )
        return self.layout.unpack(self.buffers)

    def stopped(self) -> bool:
        """Whether the group was stopped (``stop``); the first time, abort it here, which ends a
        collective still waiting on a lost peer."""
        if not self.aborted and self.store.check([STOP_KEY]):
            self.aborted = True
            self.group.abort()
        return self.aborted


def signal_stop(rendezvous: Rendezvous, reason: str, timeout_s: float = 10.0) -> None:
    """Tell every member that the group is done: their waits end at once (``BroadcastMember.stopped``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    client = dist.TCPStore(rendezvous.host, rendezvous.port, None, False, timeout, wait_for_workers=False)
    client.set(STOP_KEY, reason)
