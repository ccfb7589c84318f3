"""Multi-turn episodes, token-in / token-out: the tokens kept are the ones sampled, each observation
is the chat template's delta and is masked out of the loss, limits truncate, and an episode waiting
on its environment never holds up the others."""

import re
import threading
import time
from dataclasses import replace
from functools import partial

import pytest
import torch

from asyncrl.algorithms.grpo import GRPO
from asyncrl.config import StepConfig, TrainerConfig
from asyncrl.data import Prompt
from asyncrl.environments import Environment, Turn
from asyncrl.environments.feedback import FeedbackEnvironment
from asyncrl.generation import GeneratorBase, SampleRequest, SamplingParams, sample_seed
from asyncrl.generation.hf import HFGenerator
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.rewards import RewardResult
from asyncrl.rollout import RolloutWorker
from asyncrl.rollout.episode import EpisodeLimits, MultiTurn, turn_seed
from asyncrl.trainer import PolicyTrainer
from asyncrl.trainer.worker import TrainerWorker
from asyncrl.types import Rollout, RolloutGroup, RolloutJob

TOKENIZER = build_char_tokenizer(chat=True)
EOS = TOKENIZER.eos_token_id
PARAMS = SamplingParams(max_new_tokens=8)


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class ScriptedGenerator(GeneratorBase):
    """Answers turn t of the episode with seed s with ``script[s][t]`` (a request's seed names
    both, through ``turn_seed``), with logprobs -0.1 * (position + 1)."""

    def __init__(self, script: dict[int, list[list[int]]]) -> None:
        self.by_seed = {turn_seed(seed, t): out for seed, turns in script.items() for t, out in enumerate(turns)}
        self.version = 7
        self.calls: list[list[int]] = []

    def generate(self, requests: list[SampleRequest], params: SamplingParams) -> list[Rollout]:
        self.calls.append([r.seed for r in requests])
        rollouts = []
        for r in requests:
            out = self.by_seed[r.seed][: params.max_new_tokens]
            stop = out[-1] == EOS
            rollouts.append(
                Rollout(
                    list(r.prompt_ids), out, [-0.1 * (i + 1) for i in range(len(out))], "stop" if stop else "length"
                )
            )
        return rollouts


def defaults(cls):
    """One episode's ``cls`` as a run builds it (``plugins.build_part``), its options at their defaults."""
    return partial(cls, cls.Options())


def run(script, prompts, limits=EpisodeLimits(max_turns=4, max_tokens=200), make_env=None):
    generator = ScriptedGenerator(script)
    make_env = make_env or defaults(FeedbackEnvironment)
    episodes = MultiTurn(generator, TOKENIZER, make_env, stop_token_ids=[EOS], limits=limits)
    try:
        return episodes.run(prompts, sorted(script), PARAMS), generator
    finally:
        episodes.close()


def test_an_episode_keeps_the_sampled_tokens_and_appends_each_observation_as_the_template_delta():
    turns = [ids("9") + [EOS], ids("3") + [EOS], ids("4") + [EOS]]
    [completion], generator = run({11: turns}, [Prompt("p", "2+2=", "4")])
    rollout = completion.rollout
    assert rollout.prompt_ids == ids("U:2+2=\nA:")
    too_high, too_low = ids("U:too high\nA:"), ids("U:too low\nA:")
    assert rollout.response_ids == turns[0] + too_high + turns[1] + too_low + turns[2]
    assert rollout.loss_mask == [1, 1] + [0] * len(too_high) + [1, 1] + [0] * len(too_low) + [1, 1]
    assert rollout.logprobs == [-0.1, -0.2] + [0.0] * len(too_high) + [-0.1, -0.2] + [0.0] * len(too_low) + [-0.1, -0.2]
    assert rollout.versions == [7, 7] + [-1] * len(too_high) + [7, 7] + [-1] * len(too_low) + [7, 7]
    assert rollout.finish_reason == "stop"
    assert completion.reward == 0.25 and completion.text == "4"  # solved at the third answer: 0.5 ** 2
    metrics = completion.metrics
    assert metrics["turns"] == 3 and metrics["solved"] == 1 and metrics["truncated"] == 0
    assert (metrics["trained_tokens"], metrics["masked_tokens"]) == (6, len(too_high) + len(too_low))
    transcript = [
        {"role": "user", "content": "2+2="},
        *[m for t in ("9", "too high", "3", "too low") for m in [{"role": "x", "content": t}]],
        {"role": "assistant", "content": "4"},
    ]
    for i, role in enumerate(["assistant", "user", "assistant", "user"]):
        transcript[1 + i]["role"] = role
    assert rollout.prompt_ids + rollout.response_ids == ids(TOKENIZER.apply_chat_template(transcript, tokenize=False))
    assert generator.calls == [[11], [turn_seed(11, 1)], [turn_seed(11, 2)]]


def test_sampled_ids_are_kept_even_where_decoding_and_encoding_would_change_them():
    unk = TOKENIZER.unk_token_id
    [completion], _ = run({3: [ids("1") + [unk] + [EOS], ids("2") + [EOS]]}, [Prompt("p", "1+1=", "2")])
    assert completion.rollout.response_ids[:3] == ids("1") + [unk, EOS]  # decode drops <unk>; the ids stay


def test_the_episode_row_trains_only_the_sampled_tokens():
    turns = [ids("9") + [EOS], ids("4") + [EOS]]
    [completion], _ = run({5: turns}, [Prompt("p", "2+2=", "4")])
    rollout = completion.rollout
    group = RolloutGroup.from_rollouts("p", [rollout], pad_id=0, start_version=7, end_version=7)
    p = len(rollout.prompt_ids)
    assert group.response_mask[0, p:].tolist() == [float(m) for m in rollout.loss_mask]
    assert group.response_tokens == 4
    masked = group.response_mask[0] == 0
    assert bool((group.behaviour_logprobs[0][masked] == 0).all())
    assert group.token_versions[0].tolist() == [-1] * p + [7 if m else -1 for m in rollout.loss_mask]


def test_limits_truncate_an_episode_by_turns_and_by_tokens():
    wrong = [ids("9") + [EOS]] * 5
    [by_turns], _ = run({1: wrong}, [Prompt("p", "2+2=", "4")], EpisodeLimits(max_turns=2, max_tokens=200))
    assert by_turns.metrics["turns"] == 2 and by_turns.metrics["truncated"] == 1
    assert by_turns.rollout.finish_reason == "max_turns" and by_turns.reward is None  # the run's rewards score it
    [by_tokens], _ = run({1: wrong}, [Prompt("p", "2+2=", "4")], EpisodeLimits(max_turns=5, max_tokens=15))
    assert len(by_tokens.rollout.response_ids) <= 15 and by_tokens.metrics["truncated"] == 1
    assert by_tokens.rollout.finish_reason == "length"
    [cut], _ = run({1: [ids("123456") + [EOS]]}, [Prompt("p", "2+2=", "4")], EpisodeLimits(max_turns=5, max_tokens=3))
    assert cut.rollout.response_ids == ids("123") and cut.rollout.finish_reason == "length"


def test_a_template_that_rewrites_the_transcript_ends_the_episode_before_the_observation():
    tokenizer = build_char_tokenizer(chat=True)
    tokenizer.chat_template = "{% for m in messages[-1:] %}{{ m.content }}{% endfor %}"  # only the last message
    generator = ScriptedGenerator({1: [ids("9") + [EOS], ids("4") + [EOS]]})
    episodes = MultiTurn(
        generator, tokenizer, defaults(FeedbackEnvironment), stop_token_ids=[EOS], limits=EpisodeLimits(4, 99)
    )
    [completion] = episodes.run([Prompt("p", "2+2=", "4")], [1], PARAMS)
    episodes.close()
    assert completion.rollout.finish_reason == "transcript" and completion.metrics["transcript_breaks"] == 1
    assert completion.rollout.response_ids == ids("9") + [EOS]  # the first turn alone: nothing was appended
    assert completion.metrics["turns"] == 1 and completion.rollout.loss_mask == [1] * 2


class _Blocking(Environment):
    """Episode "slow" answers its first turn only once episode "fast" has finished three turns."""

    fast_done = threading.Event()

    def reset(self, prompt):
        self.uid, self.turns = prompt.uid, 0
        return [{"role": "user", "content": prompt.text}]

    def step(self, assistant):
        self.turns += 1
        if self.uid == "slow":
            assert type(self).fast_done.wait(timeout=20), "the slow environment held up the other episode"
            return Turn([], done=True, reward=1.0)
        if self.turns == 3:
            type(self).fast_done.set()
            return Turn([], done=True, reward=1.0)
        return Turn([{"role": "user", "content": "again"}], done=False)


def test_an_episode_waiting_on_its_environment_does_not_hold_up_the_others():
    _Blocking.fast_done.clear()
    answer = [ids("1") + [EOS]] * 3
    prompts = [Prompt("slow", "1=", "1"), Prompt("fast", "1=", "1")]
    (slow, fast), generator = run({1: answer, 2: answer}, prompts, make_env=_Blocking)
    assert fast.metrics["turns"] == 3 and slow.metrics["turns"] == 1
    assert generator.calls[0] == [1, 2]  # both first turns in one generation call
    assert all(len(call) == 1 for call in generator.calls[1:])  # then the fast one alone, twice


def test_an_episode_samples_the_same_tokens_alone_or_batched_with_others_on_the_hf_backend():
    """Turns end on any digit, so the untrained model takes several turns."""
    model = build_tiny_model(len(TOKENIZER), seed=0, dtype=torch.float64)
    stops = ids("0123456789") + [EOS]
    generator = HFGenerator(model, stop_token_ids=stops, pad_token_id=0, batch_size=8)
    episodes = MultiTurn(
        generator, TOKENIZER, defaults(FeedbackEnvironment), stop_token_ids=stops, limits=EpisodeLimits(4, 60)
    )
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    together = episodes.run(prompts, [10, 11, 12, 13], SamplingParams(max_new_tokens=12))
    alone = episodes.run(prompts[2:3], [12], SamplingParams(max_new_tokens=12))
    episodes.close()
    assert max(c.metrics["turns"] for c in together) > 1
    one, batched = alone[0].rollout, together[2].rollout
    assert (one.response_ids, one.loss_mask, one.versions) == (
        batched.response_ids,
        batched.loss_mask,
        batched.versions,
    )
    assert one.logprobs == pytest.approx(batched.logprobs, abs=1e-9)  # padding may move the last bits


class _NewWeightsEachCall(ScriptedGenerator):
    """Under sync.mode inflight the weights may change between two turns: here, after every call."""

    def generate(self, requests, params):
        rollouts = super().generate(requests, params)
        self.version += 1
        return rollouts


class _NoRewards:
    """Every episode here is scored by its environment: the run's rewards must not be asked."""

    def score(self, completions, answers, num_tokens=None):
        assert not completions
        return RewardResult([], [], {}, [], [])


def test_an_episode_takes_new_weights_between_turns_and_each_token_keeps_its_version():
    seed = sample_seed(0, "p", 0)  # the worker's seed for sample 0 of prompt "p"
    generator = _NewWeightsEachCall({seed: [ids("9") + [EOS], ids("3") + [EOS], ids("4") + [EOS]]})
    episodes = MultiTurn(
        generator, TOKENIZER, defaults(FeedbackEnvironment), stop_token_ids=[EOS], limits=EpisodeLimits(4, 99)
    )
    worker = RolloutWorker(
        generator, _NoRewards(), TOKENIZER, run_seed=0, group_size=1, sampling=PARAMS, inflight=True, episodes=episodes
    )
    prompt = Prompt("p", "2+2=", "4")
    [group] = worker.generate([RolloutJob(slot_id=0, prompt=prompt, start_version=7, target_step=0)]).groups
    episodes.close()
    versions = group.token_versions[0][group.response_mask[0] > 0].tolist()
    assert versions == [7, 7, 8, 8, 9, 9]
    assert (group.start_version, group.end_version) == (7, 9)
    assert group.rewards.tolist() == [0.25] and group.correct.tolist() == [0.0]  # solved, not at the first answer
    assert group.episode_metrics["turns"] == 3 and group.episode_metrics["solved"] == 1


class _Slow(FeedbackEnvironment):
    """The feedback environment, with a delay before it answers the episodes of ``slow`` uids."""

    slow: tuple[str, ...] = ()

    def reset(self, prompt):
        self.uid = prompt.uid
        return super().reset(prompt)

    def step(self, assistant):
        if self.uid in type(self).slow:
            time.sleep(0.3)
        return super().step(assistant)


def test_episodes_are_bit_identical_however_their_turns_were_batched_on_the_hf_backend():
    """Which turns share a generation call depends on when environments answer; the episodes'
    tokens and logprobs must not."""
    model = build_tiny_model(len(TOKENIZER), seed=0)
    stops = ids("0123456789") + [EOS]
    generator = HFGenerator(model, stop_token_ids=stops, pad_token_id=0, batch_size=8)
    episodes = MultiTurn(generator, TOKENIZER, defaults(_Slow), stop_token_ids=stops, limits=EpisodeLimits(4, 60))
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(6)]
    runs = []
    for slow in (("p0", "p1"), ("p4", "p5")):
        _Slow.slow = slow
        runs.append([c.rollout for c in episodes.run(prompts, list(range(6)), SamplingParams(max_new_tokens=12))])
    episodes.close()
    assert max(len(r.response_ids) for r in runs[0]) > 12  # several turns
    assert runs[0] == runs[1]


def test_the_environment_docs_example_runs_as_a_user_copies_it(tmp_path, monkeypatch):
    from helpers import ROOT

    from asyncrl.config import load_config
    from asyncrl.environments.base import environment_class

    doc = (ROOT / "docs" / "environments.md").read_text()
    (tmp_path / "my_env.py").write_text(re.search(r"```python\n(# my_env.py\n.*?)```", doc, re.S).group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["environment.name=my_env:Spell", "environment.options={bonus: 0.5}"])
    environment = environment_class(config)
    assert environment.options == environment.cls.Options(bonus=0.5)
    [completion], _ = run(
        {4: [ids("cot") + [EOS], ids("cat") + [EOS]]},
        [Prompt("w", "spell cat", "cat")],
        make_env=environment.build,
    )
    assert completion.reward == 1.0 and completion.metrics["right_letters"] == 2 + 3
    assert TOKENIZER.decode(completion.rollout.response_ids) == "cot<eos>U:2 letters right\nA:cat<eos>"


def test_an_episode_past_its_wall_time_is_truncated_after_the_step_that_crossed_it():
    _Slow.slow = ("p",)  # each step takes 0.3 s, three times the limit
    wrong = [ids("9") + [EOS]] * 4
    limits = EpisodeLimits(max_turns=4, max_tokens=200, max_seconds=0.1)
    [completion], _ = run({1: wrong}, [Prompt("p", "2+2=", "4")], limits, make_env=defaults(_Slow))
    assert completion.metrics["turns"] == 1 and completion.metrics["truncated"] == 1
    assert completion.metrics["timed_out"] == 1
    assert completion.rollout.finish_reason == "time_limit" and completion.reward is None


class _ConcurrentScripted(ScriptedGenerator):
    """A backend taking concurrent calls: the call that holds episode "b"'s second turn returns
    only once a call with episode "a"'s second turn has started, which needs calls to overlap."""

    concurrent_calls = True

    def __init__(self, script, hold_seed: int, release_seed: int) -> None:
        super().__init__(script)
        self.hold_seed, self.release_seed = hold_seed, release_seed
        self.released = threading.Event()

    def generate(self, requests, params):
        seeds = [r.seed for r in requests]
        if self.release_seed in seeds:
            self.released.set()
        if self.hold_seed in seeds:
            assert self.released.wait(timeout=20), "a generation call held up the turns that became ready"
        return super().generate(requests, params)


def test_a_backend_taking_concurrent_calls_gets_turns_that_become_ready_while_a_call_runs():
    _Slow.slow = ("a",)  # a's environment answers 0.3 s after b's, so their second turns part
    answer = [ids("9") + [EOS], ids("4") + [EOS]]
    generator = _ConcurrentScripted({1: answer, 2: answer}, hold_seed=turn_seed(2, 1), release_seed=turn_seed(1, 1))
    episodes = MultiTurn(generator, TOKENIZER, defaults(_Slow), stop_token_ids=[EOS], limits=EpisodeLimits(4, 99))
    prompts = [Prompt("a", "2+2=", "4"), Prompt("b", "2+2=", "4")]
    completions = episodes.run(prompts, [1, 2], PARAMS)
    episodes.close()
    assert [c.reward for c in completions] == [0.5, 0.5]
    assert [turn_seed(2, 1)] in generator.calls and [turn_seed(1, 1)] in generator.calls


def _trainer(**grpo) -> TrainerWorker:
    model = build_tiny_model(len(TOKENIZER), seed=0, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)
    trainer = PolicyTrainer(
        model, TrainerConfig(lr=1e-2, micro_batch_size=4), GRPO(importance_sampling="tis"), total_steps=2
    )
    return TrainerWorker(trainer, StepConfig(generations_per_prompt=2, **grpo), TOKENIZER)


def test_mask_truncated_leaves_out_a_cut_turn_but_trains_an_episode_ended_by_its_turn_limit():
    """An unsolved episode at max_turns is a failure GRPO must learn from; only a turn cut at
    generation.max_new_tokens (or the token budget) is what step.mask_truncated leaves out."""
    unsolved, cut = [ids("9") + [EOS]] * 3, [ids("123456789")]  # no end token within max_new_tokens 8
    completions, _ = run({1: unsolved, 2: cut}, [Prompt("p", "2+2=", "4")] * 2, EpisodeLimits(2, 200))
    assert [c.rollout.finish_reason for c in completions] == ["max_turns", "length"]
    assert [c.metrics["truncated"] for c in completions] == [1, 1]
    rollouts = [c.rollout for c in completions]
    for rollout, reward in zip(rollouts, (0.0, 1.0)):
        rollout.reward = reward
    group = RolloutGroup.from_rollouts("p", rollouts, pad_id=0, start_version=7, end_version=7, target_step=0)
    group = replace(group, correct=group.rewards.clone())
    trainer = _trainer(mask_truncated=True)
    trainer.begin_step(trainer.version)
    trainer.train_groups([group])
    assert trainer.finish_step().result.num_sequences == 1  # the episode ended by max_turns


class _NanReward(FeedbackEnvironment):
    def step(self, assistant):
        return Turn([], done=True, reward=float("nan"))


def test_a_non_finite_environment_reward_scores_zero_and_is_counted_as_a_reward_error():
    seeds = [sample_seed(0, "p", i) for i in range(2)]
    generator = ScriptedGenerator({seed: [ids("4") + [EOS]] for seed in seeds})
    episodes = MultiTurn(generator, TOKENIZER, defaults(_NanReward), stop_token_ids=[EOS], limits=EpisodeLimits(4, 99))
    worker = RolloutWorker(
        generator, _NoRewards(), TOKENIZER, run_seed=0, group_size=2, sampling=PARAMS, episodes=episodes
    )
    [group] = worker.generate(
        [RolloutJob(slot_id=0, prompt=Prompt("p", "2+2=", "4"), start_version=7, target_step=0)]
    ).groups
    episodes.close()
    assert group.rewards.tolist() == [0.0, 0.0] and group.reward_errors == 2
    assert torch.isfinite(GRPO(importance_sampling="tis").advantages(group.rewards)).all()


class _Hangs(FeedbackEnvironment):
    """The feedback environment, whose step never returns for prompt "hangs"."""

    never = threading.Event()

    def reset(self, prompt):
        self.uid = prompt.uid
        return super().reset(prompt)

    def step(self, assistant):
        if self.uid == "hangs":
            type(self).never.wait()
        return super().step(assistant)


def test_an_environment_step_that_never_returns_is_abandoned_at_max_seconds():
    answer = [ids("4") + [EOS]]
    limits = EpisodeLimits(max_turns=4, max_tokens=200, max_seconds=0.5)
    prompts = [Prompt("hangs", "2+2=", "4"), Prompt("answers", "2+2=", "4")]
    done = []
    thread = threading.Thread(
        target=lambda: done.append(run({1: answer, 2: answer}, prompts, limits, defaults(_Hangs))), daemon=True
    )
    thread.start()
    thread.join(timeout=120)
    assert done, "the episodes never returned: an environment call that hangs was waited on"
    hung, answered = done[0][0]
    assert hung.rollout.finish_reason == "time_limit" and hung.metrics["timed_out"] == 1 and hung.reward is None
    assert answered.rollout.finish_reason == "stop" and answered.metrics["timed_out"] == 0


class _Raises(FeedbackEnvironment):
    """The feedback environment, whose step raises ``failures[uid]`` times for a prompt's episodes."""

    failures: dict[str, int] = {}
    lock = threading.Lock()

    def reset(self, prompt):
        self.uid = prompt.uid
        return super().reset(prompt)

    def step(self, assistant):
        with type(self).lock:
            left = type(self).failures.get(self.uid, 0)
            type(self).failures[self.uid] = left - 1
        if left > 0:
            raise ConnectionError("the sandbox went away")
        return super().step(assistant)


def _generate_with_failures(failures: dict[str, int], max_retries: int = 2):
    """Prompts "a" and "b", two samples each, answered 9 then 4; (batch, generator)."""
    _Raises.failures = dict(failures)
    seeds = {uid: [sample_seed(0, uid, i) for i in range(2)] for uid in "ab"}
    generator = ScriptedGenerator({s: [ids("9") + [EOS], ids("4") + [EOS]] for uid in "ab" for s in seeds[uid]})
    episodes = MultiTurn(
        generator,
        TOKENIZER,
        defaults(_Raises),
        stop_token_ids=[EOS],
        limits=EpisodeLimits(4, 99),
        max_retries=max_retries,
    )
    worker = RolloutWorker(
        generator, _NoRewards(), TOKENIZER, run_seed=0, group_size=2, sampling=PARAMS, episodes=episodes
    )
    jobs = [
        RolloutJob(slot_id=i, prompt=Prompt(uid, "2+2=", "4"), start_version=7, target_step=0)
        for i, uid in enumerate("ab")
    ]
    try:
        return worker.generate(jobs), generator
    finally:
        episodes.close()


def test_an_environment_that_raises_reruns_only_its_episode_and_gives_the_clean_result():
    clean, _ = _generate_with_failures({})
    flaky, generator = _generate_with_failures({"b": 1})
    assert not flaky.failed and [g.retries for g in flaky.groups] == [0, 1]
    for ours, theirs in zip(flaky.groups, clean.groups):
        assert torch.equal(ours.input_ids, theirs.input_ids) and torch.equal(ours.rewards, theirs.rewards)
    sampled = [seed for call in generator.calls for seed in call]
    a_seeds = [sample_seed(0, "a", i) for i in range(2)]
    assert [sampled.count(seed) for seed in a_seeds] == [1, 1]  # the other prompt's episodes ran once


def test_an_environment_that_keeps_raising_fails_its_prompt_alone_after_the_retries():
    batch, _ = _generate_with_failures({"b": 100}, max_retries=2)
    assert [g.prompt_uid for g in batch.groups] == ["a"] and list(batch.failed) == [1]
    assert "ConnectionError in the environment's step: the sandbox went away" in str(batch.failed[1])
    assert _Raises.failures["b"] == 100 - 2 * 3  # each of its two episodes: the attempt and two reruns
