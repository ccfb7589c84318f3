"""Run metrics: jsonl sinks and their resume truncation, TensorBoard and W&B mirrors, progress display."""

import json
import sys
import types
from io import StringIO

import pytest
from rich.console import Console

from asyncrl import metrics
from asyncrl.config import LoggingConfig
from asyncrl.metrics import (
    MetricsWriter,
    ProgressDisplay,
    episode_keys,
    read_jsonl,
    scalars,
    strip_timing,
    write_json_atomic,
)

PLAIN = LoggingConfig(tensorboard=False, wandb=False)


def step_record(step, **extra):
    return {
        "step": step,
        "reward_mean": 0.25 * step,
        "accuracy": 0.5,
        "loss": -0.01 * step,
        "lag_histogram": {"0": 2, "1": step},
        "lag_mean": 0.5,
        "time/step_s": 1.5,
        "time/tokens_per_s": 1234.0,
        **extra,
    }


def eval_record(step):
    return {"step": step, "accuracy": 0.1 * step, "reward_mean": 0.2, "num_prompts": 64, "time/eval_s": 2.0}


def write_run(run_dir, steps, eval_steps, cfg=PLAIN, **kwargs):
    with MetricsWriter(run_dir, cfg, **kwargs) as writer:
        for step in steps:
            writer.log_step(step_record(step))
        for step in eval_steps:
            writer.log_eval(eval_record(step))


# ---- jsonl -----------------------------------------------------------------------------------


def test_records_append_as_json_lines_and_read_back(tmp_path):
    run_dir = tmp_path / "run"
    write_run(run_dir, [1, 2], [0])
    write_run(run_dir, [3], [3])
    assert read_jsonl(run_dir / "metrics.jsonl") == [step_record(1), step_record(2), step_record(3)]
    assert read_jsonl(run_dir / "eval.jsonl") == [eval_record(0), eval_record(3)]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def test_each_record_is_on_disk_before_close(tmp_path):
    writer = MetricsWriter(tmp_path, PLAIN)
    writer.log_step(step_record(1))
    assert read_jsonl(tmp_path / "metrics.jsonl") == [step_record(1)]
    writer.close()
    writer.close()


def test_a_truncated_last_line_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n" + '{"step": 3, "loss": 0.')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_a_broken_line_before_the_last_raises_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": \n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON"):
        read_jsonl(path)


def test_resume_keeps_records_up_to_the_checkpoint_and_continues_the_files(tmp_path):
    write_run(tmp_path, [1, 2, 3, 4, 5], [0, 2, 4])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # the crash happened mid-write
    write_run(tmp_path, [4, 5], [4], resume_step=3)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in read_jsonl(tmp_path / "eval.jsonl")] == [0, 2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "eval.jsonl",
        "groups.jsonl",
        "metrics.jsonl",
        "samples.jsonl",
    ]


def test_group_records_append_and_are_truncated_on_resume(tmp_path):
    groups = [{"step": step, "prompt_uid": f"p{step}-{i}", "lag": 1} for step in (1, 2, 3) for i in range(2)]
    with MetricsWriter(tmp_path, PLAIN) as writer:
        writer.log_groups(groups[:4])
        writer.log_groups(groups[4:])
    assert read_jsonl(tmp_path / "groups.jsonl") == groups
    with MetricsWriter(tmp_path, PLAIN, resume_step=2):
        pass
    assert read_jsonl(tmp_path / "groups.jsonl") == groups[:4]


def test_resume_without_files_starts_them(tmp_path):
    write_run(tmp_path / "new", [3], [], resume_step=2)
    assert read_jsonl(tmp_path / "new" / "metrics.jsonl") == [step_record(3)]


def test_write_json_atomic_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"steps": 1})
    write_json_atomic(path, {"steps": 2, "final_eval_accuracy": 0.5})
    assert json.loads(path.read_text()) == {"steps": 2, "final_eval_accuracy": 0.5}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"steps": object()})
    assert json.loads(path.read_text())["steps"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_strip_timing_drops_exactly_the_timing_keys():
    record = step_record(1, **{"time/wall_s": 9.0})
    stripped = strip_timing(record)
    assert stripped == {k: v for k, v in record.items() if k not in ("time/step_s", "time/tokens_per_s", "time/wall_s")}
    assert "step" in stripped and "lag_histogram" in stripped
    assert strip_timing(step_record(1, **{"time/step_s": 3.0})) == strip_timing(step_record(1))


def test_episode_means_are_keyed_under_episode_and_durations_under_time():
    record = episode_keys({"turns": 3.1, "env_s": 0.2, "solved": 0.8})
    assert record == {"time/episode/env_s": 0.2, "episode/solved": 0.8, "episode/turns": 3.1}
    assert strip_timing(record) == {"episode/solved": 0.8, "episode/turns": 3.1}


def test_scalars_flatten_the_lag_histogram_and_skip_non_numbers():
    record = {"step": 4, "loss": 1, "kl": None, "name": "x", "flag": True, "lag_histogram": {"0": 3, "2": 1}}
    assert scalars(record, "eval/") == {"eval/loss": 1.0, "eval/lag_histogram/0": 3.0, "eval/lag_histogram/2": 1.0}


# ---- TensorBoard and W&B ---------------------------------------------------------------------


def tensorboard_scalars(logdir):
    """tag -> [(step, value)] as TensorBoard shows it; values are float32, rounded back here."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    return {
        tag: [(e.step, round(e.value, 6)) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def test_tensorboard_gets_every_numeric_value_at_its_step(tmp_path):
    cfg = LoggingConfig(tensorboard=True, wandb=False)
    with MetricsWriter(tmp_path, cfg) as writer:
        writer.log_step(step_record(1, kl=None))
        writer.log_step(step_record(2, kl=None))
        writer.log_eval(eval_record(2))
    tags = tensorboard_scalars(tmp_path / "tensorboard")
    assert tags["loss"] == [(1, -0.01), (2, -0.02)]
    assert tags["lag_histogram/1"] == [(1, 1.0), (2, 2.0)]
    assert tags["eval/accuracy"] == [(2, 0.2)]
    assert "time/tokens_per_s" in tags and "kl" not in tags and "step" not in tags


def test_tensorboard_after_resume_shows_each_step_once(tmp_path):
    cfg = LoggingConfig(tensorboard=True, wandb=False)
    write_run(tmp_path, [1, 2, 3, 4], [], cfg=cfg)
    with MetricsWriter(tmp_path, cfg, resume_step=2):
        pass  # a resumed run that crashes again before its first step still hides steps 3 and 4
    assert [step for step, _ in tensorboard_scalars(tmp_path / "tensorboard")["loss"]] == [1, 2]
    with MetricsWriter(tmp_path, cfg, resume_step=2) as writer:
        writer.log_step(step_record(3, loss=7.0))
    assert tensorboard_scalars(tmp_path / "tensorboard")["loss"] == [(1, -0.01), (2, -0.02), (3, 7.0)]


def test_wandb_missing_is_one_warning_not_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    write_run(tmp_path, [1], [0], cfg=LoggingConfig(tensorboard=False, wandb=True))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wandb is not installed" in err[0]
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 1


def test_wandb_gets_the_run_config_and_flat_scalars(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    write_run(tmp_path / "run-7", [1], [1], cfg=LoggingConfig(tensorboard=False, wandb=True), run_config={"seed": 3})
    init, step_log, eval_log, finish = calls
    assert init[1]["config"] == {"seed": 3} and init[1]["name"] == "run-7"
    assert step_log[2] == 1 and step_log[1]["lag_histogram/1"] == 1.0 and "step" not in step_log[1]
    assert eval_log == ("log", scalars(eval_record(1), "eval/"), 1)
    assert finish == ("finish",)


# ---- progress display ------------------------------------------------------------------------


def plain_console():
    return Console(file=StringIO(), force_terminal=False, width=200)


def lines(console):
    return console.file.getvalue().splitlines()


def test_plain_mode_prints_one_readable_line_per_step_and_eval():
    console = plain_console()
    with ProgressDisplay(10, enabled=True, console=console) as progress:
        progress.update_eval(eval_record(0))
        progress.update(step_record(1, **{"time/wall_s": 12.4}))
        progress.update(step_record(2))
    out = lines(console)
    assert len(out) == 3
    assert out[0] == "eval step 0  accuracy 0.000  reward 0.200  prompts 64  seconds 2.0"
    assert out[1] == (
        "step 1/10  reward 0.250  acc 0.500  eval acc 0.000  loss -0.0100  lag 0.50  tok/s 1,234  wall 12 s"
    )
    assert out[2].startswith("step 2/10  reward 0.500")


def test_missing_and_null_keys_do_not_break_the_display():
    console = plain_console()
    with ProgressDisplay(10, enabled=True, console=console) as progress:
        progress.update({"step": 1})
        progress.update({"step": 2, "loss": None})
        progress.update_eval({})
    assert lines(console) == ["step 1/10  ", "step 2/10  loss -", "eval step ?"]


def test_plain_status_lines_of_one_kind_are_rate_limited(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    console = plain_console()
    with ProgressDisplay(10, enabled=True, console=console) as progress:
        for step in range(1, 51):
            progress.status(f"warm start {step}/300, loss {1 / step:.3f}")
        now[0] += 11.0
        progress.status("warm start 51/300, loss 0.019")
        progress.status("evaluating at step 0")
    assert lines(console) == ["warm start 1/300, loss 1.000", "warm start 51/300, loss 0.019", "evaluating at step 0"]


def test_disabled_prints_nothing():
    console = Console(file=StringIO(), force_terminal=True, width=120)
    with ProgressDisplay(10, enabled=False, console=console) as progress:
        progress.status("evaluating")
        progress.update(step_record(1))
        progress.update_eval(eval_record(1))
    assert console.file.getvalue() == ""


def test_a_warning_is_printed_whatever_the_display(capsys):
    console = plain_console()
    with ProgressDisplay(10, enabled=True, console=console) as progress:
        progress.warn("raise generation.max_new_tokens")
    assert lines(console) == ["warning: raise generation.max_new_tokens"]
    terminal = Console(file=StringIO(), force_terminal=True, width=120)
    with ProgressDisplay(10, enabled=True, console=terminal) as progress:
        progress.warn("raise sampler.max_lag")
    assert "warning: raise sampler.max_lag" in terminal.file.getvalue()
    with ProgressDisplay(10, enabled=False, console=plain_console()) as progress:
        progress.warn("raise rewards.timeout_s")
    assert capsys.readouterr().err == "warning: raise rewards.timeout_s\n"


def test_terminal_mode_renders_bar_numbers_and_status():
    console = Console(file=StringIO(), force_terminal=True, width=140, color_system=None)
    with ProgressDisplay(4, enabled=True, console=console) as progress:
        assert progress.live_mode
        progress.status("warm start 120/300")
        progress.update(step_record(1))
        progress.update_eval(eval_record(1))
        progress.update(step_record(2))
        progress.status("checkpointing step 2")
    out = console.file.getvalue()
    assert "GRPO" in out and "2/4" in out
    assert "reward 0.500" in out and "eval acc 0.100" in out and "tok/s 1,234" in out
    assert "checkpointing step 2" in out


def test_step_record_is_a_function_of_its_inputs():
    from collections import Counter

    from asyncrl.types import StepData, StepReport, StepResult, SyncReport

    result = StepResult(
        version=3,
        loss=float("nan"),
        grad_norm=2.0,
        lr=1e-3,
        num_sequences=8,
        num_tokens=40,
        num_microbatches=2,
        metrics={"clip_fraction": 0.1, "is_weight_mean": 1.0, "mismatch_kl": 0.0, "kl": 0.5},
    )
    data = StepData(
        num_groups=2,
        num_samples=8,
        num_scored_samples=8,
        reward_sum=4.0,
        reward_sq_sum=4.0,
        lag_histogram=Counter({0: 1, 2: 1}),
    )
    sync = SyncReport(version=3, pause_s=0.5, transfer_s=0.25, bytes=100, transport="in_process")
    counters = metrics.RunCounters(
        refill_groups_total=1, evicted_groups=2, skipped_prompts=3, step_retries=4, nonfinite_steps=5, empty_steps=6
    )
    clock = metrics.StepClock(generation_s=1.0, generated_tokens=40, train_s=1.0)
    record = metrics.step_record(StepReport(result, data), sync, counters, clock, 2.0, 10.0, 2)
    assert record == metrics.step_record(StepReport(result, data), sync, counters, clock, 2.0, 10.0, 2)
    assert record["step"] == 3 and record["loss"] is None and record["kl"] == 0.5 and "entropy" not in record
    assert record["reward_mean"] == 0.5 and record["reward_std"] == 0.5 and record["lag_mean"] == 1.0
    assert (record["evicted_groups"], record["empty_steps"], record["refill_groups_total"]) == (2, 6, 1)
    assert record["time/tokens_per_s"] == 20.0 and record["time/generation_idle_fraction"] == 0.75
    assert record["time/train_idle_fraction"] == 0.5 and record["time/wall_s"] == 10.0


def test_a_step_clock_lap_returns_what_was_counted_and_starts_again_from_zero():
    from asyncrl.metrics import StepClock

    clock = StepClock()
    clock.generation_s, clock.generated_tokens, clock.train_s, clock.train_wait_s = 1.5, 7, 2.5, 0.5
    lap = clock.lap()
    assert (lap.generation_s, lap.generated_tokens, lap.train_s, lap.train_wait_s) == (1.5, 7, 2.5, 0.5)
    assert clock == StepClock()
    clock.train_s += 1.0
    assert lap.train_s == 2.5 and clock.lap().train_s == 1.0
