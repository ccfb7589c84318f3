"""The one forward pass that turns token ids into per-token logprobs (and entropies).

Everything that scores existing tokens goes through here, so all scores agree on positions and
precision. Position ids come from the attention mask: a left-padded row then sees the same
positions as the unpadded row. (RoPE is relative, so default positions shift every rotary angle
rather than change the maths, but the shifted angles round differently: 1e-8 to 1e-7 of logprob
drift in float64, far outside the 1e-9 parity tolerance. Absolute position embeddings would
break outright.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens: 0 on left padding, then 0, 1, 2, ...; right padding
    repeats the last position (padding is masked, so its position never matters)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """``logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``, and 0 at ``t = 0``.

    ``entropy[:, t]`` is the entropy of the distribution that predicts token t (0 at ``t = 0``).
    Both are aligned with ``input_ids``; values at padding positions are finite but meaningless,
    callers mask them. p is softmax(logits / temperature): see ``logits_logprobs``.
    """
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).logits[:, :-1]
    logprobs, entropy = logits_logprobs(
        logits, input_ids[:, 1:], with_entropy=with_entropy, entropy_grad=entropy_grad, temperature=temperature
    )
    return F.pad(logprobs, (1, 0)), None if entropy is None else F.pad(entropy, (1, 0))


def logits_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """Logprob of ``targets`` [B, T] (and the entropy) under softmax(logits / temperature) [B, T, V].

    Dividing by the sampling temperature scores the distribution the generator samples from (before
    its top-k / top-p truncation, which importance sampling accounts for). Computed in float64 for
    float64 logits, float32 otherwise. The logprob is ``logit[target] - logsumexp(logits)``, so
    autograd keeps only the logits (no log-softmax copy of the [B, T, V] tensor). ``entropy_grad``
    False computes the entropy as a metric only, outside autograd: its [B, T, V] intermediates are
    freed at once instead of being kept for a backward that would multiply them by 0.
    """
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if temperature != 1.0:
        logits = logits / temperature
    log_normalizer = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - log_normalizer
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.softmax(logits, dim=-1)
        entropy = log_normalizer - (probs * logits).sum(-1)
    return logprobs, entropy
