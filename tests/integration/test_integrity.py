"""The integrity guard in real runs of the small model: each promise's fault stops the run within
three steps with the one-line integrity stop (exit code 3, a checkpoint of the last good step),
healthy runs never trip it, and it changes no metric of an in_order run (docs/integrity.md)."""

import json
import re

import pytest
from helpers import SMALL, deterministic, read_jsonl, run

from asyncrl.cli import main


def without_integrity(records):
    return [{key: value for key, value in record.items() if not key.startswith("integrity/")} for record in records]


@pytest.mark.slow
def test_the_guard_changes_no_metric_of_an_in_order_run(tmp_path):
    _, guarded, guarded_groups = run(tmp_path, "on", "grpo.max_steps=3")
    _, unguarded, unguarded_groups = run(tmp_path, "off", "grpo.max_steps=3", "integrity.enabled=false")
    assert deterministic(without_integrity(guarded)) == deterministic(unguarded)
    assert guarded_groups == unguarded_groups
    assert all(key.startswith("integrity/") for key in set(guarded[0]) - set(unguarded[0]))
    assert all(value == 0 for record in guarded for key, value in record.items() if key.startswith("integrity/"))
    assert json.dumps(unguarded).count("integrity/") == 0


def integrity_stop(tmp_path, capsys, *overrides) -> tuple[str, int, list[dict]]:
    """A SMALL run from the command line that must end in an integrity stop: (its one line without
    ``error: ``, the step it names, its metrics records). The stop's checkpoint is that step's."""
    run_dir = tmp_path / "stopped"
    assert main(["train", *SMALL, f"logging.output_dir={run_dir}", *overrides]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: integrity: ") and err.count("\n") == 1 and "Traceback" not in err, err
    step = int(re.search(r"broken at step (\d+): ", err).group(1))
    assert f"checkpoint saved to {run_dir / 'checkpoints' / f'step-{step:06d}'}" in err
    return err.removeprefix("error: ").rstrip("\n"), step, read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_tokens_older_than_the_staleness_bound_stop_the_run_before_they_are_trained(tmp_path, capsys):
    line, step, metrics = integrity_stop(tmp_path, capsys, "sampler.max_lag=0", "faults.stale_tokens=1")
    assert line.startswith("integrity: staleness broken at step 1: group ") and step == 1
    assert "has a token sampled by weights 0: lag 1 > sampler.max_lag=0; checkpoint saved to" in line
    assert [m["integrity/staleness"] for m in metrics] == [0]  # step 0: version 0 is as old as a token gets


@pytest.mark.slow
def test_stale_groups_are_dropped_and_counted_under_action_drop(tmp_path):
    _, metrics, groups = run(
        tmp_path, "drop", "sampler.max_lag=0", "faults.stale_tokens=1", "integrity.staleness.action=drop"
    )
    assert [m["integrity/dropped_groups"] for m in metrics] == [0, 4, 4, 4]
    assert [m["integrity/staleness"] for m in metrics] == [0, 1, 1, 1]
    assert [m["num_groups"] for m in metrics] == [4, 0, 0, 0]  # nothing stale reached the trainer


@pytest.mark.slow
def test_a_step_whose_rewards_fail_stops_before_its_update_and_no_failure_is_trained(tmp_path, capsys):
    line, step, metrics = integrity_stop(tmp_path, capsys, "faults.rewards_raise=true")
    assert line.startswith(
        "integrity: failures broken at step 0: 4 of the step's 4 groups have a reward that raised or was not a "
        "finite number (integrity.failures.threshold=0.5)"
    )
    assert step == 0 and metrics == []
    _, metrics, _ = run(tmp_path, "warned", "faults.rewards_raise=true", "integrity.failures.action=warn")
    assert [m["failed_groups"] for m in metrics] == [4] * 4 and [m["integrity/failures"] for m in metrics] == [1] * 4
    assert all(m["num_sequences"] == m["num_tokens"] == 0 for m in metrics)  # dropped, never trained as a 0
