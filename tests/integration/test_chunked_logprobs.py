"""Logprobs scored a chunk of tokens at a time equal the whole [B, T, V] logits' scores, with their
gradients, on the tiny model, a LoRA policy with an adapted head and every architecture of
test_architectures.py (Gemma 2's final logit softcapping and GPT-2's learned positions included),
and autograd keeps no [B, T, V] tensor for the backward."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from pydantic import ValidationError
from test_architectures import ARCHITECTURES

from asyncrl.config import LoraConfig, TrainerConfig
from asyncrl.models import SampledDistribution, build_tiny_model, token_logprobs
from asyncrl.models import logprobs as logprobs_module
from asyncrl.models.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    OutputHead,
    chunk_tokens_for,
    logits_logprobs,
    position_ids_from_mask,
)
from asyncrl.models.lora import apply_lora
from asyncrl.tools.verify import verify
from asyncrl.trainer.normalization import AGG_MODES

VOCAB = 40
TRUNCATED = SampledDistribution(temperature=0.7, top_k=12, top_p=0.9)


def rows(vocab: int = VOCAB, width: int = 11, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A full row, a right-padded one and a left-padded one (``left``) or a second right-padded one
    (a query on left padding sees no key: sdpa gives it nan, which reaches every gradient)."""
    ids = torch.randint(1, vocab, (3, width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    if left:
        mask[2, :3] = 0
    else:
        mask[2, -2:] = 0
    return ids, mask


def unchunked(model, ids, mask, distribution, entropy_grad=True):
    """The scores of the whole logits tensor: the model's own forward, then ``logits_logprobs``."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logprobs, entropy = logits_logprobs(
        logits[:, :-1], ids[:, 1:], with_entropy=True, entropy_grad=entropy_grad, distribution=distribution
    )
    return F.pad(logprobs, (1, 0)), F.pad(entropy, (1, 0))


def scored(model, mask, score):
    """(logprobs, entropy, every parameter's gradient) of a loss that uses both, on real tokens:
    values at padding are meaningless (callers mask them)."""
    model.zero_grad()
    logprobs, entropy = (x * mask for x in score())
    (logprobs.sum() + 0.3 * entropy.sum()).backward()
    return [logprobs.detach(), entropy.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]


def chunked(model, ids, mask, distribution, chunk, entropy_grad=True):
    return lambda: token_logprobs(
        model, ids, mask, with_entropy=True, entropy_grad=entropy_grad, distribution=distribution, chunk_tokens=chunk
    )


def assert_same(expected, actual, atol=1e-12):
    for want, got in zip(expected, actual, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=atol)


def tiny():
    return build_tiny_model(VOCAB, seed=0, dtype=torch.float64, hidden_size=32, num_layers=2, num_heads=4)


def lora_model():
    """A LoRA policy whose head is adapted too, with random B: the head is a peft layer."""
    settings = LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])
    return apply_lora(tiny(), settings, torch.float64, seed=1, random_b=True)


@pytest.mark.slow
@pytest.mark.parametrize("build", [tiny, lora_model], ids=["tied", "lora"])
@pytest.mark.parametrize("distribution", [SampledDistribution(), TRUNCATED], ids=["plain", "truncated"])
def test_chunked_scores_and_gradients_equal_the_whole_logits(build, distribution):
    model = build()
    ids, mask = rows()
    expected = scored(model, mask, lambda: unchunked(model, ids, mask, distribution))
    for chunk in (1, 4, 7, ids.numel(), 1000):  # 4 and 7 do not divide the 33 tokens
        assert_same(expected, scored(model, mask, chunked(model, ids, mask, distribution, chunk)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_scores_in_chunks_as_its_own_logits(name):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES[name](), dtype=torch.float64).eval()
    ids, mask = rows(model.config.vocab_size, width=13, left=False)
    expected = scored(model, mask, lambda: unchunked(model, ids, mask, TRUNCATED))
    for chunk in (5, 13, 1000):  # 5 does not divide the 39 tokens
        assert_same(expected, scored(model, mask, chunked(model, ids, mask, TRUNCATED, chunk)))


def test_an_entropy_without_gradient_is_exact_and_adds_no_gradient():
    model = tiny()
    ids, mask = rows()
    expected = scored(model, mask, lambda: unchunked(model, ids, mask, TRUNCATED, entropy_grad=False))
    assert_same(expected, scored(model, mask, chunked(model, ids, mask, TRUNCATED, 5, entropy_grad=False)))


def test_a_chunk_seam_off_by_one_is_caught(monkeypatch):
    """The planted twin: each chunk's targets taken one token late must not pass the check above."""
    model = tiny()
    ids, mask = rows()
    expected = scored(model, mask, lambda: unchunked(model, ids, mask, TRUNCATED))

    def one_late(hidden, targets, start, stop):
        return hidden[start:stop], F.pad(targets[start + 1 : stop + 1], (0, 1))[: stop - start]

    monkeypatch.setattr(logprobs_module, "chunk_inputs", one_late)
    actual = scored(model, mask, chunked(model, ids, mask, TRUNCATED, 7))
    with pytest.raises(AssertionError):
        assert_same(expected, actual)


def saved_bytes(model, score) -> int:
    """Bytes of the activations autograd keeps for the backward (parameters and their views
    excluded, each storage counted once)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in parameters:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        score()
    return sum(storages.values())


def test_the_backward_keeps_no_batch_by_tokens_by_vocabulary_tensor():
    vocab = 8192
    model = build_tiny_model(vocab, seed=0, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
    ids, mask = rows(vocab, width=64)
    logits_bytes = ids.numel() * vocab * 4  # one [B, T, V] float32 tensor
    whole = saved_bytes(model, lambda: unchunked(model, ids, mask, TRUNCATED))
    chunked = saved_bytes(
        model,
        lambda: token_logprobs(model, ids, mask, with_entropy=True, distribution=TRUNCATED, chunk_tokens=32),
    )
    assert whole > 2 * logits_bytes  # the measurement sees the whole logits when they are kept
    assert chunked < logits_bytes / 4


def test_a_head_the_chunks_cannot_reproduce_is_refused():
    model = build_tiny_model(VOCAB, seed=0, hidden_size=32, num_layers=2, num_heads=4)
    OutputHead(model).check(model)  # the plain head is what the model computes
    model.config.final_logit_softcapping = 0.5  # the chunks would softcap; this model's forward does not
    with pytest.raises(ValueError, match="its logits are not its output head"):
        OutputHead(model).check(model)


def test_the_chunk_defaults_to_auto_which_is_small_on_the_cpu_and_larger_on_a_gpu():
    assert TrainerConfig().logprob_chunk_tokens == "auto"
    assert chunk_tokens_for("auto", torch.device("cpu")) == DEFAULT_CHUNK_TOKENS == 128
    assert chunk_tokens_for("auto", torch.device("cuda")) == 1024
    assert chunk_tokens_for(7, torch.device("cuda")) == 7
    with pytest.raises(ValidationError, match="logprob_chunk_tokens"):
        TrainerConfig(logprob_chunk_tokens="big")


@pytest.mark.slow
def test_verify_s_planted_chunk_seam_fails_every_mode_and_leaves_the_scoring_as_it_was():
    for r in verify(AGG_MODES, micro_batches=4, dtype="float64", plant="chunk-seam"):
        assert not r.passed and r.worst_error[0] > 1e-3, r.mode
    assert logprobs_module.chunk_inputs.__name__ == "chunk_inputs"
