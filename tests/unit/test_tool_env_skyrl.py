"""The skyrl_gym environment: SkyRL-Gym's own environments driven through asyncrl's Environment seam."""

from __future__ import annotations

import sys

import pytest

from asyncrl.data.prompts import Prompt
from asyncrl.environments.skyrl import SkyRLGymEnvironment

pytest.importorskip("skyrl_gym")

PROMPT = Prompt("q/1", "What is 2+3?", "5")


def answer(text):
    return {"role": "assistant", "content": text}


def test_a_single_turn_environment_scores_the_answer_with_its_own_checker():
    for text, reward in [("so #### 5", 1.0), ("so #### 6", 0.0)]:
        env = SkyRLGymEnvironment(SkyRLGymEnvironment.Options(env="gsm8k"))
        assert env.reset(PROMPT) == [{"role": "user", "content": "What is 2+3?"}]
        turn = env.step(answer(text))
        assert (turn.done, turn.reward, turn.messages) == (True, reward, [])


def test_a_multi_turn_environment_answers_a_wrong_turn_and_sums_its_rewards():
    env = SkyRLGymEnvironment(SkyRLGymEnvironment.Options(env="gsm8k_multi_turn", extras={"max_turns": 3}))
    env.reset(PROMPT)
    first = env.step(answer("#### 4"))
    assert not first.done and first.reward is None
    assert first.messages[0]["role"] == "user" and "#### ANSWER" in first.messages[0]["content"]
    last = env.step(answer("#### 5"))
    assert last.done
    assert last.reward == pytest.approx(1.0 + 0.2 / 3)  # its format credit for the first turn, then 1


def test_episodes_do_not_share_state():
    env = SkyRLGymEnvironment(SkyRLGymEnvironment.Options(env="gsm8k_multi_turn", extras={"max_turns": 2}))
    other = SkyRLGymEnvironment(SkyRLGymEnvironment.Options(env="gsm8k_multi_turn", extras={"max_turns": 2}))
    env.reset(PROMPT)
    other.reset(Prompt("q/2", "What is 3+3?", "6"))
    env.step(answer("#### 1"))
    assert other.step(answer("#### 6")).reward == 1.0
    assert env.step(answer("#### 5")).reward == pytest.approx(1.0 + 0.2 / 2)


def test_an_unknown_environment_and_a_missing_library_are_one_line_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"^environment.options.env: SkyRL-Gym has no environment 'chess' \(.*gsm8k"):
        SkyRLGymEnvironment(SkyRLGymEnvironment.Options(env="chess"))
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # import skyrl_gym now raises ImportError
    with pytest.raises(ValueError, match=r"^environment.name: skyrl_gym needs .* pip install 'asyncrl\[skyrl-gym\]'$"):
        SkyRLGymEnvironment(SkyRLGymEnvironment.Options(env="gsm8k"))
