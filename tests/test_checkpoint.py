"""Checkpoint files: atomic replacement, retention, lookup, HF-loadable weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.checkpoint import CheckpointError, load_state, load_weights, resolve_checkpoint, save_checkpoint
from asyncrl.models import build_char_tokenizer, build_tiny_model

TOKENIZER = build_char_tokenizer()


def tiny(seed):
    return build_tiny_model(
        len(TOKENIZER), seed=seed, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64
    )


def save(run_dir, step, model, **kwargs):
    return save_checkpoint(
        run_dir,
        step,
        write_model=model.save_pretrained,
        tokenizer=TOKENIZER,
        state={"step": step, "tensor": torch.arange(3)},
        keep_last=kwargs.get("keep_last", 2),
    )


def test_latest_points_at_the_newest_and_old_ones_are_pruned(tmp_path):
    model = tiny(0)
    for step in (1, 2, 3):
        save(tmp_path, step, model)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-000002", "step-000003"]
    assert resolve_checkpoint(tmp_path).name == "step-000003"
    assert resolve_checkpoint(tmp_path / "checkpoints" / "step-000002").name == "step-000002"
    assert load_state(resolve_checkpoint(tmp_path))["step"] == 3


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path):
    model = tiny(0)
    save(tmp_path, 1, model)

    def crash(directory):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, write_model=crash, tokenizer=TOKENIZER, state={}, keep_last=2)
    assert resolve_checkpoint(tmp_path).name == "step-000001"
    assert load_state(resolve_checkpoint(tmp_path))["step"] == 1


def test_weights_load_with_transformers_and_back_into_a_model(tmp_path):
    model = tiny(0)
    path = save(tmp_path, 1, model)
    hf = AutoModelForCausalLM.from_pretrained(path)
    restored = tiny(1)
    load_weights(restored, path)
    ids = torch.tensor([[4, 5, 6]])
    assert torch.equal(hf(ids).logits, model(ids).logits)
    assert torch.equal(restored(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="weights do not match"):
        load_weights(
            build_tiny_model(
                len(TOKENIZER), seed=0, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
            ),
            path,
        )


def test_missing_checkpoint_is_a_one_line_error(tmp_path):
    with pytest.raises(CheckpointError, match="--resume: no checkpoint found"):
        resolve_checkpoint(tmp_path)


def test_resaving_a_step_leaves_a_whole_checkpoint_at_every_instant(tmp_path, monkeypatch):
    """A crash at each rename or removal of a re-save still resumes from a whole checkpoint."""
    import shutil

    import asyncrl.checkpoint as checkpoint

    model = tiny(0)
    save(tmp_path / "clean", 1, model)
    real = {"replace": checkpoint.os.replace, "rmtree": checkpoint.shutil.rmtree}
    for crash_at in range(1, 4):
        run_dir = tmp_path / f"crash-{crash_at}"
        shutil.copytree(tmp_path / "clean", run_dir)
        calls = []

        def crashing(name):
            def call(*args, **kwargs):
                calls.append(name)  # noqa: B023 (called within this iteration)
                if len(calls) == crash_at:  # noqa: B023
                    raise OSError("killed")
                return real[name](*args, **kwargs)

            return call

        monkeypatch.setattr(checkpoint.os, "replace", crashing("replace"))
        monkeypatch.setattr(checkpoint.shutil, "rmtree", crashing("rmtree"))
        with pytest.raises(OSError, match="killed"):
            save_checkpoint(
                run_dir,
                1,
                write_model=model.save_pretrained,
                tokenizer=TOKENIZER,
                state={"step": 1, "again": True},
                keep_last=2,
            )
        monkeypatch.undo()
        assert load_state(resolve_checkpoint(run_dir))["step"] == 1
    assert calls == ["replace", "replace", "rmtree"]  # into place, latest, the superseded one
    save_checkpoint(
        run_dir,
        1,
        write_model=model.save_pretrained,
        tokenizer=TOKENIZER,
        state={"step": 1, "again": True},
        keep_last=2,
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step-000001-2",
    ]  # both older ones gone
    assert load_state(resolve_checkpoint(run_dir))["again"]
