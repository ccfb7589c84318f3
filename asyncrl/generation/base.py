"""The generation contract every backend implements: token ids in, Rollouts out.

A backend sees only plain token ids, per-sample seeds and a name -> tensor state dict, so one that
runs outside torch's module system (an inference server) fits the same protocol as the in-process
transformers one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor

from asyncrl.types import Rollout

if TYPE_CHECKING:
    from asyncrl.config import GenerationConfig

SEED_BITS = 63  # a non-negative int64: accepted by torch.Generator.manual_seed and by numpy


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation call; the same for every request in it."""

    max_new_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # 1 disables nucleus sampling
    top_k: int = 0  # 0 disables top-k

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens: must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"SamplingParams.temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k: must be an integer >= 0, got {self.top_k!r}")

    @classmethod
    def from_config(cls, cfg: GenerationConfig) -> SamplingParams:
        return cls(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)

    def greedy(self) -> SamplingParams:
        """Same limits, temperature 0: what evaluation uses."""
        return replace(self, temperature=0.0)


@dataclass(frozen=True)
class SampleRequest:
    """One completion to sample. ``seed`` alone decides its randomness (see ``sample_seed``)."""

    prompt_ids: list[int]
    seed: int

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("SampleRequest.prompt_ids: a prompt needs at least one token")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**SEED_BITS:
            raise ValueError(f"SampleRequest.seed: must be an integer in [0, 2**{SEED_BITS}), got {self.seed!r}")


def check_vocabulary(requests: Sequence[SampleRequest], vocab_size: int) -> None:
    """Every prompt token indexes the model's embedding table; an id past it would fail deep in a
    kernel (or silently read another row), so a backend checks before generating."""
    for index, request in enumerate(requests):
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab_size:
            raise ValueError(
                f"SampleRequest.prompt_ids: request {index} has a token id outside the model's vocabulary "
                f"of {vocab_size}"
            )


def sample_seed(run_seed: int, prompt_uid: str, sample_index: int) -> int:
    """Stable across processes and Python versions (hashlib, not hash()); fits torch.Generator.manual_seed.

    The two integers come first, so the ':'-joined key is unambiguous whatever the uid contains.
    """
    key = f"{int(run_seed)}:{int(sample_index)}:{prompt_uid}".encode()
    digest = hashlib.sha256(key).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - SEED_BITS)


@runtime_checkable
class Generator(Protocol):
    """Samples completions with the weights of one trainer version.

    ``version``, ``generate`` and ``load_weights`` every backend writes; the rest are capabilities,
    which ``GeneratorBase`` gives their safe defaults (docs/generation.md, "Adding a backend").
    """

    version: int  # weight version currently loaded
    loads_while_generating: bool  # load_weights may run beside generate (sync.mode inflight); False: drained first
    concurrent_calls: bool  # generate may run on several threads at once; False: one call at a time

    def generate(self, requests: Sequence[SampleRequest], params: SamplingParams) -> list[Rollout]:
        """One Rollout per request, in request order."""

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Replace every weight by the tensor of the same name, then report ``version``."""

    def score(self, sequences: Sequence[Sequence[int]], params: SamplingParams) -> list[list[float]] | None:
        """Each token's logprob given the tokens before it (0 for the first); None: cannot score."""

    def fingerprint(self) -> str | None:
        """The fingerprint of the weights it serves (``asyncrl.weights.fingerprint``), read back
        from its own model after the last load; None: it cannot tell."""

    def abandon(self) -> None:
        """The run is ending: make the call in flight give up soon (a later call runs as usual).
        Called from another thread, before ``close``."""

    def close(self) -> None:
        """Release what the generator holds (a server, threads, files); safe to call twice."""


class GeneratorBase:
    """Every capability of ``Generator`` at its safe default; a backend inherits it and overrides
    what it can do, so callers use a capability plainly instead of probing for it."""

    loads_while_generating = False  # a load into tensors a running batch reads would tear it: drain first
    concurrent_calls = False  # a backend is assumed to hold one batch at a time: calls wait their turn

    def score(self, sequences: Sequence[Sequence[int]], params: SamplingParams) -> list[list[float]] | None:
        """None: no scorer, so multi-turn episodes keep the logprobs their turns were sampled with."""
        return None

    def fingerprint(self) -> str | None:
        """None: the weight sync cannot check what this backend serves (docs/integrity.md)."""
        return None

    def abandon(self) -> None:
        """Nothing to give up early: a call in flight runs to its end (or its own deadline)."""

    def close(self) -> None:
        """Nothing to release: a backend holding a server, threads or files stops them here."""


def missing_members(generator: object) -> list[str]:
    """The members of the ``Generator`` protocol that ``generator`` lacks, sorted."""
    methods = [name for name, value in vars(Generator).items() if callable(value) and not name.startswith("_")]
    return sorted(name for name in [*Generator.__annotations__, *methods] if not hasattr(generator, name))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
