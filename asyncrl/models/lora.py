"""LoRA adapters over a frozen base, built with peft (``lora`` section, docs/lora.md).

The base keeps the dtype it is given (the run's ``trainer.dtype``) and gets no gradient; peft
adds low-rank A and B matrices to the named projections, in float32 over a bfloat16 or float32
base and in float64 over a float64 one, so the trainable parameters and their AdamW state are
full-precision masters.

Adapters travel under PEFT's own names (``get_peft_model_state_dict``: no adapter name in them),
the names ``adapter_model.safetensors`` holds, so the same dict is a weight sync, a checkpoint and
what an inference server loads. ``adapter_tensors`` returns them as views of the model's own
tensors: a generator copies a sync straight into them.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from torch import Tensor, nn

from asyncrl.checkpoint import ADAPTER_WEIGHTS_FILE, LORA_BASE_FILE, CheckpointError

PEFT_PREFIX = "base_model.model."


class LoraSettings(Protocol):
    """What the ``lora`` config section provides."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]


def peft_config(settings: LoraSettings, *, random_b: bool = False) -> LoraConfig:
    """peft's LoraConfig for ``settings``. B starts at zero, so the wrapped model starts as the base;
    ``random_b`` draws it at random instead (a check whose adapter must already move the output)."""
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        init_lora_weights=not random_b,
        task_type="CAUSAL_LM",
    )


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Every target names a linear layer of ``model``; otherwise one line naming the ones it has."""
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    for target in targets:
        if target not in linear:
            raise ValueError(
                f"lora.target_modules: '{target}' is not a linear layer of the model (it has {', '.join(linear)})"
            )


def apply_lora(
    model: nn.Module, settings: LoraSettings, dtype: torch.dtype, *, seed: int | None = None, random_b: bool = False
) -> PeftModel:
    """``model`` (changed in place) as a PeftModel: its base cast to ``dtype`` and frozen, adapters
    trainable in float32, or float64 over a float64 base. The A matrices are drawn from ``seed``
    on a forked RNG, so they do not depend on what used the global RNG before; without a seed,
    from the global RNG."""
    check_targets(model, settings.target_modules)
    model.to(dtype)
    with _peft_quietly(), _seeded_rng(seed, next(model.parameters()).device):
        return get_peft_model(model, peft_config(settings, random_b=random_b), autocast_adapter_dtype=True)


@contextlib.contextmanager
def _peft_quietly() -> Iterator[None]:
    """peft reads a transformers attribute deprecated in 5.x; its warning is no user's to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def adapter_seed(run_seed: int, init_seed: int) -> int:
    """The seed of a run's initial adapters: the same on every runtime and in every process."""
    digest = hashlib.sha256(f"lora-init:{int(run_seed)}:{int(init_seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def _seeded_rng(seed: int | None, device: torch.device) -> Iterator[None]:
    """The CPU RNG (and ``device``'s, on CUDA) seeded with ``seed`` inside the block and restored after."""
    if seed is None:
        yield
        return
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for gpu in cuda:
            with torch.cuda.device(gpu):
                torch.cuda.manual_seed(seed)
        yield


def generator_copy(model: nn.Module, lora_rank: int, dtype: torch.dtype) -> nn.Module:
    """What an in-process generator gets of the trainer's ``model``, before the trainer wraps it.
    Full fine-tuning (``lora_rank`` 0): a copy of its own. LoRA: its own modules and buffers (peft
    wraps its layers, it gets its own adapter slot) over ``model``'s own parameter tensors, cast
    to ``dtype`` (``trainer.dtype``, the base's) in place first: the base is frozen in the trainer
    and the generator alike and a sync copies into the adapter alone, so one base in memory
    serves both."""
    if lora_rank == 0:
        return copy.deepcopy(model)
    model.to(dtype)
    shared = {id(p): nn.Parameter(p.detach(), requires_grad=False) for p in model.parameters()}
    return copy.deepcopy(model, memo=shared)


def adapter_tensors(model: nn.Module, state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The adapter's tensors of ``model`` (a PeftModel), under PEFT's names. ``state``: the model's
    state dict to take them from (a wrapped model's sharded one), else ``model.state_dict()``."""
    return get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=False)


def model_names(model: nn.Module) -> dict[str, str]:
    """PEFT's name of each adapter tensor -> its name in ``model.state_dict()``."""
    state = model.state_dict()
    by_identity = {id(tensor): name for name, tensor in state.items()}
    return {peft_name: by_identity[id(tensor)] for peft_name, tensor in adapter_tensors(model, state).items()}


def is_lora(model: nn.Module) -> bool:
    return isinstance(model, PeftModel)


@contextlib.contextmanager
def adapter_dropout(model: nn.Module) -> Iterator[None]:
    """LoRA's dropout active inside the block, on a model kept in eval mode: the loss forward
    drops adapter inputs (``lora.dropout``); every other score runs without it."""
    dropouts = [m for name, m in model.named_modules() if ".lora_dropout." in f".{name}." and m is not None]
    for module in dropouts:
        module.train()
    try:
        yield
    finally:
        for module in dropouts:
            module.eval()


def base_sha256(state: Mapping[str, Tensor]) -> str:
    """SHA-256 of the base's tensors in ``state``: a PeftModel's (adapters left out, PEFT's wrapping
    taken off the names) or the plain base's, so both give the same digest for the same base."""
    digest = hashlib.sha256()
    names = {name.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."): name for name in state if "lora_" not in name}
    for plain in sorted(names):
        tensor = state[names[plain]].detach().cpu().contiguous()
        digest.update(f"{plain} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


_BASE_DIGESTS: weakref.WeakKeyDictionary[nn.Module, tuple[list, str]] = weakref.WeakKeyDictionary()


def frozen_base_sha256(model: nn.Module, state: Mapping[str, Tensor]) -> str:
    """``base_sha256(state)`` of ``model``'s base, hashed once per model: it is reused while the
    model's frozen parameters are the same objects, none written to since (``Tensor._version``).
    Hashing a 0.5B float32 base takes seconds, and a LoRA run saves it at every checkpoint."""
    frozen = [(weakref.ref(p), p._version) for p in model.parameters() if not p.requires_grad]
    cached = _BASE_DIGESTS.get(model)
    if cached is not None and len(cached[0]) == len(frozen):
        if all(
            old() is new() and old_version == version for (old, old_version), (new, version) in zip(cached[0], frozen)
        ):
            return cached[1]
    digest = base_sha256(state)
    _BASE_DIGESTS[model] = (frozen, digest)
    return digest


def save_adapter(model: PeftModel, directory: Path, state: Mapping[str, Tensor]) -> None:
    """The adapter in PEFT's format (``PeftModel.from_pretrained`` loads it) and ``lora_base.json``:
    the base it applies to (its class, config and weights' SHA-256), which is not saved."""
    # the adapter alone, as adapter_tensors names it: peft's default ("auto") would add an
    # adapted lm_head's whole base weight, which read_adapter then refuses on resume
    model.save_pretrained(directory, state_dict=dict(state), safe_serialization=True, save_embedding_layers=False)
    base = model.get_base_model()
    (directory / LORA_BASE_FILE).write_text(
        json.dumps(
            {"sha256": frozen_base_sha256(model, state), "class": type(base).__name__, "config": base.config.to_dict()},
            indent=1,
        )
        + "\n"
    )


def check_base(state: Mapping[str, Tensor], checkpoint_dir: Path) -> None:
    """Refuse an adapter saved over another base than the one in ``state``, in one line."""
    path = Path(checkpoint_dir) / LORA_BASE_FILE
    try:
        saved = json.loads(path.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: missing or damaged, so the base the adapter applies to is unknown") from None
    here = base_sha256(state)
    if here != saved:
        raise CheckpointError(
            f"{path}: the adapter was trained over another base (weights SHA-256 {saved[:12]}, this one's "
            f"{here[:12]}); set model.* and trainer.dtype as in the run that saved it"
        )


def read_adapter(model: nn.Module, checkpoint_dir: Path) -> dict[str, Tensor]:
    """``adapter_model.safetensors`` under ``model``'s state-dict names, each checked against it."""
    path = Path(checkpoint_dir) / ADAPTER_WEIGHTS_FILE
    try:
        saved = load_file(path)
    except Exception as err:
        raise CheckpointError(f"{path}: cannot be read as safetensors ({type(err).__name__})") from None
    names, state = model_names(model), model.state_dict()
    if set(saved) != set(names):
        raise CheckpointError(
            f"{path}: does not fit the configured adapters (missing {sorted(set(names) - set(saved))[:3]}, "
            f"unexpected {sorted(set(saved) - set(names))[:3]}); set lora.* as in the run that saved it"
        )
    for peft_name, tensor in saved.items():
        if tensor.shape != state[names[peft_name]].shape:
            raise CheckpointError(f"{path}: {peft_name} is {list(tensor.shape)}, the configured adapter's is not")
    return {names[peft_name]: tensor for peft_name, tensor in saved.items()}


def merged_model(base: nn.Module, checkpoint_dir: Path, dtype: torch.dtype) -> nn.Module:
    """``base`` (cast to ``dtype``, the trainer's) with the checkpoint's adapter added into its
    weights: a plain model again. The base is checked against the one the adapter was trained over."""
    base.to(dtype)
    check_base(base.state_dict(), checkpoint_dir)
    _untie_an_adapted_head(base, LoraConfig.from_pretrained(checkpoint_dir).target_modules)
    with _peft_quietly():
        return PeftModel.from_pretrained(base, checkpoint_dir).merge_and_unload()


def _untie_an_adapted_head(base: nn.Module, targets) -> None:
    """An output head tied to the input embedding that has an adapter gets its own copy of the
    weight, so that merging adds B A into the head alone: merged into the shared tensor it would
    change the input embedding too, which the trained policy never did."""
    head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    if head is None or head.weight is not embedding.weight:
        return
    name = next(name for name, module in base.named_modules() if module is head).rsplit(".", 1)[-1]
    if name in targets:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        base.config.tie_word_embeddings = False
