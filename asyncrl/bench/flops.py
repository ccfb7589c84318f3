"""Model FLOPs per token, PaLM's count, shared by the benchmarks that report FLOP/s.

A forward through N parameters costs 2 N per token (a multiply and an add per weight; the tied
embedding counted once, as the output projection) plus 4 L H T for attention scores and their
weighted sum over a context of T. A backward costs twice its forward: the input gradient and the
weight gradient of every matmul. Attention has no weights, so its backward is two input gradients.
"""

from __future__ import annotations


def forward_flops_per_token(parameters: int, num_layers: int, hidden_size: int, context: int) -> float:
    return 2 * parameters + 4 * num_layers * hidden_size * context


def train_flops_per_token(parameters: int, num_layers: int, hidden_size: int, context: int) -> float:
    """Forward and backward: 6 N + 12 L H T."""
    return 3 * forward_flops_per_token(parameters, num_layers, hidden_size, context)


def lora_train_flops_per_token(
    base_parameters: int, adapter_parameters: int, num_layers: int, hidden_size: int, context: int
) -> float:
    """Forward through base and adapters, then a backward that takes the input gradient through
    the frozen base (2 N: no weight gradient for it) and both gradients through the adapters:
    4 N_base + 6 N_adapter + 12 L H T."""
    attention = 12 * num_layers * hidden_size * context
    return 4 * base_parameters + 6 * adapter_parameters + attention
