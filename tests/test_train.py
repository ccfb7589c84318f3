"""End-to-end runs of the single controller on the local runtime, with a small model.

Each run is a few seconds: a 2-layer model, 4 prompts x 4 samples per step, short answers.
"""

import json
import threading
import time

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.controller import RolloutFailedError
from asyncrl.metrics import read_jsonl, strip_timing
from asyncrl.run import train

SMALL = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=64",
    "grpo.prompts_per_step=4",
    "grpo.generations_per_prompt=4",
    "grpo.max_steps=4",
    "generation.max_new_tokens=4",
    "generation.batch_size=8",
    "trainer.micro_batch_size=6",
    "trainer.lr=0.01",
    "data.eval_size=8",
    "warm_start.steps=0",
    "logging.eval_every_steps=2",
    "logging.tensorboard=false",
    "logging.progress=false",
]


def run(tmp_path, name, *overrides, resume=None):
    config = load_config(None, [*SMALL, f"logging.output_dir={tmp_path / name}", *overrides])
    summary = train(config, resume=resume)
    return summary, read_jsonl(tmp_path / name / "metrics.jsonl"), read_jsonl(tmp_path / name / "groups.jsonl")


def deterministic(records):
    return [strip_timing(r) for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("max_lag", [0, 2])
def test_in_order_runs_are_reproducible_and_use_the_prescribed_weights(tmp_path, max_lag):
    _, metrics_a, groups_a = run(tmp_path, "a", f"sampler.max_lag={max_lag}")
    _, metrics_b, groups_b = run(tmp_path, "b", f"sampler.max_lag={max_lag}")
    assert deterministic(metrics_a) == deterministic(metrics_b)
    assert groups_a == groups_b
    assert len(metrics_a) == 4 and len(groups_a) == 4 * 4
    for record in groups_a:
        assert record["start_version"] == max(0, record["target_step"] - max_lag)
        assert record["trained_at"] == record["target_step"]


@pytest.mark.slow
def test_max_lag_one_overlaps_the_loops_but_never_exceeds_the_bound(tmp_path):
    summary, metrics, groups = run(tmp_path, "lag", "sampler.max_lag=1", "grpo.max_steps=5")
    lags = [g["trained_at"] - g["start_version"] for g in groups]
    assert max(lags) == 1 and lags.count(1) >= 4 * 4  # every step after the first trained lag-1 data
    assert summary["max_lag_trained"] == 1


@pytest.mark.slow
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    _, full, full_groups = run(tmp_path, "full", "grpo.max_steps=5", "checkpoint.every_steps=2")
    _, head, _ = run(tmp_path, "part", "grpo.max_steps=2")
    summary, resumed, resumed_groups = run(tmp_path, "part", "grpo.max_steps=5", resume=tmp_path / "part")
    assert deterministic(resumed) == deterministic(full)
    assert resumed_groups == full_groups
    assert summary["steps"] == 5


@pytest.mark.slow
def test_the_end_of_the_data_stops_the_run_cleanly(tmp_path):
    summary, metrics, _ = run(tmp_path, "short", "data.epochs=1", "data.num_problems=18", "grpo.max_steps=100")
    assert summary["steps"] == len(metrics) == 3  # 10 prompts: steps of 4, 4 and the last 2
    assert metrics[-1]["num_groups"] == 2
    assert threading.active_count() < 10
