"""The weights and optimizer state a step started from, kept off the training device.

With several updates per step (docs/loss.md, "Several updates per step") the weights and AdamW
moments change before the step has finished, and ``abort_train_step`` must put them back bit for
bit. A copy on the training device would cost another 12 bytes a parameter (float32 weight and
two moments: about 84 GB for 7B parameters), close to doubling what the trainer holds there. So
the copy goes where the device's memory is not:

- a trainer on an accelerator copies into host memory, pinned on CUDA so the copies are DMA;
  the host buffers are allocated at the first snapshot and reused by every later step;
- a trainer on the CPU, whose memory a host copy would share, writes the bytes to an anonymous
  temporary file (in ``TMPDIR``; on a tmpfs that is memory again), read back straight into the
  tensors, one at a time, only when a step aborts.

Only this rank's part of each tensor is kept (an FSDP shard, or the whole tensor), so every rank
snapshots and restores its own shards.
"""

from __future__ import annotations

import tempfile

import torch
from torch import Tensor


class HostStore:
    """Copies in host memory; each buffer is allocated once and refilled by later snapshots."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self.buffers: dict[str, Tensor] = {}

    def save(self, tensors: dict[str, Tensor]) -> None:
        for key, tensor in tensors.items():
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = self.buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
            buffer.copy_(tensor, non_blocking=self.pin)

    def load_into(self, tensors: dict[str, Tensor]) -> None:
        for key, tensor in tensors.items():
            tensor.copy_(self.buffers[key], non_blocking=self.pin)

    def discard(self) -> None:
        """The buffers stay for the next step's snapshot."""


class FileStore:
    """The raw bytes of every tensor, in order, in an anonymous file deleted when closed."""

    def __init__(self) -> None:
        self.file = None

    def save(self, tensors: dict[str, Tensor]) -> None:
        self.discard()
        self.file = tempfile.TemporaryFile(prefix="asyncrl-step-start-")
        for tensor in tensors.values():
            self.file.write(_bytes(tensor))
        self.file.flush()

    def load_into(self, tensors: dict[str, Tensor]) -> None:
        self.file.seek(0)
        for key, tensor in tensors.items():
            view = _bytes(tensor)
            if self.file.readinto(view) != view.nbytes:
                raise RuntimeError(f"step snapshot: {key} is cut short in its file")

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _bytes(tensor: Tensor):
    """The tensor's own memory as a writable byte array (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class StepSnapshot:
    """Weights and optimizer state at step start: ``save`` before the step's first update,
    ``restore`` on abort, ``discard`` when the step ends either way."""

    def __init__(self, device: torch.device) -> None:
        self.store = FileStore() if device.type == "cpu" else HostStore(pin=device.type == "cuda")
        self.keys: list[str] | None = None

    @property
    def taken(self) -> bool:
        return self.keys is not None

    @torch.no_grad()
    def save(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        tensors = _state_tensors(params, optimizer)
        self.store.save(tensors)
        self.keys = list(tensors)

    @torch.no_grad()
    def restore(self, params: list[Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Put the saved values back into the same tensors; optimizer state created since (the
        moments of a run's first update) is dropped, as it did not exist at step start."""
        owners = {key.rsplit(".", 1)[0] for key in self.keys if key.startswith("state.")}
        for index, param in enumerate(params):
            if f"state.{index}" not in owners:
                optimizer.state.pop(param, None)
        current = _state_tensors(params, optimizer)
        self.store.load_into({key: current[key] for key in self.keys})

    def discard(self) -> None:
        self.store.discard()
        self.keys = None


def _state_tensors(params: list[Tensor], optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """This rank's part of every parameter and of every tensor of its optimizer state, by a stable key."""
    tensors = {f"param.{index}": _local(param) for index, param in enumerate(params)}
    for index, param in enumerate(params):
        for name, value in optimizer.state.get(param, {}).items():
            tensors[f"state.{index}.{name}"] = _local(value)
    return tensors


def _local(tensor: Tensor) -> Tensor:
    """The part of a DTensor this rank holds; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor.detach()
