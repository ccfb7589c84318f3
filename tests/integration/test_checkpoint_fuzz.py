"""Damaged checkpoints never load: every file of a checkpoint, emptied, cut short, lengthened or
with a byte changed, is refused by ``train --resume`` and ``eval --checkpoint`` with one line
naming that file (exit 2), and nothing of the run is changed. A damaged ``latest`` is ignored: the
run resumes from its newest checkpoint directory, which is intact.

Files damaged with a manifest that vouches for them (rewritten to match) are refused by the
loaders themselves: a state or weights file that does not parse, or a state of another shape, is
a one-line error too.
"""

import hashlib
import json
import random
import shutil

import pytest
import torch
from helpers import SMALL, run

from asyncrl.checkpoint import MANIFEST_FILE, resolve_checkpoint
from asyncrl.cli import main

FLIPS_PER_FILE = 12


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    run(
        root, "run", "step.max_steps=2", "checkpoint.every_steps=1", "logging.eval_every_steps=null", "data.eval_size=2"
    )
    return root / "run"


def variants(data: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    """Truncated, empty, lengthened and byte-flipped copies of ``data``."""
    out = [
        ("empty", b""),
        ("half", data[: len(data) // 2]),
        ("one byte short", data[:-1]),
        ("one byte more", data + b"\0"),
    ]
    for _ in range(FLIPS_PER_FILE):
        at = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[at] ^= rng.randrange(1, 256)
        out.append((f"byte {at} changed", bytes(flipped)))
    return out


def refused(capsys, argv: list[str], name: str) -> None:
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert name in captured.err, captured.err


def snapshot(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_every_damaged_checkpoint_file_is_refused_by_name(trained, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest = run_dir / "checkpoints" / "step-000002"
    files = sorted(p for p in newest.iterdir())
    assert {p.name for p in files} >= {"state.pt", "model.safetensors", "config.json", "tokenizer.json", MANIFEST_FILE}
    before = snapshot(run_dir)
    rng = random.Random(0)
    tried = 0
    for path in files:
        original = path.read_bytes()
        for _what, damaged in variants(original, rng):
            path.write_bytes(damaged)
            refused(capsys, ["train", "--resume", str(run_dir)], path.name)
            refused(capsys, ["eval", "--checkpoint", str(run_dir), *SMALL, "data.eval_size=2"], path.name)
            tried += 1
        path.write_bytes(original)
    assert tried >= 100
    assert snapshot(run_dir) == before  # nothing was written, nothing was lost


def test_a_damaged_latest_is_ignored_for_the_newest_checkpoint(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    latest = run_dir / "checkpoints" / "latest"
    for what, damaged in variants(latest.read_bytes(), random.Random(1)):
        latest.write_bytes(damaged)
        assert resolve_checkpoint(run_dir) == run_dir / "checkpoints" / "step-000002", what


def vouch(checkpoint, name: str, data: bytes) -> None:
    """Write ``data`` as ``name`` and rewrite the manifest to match it."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")


@pytest.mark.parametrize("name", ["state.pt", "model.safetensors"])
@pytest.mark.parametrize("cut", [0, 0.5])
def test_unparseable_files_with_a_matching_manifest_are_refused_by_the_loaders(trained, tmp_path, capsys, name, cut):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest = run_dir / "checkpoints" / "step-000002"
    data = (newest / name).read_bytes()
    vouch(newest, name, data[: int(len(data) * cut)])
    refused(capsys, ["train", "--resume", str(run_dir)], f"{newest / name}: ")
    if name == "model.safetensors":
        refused(capsys, ["eval", "--checkpoint", str(run_dir), *SMALL, "data.eval_size=2"], f"{newest / name}: ")


@pytest.mark.parametrize(
    "state, culprit",
    [
        (
            {"trainer": {}, "run": {"version": 2}},
            "state.pt: holds a state this version of asyncrl cannot load (KeyError: 'optimizer')",
        ),
        ({"trainer": {}, "run": {}}, "state.pt: not an asyncrl run state"),
        ([1, 2], "state.pt: holds a list, not a checkpoint state"),
        ({"trainer": 3}, "state.pt: not an asyncrl run state"),
        (
            "real trainer, foreign run",
            "the resumed checkpoint's state.pt: holds a state this version of asyncrl cannot load (KeyError: 'num_evicted')",
        ),
    ],
)
def test_a_foreign_state_with_a_matching_manifest_is_refused_by_name(trained, tmp_path, capsys, state, culprit):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest = run_dir / "checkpoints" / "step-000002"
    if state == "real trainer, foreign run":
        state = {**torch.load(newest / "state.pt", weights_only=True), "run": {"format": 2, "version": 2}}
    torch.save(state, newest / "state.pt")
    vouch(newest, "state.pt", (newest / "state.pt").read_bytes())
    refused(capsys, ["train", "--resume", str(run_dir)], culprit)
