"""Checkpoints: atomic on disk, checked on load, exact on resume.

A checkpoint is a directory ``<run>/checkpoints/step-<V>/`` holding

- the policy as an HF model (``config.json`` + ``model.safetensors``) and the tokenizer, so
  ``AutoModelForCausalLM.from_pretrained`` works on it directly; for a LoRA policy the adapter in
  PEFT's format instead (``adapter_model.safetensors``) and ``lora_base.json``, the digest of the
  base it applies to (models/lora.py, docs/lora.md);
- ``state.pt``: optimizer, scheduler, RNG and version of the trainer, the sampler, the prompt
  loader, the ready buffer groups and any prompt still waiting for its rollout, all tensors and
  plain Python so it loads with ``torch.load(weights_only=True)``;
- ``run.yaml``: the run config the state was saved under (the run state's ``config``), which
  ``--resume`` continues with;
- ``manifest.json``: the size and SHA-256 of every other file, written last. A file that was cut
  short, emptied or altered after the save no longer matches, so it is refused by name before
  anything is parsed (docs/reliability.md).

It is written into a temporary directory, every file and the directory are flushed to disk
(fsync), it is renamed into place and the rename is flushed too; ``latest`` (its name, for other
tools) is rewritten the same way afterwards, and only then are older checkpoints removed. So a
process or host crash at any moment leaves a whole checkpoint, and a write that fails (a full disk)
removes its temporary directory and stops the run naming the last complete checkpoint. Saving a
step that already has a checkpoint writes a new directory (``step-<V>-1``, ...) and removes the old
one only after that, so a whole checkpoint of the step exists at every instant. A run resumes from
its newest ``step-*`` directory.

The state is checked before anything is written: an object that ``torch.load(weights_only=True)``
would refuse is a ``TypeError`` naming its key path, so a checkpoint that could not be resumed is
never saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from asyncrl.config import ConfigError
from asyncrl.errors import RunStopped

STATE_FILE = "state.pt"
WEIGHTS_FILE = "model.safetensors"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"  # a LoRA run's checkpoint: the adapter alone
LORA_BASE_FILE = "lora_base.json"  # next to it: the base it applies to (models/lora.py)
MANIFEST_FILE = "manifest.json"
RUN_CONFIG_FILE = "run.yaml"
LATEST_FILE = "latest"


T = TypeVar("T")


class CheckpointError(ConfigError):
    """A checkpoint that is missing, damaged or does not fit the run: one line naming the file."""


class CheckpointWriteError(RunStopped):
    """A checkpoint could not be written (a full disk, say): the run stops, and since the same
    write would fail again, without trying another checkpoint first."""

    saves_checkpoint = False


# What torch.load(weights_only=True) loads back without running code: these exact types.
PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size)
PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple, set)
PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    write_model: Callable[[Path], None],
    tokenizer,
    state: dict,
    keep_last: int,
) -> Path:
    """Write checkpoint ``step`` atomically and durably, point ``latest`` at it, keep the newest
    ``keep_last`` steps. A failed write removes its temporary directory and raises ``CheckpointWriteError``."""
    _check_plain(state, "state")
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):  # left by a writer that died mid-write; one run, one writer
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    try:
        tmp.mkdir()
        write_model(tmp)
        tokenizer.save_pretrained(tmp)
        with open(tmp / STATE_FILE, "wb") as f:  # through Python's file, a full disk stays an OSError
            torch.save(state, f)
        run_state = state.get("run")
        if isinstance(run_state, dict) and "config" in run_state:
            (tmp / RUN_CONFIG_FILE).write_text(run_state["config"])
        _write_manifest(tmp)
        _fsync_tree(tmp)
        final = _free_name(root, step)
        os.replace(tmp, final)
        _fsync(root)
        _write_text_atomic(root / LATEST_FILE, final.name)
    except Exception as err:  # whatever the writer (torch, safetensors, tokenizers, the OS) raised
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(root, step, err) from err
    superseded = [p for p in _step_dirs(root) if _step_of(p) == step and p != final]
    for old in superseded:
        shutil.rmtree(old)
    steps = sorted({_step_of(p) for p in _step_dirs(root)})
    for old in _step_dirs(root):
        if _step_of(old) in steps[:-keep_last]:
            shutil.rmtree(old)
    return final


def _check_plain(value, path: str) -> None:
    """Raise TypeError naming the key path of the first value ``torch.load(weights_only=True)``
    would refuse (a subclass of str counts: its class would have to be imported to load it)."""
    kind = type(value)
    if kind in PLAIN_VALUES or kind in PLAIN_TENSORS:
        return
    if kind not in PLAIN_CONTAINERS:
        raise TypeError(
            f"checkpoint state: {path} is a {kind.__module__}.{kind.__qualname__}; a checkpoint holds only "
            f"tensors and plain values, so it could not be loaded back"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{path} key {key!r}")
            _check_plain(item, f"{path}[{key!r}]")
    else:
        for index, item in enumerate(value):
            _check_plain(item, f"{path}[{index}]")


def _fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """Every file under ``directory``, then each directory, deepest first, ``directory`` itself last."""
    paths = sorted(directory.rglob("*"), key=lambda p: (p.is_dir(), -len(p.parts)))
    for path in [*paths, directory]:
        _fsync(path)


def _write_failed(root: Path, step: int, err: Exception) -> CheckpointWriteError:
    """One line: what could not be written, why, and the checkpoint a resumed run would start from."""
    if not isinstance(err, OSError) and isinstance(err.__context__, OSError):
        err = err.__context__  # torch's zip writer reports a full disk as "unexpected pos" while handling it
    cause = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    complete = _step_dirs(root)
    stop = CheckpointWriteError(
        f"checkpoint step-{step:06d} could not be written in {root} ({cause}); "
        + (f"the last complete checkpoint is {complete[-1]}" if complete else "no checkpoint of this run is complete")
    )
    if complete:
        stop.add_note(f"continue from it with: asyncrl train --resume {root.parent}")
    return stop


def _free_name(root: Path, step: int) -> Path:
    """``step-<V>``, or ``step-<V>-<k>`` with the first unused k when step V was saved before."""
    final, k = root / f"step-{step:06d}", 0
    while final.exists():
        k += 1
        final = root / f"step-{step:06d}-{k}"
    return final


def _step_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under ``root``, in the order they were written."""
    return sorted((p for p in root.glob("step-*") if p.is_dir() and _save_order(p) is not None), key=_save_order)


def _save_order(path: Path) -> tuple[int, int] | None:
    """(step, re-save number) of ``step-<V>`` or ``step-<V>-<k>``; None for any other name."""
    parts = path.name.removeprefix("step-").split("-")
    if len(parts) > 2 or not all(part.isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def _step_of(path: Path) -> int:
    return _save_order(path)[0]


def _write_manifest(directory: Path) -> None:
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE
    }
    (directory / MANIFEST_FILE).write_text(_manifest_text(files))


def _manifest_text(files: dict) -> str:
    """The one way a manifest is written, so a changed byte that still parses is caught too."""
    return json.dumps({"files": files}, indent=1) + "\n"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checkpoint(directory: Path) -> None:
    """Raise ``CheckpointError`` naming the first file that is missing or differs from what was saved."""
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        raise CheckpointError(f"{MANIFEST_FILE} is missing, so the checkpoint's files cannot be checked")
    text = manifest.read_bytes()
    try:
        files = json.loads(text)["files"]
        entries = [(name, int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()]
        written = _manifest_text(files).encode() == text
    except (ValueError, TypeError, KeyError, AttributeError):
        written = False
    if not written:
        raise CheckpointError(
            f"{MANIFEST_FILE} is damaged (not a manifest of file sizes and checksums as asyncrl writes it)"
        )
    listed = {name for name, _, _ in entries}
    if STATE_FILE not in listed or not listed & {WEIGHTS_FILE, ADAPTER_WEIGHTS_FILE}:
        raise CheckpointError(
            f"{MANIFEST_FILE} is damaged (it does not list {STATE_FILE} and {WEIGHTS_FILE} or {ADAPTER_WEIGHTS_FILE})"
        )
    for name, size, sha256 in entries:
        path = directory / name
        if Path(name).name != name or not path.is_file():
            raise CheckpointError(f"{name[:80]} is missing ({MANIFEST_FILE} lists it)")
        if path.stat().st_size != size:
            raise CheckpointError(
                f"{name} is damaged ({path.stat().st_size} bytes; {MANIFEST_FILE} says {size} were saved)"
            )
        if _sha256(path) != sha256:
            raise CheckpointError(f"{name} is damaged (its SHA-256 differs from the one {MANIFEST_FILE} holds)")


def resolve_checkpoint(path: str | Path, option: str = "--resume") -> Path:
    """A checked checkpoint directory: ``path`` itself, or the newest ``step-*`` directory of
    ``path`` or ``path/checkpoints``. The newest directory is whole (each one is renamed into place
    complete), so a crash before ``latest`` was rewritten, or a damaged ``latest``, loses nothing.
    ``option`` names the command-line option in errors; a damaged checkpoint's error names the
    newest intact one of the same run, which ``option`` can then name directly."""
    path = Path(path).expanduser()
    for candidate in (path, path / "checkpoints"):
        if (candidate / STATE_FILE).is_file() or (candidate / MANIFEST_FILE).is_file():
            _checked(candidate, option, named=True)
            return candidate
        saved = _step_dirs(candidate)
        if saved:
            _checked(saved[-1], option, named=False)
            return saved[-1]
    raise CheckpointError(f"{option}: no checkpoint found in '{path}' (expected {STATE_FILE} or checkpoints/step-*)")


def _checked(directory: Path, option: str, *, named: bool) -> None:
    try:
        verify_checkpoint(directory)
    except CheckpointError as err:
        hint = "" if named else _intact_hint(directory.parent, option, skip=directory)
        raise CheckpointError(f"{option}: checkpoint {directory}: {err}{hint}") from None


def _intact_hint(root: Path, option: str, skip: Path | None = None) -> str:
    """'; the newest intact one is ...' for the other checkpoints of the run, newest first."""
    for other in reversed(_step_dirs(root)):
        if other == skip:
            continue
        try:
            verify_checkpoint(other)
        except CheckpointError:
            continue
        return f"; the newest intact checkpoint is {other.name}: continue from it with {option} {other}"
    return "; no other checkpoint of this run is intact"


def is_adapter_checkpoint(checkpoint_dir: Path) -> bool:
    """A LoRA run's checkpoint: the adapter alone, over a base saved elsewhere (docs/lora.md)."""
    return (Path(checkpoint_dir) / ADAPTER_WEIGHTS_FILE).is_file()


def load_contents(where: str, load: Callable[..., T], *args: Any) -> T:
    """Load checkpoint contents that passed the manifest check: contents of another shape (a
    foreign or older file vouched for by its manifest) are a one-line error naming ``where``, not
    a traceback."""
    try:
        return load(*args)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as err:
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        raise CheckpointError(f"{where}: holds a state this version of asyncrl cannot load ({detail})") from None


def load_state(checkpoint_dir: Path) -> dict:
    """``state.pt`` as tensors and plain values; anything else is refused unexecuted, by name."""
    path = Path(checkpoint_dir) / STATE_FILE
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: {_refusal(err)}; refused, and nothing in it was run") from None
    except Exception as err:
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a checkpoint state")
    return state


def _refusal(err: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler met, named: a global from a module it blocks (os, sys:
    what a file built to run code calls), any other global (a class that is not a plain value, say
    one an older asyncrl saved), or else only that it was not plain."""
    message = str(err)
    blocked = re.search(r"unsupported GLOBAL (\S{1,200}) whose module (\S{1,200}) is blocked", message)
    if blocked:
        return f"holds {blocked[1]}, from module {blocked[2]}, which torch blocks because loading it could run code"
    unsupported = re.search(r"Unsupported global: GLOBAL (\S{1,200})", message)
    if unsupported:
        return f"holds {unsupported[1]}, which is not a tensor or a plain value"
    return "holds objects other than tensors and plain values"


def load_run_state(checkpoint_dir: Path) -> dict:
    """The state of a training run: ``load_state`` with its two parts present."""
    state = load_state(checkpoint_dir)
    if not all(isinstance(state.get(part), dict) for part in ("trainer", "run")) or not isinstance(
        state["run"].get("version"), int
    ):
        raise CheckpointError(
            f"{Path(checkpoint_dir) / STATE_FILE}: not an asyncrl run state (no 'trainer' and 'run' parts with a version)"
        )
    return state


def read_weights(model: nn.Module, checkpoint_dir: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """``model.safetensors`` as tensors, after checking each one's shape against ``model``."""
    path = Path(checkpoint_dir) / WEIGHTS_FILE
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    try:
        with safe_open(path, framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        for name, shape in shapes.items():
            if name in expected and shape != expected[name]:
                raise CheckpointError(
                    f"{path}: does not fit the configured model: {name} is {list(shape)} there and "
                    f"{list(expected[name])} here; set model.* as in the run that saved it"
                )
        return load_file(path, device=device)
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{path}: cannot be read as safetensors ({type(err).__name__})") from None


def load_weights(model: nn.Module, checkpoint_dir: Path) -> None:
    """Load ``model.safetensors`` into ``model``; tied weights that HF leaves out stay tied."""
    weights = read_weights(model, checkpoint_dir, device=str(next(model.parameters()).device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    params = model.state_dict()
    loaded_storage = {params[name].data_ptr() for name in weights if name in params}
    untied = [name for name in missing if params[name].data_ptr() not in loaded_storage]
    if unexpected or untied:
        raise CheckpointError(
            f"checkpoint {checkpoint_dir}: weights do not match the model "
            f"(missing {untied[:5]}, unexpected {unexpected[:5]})"
        )


def write_directory_atomic(final: Path, write: Callable[[Path], None]) -> None:
    """Fill a new directory ``final`` through ``write(tmp)`` and rename it into place once flushed:
    a crash or a failed write leaves no ``final``, never a part of it. ``final`` must not exist."""
    final = Path(final).expanduser().absolute()
    if final.exists():
        raise CheckpointError(f"{final}: already exists; name a new directory")
    if not final.parent.is_dir():
        raise CheckpointError(f"{final.parent}: no such directory")
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    try:
        tmp.mkdir()
        write(tmp)
        _fsync_tree(tmp)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _fsync(final.parent)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync(path.parent)
