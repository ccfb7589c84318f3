"""The one forward pass that turns token ids into per-token logprobs (and entropies).

The [B, T, V] logits never exist at once: the final hidden states are projected and scored a chunk
of tokens at a time, inside the model's forward, and the backward recomputes each chunk
(``model_logprobs``). With a 151,936-token vocabulary the whole logits tensor and its backward's
temporaries took about 3 MB a token.

Everything that scores existing tokens goes through here, so all scores agree on positions and
precision. Position ids come from the attention mask: a left-padded row then sees the same
positions as the unpadded row. (RoPE is relative, so default positions shift every rotary angle
rather than change the maths, but the shifted angles round differently: 1e-8 to 1e-7 of logprob
drift in float64, far outside the 1e-9 parity tolerance. Absolute position embeddings would
break outright.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from asyncrl.models.packing import Packing

# trainer.logprob_chunk_tokens "auto", by device type: 1024 scored a bf16 step of a 0.5B model 1.5x
# faster than 128 on an H100 (bench gpu), for about 2.5 GB more at a 151,936-token vocabulary.
AUTO_CHUNK_TOKENS = {"cuda": 1024}
DEFAULT_CHUNK_TOKENS = 128  # any other device


def chunk_tokens_for(setting: int | str, device: torch.device) -> int:
    """The chunk ``trainer.logprob_chunk_tokens`` means on ``device``."""
    return AUTO_CHUNK_TOKENS.get(device.type, DEFAULT_CHUNK_TOKENS) if setting == "auto" else int(setting)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens: 0 on left padding, then 0, 1, 2, ...; right padding
    repeats the last position (padding is masked, so its position never matters)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def right_padded(attention_mask: Tensor) -> bool:
    """Whether every row's real tokens come first: no real token after a padding column."""
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


def causal_inputs(attention_mask: Tensor) -> dict[str, Tensor | None]:
    """The mask and positions of a scoring forward. Right-padded rows pass no mask: causal
    attention already keeps every real token from the padding after it, and a padding mask costs
    every layer a [B, 1, T, T] float copy kept for the backward. Their positions count on through
    the padding (real tokens keep theirs), since transformers reads a position that does not
    advance as the start of a packed sequence and builds a mask after all. Other rows (left
    padding) keep their mask and the positions of ``position_ids_from_mask``."""
    if right_padded(attention_mask):
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        return {"attention_mask": None, "position_ids": positions.expand_as(attention_mask)}
    return {"attention_mask": attention_mask, "position_ids": position_ids_from_mask(attention_mask)}


@dataclass(frozen=True)
class SampledDistribution:
    """The distribution rollouts are sampled from, which every score of the trainer is taken under.

    softmax(logits / temperature), truncated to the ``top_k`` most likely tokens (0: all; ties with
    the k-th are kept), then to the nucleus (``top_p`` 1: all): in ascending order of probability a
    token is dropped while the mass up to and including it is at most 1 - top_p, the most likely
    token always kept. The kept tokens are renormalized. This is vLLM's rule (its PyTorch top-k /
    top-p sampler, in the same float arithmetic), so the transformers generator, a vLLM server
    returning processed logprobs and the trainer all mean the same distribution.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def logits(self, logits: Tensor, targets: Tensor | None = None) -> Tensor:
        """``logits`` [..., V] divided by the temperature, -inf outside the kept tokens.

        ``targets`` [...] (the tokens being scored) stay kept whatever their rank: a sampled token
        was in the generator's kept set, and a near tie at the boundary that rounds the other way
        in the trainer's forward must not turn its logprob into -inf. On-policy this changes nothing.
        The kept set is chosen without gradient; the gradient is that of the renormalized logprob."""
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if not self.truncates:
            return logits
        with torch.no_grad():
            drop = truncated(logits, self.top_k, self.top_p)
            if targets is not None:
                drop.scatter_(-1, targets[..., None], False)
        return logits.masked_fill(drop, -torch.inf)


def truncated(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """True for the tokens of ``logits`` [..., V] that top-k, then top-p, drop (see ``SampledDistribution``)."""
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        drop = logits < kth
    if top_p < 1.0:
        ascending, order = logits.masked_fill(drop, -torch.inf).sort(dim=-1, stable=True)
        mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass_up_to <= 1 - torch.tensor(top_p, dtype=mass_up_to.dtype)
        drop_sorted[..., -1] = False
        drop = drop | drop_sorted.scatter(-1, order, drop_sorted)
    return drop


def token_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    distribution: SampledDistribution = SampledDistribution(),
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    packed: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``, and 0 at ``t = 0``.

    ``entropy[:, t]`` is the entropy of the distribution that predicts token t (0 at ``t = 0``).
    Both are aligned with ``input_ids``; values at padding positions are finite but meaningless,
    callers mask them. p is ``distribution``: see ``logits_logprobs``. Scored ``chunk_tokens``
    tokens at a time: see ``model_logprobs``. ``packed``: the forward runs over the rows' real
    tokens in one row (``packed_token_logprobs``).
    """
    scoring = {
        "with_entropy": with_entropy,
        "entropy_grad": entropy_grad,
        "distribution": distribution,
        "chunk_tokens": chunk_tokens,
    }
    if packed:
        return packed_token_logprobs(model, input_ids, attention_mask, **scoring)
    logprobs, entropy = model_logprobs(
        model,
        F.pad(input_ids[:, 1:], (0, 1)),  # column t predicts column t + 1; the last predicts nothing
        **scoring,
        input_ids=input_ids,
        **causal_inputs(attention_mask),
    )
    return F.pad(logprobs[:, :-1], (1, 0)), None if entropy is None else F.pad(entropy[:, :-1], (1, 0))


def packed_token_logprobs(
    model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, **scoring
) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs`` from one forward over the rows' real tokens, concatenated (models/packing.py).

    The model's attention must keep each segment to itself from ``packed_segments`` (the
    trainer routes it through ``context_parallel_attention``). Scores come back in the rows'
    layout: a segment's first token, which no column of its row predicts, gets 0, as column 0 does
    unpacked, and padding gets 0."""
    packing = Packing.of(attention_mask)
    ids = packing.pack(input_ids)
    logprobs, entropy = model_logprobs(
        model,
        F.pad(ids[:, 1:], (0, 1)),  # a segment's last column predicts the next one's first: masked below
        **scoring,
        input_ids=ids,
        attention_mask=None,
        position_ids=packing.position_ids,
        packed_segments=packing.segment_starts,
    )
    first = packing.first_columns()

    def aligned(x: Tensor) -> Tensor:
        return packing.unpack(F.pad(x[:, :-1], (1, 0)).masked_fill(first, 0.0))

    return aligned(logprobs), None if entropy is None else aligned(entropy)


@torch.no_grad()
def check_packing(model: nn.Module) -> None:
    """Refuse a model whose packed forward differs from its rows' (an architecture whose layers do
    not hand ``packed_segments`` to the attention function would attend across sequences), on two
    short rows: packing it would train on other sequences' tokens silently."""
    weight = OutputHead(model).head.weight
    ids = (torch.arange(1, 9, device=weight.device) % weight.shape[0]).view(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], device=weight.device)
    rows, _ = token_logprobs(model, ids, mask)
    packed, _ = token_logprobs(model, ids, mask, packed=True)
    tolerance = 1e-5 if weight.dtype in (torch.float32, torch.float64) else 3e-2
    scored = mask.bool() & (mask.cumsum(1) > 1)
    if not torch.allclose(packed[scored], rows[scored], rtol=tolerance, atol=tolerance):
        model_type = OutputHead(model).model_type
        raise ValueError(
            f"trainer.packing: a '{model_type}' model scores packed sequences differently from its rows (its "
            "attention does not keep them apart), so use trainer.packing=false"
        )


class OutputHead:
    """The model's last step, final hidden states to logits, taken out so it runs on a chunk:
    ``lm_head(hidden)`` (a LoRA-wrapped head included), then, where the config sets
    ``final_logit_softcapping`` (Gemma 2 and 3), tanh softcapping as the model applies it.
    ``check`` proves on a probe that this is what the model computes."""

    def __init__(self, model: nn.Module) -> None:
        causal = model.get_base_model() if isinstance(model, PeftModel) else model
        self.model_type = getattr(causal.config, "model_type", None)
        self.decoder = causal.base_model
        self.head = causal.get_output_embeddings()
        self.softcap = getattr(causal.config, "final_logit_softcapping", None)

    def logits(self, hidden: Tensor) -> Tensor:
        logits = self.head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def check(self, model: nn.Module) -> None:
        """Refuse a model whose logits are not ``logits(final hidden states)`` (another scaling
        or transform in its head), on a few tokens: chunked scores of it would differ silently."""
        hidden = []
        hook = self.decoder.register_forward_hook(lambda module, args, output: hidden.append(output[0]))
        try:
            ids = torch.arange(min(4, self.head.weight.shape[0]), device=self.head.weight.device)[None]
            expected = model(input_ids=ids, use_cache=False).logits
        finally:
            hook.remove()
        if not torch.allclose(self.logits(hidden[0]).to(expected.dtype), expected, rtol=1e-4, atol=1e-5):
            raise ValueError(
                f"model: its logits are not its output head applied to the final hidden states (model_type "
                f"'{self.model_type}'), so chunked logprobs cannot reproduce them"
            )


def model_logprobs(
    model: nn.Module,
    targets: Tensor,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    distribution: SampledDistribution = SampledDistribution(),
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    **inputs,
) -> tuple[Tensor, Tensor | None]:
    """Logprob of ``targets`` [B, T] (and the entropy) at each column of ``model(**inputs)``,
    never holding the [B, T, V] logits: see ``chunked_logprobs``.

    The scoring runs inside the model's own forward, in a hook on its decoder, and the model's head
    then projects one column only: a wrapper that gathers parameters for the forward (FSDP2's
    root holds the head) sees the head used within it, and the backward's recomputation too."""
    head = OutputHead(model)
    scored = []

    def score(module: nn.Module, args, output) -> None:
        scored.append(
            chunked_logprobs(
                head,
                output[0],
                targets,
                chunk_tokens=chunk_tokens,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                distribution=distribution,
            )
        )

    hook = head.decoder.register_forward_hook(score)
    try:
        model(**inputs, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    return scored[0]


def chunk_spans(tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of ``chunk_tokens`` consecutive tokens, the last one shorter."""
    return [(start, min(start + chunk_tokens, tokens)) for start in range(0, tokens, chunk_tokens)]


def chunk_inputs(hidden: Tensor, targets: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """A chunk's hidden states [N, H] and the targets they predict [N]: the same tokens of both."""
    return hidden[start:stop], targets[start:stop]


def chunked_logprobs(
    head: OutputHead,
    hidden: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool,
    distribution: SampledDistribution,
) -> tuple[Tensor, Tensor | None]:
    """``logits_logprobs`` of ``head.logits(hidden)`` [B, T, H], ``chunk_tokens`` tokens at a time.

    Each chunk's logits live only while it is scored: with a backward to come the chunk is
    checkpointed, so autograd keeps its hidden states, not its [chunk, V] logits, and the backward
    recomputes them one chunk at a time. Every position is scored as unchunked (softmax and
    truncation act within one position), so only the weight gradient's sum over tokens changes order."""
    if chunk_tokens < 1:
        raise ValueError(f"trainer.logprob_chunk_tokens: must be >= 1, got {chunk_tokens}")
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)

    def score(chunk_hidden: Tensor, chunk_targets: Tensor) -> tuple[Tensor, Tensor | None]:
        return logits_logprobs(
            head.logits(chunk_hidden),
            chunk_targets,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            distribution=distribution,
        )

    recompute = torch.is_grad_enabled()
    parts = []
    for start, stop in chunk_spans(flat_targets.shape[0], chunk_tokens):
        args = chunk_inputs(flat_hidden, flat_targets, start, stop)
        parts.append(checkpoint(score, *args, use_reentrant=False) if recompute else score(*args))
    logprobs = torch.cat([p[0] for p in parts]).view(targets.shape)
    return logprobs, torch.cat([p[1] for p in parts]).view(targets.shape) if with_entropy else None


def logits_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    distribution: SampledDistribution = SampledDistribution(),
) -> tuple[Tensor, Tensor | None]:
    """Logprob of ``targets`` [B, T] (and the entropy) under ``distribution`` of ``logits`` [B, T, V].

    That is the distribution the generator samples from, temperature and truncation included, so
    on-policy the trainer's logprob equals the generator's. The entropy is that of the same
    truncated distribution: what the sampler actually draws from, and what an entropy bonus can
    change. Computed in float64 for float64 logits, float32 otherwise. The logprob is
    ``logit[target] - logsumexp(logits)``, so autograd keeps only the logits (no log-softmax copy
    of the [B, T, V] tensor). ``entropy_grad`` False computes the entropy as a metric only, outside
    autograd: its [B, T, V] intermediates are freed at once instead of being kept for a backward
    that would multiply them by 0.
    """
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    logits = distribution.logits(logits, targets)
    log_normalizer = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - log_normalizer
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.softmax(logits, dim=-1)
        finite = logits.nan_to_num(neginf=0.0) if distribution.truncates else logits  # 0 · -inf is nan
        entropy = log_normalizer - (probs * finite).sum(-1)
    return logprobs, entropy
