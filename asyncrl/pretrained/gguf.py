"""Convert a GGUF file into a float32 safetensors model directory that ``model.path`` loads.

transformers reads a GGUF file, dequantizing every tensor to float32, but refuses to save a model
it loaded from one (it counts as quantized). So the weights move into a model built from the same
config without its ``quantization_config``, which saves like any other, next to the tokenizer,
chat template and generation config the file describes. The copy is checked, not trusted: the
saved directory, loaded back as a run loads it, must give the GGUF model's logits on a probe.
The directory appears whole or not at all: it is written beside its destination, then renamed.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

PROBE = "The capital of France is"
TOLERANCE = 1e-4  # max abs logit difference; the same float32 weights give the same logits
SOURCE_FILE = "asyncrl-source.json"  # where the weights came from, written into the directory
INSTALL_HINT = "pip install asyncrl[gguf]"


class GGUFError(ValueError):
    """A GGUF file that cannot be converted, or the package to read it is missing; names which."""


def require_gguf() -> None:
    """Fail in one line, before any download, when the ``gguf`` package is not installed."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GGUFError(f"reading a GGUF file needs the gguf package: {INSTALL_HINT}") from None


def check_file(path: Path) -> str:
    """``path``'s quantization (e.g. ``MOSTLY_Q4_1``), once its header and every tensor's bytes
    are there: a damaged, truncated or foreign file fails here, naming itself."""
    require_gguf()
    from gguf import GGUFReader, LlamaFileType

    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    try:
        reader = GGUFReader(path)
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
        field = reader.fields.get("general.file_type")
        kind = "unknown" if field is None else LlamaFileType(int(field.parts[-1][0])).name
    except Exception as err:  # the reader fails a damaged file with many error types
        raise GGUFError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
    if not reader.tensors or end > path.stat().st_size:
        raise GGUFError(f"{path}: not a complete GGUF file (its tensors need {end} bytes)")
    return kind


def convert(gguf_file: Path, out_dir: Path, source: dict, log: Callable[[str], object]) -> float:
    """Write ``gguf_file`` as a model directory at ``out_dir``; return the checked max abs logit
    difference. ``source`` (where the file came from) is recorded in the directory."""
    kind = check_file(gguf_file)
    log(f"converting {gguf_file.name} ({kind}) to float32")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        staged = staging / "model"
        model, tokenizer = _load_gguf(gguf_file)
        _save(model, tokenizer, staged)
        diff = _logit_diff(model, tokenizer, staged)
        log(f"saved model's logits vs the GGUF model's on {PROBE!r}: max abs diff {diff:.3g}")
        if not diff <= TOLERANCE:
            raise GGUFError(f"{gguf_file}: the converted model's logits differ by {diff:.3g} (> {TOLERANCE:g})")
        record = {**source, "quantization": kind, "max_abs_logit_diff": diff}
        (staged / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        _publish(staged, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return diff


def _load_gguf(gguf_file: Path):
    """(model, tokenizer) as transformers reads them from the file, the model dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"pretrained_model_name_or_path": gguf_file.parent, "gguf_file": gguf_file.name, "local_files_only": True}
    try:
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except Exception as err:  # an unsupported architecture or tokenizer, or a bad field
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise GGUFError(f"{gguf_file}: transformers cannot load it ({type(err).__name__}: {first})") from None
    return model.eval(), tokenizer


def _save(model, tokenizer, directory: Path) -> None:
    """The weights in a model built from ``model``'s config less its quantization, saved with the
    tokenizer (and its chat template) and the generation config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = copy.deepcopy(model.generation_config)
    plain.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _logit_diff(model, tokenizer, directory: Path) -> float:
    """Max abs difference of the probe's logits: the GGUF model against ``directory`` loaded by
    ``load_model``, the loader a run uses."""
    import torch

    from asyncrl.models.hf import load_model

    saved = load_model(directory, dtype=torch.float32)
    ids = tokenizer(PROBE, return_tensors="pt").input_ids
    with torch.no_grad():
        return (model(ids).logits - saved(ids).logits).abs().max().item()


def _publish(staged: Path, out_dir: Path) -> None:
    """Rename into place; a directory another conversion published first is kept."""
    try:
        os.rename(staged, out_dir)
    except OSError:
        if not (out_dir / SOURCE_FILE).is_file():
            raise
