"""The integrity guard in real runs of the small model: each promise's fault stops the run within
three steps with the one-line integrity stop (exit code 3, a checkpoint of the last good step),
healthy runs never trip it, and it changes no metric of an in_order run (docs/integrity.md)."""

import json

import pytest
from helpers import deterministic, run


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
