"""The overlong reward in an episode: ``generation.max_new_tokens`` limits each model turn alone,
so the length it is held against is the episode's longest turn, never the turns' sum."""

from functools import partial

from asyncrl.data import Prompt
from asyncrl.environments.feedback import FeedbackEnvironment
from asyncrl.generation import GeneratorBase, SamplingParams
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.rewards import RewardResult
from asyncrl.rewards.functions import OverlongPenalty
from asyncrl.rollout import RolloutWorker
from asyncrl.rollout.episode import EpisodeLimits, MultiTurn
from asyncrl.types import Rollout, RolloutJob

TOKENIZER = build_char_tokenizer(chat=True)
EOS = TOKENIZER.eos_token_id
LIMIT, CACHE = 6, 2


class _WrongAnswers(GeneratorBase):
    """Every turn answers ``turn_text`` and stops: the feedback environment never ends the episode,
    so its turn limit does and the run's rewards score it."""

    version = 0

    def __init__(self, turn_text: str) -> None:
        self.out = TOKENIZER(turn_text, add_special_tokens=False)["input_ids"] + [EOS]

    def generate(self, requests, params):
        return [Rollout(list(r.prompt_ids), list(self.out), [-0.5] * len(self.out), "stop") for r in requests]


class _OverlongOnly:
    """The run's rewards reduced to DAPO's penalty, recording the lengths it was handed."""

    def __init__(self) -> None:
        self.penalty = OverlongPenalty(LIMIT, CACHE)
        self.lengths: list[int] = []

    def score(self, completions, answers, num_tokens=None):
        self.lengths += list(num_tokens)
        rewards = [self.penalty(c, a, num_tokens=n) for c, a, n in zip(completions, answers, num_tokens)]
        zeros = [0] * len(rewards)
        return RewardResult(rewards, [r >= 1 for r in rewards], {}, zeros, zeros)


def _episode_rewards(turn_text: str, max_turns: int) -> tuple[list[float], list[int]]:
    generator, rewards = _WrongAnswers(turn_text), _OverlongOnly()
    episodes = MultiTurn(
        generator,
        TOKENIZER,
        partial(FeedbackEnvironment, FeedbackEnvironment.Options()),
        stop_token_ids=[EOS],
        limits=EpisodeLimits(max_turns=max_turns, max_tokens=200),
    )
    worker = RolloutWorker(
        generator,
        rewards,
        TOKENIZER,
        run_seed=0,
        group_size=2,
        sampling=SamplingParams(max_new_tokens=LIMIT),
        episodes=episodes,
    )
    try:
        batch = worker.generate(
            [RolloutJob(slot_id=0, prompt=Prompt("p", "2+2=", "4"), start_version=0, target_step=None)]
        )
    finally:
        episodes.close()
    return batch.groups[0].rewards.tolist(), rewards.lengths


def test_three_short_turns_are_not_punished_for_their_sum():
    rewards, lengths = _episode_rewards("9", max_turns=3)  # three turns of 2 tokens: 6 in all, the limit
    assert lengths == [2, 2]
    assert rewards == [0.0, 0.0]


def test_one_turn_near_its_limit_is_punished_as_a_single_response_would_be():
    rewards, lengths = _episode_rewards("9999", max_turns=2)  # 5 tokens a turn: one into the cache
    assert lengths == [5, 5]
    assert rewards == [-0.5, -0.5]
