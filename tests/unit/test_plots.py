"""The PNG report: drawn from a run's files, tolerant of missing keys, strict about missing files."""

import json

import pytest

from asyncrl.metrics import write_json_atomic
from asyncrl.plots import _lag_counts, _moving_average, _time_totals, _title, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step_record(step):
    return {
        "step": step,
        "reward_mean": 0.3 + 0.01 * step,
        "reward_std": 0.2,
        "accuracy": 0.2 + 0.01 * step,
        "loss": 0.01 * (-1) ** step,
        "grad_norm": 0.5,
        "entropy": 1.0 - 0.01 * step,
        "mismatch_kl": 1e-3,
        "lag_histogram": {"0": 2, "1": 6} if step % 2 else {"1": 8},
        "evicted_groups": step // 10,
        "time/step_s": 2.0,
        "time/wall_s": 2.0 * step,
        "time/tokens_per_s": 500.0,
        "time/generation_s": 1.5,
        "time/generation_idle_fraction": 0.25,
        "time/train_s": 1.0,
        "time/train_idle_fraction": 0.5,
        "time/sync_pause_s": 0.1,
    }


def write_jsonl(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def synthetic_run(run_dir, steps):
    run_dir.mkdir(parents=True)
    write_jsonl(run_dir / "metrics.jsonl", [step_record(s) for s in range(1, steps + 1)])
    evals = [{"step": s, "accuracy": 0.1 + s / (2 * steps), "reward_mean": 0.3} for s in range(0, steps + 1, 5)]
    write_jsonl(run_dir / "eval.jsonl", evals)
    return run_dir


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 50_000  # a drawn multi-panel figure, not an empty canvas
    return data


@pytest.mark.slow
def test_report_is_a_png_drawn_from_the_run_files(tmp_path):
    run_dir = synthetic_run(tmp_path / "run-a", 80)
    write_json_atomic(run_dir / "summary.json", {"steps": 80, "initial_eval_accuracy": 0.1, "final_eval_accuracy": 0.6})
    path = write_report(run_dir)
    assert path == run_dir / "report.png"
    assert_png(path)
    assert sorted(p.name for p in run_dir.iterdir()) == ["eval.jsonl", "metrics.jsonl", "report.png", "summary.json"]


def test_missing_keys_and_files_other_than_metrics_are_fine(tmp_path):
    run_dir = tmp_path / "sparse"
    run_dir.mkdir()
    write_jsonl(
        run_dir / "metrics.jsonl", [{"step": 1}, {"step": 2, "loss": None, "lag_histogram": {}}], tail='{"step": 3, "lo'
    )
    assert_png(write_report(run_dir))


def test_a_missing_metrics_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere/metrics.jsonl: no such file"):
        write_report(tmp_path / "nowhere")


def test_an_empty_metrics_file_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"metrics.jsonl: no step records"):
        write_report(tmp_path)


def test_lag_counts_sum_over_the_run_in_lag_order():
    steps = [{"lag_histogram": {"2": 1, "0": 3}}, {"lag_histogram": {"0": 1}}, {"step": 3}]
    assert list(_lag_counts(steps).items()) == [(0, 4), (2, 1)]


def test_time_totals_count_generation_idle_in_worker_seconds():
    two_workers = {"time/step_s": 10.0, "time/generation_s": 15.0, "time/generation_idle_fraction": 0.25}
    idle_worker = {"time/step_s": 4.0, "time/generation_s": 0.0, "time/generation_idle_fraction": 1.0}
    trainer = {"time/step_s": 10.0, "time/train_s": 6.0, "time/train_idle_fraction": 0.4, "time/sync_pause_s": 0.5}
    totals = _time_totals([two_workers, idle_worker, trainer])
    assert totals == {
        "generation busy": 15.0,
        "generation idle": 5.0 + 4.0,
        "train busy": 6.0,
        "train idle": 4.0,
        "sync pause": 0.5,
    }


def test_moving_average_is_trailing_and_keeps_length():
    assert _moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_title_prefers_the_summary_and_falls_back_to_the_records(tmp_path):
    steps = [step_record(1), step_record(2)]
    evals = [{"step": 0, "accuracy": 0.25}, {"step": 2, "accuracy": 0.5}]
    title = _title(tmp_path / "run-b", steps, evals, {})
    assert title.startswith("run-b: 2 steps") and "eval accuracy 0.250 → 0.500" in title and title.endswith("4 s")
    summary = {"steps": 7, "initial_eval_accuracy": 0.1, "final_eval_accuracy": 0.9, "wall_seconds": 600}
    assert "7 steps" in _title(tmp_path / "run-b", steps, evals, summary)
    assert "eval accuracy 0.100 → 0.900" in _title(tmp_path / "run-b", steps, evals, summary)
    assert _title(tmp_path / "run-b", steps, [], summary).endswith("10.0 min")
    assert _title(tmp_path / "run-b", steps, [], {"wall_seconds": 9000}).endswith("2.5 h")
