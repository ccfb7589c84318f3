import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from asyncrl.models import (
    DEFAULT_ALPHABET,
    build_char_tokenizer,
    build_tiny_model,
    load_model,
    load_tokenizer,
    position_ids_from_mask,
    token_logprobs,
)

SMALL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def random_ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 50, shape, generator=torch.Generator().manual_seed(seed))


def small_model(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides):
    return build_tiny_model(len(build_char_tokenizer()), seed=seed, dtype=dtype, **{**SMALL, **overrides}).eval()


@pytest.mark.parametrize("text", ["12+34=46", "a b", "  What is 3 * (4 - 1)?\nIt is 9. "])
def test_char_tokenizer_round_trips_text_one_token_per_char(text):
    tok = build_char_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_char_tokenizer_special_tokens_and_left_padding():
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    batch = tok(["1+1=", "12+13="], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]
    assert tok.decode(tok.encode("7") + [tok.eos_token_id], skip_special_tokens=True) == "7"
    assert set(tok.encode("é")) == {tok.unk_token_id}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_char_tokenizer_reloads_with_auto_tokenizer_next_to_each_model(tmp_path, arch):
    """transformers picks a tokenizer class by the model type beside it (Qwen2's rebuilds byte-level
    BPE from the vocabulary): saved with either tiny model, it encodes and decodes as built."""
    tok = build_char_tokenizer()
    build_tiny_model(len(tok), seed=0, arch=arch, **SMALL).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in ("x = 3 * 14\n(ok)", "running sum 3 8 5 1:", DEFAULT_ALPHABET, " <eos> a  b\n\n"):
        assert reloaded.encode(text) == tok.encode(text)
        assert reloaded.decode(reloaded.encode(text)) == text
    assert (reloaded.pad_token_id, reloaded.eos_token_id, reloaded.padding_side) == (0, 1, "left")


def test_char_tokenizer_refuses_a_character_that_is_not_one_byte():
    assert build_char_tokenizer("ab\n ").decode(build_char_tokenizer("ab\n ").encode("a b\n")) == "a b\n"
    with pytest.raises(ValueError, match="build_char_tokenizer: 'é' is more than one byte in UTF-8"):
        build_char_tokenizer("abé")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_default_tiny_model_has_1m_to_5m_parameters(arch):
    model = build_tiny_model(len(build_char_tokenizer()), seed=0, arch=arch)
    assert model.config.model_type == arch
    assert 1_000_000 <= model.num_parameters() <= 5_000_000
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tiny_model_init_depends_only_on_seed():
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    a = small_model(seed=7).state_dict()
    assert torch.equal(torch.rand(3), expected_draw), "building a model must not consume the global RNG"
    b = small_model(seed=7).state_dict()
    c = small_model(seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])


def test_tiny_model_runs_in_float64_with_left_padding():
    model = small_model(dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    ids = random_ids(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    logprobs, entropy = token_logprobs(model, ids, mask, with_entropy=True)
    assert logprobs.dtype == entropy.dtype == torch.float64
    assert torch.isfinite(logprobs).all() and torch.isfinite(entropy).all()


def test_load_model_round_trips_a_saved_tiny_model(tmp_path):
    model = small_model(seed=3, dtype=torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path)
    assert loaded.dtype == torch.float32 and not loaded.training
    ids = random_ids(2, 7)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


@pytest.mark.parametrize("loader", [load_model, load_tokenizer])
def test_loaders_reject_a_missing_path_in_one_line(tmp_path, loader):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        loader(missing)
    assert str(missing) in str(err.value) and "\n" not in str(err.value)


def test_load_model_refuses_pickled_weights(tmp_path):
    model = small_model(seed=3, dtype=torch.float32)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="cannot be loaded as a model .*safetensors") as err:
        load_model(tmp_path)
    assert "\n" not in str(err.value)


def test_load_model_rejects_a_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json") as err:
        load_model(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_load_tokenizer_pads_left_and_falls_back_to_eos_as_pad(tmp_path):
    tok = build_char_tokenizer()
    tok.padding_side = "right"
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id
    assert loaded.padding_side == "left"


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]


def test_left_padding_needs_position_ids_from_the_mask():
    """RoPE is relative, so default positions shifted by the padding change only rounding: the
    rotary angles are computed in float32. In float64 that drift is still far beyond the 1e-9
    parity bound, while positions from the mask reproduce the unpadded row."""
    model = build_tiny_model(len(build_char_tokenizer()), seed=0, dtype=torch.float64).eval()
    ids = random_ids(1, 12)
    pads = 64
    padded = torch.cat([torch.zeros(1, pads, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pads, dtype=torch.long), torch.ones_like(ids)], dim=1)

    with torch.no_grad():
        unpadded_lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        padded_lp, _ = token_logprobs(model, padded, mask)
        default_positions_logits = model(input_ids=padded, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(padded_lp[:, pads + 1 :], unpadded_lp[:, 1:], rtol=0, atol=1e-12)

    default_positions_lp = torch.log_softmax(default_positions_logits[:, pads:-1], -1).gather(-1, ids[:, 1:, None])
    assert (default_positions_lp.squeeze(-1) - unpadded_lp[:, 1:]).abs().max() > 1e-9


def test_token_logprobs_and_entropy_match_a_per_prefix_loop():
    model = small_model(seed=1, dtype=torch.float64)
    ids = random_ids(3, 7, seed=1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    logprobs, entropy = token_logprobs(model, ids, mask, with_entropy=True)
    assert torch.all(logprobs[:, 0] == 0) and torch.all(entropy[:, 0] == 0)

    checked = 0
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if not (mask[b, t] and mask[b, t - 1]):
                continue  # the token or its context is padding
            prefix = ids[b, :t][mask[b, :t].bool()][None]
            with torch.no_grad():
                probs = torch.softmax(model(input_ids=prefix).logits[0, -1], -1)
            torch.testing.assert_close(logprobs[b, t], probs[ids[b, t]].log(), rtol=0, atol=1e-12)
            torch.testing.assert_close(entropy[b, t], -(probs * probs.log()).sum(), rtol=0, atol=1e-12)
            checked += 1
    assert checked == 6 + 4 + 3


def test_token_logprobs_are_float32_for_a_float32_model_and_differentiable():
    model = small_model(dtype=torch.float32).train()
    ids = random_ids(2, 5)
    logprobs, entropy = token_logprobs(model, ids, torch.ones_like(ids))
    assert logprobs.dtype == torch.float32 and entropy is None
    logprobs.sum().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_the_example_checkpoint_has_a_released_checkpoints_files(tmp_path, capsys):
    from asyncrl.models.example import END_OF_TURN, main

    main([str(tmp_path)])
    assert json.loads(capsys.readouterr().out)["directory"] == str(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["dtype"]) == ("llama", "bfloat16")
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    tokenizer = load_tokenizer(tmp_path)
    end_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)]
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == end_ids
    assert tokenizer("12+30=")["input_ids"][0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(tokenizer("12+30=", add_special_tokens=False)["input_ids"]) == list("12+30=")
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1="}], add_generation_prompt=True, tokenize=False
    ) == ("<|begin_of_text|><|user|>1+1=<|end_of_turn|><|assistant|>")
    assert len(tokenizer) == load_model(tmp_path).get_input_embeddings().num_embeddings
