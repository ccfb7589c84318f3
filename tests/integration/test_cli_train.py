"""`asyncrl train | eval | plot` from the command line: outputs, resume, and one-line input errors."""

import json

import pytest
from helpers import SMALL

from asyncrl.cli import main
from asyncrl.generation.hf import build_hf_generator


def backend_writing_to_the_run_dir(config, model, tokenizer, stop_token_ids, run_dir):
    """The hf generator, leaving a file in the run directory it declares it needs."""
    (run_dir / "backend.txt").write_text("built here")
    return build_hf_generator(config, model, tokenizer, stop_token_ids)


backend_writing_to_the_run_dir.writes_to_run_dir = True


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_bad_input_is_one_line_with_exit_code_2(tmp_path, capsys):
    assert "trainer.lrr: unknown key" in one_line_error(capsys, ["train", "trainer.lrr=1"])
    assert "--resume: no checkpoint found" in one_line_error(capsys, ["train", "--resume", str(tmp_path / "nope")])
    missing = one_line_error(
        capsys, ["train", *SMALL, "data.task={name: jsonl}", f"data.task.options.path={tmp_path / 'missing.jsonl'}"]
    )
    assert "data.task.options.path" in missing
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text("")
    taken = one_line_error(capsys, ["train", "--output-dir", str(tmp_path / "old")])
    assert "logging.output_dir" in taken and "already holds a run" in taken
    assert "plot:" in one_line_error(capsys, ["plot", str(tmp_path / "nope")])


def test_the_run_directory_is_the_command_lines_and_is_recorded_where_the_run_saves_its_config(tmp_path, capsys):
    """--output-dir wins over the config file's logging.output_dir; the run's config.yaml and every
    checkpoint's run.yaml record the directory; a backend that declares it gets it too."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"logging:\n  output_dir: {tmp_path / 'from-config'}\n")
    run_dir = tmp_path / "from-cli"
    backend = "generation.backend.name=test_cli_train:backend_writing_to_the_run_dir"
    argv = ["train", "--config", str(config_file), "--output-dir", str(run_dir), *SMALL, "step.max_steps=1", backend]
    assert main(argv) == 0
    assert not (tmp_path / "from-config").exists()
    saved = [run_dir / "config.yaml", *run_dir.glob("checkpoints/*/run.yaml")]
    assert len(saved) == 2
    for path in saved:
        assert f"output_dir: {run_dir}\n" in path.read_text(), path
    assert (run_dir / "backend.txt").read_text() == "built here"
    capsys.readouterr()


def test_a_buffer_too_small_for_the_sampler_stops_train_before_any_model_is_built(tmp_path, capsys, monkeypatch):
    import asyncrl.run

    monkeypatch.setattr(asyncrl.run, "build_tokenizer", lambda config: pytest.fail("a model part was built"))
    err = one_line_error(capsys, ["train", "--output-dir", str(tmp_path / "run"), "sampler.buffer_capacity=1"])
    assert err.startswith("error: sampler.buffer_capacity: 1 < 32 groups required")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_then_resume_eval_and_plot(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--output-dir", str(run_dir), *SMALL, "step.max_steps=2"]) == 0
    out = capsys.readouterr().out
    assert "after 2 steps" in out and str(run_dir) in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and {"initial_eval_accuracy", "final_eval_accuracy", "wall_seconds"} <= summary.keys()

    assert main(["train", "--resume", str(run_dir), "step.max_steps=3"]) == 0  # the run's own config.yaml
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    capsys.readouterr()

    assert main(["eval", "--checkpoint", str(run_dir), *SMALL]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_prompts"] == 8 and 0.0 <= result["accuracy"] <= 1.0

    (run_dir / "report.png").unlink()
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "report.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_resuming_with_an_incompatible_config_is_a_one_line_error(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--output-dir", str(run_dir), *SMALL, "step.max_steps=1"]) == 0
    capsys.readouterr()
    err = one_line_error(capsys, ["train", "--resume", str(run_dir), "step.prompts_per_step=2"])
    assert "step.prompts_per_step" in err
    err = one_line_error(capsys, ["train", "--resume", str(run_dir), "model.num_layers=3"])
    assert "weights do not match the model" in err
