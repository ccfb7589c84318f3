"""Weight fingerprints: which weights a generator serves, proved by the generator itself.

The trainer fingerprints what it exports at each sync (the whole state dict, or a LoRA policy's
adapter) and every generator fingerprints what it serves after its load, read back from its own
model (the vLLM server: from the tensors its worker received and loaded). The two must be equal.

What is hashed: each tensor's name and shape, and ``SAMPLES`` of its elements at evenly strided
positions over its flattened storage, the first and the last included. A hash of every byte would
cost a pass over the whole model at every sync and, on a GPU trainer, a copy to the host; the
strided sample costs one small gather per tensor and one transfer of a few thousand numbers.
It still catches what goes wrong in practice:

- a skipped load or stale weights: an optimizer step moves (nearly) every element of every
  trained tensor, so the sampled ones differ from the previous version's;
- a partial load: a tensor not loaded keeps its old sampled values, a missing or extra tensor
  changes the names, and a tensor loaded only in part differs at the strided positions whenever
  the part left out is contiguous and spans more than ``1 / (SAMPLES - 1)`` of it;
- a tensor loaded under another's name (same shape): the values move to another name.

Dtypes: the generator may hold a narrower dtype than the trainer exports (a bfloat16 vLLM server
fed float32 weights), so a fingerprint is taken in a dtype: the sampled values are first cast to
it, the way the transport casts them (through float32, as the weights file stores them, when it
is narrower). The trainer keeps its sample and hashes it in whichever dtype a generator reports
(``Sample.digest``), so both sides hash the same numbers exactly.

A tensor under two names (a tied output head) counts under both: the vLLM client sends each
storage once, and adds the names it left out to the server's sample (``Sample.with_aliases``).

This file imports only torch and the standard library: the vLLM server loads it by path.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

SAMPLES = 64  # elements read per tensor
HELD_DTYPES = ("float64", "float32", "bfloat16", "float16")  # what a generator may hold weights in


@dataclass(frozen=True)
class Sample:
    """The strided elements of each tensor, as float64 on the host, with names and shapes.

    ``floating`` says which tensors are cast to the fingerprint's dtype (integer buffers are not)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    floating: tuple[bool, ...]
    values: tuple[tuple[float, ...], ...]

    def digest(self, dtype: str) -> str:
        """``"<dtype>:<hex>"``: this sample as a generator holding ``dtype`` fingerprints it."""
        held = getattr(torch, dtype)
        hasher = hashlib.blake2b(dtype.encode(), digest_size=16)
        for index in sorted(range(len(self.names)), key=self.names.__getitem__):
            values = torch.tensor(self.values[index], dtype=torch.float64)
            if self.floating[index]:
                values = as_held(values, held).to(torch.float64)
            hasher.update(f"{self.names[index]}:{self.shapes[index]};".encode())
            hasher.update(values.numpy().tobytes())
        return f"{dtype}:{hasher.hexdigest()}"

    def with_aliases(self, aliases: Mapping[str, str]) -> Sample:
        """The sample with ``alias -> name`` entries added as copies of ``name``'s (a tied tensor
        the sender left out); an alias already present is kept."""
        index = {name: i for i, name in enumerate(self.names)}
        extra = [(alias, index[name]) for alias, name in aliases.items() if alias not in index and name in index]
        return Sample(
            self.names + tuple(alias for alias, _ in extra),
            self.shapes + tuple(self.shapes[i] for _, i in extra),
            self.floating + tuple(self.floating[i] for _, i in extra),
            self.values + tuple(self.values[i] for _, i in extra),
        )

    def to_json(self) -> dict:
        return {
            "names": list(self.names),
            "shapes": [list(shape) for shape in self.shapes],
            "floating": list(self.floating),
            "values": [list(values) for values in self.values],
        }

    @classmethod
    def from_json(cls, data: Mapping) -> Sample:
        return cls(
            tuple(data["names"]),
            tuple(tuple(s) for s in data["shapes"]),
            tuple(bool(f) for f in data["floating"]),
            tuple(tuple(float(x) for x in v) for v in data["values"]),
        )


def as_held(values: Tensor, dtype: torch.dtype) -> Tensor:
    """``values`` as a generator holding ``dtype`` has them: through float32 (what a weights file
    stores) when ``dtype`` is narrower, so a float64 export rounds as the file transport rounds it."""
    if dtype.itemsize < 4:
        values = values.to(torch.float32)
    return values.to(dtype)


def positions(numel: int, device: torch.device | str = "cpu") -> Tensor:
    """The ``min(SAMPLES, numel)`` evenly strided positions over ``numel`` elements, the first and
    the last included, each rounded to the nearest: in int64, exact at any size (float32 positions
    stop being whole numbers past 2**24 elements, and the last one can round to ``numel``)."""
    count = min(SAMPLES, numel)
    spans = max(count - 1, 1)
    index = torch.arange(count, dtype=torch.int64, device=device)
    return (2 * index * (numel - 1) + spans) // (2 * spans)


def sample(tensors: Mapping[str, Tensor]) -> Sample:
    """The strided sample of ``tensors`` (on any device: one gather each, one host transfer)."""
    names, shapes, floating, parts = [], [], [], []
    for name, tensor in tensors.items():
        flat = tensor.detach().reshape(-1)
        names.append(name)
        shapes.append(tuple(tensor.shape))
        floating.append(tensor.is_floating_point())
        parts.append(flat[positions(flat.numel(), flat.device)])
    lengths = [part.numel() for part in parts]
    joined = torch.cat([part.to(torch.float64) for part in parts]).cpu() if parts else torch.empty(0)
    values, start = [], 0
    for length in lengths:
        values.append(tuple(joined[start : start + length].tolist()))
        start += length
    return Sample(tuple(names), tuple(shapes), tuple(floating), tuple(values))


def fingerprint(tensors: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> str:
    """What a generator reports: its tensors' sample hashed in ``dtype`` (by default the dtype of
    its first floating tensor: what it holds)."""
    if dtype is None:
        dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    return sample(tensors).digest(dtype_name(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
