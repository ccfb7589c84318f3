"""The integrity guard's one rule (threshold, then the promise's action), its step metrics, and
how an integrity stop reaches the user: one line naming promise, evidence and step, exit code 3."""

import pickle
from pathlib import Path

import pytest

from asyncrl.cli import _run_failure
from asyncrl.config import PROMISES, ConfigError, IntegrityConfig, load_config
from asyncrl.errors import IntegrityStop
from asyncrl.integrity import IntegrityGuard


def guard(**sections) -> tuple[IntegrityGuard, list[str]]:
    warnings: list[str] = []
    return IntegrityGuard(IntegrityConfig(**sections), warn=warnings.append), warnings


def test_a_value_within_the_threshold_keeps_the_promise_and_the_largest_is_the_metric():
    checks, warnings = guard(failures={"threshold": 0.5})
    assert checks.check("failures", 0.25, step=3, evidence="1 of 4 groups") == "ok"
    assert checks.check("failures", 0.5, step=3, evidence="2 of 4 groups") == "ok"
    assert checks.check("failures", 0.0, step=3, evidence="0 of 4 groups") == "ok"
    metrics = checks.step_metrics()
    assert metrics == {
        **{f"integrity/{name}": 0.0 for name in PROMISES},
        "integrity/failures": 0.5,
        "integrity/dropped_groups": 0,
    }
    assert warnings == []
    assert checks.step_metrics()["integrity/failures"] == 0.0  # drained: the next step starts at zero


def test_stop_raises_naming_the_promise_the_evidence_and_the_step():
    checks, _ = guard()
    with pytest.raises(IntegrityStop) as caught:
        checks.check("staleness", 2, step=7, evidence="a token of prompt p3 sampled at version 4 trained at 7")
    assert str(caught.value) == (
        "integrity: staleness broken at step 7: a token of prompt p3 sampled at version 4 trained at 7"
    )
    assert (caught.value.promise, caught.value.step, caught.value.exit_code) == ("staleness", 7, 3)
    assert checks.step_metrics()["integrity/staleness"] == 2.0  # the evidence is in the step's record


def test_drop_and_warn_are_returned_counted_and_logged():
    checks, warnings = guard(staleness={"action": "drop"}, loss_counts={"action": "warn"})
    assert checks.check("staleness", 1, step=1, evidence="lag 2") == "drop"
    assert checks.check("staleness", 1, step=1, evidence="lag 2") == "drop"
    assert checks.check("loss_counts", 0.5, step=1, evidence="24 tokens counted, 16 trained") == "warn"
    assert warnings == [
        "integrity: loss_counts broken at step 1: 24 tokens counted, 16 trained (integrity.loss_counts.action=warn)"
    ]
    assert checks.step_metrics()["integrity/dropped_groups"] == 2


def test_a_nan_measurement_breaks_the_promise():
    checks, _ = guard(loss_counts={"action": "warn"})
    assert checks.check("loss_counts", float("nan"), step=0, evidence="nan") == "warn"
    assert checks.step_metrics()["integrity/loss_counts"] != 0.0


def test_the_guard_off_checks_nothing_and_adds_no_metrics():
    checks, _ = guard(enabled=False)
    assert checks.check("staleness", 10, step=0, evidence="far too old") == "ok"
    assert checks.step_metrics() == {}


def test_an_unknown_promise_is_a_programming_error():
    checks, _ = guard()
    with pytest.raises(ValueError, match="unknown promise 'weight'"):
        checks.check("weight", 1, step=0, evidence="")


def test_an_action_a_promise_does_not_offer_is_a_config_error():
    with pytest.raises(ConfigError, match="integrity.failures.action"):
        load_config(None, ["integrity.failures.action=drop"])
    assert load_config(None, ["integrity.staleness.action=drop"]).integrity.staleness.action == "drop"


def test_an_integrity_stop_is_one_line_with_its_checkpoint_and_exit_code_3():
    stop = IntegrityStop("loss_counts", "24 response tokens counted, 16 trained", 2)
    stop.checkpoint = Path("run/checkpoints/step-000002")
    line, code = _run_failure(stop)
    assert code == 3 and "\n" not in line
    assert line.startswith("integrity: loss_counts broken at step 2: 24 response tokens counted, 16 trained; ")
    assert "checkpoint saved to run/checkpoints/step-000002" in line
    copy = pickle.loads(pickle.dumps(stop))  # as it crosses from a Ray trainer rank
    assert (copy.promise, copy.evidence, copy.step, str(copy)) == (stop.promise, stop.evidence, 2, str(stop))
