"""The algorithm seam: what the trainer asks of an RL algorithm, and the run's algorithm by name.

An algorithm owns the advantages of a group, the test of whether a group is informative, the
per-token loss and its own options. Everything around them (scoring, micro-batches, the
normalization contract of docs/loss.md, parallelism, the staleness contract) is the trainer's
and the sampler's, the same for every algorithm: an algorithm says what the trainer must score for
it (``Scoring``) and which per-token metrics its loss returns (``metrics``), and the trainer
reduces those whatever their names. ``algorithm.name`` picks a built-in (``grpo``, in
``asyncrl.plugins.BUILTINS``) or ``package.module:attribute``, a factory built like every part
(``plugins.build_part``): called with the run config and its validated ``algorithm.options``
(docs/plugins.md, "Algorithm").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from asyncrl.config import RunConfig
from asyncrl.plugins import build_part, resolve, validate_options
from asyncrl.types import TokenLossInputs


@dataclass(frozen=True)
class Scoring:
    """What the trainer scores for an algorithm besides the policy's logprobs: the logprobs of a
    frozen reference (a copy of the starting policy) and the entropy with its gradient."""

    reference: bool = False
    entropy: bool = False


@dataclass(frozen=True)
class MetricKeys:
    """Where the trainer reports a per-token metric of the loss: its mean over the step's response
    tokens under ``mean``; with ``low`` and ``high``, its smallest and largest value too."""

    mean: str
    low: str | None = None
    high: str | None = None


class Algorithm(Protocol):
    scoring: Scoring
    metrics: Mapping[str, MetricKeys]  # every metric token_loss returns, by its name there

    def advantages(self, rewards: Tensor) -> Tensor:
        """Per-sample advantages [n] of one group's rewards [n]."""
        ...

    def informative(self, rewards: Tensor) -> bool:
        """Whether a group carries a learning signal; decided once, where the group is produced,
        and read by the refill and by ``step.filter_zero_variance``."""
        ...

    def token_loss(self, inputs: TokenLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        """(per-token loss l [B, T], per-token detached metrics): the trainer back-propagates
        sum_it w_it * m_it * l_it and reduces each metric, exactly those of ``metrics``, over
        the response tokens."""
        ...


_MEMBERS = ("scoring", "metrics", "advantages", "informative", "token_loss")


def build_algorithm(config: RunConfig) -> Algorithm:
    """The run's algorithm, its options checked; a bad name or option is one ValueError naming the field."""
    name = config.algorithm.name
    factory = resolve("algorithm", name, "algorithm.name")
    if not callable(factory):
        raise ValueError(f"algorithm.name: '{name}' is not callable; it must take the run config and its options")
    options = validate_options(factory, name, config.algorithm.options, "algorithm.options")
    try:
        algorithm = build_part(factory, options, config)
    except ValueError as err:  # the algorithm refusing its options against the rest of the run
        raise ValueError(f"algorithm.options.{err}") from None
    except Exception as err:  # the user's code raising on the run config
        raise ValueError(f"algorithm.name: '{name}' raised on the run config ({type(err).__name__}: {err})") from None
    missing = [member for member in _MEMBERS if not hasattr(algorithm, member)]
    if missing:
        raise ValueError(f"algorithm.name: '{name}' does not return an Algorithm; missing {', '.join(missing)}")
    return algorithm
