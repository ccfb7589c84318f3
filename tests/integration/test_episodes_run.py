"""Runs with multi-turn episodes (environment.name feedback, and SkyRL-Gym's through skyrl_gym):
the step records carry the documented episode metrics, and an in_order run resumed from a
checkpoint matches the uninterrupted one."""

import re
from pathlib import Path

import pytest
from helpers import deterministic, error, run

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
# A warm start teaches the answer format (digits, then EOS), so episodes take several turns.
EPISODES = (
    "environment.name=feedback",
    "environment.max_turns=3",
    "environment.max_tokens=40",
    "warm_start.steps=60",
    "warm_start.lr=0.01",
)


def documented_episode_keys() -> tuple[set[str], set[str]]:
    """(the keys every episode run writes, the keys the built-in environments add)."""
    section = re.search(r"^## Episode metrics[^\n]*\n(.*?)(?=^## )", DOC.read_text(), re.M | re.S)
    assert section, "docs/metrics.md has no Episode metrics section"
    common, _, added = section.group(1).partition("### Keys the built-in environments add")
    keys = [set(re.findall(r"^\| `([^`]+)` \|", part, re.M)) for part in (common, added)]
    return keys[0], keys[1]


@pytest.mark.slow
def test_a_multi_turn_run_writes_every_documented_episode_metric_and_trains_sampled_tokens_only(tmp_path, monkeypatch):
    from asyncrl.environments import base

    resolved = []
    part = base.environment_part
    monkeypatch.setattr(base, "environment_part", lambda *args: resolved.append(args) or part(*args))
    _, metrics, _ = run(tmp_path, "run", *EPISODES, "step.max_steps=2")
    # once to check the config, once for the whole run: the warm start, the request bound and the
    # rollout worker's episodes share it
    assert len(resolved) == 2
    written = {key for record in metrics for key in record if "episode/" in key}
    common, added = documented_episode_keys()
    assert common <= written <= common | added and "episode/solved" in written  # the feedback environment's
    assert max(record["episode/turns"] for record in metrics) > 1
    for record in metrics:
        assert record["episode/masked_tokens"] > 0
        assert record["response_length_mean"] == pytest.approx(record["episode/trained_tokens"])
        assert record["num_tokens"] == pytest.approx(record["episode/trained_tokens"] * 16)  # 4 prompts x 4


@pytest.mark.slow
def test_a_resumed_multi_turn_in_order_run_matches_the_uninterrupted_one(tmp_path):
    _, full, full_groups = run(tmp_path, "full", *EPISODES, "step.max_steps=4", "checkpoint.every_steps=2")
    run(tmp_path, "part", *EPISODES, "step.max_steps=2")
    _, resumed, resumed_groups = run(tmp_path, "part", *EPISODES, "step.max_steps=4", resume=tmp_path / "part")
    assert deterministic(resumed) == deterministic(full)
    assert resumed_groups == full_groups
    assert max(record["episode/turns"] for record in full) > 1


@pytest.mark.slow
def test_a_skyrl_gym_environment_trains_whole_episodes_with_its_own_rewards(tmp_path):
    pytest.importorskip("skyrl_gym")
    skyrl = (
        "environment.name=skyrl_gym",
        "environment.options={env: gsm8k_multi_turn, extras: {max_turns: 3}}",
        *EPISODES[3:],
        "environment.max_turns=3",
        "environment.max_tokens=400",  # its requests for another answer are about 130 tokens each
    )
    _, metrics, groups = run(tmp_path, "run", *skyrl, "step.max_steps=2")
    assert [record["step"] for record in metrics] == [1, 2]
    assert max(record["episode/turns"] for record in metrics) > 1  # its feedback asks for another answer
    assert all(record["episode/masked_tokens"] > 0 for record in metrics)
    assert all(0.0 <= group["reward_mean"] <= 1.0 for group in groups)  # its reward: 1 for the right answer


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["environment.name=nope"], "environment.name: unknown environment 'nope'"),
        (["environment.name=feedback", "environment.options={bogus: 1}"], "environment.options.bogus: unknown option"),
        (["environment.name=feedback", "environment.options={discount: 2}"], "environment.options.discount:"),
        (["environment.name=asyncrl.data:Prompt"], "environment.name: 'asyncrl.data:Prompt' is not a subclass"),
        (["environment.options={discount: 0.5}"], "environment.options: set, but environment.name is null"),
        (["environment.name=feedback", "data.chat_template=true"], "data.chat_template: environment.name is set"),
    ],
)
def test_a_bad_environment_setting_is_a_one_line_error(tmp_path, capsys, overrides, message):
    assert error(capsys, "train", *overrides, "warm_start.steps=0", f"logging.output_dir={tmp_path}").startswith(
        message
    )
