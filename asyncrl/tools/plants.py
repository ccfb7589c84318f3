"""The planted mistakes of ``asyncrl verify --plant``, by name.

Kept free of torch so that the CLI can list them without importing the verifier; docs/loss.md
says what each one gets wrong.
"""

from typing import Literal, get_args

Plant = Literal[
    "per-microbatch-mean",
    "shift-after-shard",
    "per-shard-mean",
    "average-without-compensation",
    "double-count-tokens",
    "whole-step-normalizer",
    "recompute-proximal",
    "cp-shard-mean",
    "cp-untruncated",
    "cp-causal-leak",
    "observation-trained",
    "lora-base-trainable",
    "lora-double-scaling",
    "chunk-seam",
    "packed-leak",
]
PLANTS: tuple[str, ...] = get_args(Plant)
