"""The integrity guard in real runs of the small model: each promise's fault stops the run within
three steps with the one-line integrity stop (exit code 3, a checkpoint of the last good step),
healthy runs never trip it, and it changes no metric of an in_order run (docs/integrity.md)."""

import json
import re

import pytest
from helpers import ROOT, SMALL, deterministic, read_jsonl, run

from asyncrl.cli import main
from asyncrl.config import load_config


def without_integrity(records):
    return [{key: value for key, value in record.items() if not key.startswith("integrity/")} for record in records]


@pytest.mark.slow
def test_the_guard_changes_no_metric_of_an_in_order_run(tmp_path):
    _, guarded, guarded_groups = run(tmp_path, "on", "step.max_steps=3")
    _, unguarded, unguarded_groups = run(tmp_path, "off", "step.max_steps=3", "integrity.enabled=false")
    assert deterministic(without_integrity(guarded)) == deterministic(unguarded)
    assert guarded_groups == unguarded_groups
    assert all(key.startswith("integrity/") for key in set(guarded[0]) - set(unguarded[0]))
    for record in guarded:  # the sampling probe's gap is a measured rounding difference, every other value a count
        checked = {key: value for key, value in record.items() if key.startswith("integrity/")}
        assert checked.pop("integrity/sampling") <= 1e-5 and set(checked.values()) == {0}, record
    assert json.dumps(unguarded).count("integrity/") == 0


def integrity_stop(tmp_path, capsys, *overrides) -> tuple[str, int, list[dict]]:
    """A SMALL run from the command line that must end in an integrity stop before an update: (its
    one line without ``error: ``, the step it names, its metrics records). The step is numbered as
    metrics.jsonl numbers steps: the one after its last line, which has none; the stop's
    checkpoint is the last line's step."""
    run_dir = tmp_path / "stopped"
    assert main(["train", *SMALL, f"logging.output_dir={run_dir}", *overrides]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: integrity: ") and err.count("\n") == 1 and "Traceback" not in err, err
    step = int(re.search(r"broken at step (\d+): ", err).group(1))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    last = metrics[-1]["step"] if metrics else 0
    assert step == last + 1, (step, [m["step"] for m in metrics])
    assert f"checkpoint saved to {run_dir / 'checkpoints' / f'step-{last:06d}'}" in err
    return err.removeprefix("error: ").rstrip("\n"), step, metrics


@pytest.mark.slow
def test_tokens_older_than_the_staleness_bound_stop_the_run_before_they_are_trained(tmp_path, capsys):
    line, step, metrics = integrity_stop(tmp_path, capsys, "sampler.max_lag=0", "faults.stale_tokens=1")
    assert line.startswith("integrity: staleness broken at step 2: group ") and step == 2
    assert "has a token sampled by weights 0: lag 1 > sampler.max_lag=0; checkpoint saved to" in line
    assert [(m["step"], m["integrity/staleness"]) for m in metrics] == [(1, 0)]  # version 0: as old as a token gets


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
        "integrity: failures broken at step 1: 4 of the step's 4 groups have a reward that raised or was not a "
        "finite number (integrity.failures.threshold=0.5)"
    )
    assert step == 1 and metrics == []
    _, metrics, _ = run(tmp_path, "warned", "faults.rewards_raise=true", "integrity.failures.action=warn")
    assert [m["failed_groups"] for m in metrics] == [4] * 4 and [m["integrity/failures"] for m in metrics] == [1] * 4
    assert all(m["num_sequences"] == m["num_tokens"] == 0 for m in metrics)  # dropped, never trained as a 0
    assert all(m["reward_mean"] is None for m in metrics)  # nothing was scored: no mean of zeros
    run_dir = tmp_path / "warned"
    assert all(g["failed"] for g in read_jsonl(run_dir / "groups.jsonl"))
    assert all(r["failed"] for r in read_jsonl(run_dir / "samples.jsonl") if r["split"] == "train")
    assert main(["samples", str(run_dir), "--step", "1"]) == 0
    view = capsys.readouterr().out
    assert "failed (a reward raised: not trained)" in view and "filtered" not in view


@pytest.mark.slow
def test_a_loss_counted_twice_stops_the_run_before_the_update(tmp_path, capsys):
    line, step, metrics = integrity_stop(tmp_path, capsys, "faults.duplicate_microbatch=true")
    assert step == 1 and metrics == []
    counts = re.fullmatch(
        r"integrity: loss_counts broken at step 1: the loss summed (\d+) response tokens in (\d+) sequences over its "
        r"micro-batches and ranks, but the groups trained hold (\d+) in 16; checkpoint saved to .*",
        line,
    )
    summed_tokens, summed_sequences, tokens = map(int, counts.groups())
    assert summed_tokens > tokens and summed_sequences > 16  # the first micro-batch, twice


EPISODES = (  # the multi-turn runs of tests/integration/test_episodes_run.py
    "environment.name=feedback",
    "environment.max_turns=3",
    "environment.max_tokens=40",
    "warm_start.steps=60",
    "warm_start.lr=0.01",
)


@pytest.mark.slow
def test_a_template_that_rewrites_the_transcript_stops_a_multi_turn_run(tmp_path, capsys):
    line, step, _ = integrity_stop(tmp_path, capsys, *EPISODES, "faults.template_rewrites_transcript=true")
    assert step <= 3 and line.startswith(f"integrity: transcripts broken at step {step}: ")
    assert "met a chat template that rendered the transcript differently once messages were appended" in line


TINY = [key for key in SMALL if key.startswith(("model.", "step.", "logging.", "trainer.micro"))]
HEALTHY = {  # the shipped configs, at the small model's size and a few steps (the default: the first test)
    "tool-use": (
        ROOT / "configs" / "tool-use.yaml",
        [
            "data.task.options.num_problems=200",
            "data.eval_size=4",
            "warm_start.steps=20",
            "generation.max_new_tokens=24",
        ],
    ),
    "multi-turn": (ROOT / "configs" / "multi-turn.yaml", ["data.eval_size=4", *EPISODES[2:]]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_runs_of_the_shipped_configs_never_trip_the_guard(tmp_path, name):
    from asyncrl.run import train

    path, overrides = HEALTHY[name]
    train(load_config(path, [*TINY, "step.max_steps=3", f"logging.output_dir={tmp_path}", *overrides]))
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(metrics) == 3
    measured = {"integrity/sampling"}  # the probe's logprob gap: rounding in a healthy float32 run
    assert [key for m in metrics for key, value in m.items() if key.startswith("integrity/") and value
            and key not in measured] == []  # fmt: skip
    assert all(m["integrity/sampling"] < 1e-5 for m in metrics)
    if name == "multi-turn":
        assert max(m["episode/turns"] for m in metrics) > 1  # observations were appended
