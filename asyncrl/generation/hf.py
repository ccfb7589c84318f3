"""HFGenerator: batched sampling from a transformers causal LM with a KV cache.

Requests run in consecutive chunks of at most ``batch_size``, in the order given. A chunk is
left-padded, with position ids derived from the attention mask, so a padded row computes what the
row would compute alone. One prefill forward fills the cache, then one forward per new token; a
row stops at any of ``stop_token_ids`` (kept in the response, finish reason "stop") or at
``max_new_tokens`` ("length"), and the loop stops once every row has. A checkpoint may declare
several end tokens (a chat model's end of turn beside the tokenizer's EOS): each one stops a row.

Randomness: a request draws from its own ``torch.Generator`` seeded with ``request.seed``, one
uniform per step, and picks the token by inverse CDF over the sampling distribution. Neither the
global torch RNG, the batch's composition, the row's position nor timing enters, so a request
gets the same tokens alone or among any neighbours, and the same chunk run twice is bit-identical.

Logprob semantics: the returned logprob is that of the distribution actually sampled from, after
temperature, top-k and top-p, so a sampled token always has a finite logprob. With temperature 0
(greedy) it is the logprob of the argmax under the unmodified distribution. Temperature and
truncation are ``SampledDistribution``, the one rule the trainer scores with too, so on-policy the
two agree to floating-point tolerance whatever the sampling settings.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import PreTrainedModel

from asyncrl.generation.base import GeneratorBase, SampleRequest, SamplingParams, check_vocabulary
from asyncrl.models.abandon import Abandoned
from asyncrl.models.factory import DTYPES
from asyncrl.models.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    SampledDistribution,
    chunk_tokens_for,
    position_ids_from_mask,
    token_logprobs,
)
from asyncrl.models.lora import adapter_seed, adapter_tensors, apply_lora
from asyncrl.types import Rollout
from asyncrl.weights.fingerprint import fingerprint

if TYPE_CHECKING:
    from asyncrl.config import RunConfig


def build_hf_generator(
    config: RunConfig, model: PreTrainedModel, tokenizer, stop_token_ids: Sequence[int]
) -> HFGenerator:
    """The ``hf`` backend: ``model`` in ``trainer.dtype``, in this process, ``generation.batch_size`` rows a chunk.

    With ``lora.rank`` > 0 the generator holds the base with one adapter slot (models/lora.py),
    initialised as the trainer's, and a sync copies the adapter alone into it; the base may be
    the trainer's own tensors (``generator_copy``), which nothing here writes to. One slot is
    exact: this backend loads weights only between batches (``loads_while_generating`` is
    False), so every token of a batch is sampled with the adapter version the batch started with."""
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dtype = DTYPES[config.trainer.dtype]
    targets = None
    if config.lora.rank > 0:
        peft_model = apply_lora(model, config.lora, dtype, seed=adapter_seed(config.seed, config.model.init_seed))
        targets, model = adapter_tensors(peft_model), peft_model.get_base_model()
    else:
        model = model.to(dtype)
    return HFGenerator(
        model,
        stop_token_ids=stop_token_ids,
        pad_token_id=pad_token_id,
        batch_size=config.generation.batch_size,
        targets=targets,
        chunk_tokens=chunk_tokens_for(config.trainer.logprob_chunk_tokens, model.device),
    )


build_hf_generator.takes_lora_adapters = True


class HFGenerator(GeneratorBase):
    """Owns ``model`` (the caller passes its own copy) and runs on the model's device and dtype."""

    loads_while_generating = False  # a sync copies into the tensors a running batch reads

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        batch_size: int,
        targets: Mapping[str, Tensor] | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        """``targets``: the tensors a sync replaces, by name, sharing the model's storage; by default
        every tensor of ``model.state_dict()`` (a LoRA generator passes its adapter's).
        ``chunk_tokens``: the tokens whose logits ``score`` holds at once, the trainer's
        ``trainer.logprob_chunk_tokens``, so scoring an episode costs the memory a train step does."""
        vocab_size = model.get_input_embeddings().num_embeddings
        if not stop_token_ids:
            raise ValueError("HFGenerator.stop_token_ids: at least one stop token is needed")
        for name, token_id in [*(("stop_token_ids", t) for t in stop_token_ids), ("pad_token_id", pad_token_id)]:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"HFGenerator.{name}: {token_id} is outside the model's vocabulary of {vocab_size}")
        if batch_size < 1:
            raise ValueError(f"HFGenerator.batch_size: must be >= 1, got {batch_size}")
        if chunk_tokens < 1:
            raise ValueError(f"HFGenerator.chunk_tokens: must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), device=model.device)
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self.version = 0
        self._targets = dict(targets) if targets is not None else self.model.state_dict()  # a sync copies into them
        self._abandoned = threading.Event()
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache``; a GPU image may hold an older one.
        self._cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def fingerprint(self) -> str:
        """Of the tensors a sync replaces (the whole model, or the adapter), as the model holds them."""
        return fingerprint(self._targets)

    def generate(self, requests: Sequence[SampleRequest], params: SamplingParams) -> list[Rollout]:
        """One Rollout per request, in request order."""
        check_vocabulary(requests, self.vocab_size)
        self._abandoned.clear()
        rollouts: list[Rollout] = []
        for start in range(0, len(requests), self.batch_size):
            rollouts += self._generate_chunk(requests[start : start + self.batch_size], params)
        return rollouts

    def abandon(self) -> None:
        """The decoding loop and the scorer check it at every token and every chunk: a stopping
        run's shutdown does not wait for a batch that takes minutes on a real model. Each call
        clears it as it starts, so it ends only the call in flight."""
        self._abandoned.set()

    def _check_abandoned(self) -> None:
        if self._abandoned.is_set():
            raise Abandoned("generation was abandoned: the run is stopping")

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy every tensor into the model (strictly: same names, same shapes), then set ``version``.

        Names and shapes are checked before anything is copied, so a bad state dict leaves the
        loaded weights and version as they were. The copies go straight into the model's tensors,
        found once: a sync of a small model costs its bytes, not a walk over every module.
        """
        expected = self._targets
        missing = sorted(expected.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - expected.keys())
        if missing or unexpected:
            raise ValueError(
                f"HFGenerator.load_weights: version {version} does not match the model: "
                f"missing tensors {missing}, unexpected tensors {unexpected}"
            )
        for name, tensor in state_dict.items():
            if tensor.shape != expected[name].shape:
                raise ValueError(
                    f"HFGenerator.load_weights: tensor {name} of version {version} has shape {tuple(tensor.shape)}, "
                    f"the model's has {tuple(expected[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in state_dict.items():
                expected[name].copy_(tensor)
        self.version = version

    @torch.inference_mode()
    def score(self, sequences: Sequence[Sequence[int]], params: SamplingParams) -> list[list[float]]:
        """Each token's logprob given the tokens before it (0 for the first), under the sampling
        distribution, in chunks of ``batch_size`` in the order given: a function of the sequences,
        their order and the weights alone. Multi-turn episodes take their logprobs from here,
        since the batches their turns were sampled in depend on when environments answered."""
        distribution = SampledDistribution(params.temperature, params.top_k, params.top_p)
        self._abandoned.clear()
        scores: list[list[float]] = []
        for start in range(0, len(sequences), self.batch_size):
            self._check_abandoned()
            chunk = sequences[start : start + self.batch_size]
            width = max(len(s) for s in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, sequence in enumerate(chunk):
                input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
                attention_mask[row, : len(sequence)] = 1
            device = self.model.device
            logprobs, _ = token_logprobs(
                self.model,
                input_ids.to(device),
                attention_mask.to(device),
                distribution=distribution,
                chunk_tokens=self.chunk_tokens,
            )
            scores += [row[: len(s)] for row, s in zip(logprobs.double().tolist(), chunk)]
        return scores

    @torch.inference_mode()
    def _generate_chunk(self, requests: Sequence[SampleRequest], params: SamplingParams) -> list[Rollout]:
        """Decode until every row has stopped; a stopped row leaves the batch (and the cache) at once."""
        device = self.model.device
        input_ids, attention_mask = self._left_pad(requests, device)
        uniforms = None if params.temperature == 0 else _uniforms(requests, params.max_new_tokens, device)
        rows = len(requests)
        tokens = torch.full((rows, params.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, params.max_new_tokens), dtype=torch.float64, device=device)
        active = torch.arange(rows, device=device)  # the chunk row of each batch row still decoding
        position_ids = position_ids_from_mask(attention_mask)
        next_ids, cache, steps = input_ids, None, 0
        while steps < params.max_new_tokens and len(active):
            self._check_abandoned()
            output = self.model(
                input_ids=next_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_name: cache},
            )
            cache = getattr(output, self._cache_name)
            draws = None if uniforms is None else uniforms[active, steps]
            token, logprob = sample_next(output.logits[:, -1], params.temperature, params.top_k, params.top_p, draws)
            tokens[active, steps] = token
            logprobs[active, steps] = logprob.to(logprobs.dtype)
            steps += 1
            running = ~torch.isin(token, self.stop_token_ids)
            if not bool(running.all()):
                keep = running.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                active, token = active[keep], token[keep]
                attention_mask, position_ids = attention_mask[keep], position_ids[keep]
            next_ids = token[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active), 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1
        return self._rollouts(requests, tokens[:, :steps], logprobs[:, :steps])

    def _left_pad(self, requests: Sequence[SampleRequest], device: torch.device) -> tuple[Tensor, Tensor]:
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):
            input_ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids, dtype=torch.long)
            attention_mask[row, width - len(request.prompt_ids) :] = 1
        return input_ids.to(device), attention_mask.to(device)

    def _rollouts(self, requests: Sequence[SampleRequest], tokens: Tensor, logprobs: Tensor) -> list[Rollout]:
        """Cut each row after its first stop token; one host transfer for the whole chunk."""
        is_stop = torch.isin(tokens, self.stop_token_ids)
        stopped = is_stop.any(dim=1)
        lengths = torch.where(stopped, is_stop.long().argmax(dim=1) + 1, tokens.shape[1])
        token_rows, logprob_rows = tokens.tolist(), logprobs.tolist()
        return [
            Rollout(
                prompt_ids=list(request.prompt_ids),
                response_ids=token_rows[row][:length],
                logprobs=logprob_rows[row][:length],
                finish_reason="stop" if stop else "length",
            )
            for row, (request, length, stop) in enumerate(zip(requests, lengths.tolist(), stopped.tolist()))
        ]


def _uniforms(requests: Sequence[SampleRequest], steps: int, device: torch.device) -> Tensor:
    """``[rows, steps]`` uniforms in [0, 1): row i comes from its own generator seeded with its seed."""
    draws = [torch.rand(steps, generator=torch.Generator().manual_seed(r.seed), dtype=torch.float64) for r in requests]
    return torch.stack(draws).to(device)


def sample_next(
    logits: Tensor, temperature: float, top_k: int, top_p: float, uniforms: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The next token of each row and its logprob (see the module docstring for which distribution).

    ``logits`` is ``[rows, vocab]``; ``uniforms`` is one draw per row, None when greedy. Computed
    in float64 for a float64 model and in float32 otherwise, like ``token_logprobs``.
    """
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if temperature == 0:
        token = logits.argmax(dim=-1)
        return token, _gather(logits, token) - logits.logsumexp(dim=-1)
    logits = SampledDistribution(temperature, top_k, top_p).logits(logits)
    logprobs = logits - logits.logsumexp(dim=-1, keepdim=True)
    cdf = logprobs.exp().cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total mass, so the first cdf entry above the target always exists and
    # belongs to a token of non-zero probability (a zero-probability token does not raise the cdf).
    target = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    token = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return token, _gather(logprobs, token)


def _gather(values: Tensor, index: Tensor) -> Tensor:
    return values.gather(-1, index[:, None]).squeeze(-1)
