"""The algorithm seam: what the workers ask of an RL algorithm, and the run's algorithm by name.

An algorithm owns the advantages of a group, the test of whether a group is informative, and the
per-token loss. Everything around them (scoring, micro-batches, the normalization contract of
docs/loss.md, parallelism, the staleness contract) is the trainer's and the sampler's, the same
for every algorithm. ``algorithm.name`` picks a built-in (``grpo``, in ``asyncrl.plugins.BUILTINS``)
or ``package.module:attribute``, a callable that takes the run config and returns an
``Algorithm`` (docs/plugins.md, "Algorithm").
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from asyncrl.config import LossConfig, RunConfig
from asyncrl.plugins import resolve
from asyncrl.types import TokenLossInputs


class Algorithm(Protocol):
    options: LossConfig  # the run's `loss` section: the trainer reads its aggregation and what to score

    def advantages(self, rewards: Tensor) -> Tensor:
        """Per-sample advantages [n] of one group's rewards [n]."""
        ...

    def informative(self, rewards: Tensor) -> bool:
        """Whether a group carries a learning signal; decided once, where the group is produced,
        and read by the refill and by ``grpo.filter_zero_variance``."""
        ...

    def token_loss(self, inputs: TokenLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        """(per-token loss l [B, T], per-token detached metrics): the trainer back-propagates
        sum_it w_it * m_it * l_it. Metrics it reports, where given: clip, is_weight, ratio, kl,
        entropy, mismatch_kl (docs/metrics.md); an absent is_weight counts as 1."""
        ...


_MEMBERS = ("options", "advantages", "informative", "token_loss")


def build_algorithm(config: RunConfig) -> Algorithm:
    """The run's algorithm; a bad ``algorithm.name`` is one ValueError naming the field."""
    name = config.algorithm.name
    factory = resolve("algorithm", name, "algorithm.name")
    if not callable(factory):
        raise ValueError(f"algorithm.name: '{name}' is not callable; it must take the run config")
    try:
        algorithm = factory(config)
    except Exception as err:  # the user's code raising on the run config
        raise ValueError(f"algorithm.name: '{name}' raised on the run config ({type(err).__name__}: {err})") from None
    missing = [member for member in _MEMBERS if not hasattr(algorithm, member)]
    if missing:
        raise ValueError(f"algorithm.name: '{name}' does not return an Algorithm; missing {', '.join(missing)}")
    return algorithm
