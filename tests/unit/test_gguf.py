"""A GGUF file (a tiny one written here) becomes a float32 model directory that a run loads, with
the GGUF model's logits, its tokenizer, chat template and end token; a damaged, foreign or
missing file, an architecture transformers cannot read and a missing gguf package are errors
naming the file or the package, and leave no directory behind."""

import json
import sys

import pytest
import torch
from tiny_gguf import CHATML, TOKENS, write_tiny_llama
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from asyncrl.models import build_model, build_tokenizer, stop_token_ids
from asyncrl.pretrained.gguf import GGUFError, check_file, convert, require_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_converted_directory_loads_as_a_run_loads_it_with_the_gguf_models_logits(tiny_gguf, tmp_path):
    lines = []
    out_dir = tmp_path / "models" / "tiny"
    assert convert(tiny_gguf, out_dir, {"file": str(tiny_gguf)}, lines.append) == 0.0
    assert "max abs diff 0" in lines[-1]
    assert "quantization_config" not in json.loads((out_dir / "config.json").read_text())
    source = json.loads((out_dir / "asyncrl-source.json").read_text())
    assert source == {"file": str(tiny_gguf), "quantization": "ALL_F32", "max_abs_logit_diff": 0.0}
    assert [p.name for p in out_dir.parent.iterdir()] == ["tiny"]  # no staging directory left

    config = load_config(None, [f"model.path={out_dir}", "trainer.dtype=float32"])
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    assert len(tokenizer) == len(TOKENS) and tokenizer.chat_template == CHATML
    assert stop_token_ids(tokenizer, out_dir) == [TOKENS.index("<|im_end|>")]
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "the cat"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_damaged_foreign_or_missing_file_is_an_error_naming_it(tiny_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:-1000])
    foreign = tmp_path / "notes.gguf"
    foreign.write_text("not a model\n")
    for path, message in [
        (truncated, "not a readable GGUF file"),
        (foreign, "not a readable GGUF file (ValueError: GGUF magic invalid)"),
        (tmp_path / "missing.gguf", "no such file"),
    ]:
        with pytest.raises(GGUFError, match="^" + str(path) + ": ") as err:
            check_file(path)
        assert message in str(err.value) and "\n" not in str(err.value)


def test_an_architecture_transformers_cannot_read_leaves_no_directory(tmp_path):
    unsupported = write_tiny_llama(tmp_path / "rwkv.gguf", architecture="rwkv6")
    assert check_file(unsupported) == "ALL_F32"  # a sound file, of an architecture the loader lacks
    with pytest.raises(GGUFError, match=f"^{unsupported}: transformers cannot load it .*rwkv6"):
        convert(unsupported, tmp_path / "models" / "rwkv", {}, print)
    assert list((tmp_path / "models").iterdir()) == []


def test_without_the_gguf_package_the_error_says_what_to_install(tiny_gguf, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    for check in (require_gguf, lambda: check_file(tiny_gguf)):
        with pytest.raises(GGUFError, match=r"needs the gguf package: pip install asyncrl\[gguf\]$"):
            check()


def test_logits_that_differ_fail_the_conversion_and_leave_no_directory(tiny_gguf, tmp_path, monkeypatch):
    import asyncrl.pretrained.gguf

    monkeypatch.setattr(asyncrl.pretrained.gguf, "_logit_diff", lambda *args: 0.5)
    with pytest.raises(GGUFError, match=f"^{tiny_gguf}: the converted model's logits differ by 0.5"):
        convert(tiny_gguf, tmp_path / "models" / "tiny", {}, print)
    assert list((tmp_path / "models").iterdir()) == []
