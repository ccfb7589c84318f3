"""Building tokenizer, model and trainer from a run config."""

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.models import build_model, build_tokenizer, resolve_device
from asyncrl.trainer import PolicyTrainer


def test_default_config_builds_the_tiny_model_with_the_char_tokenizer():
    config = load_config()
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)
    assert 300_000 <= sum(p.numel() for p in model.parameters()) <= 1_000_000
    assert next(model.parameters()).dtype == torch.float32


def test_model_section_and_dtype_are_honoured():
    config = load_config(None, ["model.arch=llama", "model.num_layers=2", "trainer.dtype=float64", "model.init_seed=3"])
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 2
    assert next(model.parameters()).dtype == torch.float64
    again = build_model(config, tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_local_model_path_loads_model_and_its_tokenizer(tmp_path):
    config = load_config(None, ["model.num_layers=1"])
    tokenizer = build_tokenizer(config)
    build_model(config, tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded_config = load_config(None, [f"model.path={tmp_path}"])
    loaded_tokenizer = build_tokenizer(loaded_config)
    assert loaded_tokenizer("12+3=").input_ids == tokenizer("12+3=").input_ids
    assert build_model(loaded_config, loaded_tokenizer).config.num_hidden_layers == 1


def test_tokenizer_larger_than_the_model_vocabulary_is_rejected(tmp_path):
    from asyncrl.models import build_char_tokenizer

    build_char_tokenizer(alphabet="0123456789 ").save_pretrained(tmp_path / "digits")
    config = load_config(None, ["model.num_layers=1", f"tokenizer.path={tmp_path / 'digits'}"])
    build_model(config, build_tokenizer(config)).save_pretrained(tmp_path / "model")
    build_char_tokenizer().save_pretrained(tmp_path / "chars")  # the default alphabet: more tokens
    bad = load_config(None, [f"model.path={tmp_path / 'model'}", f"tokenizer.path={tmp_path / 'chars'}"])
    with pytest.raises(ValueError, match="^tokenizer.path: "):
        build_model(bad, build_tokenizer(bad))


def test_device_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^trainer.device: "):
            resolve_device("cuda")


def test_trainer_from_config_wires_loss_schedule_and_reference():
    config = load_config(
        None, ["model.num_layers=1", "algorithm.options.kl_coef=0.1", "sampler.max_lag=0", "step.max_steps=7"]
    )
    model = build_model(config, build_tokenizer(config))
    trainer = PolicyTrainer.from_config(config, model)
    assert trainer.algorithm.options.kl_coef == 0.1 and trainer.algorithm.importance_sampling == "none"
    assert trainer.reference_model is not None and trainer.reference_model is not model
    assert not any(p.requires_grad for p in trainer.reference_model.parameters())
    assert PolicyTrainer.from_config(load_config(None, ["model.num_layers=1"]), model).reference_model is None
