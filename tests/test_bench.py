"""``asyncrl bench``: every --quick variant runs and reports the keys its page needs.

Timings are never asserted (the machines are shared and noisy); shapes, keys and the arithmetic
of the ratios are.
"""

import json

import pytest

from asyncrl.cli import main
from benchmarks import e2e, report

pytestmark = pytest.mark.slow


def bench(capsys, tmp_path, name, *args):
    output = tmp_path / f"{name.split()[0]}.json"
    code = main(["bench", *name.split(), "--quick", "--output", str(output), *args])
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads(output.read_text())
    assert json.loads(printed) == result
    for key in ("machine", "versions", "settings", "results", "commit", "date"):
        assert key in result
    assert result["versions"]["torch"] and result["machine"]["cores"]
    return result


def test_overlap_reports_ratios_against_the_ideal_and_the_synchronous_loop(capsys, tmp_path):
    rows = bench(capsys, tmp_path, "overlap")["results"]
    assert len(rows) == 3 * 3  # (g, t) shapes x max_lag 0, 1, 2
    for row in rows:
        assert row["step_time_over_ideal"] == pytest.approx(row["step_time_s"] / max(row["g_s"], row["t_s"]))
        assert row["sync_step_time_over_ideal"] == pytest.approx(row["sync_step_time_s"] / (row["g_s"] + row["t_s"]))
        assert row["speedup_over_sync"] == pytest.approx(row["sync_step_time_s"] / row["step_time_s"])
        assert row["step_time_over_ideal"] > 0.9  # no step beats the physical limit
        assert (row["goal_met"] is None) == (row["max_lag"] == 0)


def test_controller_reports_time_per_group_and_its_top_costs(capsys, tmp_path):
    result = bench(capsys, tmp_path, "controller")["results"]
    inline = result["inline"]
    assert inline["groups"] == 50 * 8
    assert 0 < inline["controller_s"] < inline["wall_s"]  # the workers' own time is subtracted
    assert inline["controller_us_per_group"] == pytest.approx(1e6 * inline["controller_s"] / inline["groups"])
    functions = [row["function"] for row in result["profile_top_by_own_time"]]
    assert functions and not any("fake_workers" in f or "trainer/worker" in f for f in functions)


def test_weight_sync_compares_with_memcpy(capsys, tmp_path):
    (row,) = bench(capsys, tmp_path, "weight-sync")["results"]
    assert row["model"] == "1M" and 0.9e6 < row["parameters"] < 1.2e6
    assert row["sync_bytes"] >= 4 * row["parameters"]  # float32, every tensor of the state dict
    assert row["fraction_of_memcpy"] == pytest.approx(row["sync_bytes_per_s"] / row["memcpy_bytes_per_s"])


def test_e2e_reports_time_to_target_and_final_accuracy(capsys, tmp_path):
    result = bench(capsys, tmp_path, "e2e", "--target", "0.0")["results"]
    assert set(result["runs"]) == {"max_lag=0", "max_lag=1", "max_lag=2"}
    for run in result["runs"].values():
        assert run["time_to_target_s"]["values"] == [0.0]  # accuracy >= 0 holds at the first eval
        assert [e["step"] for e in run["evals"][0]] == [0, 3, 6] and run["samples"] == 6 * 4 * 4
    assert "max_lag_1_time_to_sync_final_accuracy_over_sync_time" in result


def test_time_to_target_uses_training_time_and_the_first_eval_that_reaches_it():
    evals = [
        {"train_wall_s": 0.0, "accuracy": 0.1},
        {"train_wall_s": 2.0, "accuracy": 0.4},
        {"train_wall_s": 4.0, "accuracy": 0.3},
        {"train_wall_s": 6.0, "accuracy": 0.5},
    ]
    assert e2e.time_to(evals, 0.35) == 2.0 and e2e.time_to(evals, 0.45) == 6.0 and e2e.time_to(evals, 0.6) is None
    summary = e2e.summarize([2.0, None, 4.0])
    assert summary["reached"] == "2/3" and summary["mean"] == 3.0 and summary["median"] is None


def test_report_replaces_only_the_generated_section(capsys, tmp_path):
    bench(capsys, tmp_path, "overlap")
    page = tmp_path / "performance.md"
    page.write_text(f"# Performance\n\nprose before\n\n{report.BEGIN}\nold tables\n{report.END}\n\nprose after\n")
    assert main(["bench", "report", "--results-dir", str(tmp_path), "--write", str(page)]) == 0
    text = page.read_text()
    assert "old tables" not in text and "prose before" in text and "prose after" in text
    assert "### `asyncrl bench overlap`" in text and "| local | 0.05 | 0.05 | 1 |" in text
    page.write_text("no markers")
    capsys.readouterr()
    assert main(["bench", "report", "--results-dir", str(tmp_path), "--write", str(page)]) == 2
    assert "--write:" in capsys.readouterr().err
