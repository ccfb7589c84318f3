"""End-to-end runs of the single controller on the local runtime, with a small model.

Each run is a few seconds: a 2-layer model, 4 prompts x 4 samples per step, short answers.
"""

import math
import threading

import pytest
import torch
from helpers import SMALL, deterministic, run

from asyncrl.config import load_config
from asyncrl.errors import RolloutFailedError
from asyncrl.metrics import read_jsonl, strip_timing


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
    summary, metrics, groups = run(tmp_path, "lag", "sampler.max_lag=1", "step.max_steps=5")
    lags = [g["trained_at"] - g["start_version"] for g in groups]
    assert max(lags) == 1 and lags.count(1) >= 4 * 4  # every step after the first trained lag-1 data
    assert summary["max_lag_trained"] == 1


@pytest.mark.slow
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    _, full, full_groups = run(tmp_path, "full", "step.max_steps=5", "checkpoint.every_steps=2")
    _, head, _ = run(tmp_path, "part", "step.max_steps=2")
    summary, resumed, resumed_groups = run(tmp_path, "part", "step.max_steps=5", resume=tmp_path / "part")
    assert deterministic(resumed) == deterministic(full)
    assert resumed_groups == full_groups
    assert read_jsonl(tmp_path / "part" / "samples.jsonl") == read_jsonl(tmp_path / "full" / "samples.jsonl")
    assert summary["steps"] == 5


@pytest.mark.slow
def test_the_end_of_the_data_stops_the_run_cleanly(tmp_path):
    before = set(threading.enumerate())  # threads earlier tests of the session left are theirs
    summary, metrics, _ = run(
        tmp_path, "short", "data.epochs=1", "data.task.options.num_problems=18", "step.max_steps=100"
    )
    assert summary["steps"] == len(metrics) == 3  # 10 prompts: steps of 4, 4 and the last 2
    assert metrics[-1]["num_groups"] == 2
    assert set(threading.enumerate()) <= before, "the run left threads running"


@pytest.mark.slow
def test_rewards_that_raise_drop_their_group_and_rewards_that_hang_score_zero_and_are_counted(tmp_path):
    """A reward that raised fails its group, which is never trained (docs/integrity.md, promise 4;
    the share of failed groups here is 1, so the run is told to warn); one that timed out on its
    input scores 0 and is trained."""
    summary, metrics, _ = run(
        tmp_path,
        "faulty",
        "step.max_steps=2",
        "rewards.functions=[exact_match, reward_functions:raising_reward, reward_functions:hanging_reward]",
        "rewards.timeout_s=0.1",
        "integrity.failures.action=warn",
    )
    samples_per_step = 4 * 4
    assert [m["reward_errors"] for m in metrics] == [samples_per_step] * 2
    assert [m["reward_timeouts"] for m in metrics] == [samples_per_step] * 2
    assert [m["failed_groups"] for m in metrics] == [4] * 2 and all(m["num_tokens"] == 0 for m in metrics)
    assert summary["reward_errors"] == summary["reward_timeouts"] == 2 * samples_per_step
    assert all(m["reward_mean"] is None and m["accuracy"] is None for m in metrics)  # every group failed
    _, metrics, _ = run(
        tmp_path,
        "hanging",
        "step.max_steps=1",
        "step.prompts_per_step=1",
        "step.generations_per_prompt=2",
        "rewards.functions=[exact_match, reward_functions:hanging_reward]",
        "rewards.timeout_s=0.1",
    )
    assert metrics[0]["reward_timeouts"] == 2 and metrics[0]["failed_groups"] == 0
    assert metrics[0]["num_sequences"] == 2  # a timed-out call is a 0 the step trains


def fail_some_generations(monkeypatch, failing_calls: set[int]):
    from asyncrl.generation.hf import HFGenerator

    original, calls = HFGenerator.generate, {"n": 0}

    def generate(self, requests, params):
        calls["n"] += 1
        if calls["n"] in failing_calls:
            raise RuntimeError(f"injected generation failure {calls['n']}")
        return original(self, requests, params)

    monkeypatch.setattr(HFGenerator, "generate", generate)


@pytest.mark.slow
def test_a_failed_generation_is_retried_with_the_same_slots_and_seeds(tmp_path, monkeypatch):
    _, clean, clean_groups = run(tmp_path, "clean", "sampler.max_lag=0")
    fail_some_generations(monkeypatch, {2, 4})  # call 1 is the initial evaluation
    summary, retried, retried_groups = run(tmp_path, "retried", "sampler.max_lag=0")
    assert summary["rollout_retries"] == 2 * 2  # two failed batches of two groups
    without_retries = [{k: v for k, v in strip_timing(m).items() if k != "rollout_retries"} for m in retried]
    assert without_retries == [{k: v for k, v in strip_timing(m).items() if k != "rollout_retries"} for m in clean]
    assert [g["prompt_uid"] for g in retried_groups] == [g["prompt_uid"] for g in clean_groups]


@pytest.mark.slow
def test_a_generation_that_keeps_failing_stops_the_run_with_a_clear_error(tmp_path, monkeypatch):
    fail_some_generations(monkeypatch, set(range(2, 100)))
    with pytest.raises(RolloutFailedError, match=r"generation failed 3 times \(runtime.max_rollout_retries=2\)"):
        run(tmp_path, "broken")


@pytest.mark.slow
def test_max_lag_zero_reproduces_a_plain_synchronous_loop(tmp_path):
    """The reference: the same components called in sequence, with no controller, threads or buffer."""
    import copy

    from safetensors.torch import load_file

    from asyncrl.data import PromptLoader, build_task
    from asyncrl.generation import SamplingParams, build_generator
    from asyncrl.models.factory import build_model, build_tokenizer
    from asyncrl.rewards import RewardRunner
    from asyncrl.rollout import RolloutWorker
    from asyncrl.trainer import PolicyTrainer
    from asyncrl.trainer.worker import TrainerWorker
    from asyncrl.types import RolloutJob

    steps = 3
    _, metrics, _ = run(tmp_path, "async", "sampler.max_lag=0", f"step.max_steps={steps}")

    config = load_config(None, [*SMALL, "sampler.max_lag=0"])
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    task = build_task(config.data, tokenizer)
    trainer = TrainerWorker(PolicyTrainer.from_config(config, model), config.step, tokenizer)
    rewards = RewardRunner.from_config(config.rewards, task)
    rollout = RolloutWorker(
        build_generator(config, copy.deepcopy(model), tokenizer),
        rewards,
        tokenizer,
        run_seed=config.seed,
        group_size=config.step.generations_per_prompt,
        sampling=SamplingParams.from_config(config.generation),
    )
    loader = PromptLoader(task.train, shuffle_seed=config.data.shuffle_seed, epochs=None)
    per_batch = config.generation.batch_size // config.step.generations_per_prompt
    reference = []
    for step in range(steps):
        jobs = [RolloutJob(i, loader.next(), step, step) for i in range(config.step.prompts_per_step)]
        groups = [g for b in range(0, len(jobs), per_batch) for g in rollout.generate(jobs[b : b + per_batch]).groups]
        trainer.begin_step(step)
        trainer.train_groups(groups)
        report = trainer.finish_step()
        version, weights = trainer.export_weights()
        rollout.load_weights(weights, version)
        reference.append(
            (report.result.loss, report.result.grad_norm, report.data.reward_sum / report.data.num_samples)
        )
    rewards.close()

    assert [(m["loss"], m["grad_norm"], m["reward_mean"]) for m in metrics] == reference
    saved = load_file(tmp_path / "async" / "checkpoints" / f"step-{steps:06d}" / "model.safetensors")
    for name, tensor in saved.items():
        assert torch.equal(tensor, model.state_dict()[name]), name


@pytest.mark.slow
def test_drain_and_inflight_syncs_train_the_same_in_order_run(tmp_path):
    _, inflight, _ = run(tmp_path, "inflight", "sync.mode=inflight")
    _, drained, _ = run(tmp_path, "drained", "sync.mode=drain")
    assert deterministic(inflight) == deterministic(drained)


@pytest.mark.slow
@pytest.mark.parametrize("sampler, max_lag", [("weight_fifo", 1), ("windowed", 1), ("windowed", 0)])
def test_other_samplers_keep_their_lag_bound(tmp_path, sampler, max_lag):
    summary, metrics, groups = run(tmp_path, sampler, f"sampler.name={sampler}", f"sampler.max_lag={max_lag}")
    assert summary["steps"] == 4 and all(m["num_groups"] == 4 for m in metrics)
    assert all(0 <= g["lag"] <= max_lag for g in groups)


@pytest.mark.slow
def test_the_controller_imports_no_model_code():
    import subprocess
    import sys

    probe = "import sys, asyncrl.control.controller; print([m for m in ('transformers', 'asyncrl.models', 'asyncrl.generation') if m in sys.modules])"
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


@pytest.mark.slow
def test_the_multi_token_task_trains_with_a_format_reward(tmp_path):
    summary, metrics, _ = run(
        tmp_path,
        "running_sum",
        "data.task={name: running_sum}",
        "generation.max_new_tokens=8",
        "rewards.functions=[exact_match, format]",
        "rewards.weights=[1.0, 0.1]",
        "step.max_steps=2",
    )
    assert summary["steps"] == 2 and summary["reward_errors"] == 0
    assert all(0.0 <= m["reward_mean"] <= 1.1 for m in metrics)


@pytest.mark.slow
def test_a_run_trains_with_the_sequence_ratio_and_the_overlong_penalty(tmp_path):
    overrides = ["algorithm.options.ratio_level=sequence", "step.num_minibatches=2", "step.max_steps=2"]
    overrides += ["rewards.functions=[exact_match,overlong]", "rewards.options.overlong.cache=2"]
    _, metrics, groups = run(tmp_path, "gspo", *overrides)
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    assert any(g["reward_mean"] < 0 for g in groups)  # 4-token responses that reach the limit are penalized
