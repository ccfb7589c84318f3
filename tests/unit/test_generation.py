import hashlib
import inspect
import json
import math
from types import SimpleNamespace

import pytest
import torch

from asyncrl.config import BackendConfig, GenerationConfig, load_config
from asyncrl.generation import Generator, HFGenerator, SampleRequest, SamplingParams, build_generator, sample_seed
from asyncrl.generation.hf import sample_next
from asyncrl.models import (
    build_char_tokenizer,
    build_tiny_model,
    load_model,
    load_tokenizer,
    stop_token_ids,
    token_logprobs,
)
from asyncrl.models.example import END_OF_TURN, write_example_checkpoint
from asyncrl.models.logprobs import truncated

TOKENIZER = build_char_tokenizer()
SMALL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
PROMPTS = ["1+1=", "12+30=", "7*8=", "(3+4)*2=", "9-5=", "100/4=", "2*3*4="]


def small_model(seed: int = 0, dtype: torch.dtype = torch.float32):
    return build_tiny_model(len(TOKENIZER), seed=seed, dtype=dtype, **SMALL)


def generator(seed: int = 0, *, dtype: torch.dtype = torch.float32, batch_size: int = 64, eos: int | None = None):
    eos = TOKENIZER.eos_token_id if eos is None else eos
    model = small_model(seed, dtype)
    return HFGenerator(model, stop_token_ids=[eos], pad_token_id=TOKENIZER.pad_token_id, batch_size=batch_size)


def requests(prompts=PROMPTS, samples: int = 2, run_seed: int = 0) -> list[SampleRequest]:
    return [SampleRequest(TOKENIZER.encode(p), sample_seed(run_seed, p, i)) for p in prompts for i in range(samples)]


def assert_same_samples(actual, expected, atol: float = 1e-5):
    assert [r.response_ids for r in actual] == [r.response_ids for r in expected]
    assert [r.finish_reason for r in actual] == [r.finish_reason for r in expected]
    for a, e in zip(actual, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(e.logprobs), rtol=0, atol=atol)


def trainer_logits(model, rollout) -> torch.Tensor:
    """Unmodified logits predicting each response token, from one full forward."""
    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(rollout.prompt_ids) - 1 : -1].to(torch.float64)


# --- seeds and parameters ---------------------------------------------------------------------


def test_sample_seed_is_a_fixed_hash_of_its_arguments():
    expected = int.from_bytes(hashlib.sha256(b"7:3:prompt-42").digest()[:8], "little") >> 1
    assert sample_seed(7, "prompt-42", 3) == expected == 2540106890583816718  # pinned: resumed runs rely on it
    seeds = {sample_seed(r, uid, i) for r in (0, 1) for uid in ("a", "b", "1:0") for i in (0, 1)}
    assert len(seeds) == 12
    assert all(0 <= s < 2**63 for s in seeds)
    torch.Generator().manual_seed(max(seeds))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(max_new_tokens=4, temperature=-0.1), "temperature"),
        (dict(max_new_tokens=4, temperature=math.nan), "temperature"),
        (dict(max_new_tokens=4, temperature=math.inf), "temperature"),
        (dict(max_new_tokens=4, top_p=0.0), "top_p"),
        (dict(max_new_tokens=4, top_p=1.5), "top_p"),
        (dict(max_new_tokens=4, top_k=-1), "top_k"),
        (dict(max_new_tokens=4, top_k=True), "top_k"),
    ],
)
def test_sampling_params_reject_nonsense(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}: "):
        SamplingParams(**kwargs)


def test_sampling_params_from_config_and_greedy():
    params = SamplingParams.from_config(GenerationConfig(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=5))
    assert params == SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=5)
    assert params.greedy() == SamplingParams(max_new_tokens=9, temperature=0.0, top_p=0.9, top_k=5)


@pytest.mark.parametrize("prompt_ids, seed, field", [([], 0, "prompt_ids"), ([3], -1, "seed"), ([3], 2**63, "seed")])
def test_sample_request_rejects_nonsense(prompt_ids, seed, field):
    with pytest.raises(ValueError, match=rf"^SampleRequest\.{field}: "):
        SampleRequest(prompt_ids, seed)


def test_generate_rejects_token_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"^SampleRequest\.prompt_ids: request 1 has a token id outside .* of 82"):
        generator().generate([SampleRequest([3], 0), SampleRequest([3, 82], 0)], SamplingParams(max_new_tokens=2))


# --- the sampling step ------------------------------------------------------------------------


def test_inverse_cdf_picks_the_token_whose_mass_holds_the_uniform():
    logits = torch.tensor([0.1, 0.0, 0.2, 0.7]).log().expand(6, 4)  # token 1 has zero probability
    uniforms = torch.tensor([0.0, 0.05, 0.1, 0.25, 0.31, 1 - 1e-12], dtype=torch.float64)
    tokens, logprobs = sample_next(logits, 1.0, 0, 1.0, uniforms)
    assert tokens.tolist() == [0, 0, 2, 2, 3, 3]
    assert torch.isfinite(logprobs).all()
    torch.testing.assert_close(logprobs.exp(), torch.tensor([0.1, 0.1, 0.2, 0.2, 0.7, 0.7]))


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = torch.randn(10, generator=torch.Generator().manual_seed(0)) * 2
    temperature, top_k = 0.7, 6
    uniforms = torch.rand(40_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens, logprobs = sample_next(logits.expand(len(uniforms), -1), temperature, top_k, 1.0, uniforms)
    kept = logits.topk(top_k).indices
    expected = torch.zeros(10)
    expected[kept] = (logits[kept] / temperature).softmax(-1)
    frequencies = torch.bincount(tokens, minlength=10) / len(tokens)
    assert (frequencies - expected).abs().max() < 0.01
    torch.testing.assert_close(logprobs.exp(), expected[tokens])


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    uniforms = torch.linspace(0, 1 - 1e-9, 101, dtype=torch.float64)
    tokens, logprobs = sample_next(probs.log().expand(101, -1), 1.0, 0, 0.75, uniforms)
    assert set(tokens.tolist()) == {1, 3}  # 0.5 < 0.75 <= 0.5 + 0.3
    torch.testing.assert_close(logprobs.exp(), probs[tokens] / 0.8)
    tokens, logprobs = sample_next(probs.log().expand(101, -1), 1.0, 0, 1e-6, uniforms)
    assert set(tokens.tolist()) == {1} and logprobs.abs().max() == 0


def test_truncation_is_vllms_rule_ties_and_order_included():
    """Top-k keeps ties with the k-th; top-p then acts on the top-k distribution, dropping tokens
    in ascending order while their cumulative mass is at most 1 - top_p (a tie at that boundary:
    the lower token id goes first), and always keeps the most likely token."""
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert truncated(logits, 1, 1.0).tolist() == [True, False, False, True]
    probs = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    assert truncated(probs.log(), 0, 0.75).tolist() == [True, False, False]
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    # renormalized over the top 3, the third holds 0.222 <= 0.25; over all four it would be kept
    assert truncated(probs.log(), 3, 0.75).tolist() == [False, False, True, True]
    assert truncated(probs.log(), 0, 0.75).tolist() == [False, False, False, True]
    assert truncated(probs.log(), 0, 1e-9).tolist() == [False, True, True, True]


def test_greedy_returns_the_argmax_and_its_unmodified_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, -1.0, 0.0, 0.5]])
    tokens, logprobs = sample_next(logits, 0.0, 2, 0.5, None)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])


# --- generation -------------------------------------------------------------------------------


def test_hf_generator_satisfies_the_protocol_and_returns_one_rollout_per_request_in_order():
    gen = generator()
    assert isinstance(gen, Generator) and gen.version == 0
    reqs = requests()
    rollouts = gen.generate(reqs, SamplingParams(max_new_tokens=6))
    assert [r.prompt_ids for r in rollouts] == [r.prompt_ids for r in reqs]
    assert gen.generate([], SamplingParams(max_new_tokens=6)) == []
    for r in rollouts:
        eos_at = [i for i, t in enumerate(r.response_ids) if t == TOKENIZER.eos_token_id]
        if r.finish_reason == "stop":
            assert eos_at == [len(r.response_ids) - 1]
        else:
            assert r.finish_reason == "length" and not eos_at and len(r.response_ids) == 6
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.logprobs)


def test_a_request_samples_the_same_alone_at_any_position_and_with_any_neighbours():
    gen = generator(batch_size=64)
    params = SamplingParams(max_new_tokens=8)
    reqs = requests()
    together = gen.generate(reqs, params)
    alone = [gen.generate([r], params)[0] for r in reqs]
    assert_same_samples(together, alone)
    reversed_order = gen.generate(reqs[::-1], params)[::-1]
    assert_same_samples(reversed_order, together)
    other_neighbours = gen.generate([reqs[3]] + requests(["55555555555+1=", "?"], run_seed=9), params)[0]
    assert_same_samples([other_neighbours], [together[3]])
    assert len({tuple(r.response_ids) for r in together}) == len(together)  # the seeds do differ


def test_the_same_batch_twice_is_bit_identical_and_leaves_the_global_rng_alone():
    gen = generator()
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=20)
    torch.manual_seed(123)
    rng_state = torch.get_rng_state()
    first = gen.generate(requests(), params)
    assert torch.equal(torch.get_rng_state(), rng_state)
    second = gen.generate(requests(), params)
    assert_same_samples(second, first, atol=0)


def test_chunks_of_batch_size_give_the_same_samples_as_one_batch():
    params = SamplingParams(max_new_tokens=8)
    reqs = requests()
    assert_same_samples(generator(batch_size=3).generate(reqs, params), generator(batch_size=64).generate(reqs, params))


def test_chunks_run_in_order_of_at_most_batch_size_rows():
    gen = generator(batch_size=3)
    prefill_rows = []
    gen.model.register_forward_pre_hook(
        lambda _, args, kwargs: (
            prefill_rows.append(kwargs["input_ids"].shape[0])
            if kwargs["input_ids"].shape[1] > 1  # the prefill: later forwards take one token per row
            else None
        ),
        with_kwargs=True,
    )
    gen.generate(requests(samples=1), SamplingParams(max_new_tokens=2))
    assert prefill_rows == [3, 3, 1]


@pytest.mark.skipif(
    "cache" not in inspect.signature(type(small_model()).forward).parameters,
    reason="this transformers names the KV cache past_key_values itself",
)
def test_a_model_that_names_the_kv_cache_past_key_values_samples_the_same():
    """Before 5.24, transformers passes and returns the KV cache as ``past_key_values``, not ``cache``."""
    base = type(small_model())

    class OlderNames(base):
        def forward(self, *, past_key_values=None, **kwargs):
            output = super().forward(cache=past_key_values, **kwargs)
            return SimpleNamespace(logits=output.logits, past_key_values=output.cache)

    older = generator()
    older.model.__class__ = OlderNames
    older = HFGenerator(older.model, stop_token_ids=older.stop_token_ids.tolist(), pad_token_id=0, batch_size=64)
    params = SamplingParams(max_new_tokens=8, temperature=0.8)
    assert_same_samples(older.generate(requests(), params), generator().generate(requests(), params), atol=0)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_sampled_logprobs_at_temperature_one_equal_the_trainers(dtype, atol):
    gen = generator(dtype=dtype)
    rollouts = gen.generate(requests(), SamplingParams(max_new_tokens=10))
    trainer = small_model(dtype=dtype)
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            expected = token_logprobs(trainer, ids, torch.ones_like(ids))[0][0, len(r.prompt_ids) :]
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=expected.dtype), expected, rtol=0, atol=atol)


def test_logprobs_are_those_of_the_tempered_top_k_distribution():
    gen = generator()
    temperature, top_k = 0.6, 5
    rollouts = gen.generate(requests(), SamplingParams(max_new_tokens=8, temperature=temperature, top_k=top_k))
    for r in rollouts:
        logits = trainer_logits(small_model(), r)
        kept = logits.topk(top_k, dim=-1).indices
        tokens = torch.tensor(r.response_ids)
        assert (kept == tokens[:, None]).any(dim=1).all()
        tempered = logits / temperature
        expected = tempered.gather(1, tokens[:, None])[:, 0] - tempered.gather(1, kept).logsumexp(dim=1)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), expected, rtol=0, atol=1e-5)


def test_greedy_generation_follows_the_argmax_with_unmodified_logprobs():
    gen = generator()
    reqs = requests(samples=2)
    rollouts = gen.generate(reqs, SamplingParams(max_new_tokens=8, temperature=0.0, top_k=3))
    assert [r.response_ids for r in rollouts[0::2]] == [r.response_ids for r in rollouts[1::2]]  # seeds unused
    for r in rollouts:
        logits = trainer_logits(small_model(), r)
        assert r.response_ids == logits.argmax(dim=-1).tolist()
        expected = logits.log_softmax(dim=-1).max(dim=-1).values
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), expected, rtol=0, atol=1e-5)


def unused_token(rollouts) -> int:
    used = {t for r in rollouts for t in r.prompt_ids + r.response_ids}
    return min(set(range(len(TOKENIZER))) - used)


def test_a_row_stops_at_eos_while_the_others_continue():
    params = SamplingParams(max_new_tokens=8)
    reqs = requests(samples=1)
    free = generator(eos=TOKENIZER.unk_token_id).generate(reqs, params)
    free = generator(eos=unused_token(free)).generate(reqs, params)
    assert all(r.finish_reason == "length" for r in free)
    eos = free[0].response_ids[2]
    stopped = generator(eos=eos).generate(reqs, params)
    for before, after in zip(free, stopped):
        cut = before.response_ids.index(eos) + 1 if eos in before.response_ids else len(before.response_ids)
        assert after.response_ids == before.response_ids[:cut]
        assert after.finish_reason == ("stop" if eos in before.response_ids else "length")
        torch.testing.assert_close(after.logprobs, before.logprobs[:cut], rtol=0, atol=1e-5)
    assert stopped[0].finish_reason == "stop" and len(stopped[0].response_ids) <= 3
    assert any(r.finish_reason == "length" for r in stopped)


def test_a_row_stops_at_whichever_of_two_stop_tokens_comes_first():
    params = SamplingParams(max_new_tokens=8)
    reqs = requests(samples=1)
    free = generator(eos=TOKENIZER.unk_token_id).generate(reqs, params)
    free = generator(eos=unused_token(free)).generate(reqs, params)
    first = free[0].response_ids[1]
    second = next(  # a token that ends another row before ``first`` appears in it, and not in row 0's first two
        t
        for r in free[1:]
        for j, t in enumerate(r.response_ids)
        if t not in free[0].response_ids[:2] and first not in r.response_ids[: j + 1]
    )
    model = small_model()
    gen = HFGenerator(model, stop_token_ids=[first, second], pad_token_id=TOKENIZER.pad_token_id, batch_size=64)
    stopped = gen.generate(reqs, params)
    for before, after in zip(free, stopped):
        ends = [j for j, t in enumerate(before.response_ids) if t in (first, second)]
        cut = ends[0] + 1 if ends else len(before.response_ids)
        assert after.response_ids == before.response_ids[:cut]
        assert after.finish_reason == ("stop" if ends else "length")
    assert {r.response_ids[-1] for r in stopped if r.finish_reason == "stop"} == {first, second}


def test_the_decode_loop_ends_once_every_row_has_stopped():
    params = SamplingParams(max_new_tokens=8)
    req = requests(["1+1="], samples=1)
    free = generator(eos=TOKENIZER.unk_token_id).generate(req, params)
    eos = generator(eos=unused_token(free)).generate(req, params)[0].response_ids[1]
    gen = generator(eos=eos)
    forwards = []
    gen.model.register_forward_hook(lambda *_: forwards.append(1))
    rollout = gen.generate(req, params)[0]
    assert rollout.finish_reason == "stop" and len(rollout.response_ids) == len(forwards) <= 2


def test_bfloat16_model_generates_on_its_own_dtype():
    gen = generator(dtype=torch.bfloat16)
    rollouts = gen.generate(requests(), SamplingParams(max_new_tokens=4))
    assert next(gen.model.parameters()).dtype == torch.bfloat16
    assert all(math.isfinite(lp) for r in rollouts for lp in r.logprobs)


# --- weights ----------------------------------------------------------------------------------


def test_loaded_weights_generate_like_a_generator_built_from_them():
    params = SamplingParams(max_new_tokens=8)
    gen = generator(seed=0)
    before = gen.generate(requests(), params)
    gen.load_weights(small_model(seed=1).state_dict(), version=3)
    assert gen.version == 3
    after = gen.generate(requests(), params)
    assert [r.response_ids for r in after] != [r.response_ids for r in before]
    assert_same_samples(after, generator(seed=1).generate(requests(), params), atol=0)


def test_load_weights_casts_to_the_generators_dtype():
    gen = generator(dtype=torch.bfloat16)
    weights = small_model(seed=1, dtype=torch.float32).state_dict()
    gen.load_weights(weights, version=1)
    assert all(p.dtype == torch.bfloat16 for p in gen.model.parameters())
    # against a cast, not a model built in bfloat16: before torch 2.12 a CPU bfloat16 init draws other values
    assert all(torch.equal(t, weights[name].bfloat16()) for name, t in gen.model.state_dict().items())


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda sd: sd.pop("model.norm.weight"), r"missing tensors \['model\.norm\.weight'\]"),
        (lambda sd: sd.update(extra=torch.zeros(1)), r"unexpected tensors \['extra'\]"),
        (
            lambda sd: sd.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3)}),
            r"tensor model\.layers\.1\.mlp\.up_proj\.weight of version 5 has shape \(3, 3\)",
        ),
    ],
)
def test_load_weights_rejects_a_mismatched_state_dict_and_keeps_the_old_weights(corrupt, message):
    gen = generator(seed=0)
    state = small_model(seed=1).state_dict()
    corrupt(state)
    with pytest.raises(ValueError, match=r"^HFGenerator\.load_weights: .*" + message):
        gen.load_weights(state, version=5)
    assert gen.version == 0
    assert all(torch.equal(t, small_model(seed=0).state_dict()[n]) for n, t in gen.model.state_dict().items())


# --- construction -----------------------------------------------------------------------------


def test_build_generator_uses_the_config_and_the_tokenizers_special_tokens():
    config = load_config(None, ["generation.batch_size=5"])
    gen = build_generator(config, small_model(), TOKENIZER)
    assert isinstance(gen, HFGenerator)
    assert (gen.batch_size, gen.pad_token_id) == (5, TOKENIZER.pad_token_id)
    assert gen.stop_token_ids.tolist() == [TOKENIZER.eos_token_id]


def test_build_generator_stops_on_every_end_token_the_checkpoint_declares(tmp_path):
    write_example_checkpoint(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]
    assert stop_token_ids(tokenizer, tmp_path) == [tokenizer.eos_token_id, end_of_turn]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert stop_token_ids(tokenizer, tmp_path) == [tokenizer.eos_token_id, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_of_turn, 9]}))
    gen = build_generator(load_config(None, [f"model.path={tmp_path}"]), load_model(tmp_path), tokenizer)
    assert gen.stop_token_ids.tolist() == sorted([tokenizer.eos_token_id, end_of_turn, 9])


def test_build_generator_rejects_an_unknown_backend():
    config = load_config(None, [])
    config = config.model_copy(
        update={
            "generation": GenerationConfig.model_construct(
                backend=BackendConfig.model_construct(name="other"), batch_size=4
            )
        }
    )
    with pytest.raises(ValueError, match=r"^generation\.backend\.name: unknown backend 'other'"):
        build_generator(config, small_model(), TOKENIZER)


def test_build_generator_needs_an_eos_token():
    tokenizer = build_char_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match=r"^tokenizer\.path: the tokenizer has no eos token"):
        build_generator(load_config(None, []), small_model(), tokenizer)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stop_token_ids=[1, 500], pad_token_id=0, batch_size=4), r"^HFGenerator\.stop_token_ids: 500 is outside"),
        (dict(stop_token_ids=[], pad_token_id=0, batch_size=4), r"^HFGenerator\.stop_token_ids: at least one"),
        (dict(stop_token_ids=[1], pad_token_id=-1, batch_size=4), r"^HFGenerator\.pad_token_id: -1 is outside"),
        (dict(stop_token_ids=[1], pad_token_id=0, batch_size=0), r"^HFGenerator\.batch_size: must be >= 1"),
        (
            dict(stop_token_ids=[1], pad_token_id=0, batch_size=4, chunk_tokens=0),
            r"^HFGenerator\.chunk_tokens: must be",
        ),
    ],
)
def test_hf_generator_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HFGenerator(small_model(), **kwargs)


def test_the_hf_generator_scores_in_the_trainer_s_logprob_chunks(monkeypatch):
    """Episodes are scored with ``trainer.logprob_chunk_tokens``, the memory bound a train step keeps."""
    import asyncrl.generation.hf as hf
    from asyncrl.config import load_config

    config = load_config(None, ["trainer.logprob_chunk_tokens=3", "generation.batch_size=4"])
    built = hf.build_hf_generator(config, small_model(), TOKENIZER, [TOKENIZER.eos_token_id])
    seen = []

    def recording(*args, chunk_tokens, **kwargs):
        seen.append(chunk_tokens)
        return token_logprobs(*args, chunk_tokens=chunk_tokens, **kwargs)

    token_logprobs = hf.token_logprobs
    monkeypatch.setattr(hf, "token_logprobs", recording)
    sequences = [TOKENIZER.encode(p) for p in PROMPTS]
    scored = built.score(sequences, SamplingParams(max_new_tokens=4))
    assert seen and set(seen) == {3}
    whole = generator().score(sequences, SamplingParams(max_new_tokens=4))  # the default chunk: the same numbers
    assert [x for row in scored for x in row] == pytest.approx([x for row in whole for x in row], abs=1e-5)
