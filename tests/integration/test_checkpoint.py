"""Checkpoint files: atomic and durable replacement, retention, lookup, plain state, HF-loadable
weights and tokenizer, a full disk."""

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SMALL
from transformers import AutoModelForCausalLM, AutoTokenizer

import asyncrl.checkpoint as checkpoint
from asyncrl.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    load_state,
    load_weights,
    resolve_checkpoint,
    save_checkpoint,
)
from asyncrl.cli import main
from asyncrl.metrics import read_jsonl
from asyncrl.models import DEFAULT_ALPHABET, build_char_tokenizer, build_tiny_model

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
        (directory / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(tmp_path, 2, write_model=crash, tokenizer=TOKENIZER, state={}, keep_last=2)
    assert str(err.value) == (
        f"checkpoint step-000002 could not be written in {root} (OSError: [Errno 28] No space left on device); "
        f"the last complete checkpoint is {root / 'step-000001'}"
    )
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # the temporary directory is gone
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
        with pytest.raises((OSError, CheckpointWriteError), match="killed"):
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


class Answer(str):
    """A str subclass, as a task's answer object may be: it would need its class to load."""


@pytest.mark.parametrize(
    "value, kind",
    [(Answer("4"), "test_checkpoint.Answer"), (range(3), "builtins.range"), (object(), "builtins.object")],
)
def test_a_state_that_could_not_be_loaded_back_is_refused_before_anything_is_written(tmp_path, value, kind):
    state = {"run": {"pending": [{"prompt": {"uid": "a/0", "answer": value}}]}, "tensor": torch.zeros(2)}
    with pytest.raises(TypeError) as err:
        save_checkpoint(tmp_path, 1, write_model=tiny(0).save_pretrained, tokenizer=TOKENIZER, state=state, keep_last=2)
    assert str(err.value) == (
        f"checkpoint state: state['run']['pending'][0]['prompt']['answer'] is a {kind}; a checkpoint holds only "
        "tensors and plain values, so it could not be loaded back"
    )
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_a_state_holding_an_unknown_class_is_refused_naming_it(tmp_path):
    path = save(tmp_path, 1, tiny(0))
    torch.save({"run": {"answer": Answer("4")}}, path / "state.pt")
    with pytest.raises(CheckpointError) as err:
        load_state(path)
    assert str(err.value) == (
        f"{path / 'state.pt'}: holds test_checkpoint.Answer, which is not a tensor or a plain value; "
        "refused, and nothing in it was run"
    )


def test_files_reach_the_disk_before_the_rename_and_older_checkpoints_go_only_after(tmp_path, monkeypatch):
    """fsync every file, then the temporary directory; rename; fsync the parent; rewrite latest the
    same way; only then remove older checkpoints. A host crash at any point leaves a whole one."""
    model = tiny(0)
    save(tmp_path, 1, model)
    save(tmp_path, 2, model)
    events = []
    real = {"fsync": os.fsync, "replace": os.replace, "rmtree": shutil.rmtree}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real["fsync"](fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real["replace"](src, dst)

    def rmtree(path, *args, **kwargs):
        events.append(("rmtree", str(path)))
        return real["rmtree"](path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    final = save(tmp_path, 3, model, keep_last=2)
    root = str(tmp_path / "checkpoints")
    (rename,) = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final)]
    tmp = events[rename][1]
    synced_before = [Path(e[1]) for e in events[:rename] if e[0] == "fsync"]
    assert {p.name for p in synced_before if p.parent == Path(tmp)} == {p.name for p in final.iterdir()}
    assert synced_before[-1] == Path(tmp)  # the directory after its files
    (latest,) = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == f"{root}/latest"]
    assert ("fsync", root) in events[rename:latest]
    assert ("fsync", events[latest][1]) in events[rename:latest] and events[latest + 1] == ("fsync", root)
    removals = [i for i, e in enumerate(events) if e[0] == "rmtree"]
    assert [events[i][1] for i in removals] == [f"{root}/step-000001"] and removals[0] > latest + 1


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_stops_in_one_line_and_the_previous_one_resumes(tmp_path, capsys, monkeypatch):
    run_dir, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    real_save = torch.save

    class FullDisk:
        """The state file on a disk that takes 64 more bytes; torch's zip writer then reports the
        OSError as a RuntimeError ("unexpected pos"), as on a real full disk."""

        def __init__(self, file):
            self.file = file

        def write(self, data):
            if self.file.tell() + len(data) > 64:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.file.write(data)

        def flush(self):
            self.file.flush()

    def disk_full(obj, f, *args, **kwargs):
        full = ".tmp-step-000002" in str(getattr(f, "name", f))
        return real_save(obj, FullDisk(f) if full else f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full)
    train = ["train", "--output-dir", str(run_dir), *SMALL, "step.max_steps=3", "checkpoint.every_steps=1"]
    assert main(train) == 1
    assert capsys.readouterr().err == (
        f"error: checkpoint step-000002 could not be written in {root} (OSError: [Errno 28] No space left on "
        f"device); the last complete checkpoint is {root / 'step-000001'}; continue from it with: "
        f"asyncrl train --resume {run_dir}\n"
    )
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert load_state(resolve_checkpoint(run_dir))["run"]["version"] == 1
    monkeypatch.undo()  # space is back
    assert main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert (root / "latest").read_text() == "step-000003"


def test_a_checkpoint_reloads_in_transformers_exactly_as_trained(tmp_path):
    """The README's promise: AutoModelForCausalLM and AutoTokenizer on a checkpoint directory are the
    trained model and its tokenizer, token for token and logit for logit."""
    model = tiny(0).eval()
    path = save(tmp_path, 1, model)
    hf, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    for text in ("running sum 3 8 5 1:", DEFAULT_ALPHABET, "  two  spaces . , ? ! end \n\n"):
        ids = TOKENIZER(text)["input_ids"]
        assert tokenizer(text)["input_ids"] == ids
        assert tokenizer.decode(ids) == text
        with torch.no_grad():
            assert torch.equal(hf(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.padding_side) == (0, 1, "left")


@pytest.mark.slow
def test_a_run_starts_from_a_checkpoint_given_as_model_path(tmp_path, capsys):
    path = save(tmp_path / "first", 1, tiny(0))
    args = ["train", "--output-dir", str(tmp_path / "second"), *SMALL, "step.max_steps=1", f"model.path={path}"]
    args.append("data.task={name: running_sum}")  # prompts with spaces: "running sum 3 8 5 1:"
    assert main(args) == 0, capsys.readouterr().err
    assert len(read_jsonl(tmp_path / "second" / "metrics.jsonl")) == 1
