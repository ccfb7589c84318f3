"""RolloutWorker: prompts -> generator -> rewards -> tensorized RolloutGroups.

The worker is a plain object; a runtime puts it behind a handle (a thread, or a Ray actor). One
``generate`` call is one deterministic generation batch: the caller composes it, the worker keeps
its order, and every sample's seed comes from (run seed, prompt uid, sample index) alone.

How a prompt becomes a completion is the worker's ``episodes`` (asyncrl/rollout/episode.py):
one turn by default, or multi-turn episodes against an environment. Either way a completion's
reward is the environment's, when it gave one, or else the run's rewards' score of its text.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from asyncrl.algorithms import Algorithm
from asyncrl.data import Prompt
from asyncrl.generation import Generator, SamplingParams, sample_seed
from asyncrl.rewards import RewardResult, RewardRunner
from asyncrl.rollout.episode import Completion, EpisodeError, Episodes, SingleTurn
from asyncrl.types import EvalResult, Rollout, RolloutBatch, RolloutGroup, RolloutJob


class RolloutWorker:
    def __init__(
        self,
        generator: Generator,
        rewards: RewardRunner,
        tokenizer,
        *,
        run_seed: int,
        group_size: int,
        sampling: SamplingParams,
        inflight: bool = False,
        algorithm: Algorithm | None = None,
        episodes: Episodes | None = None,
        samples: int = 0,
        eval_samples: int = 0,
        fingerprints: bool = True,
    ) -> None:
        """``algorithm``: the run's, which judges whether each group is informative as it is
        tensorized (None: ``RolloutGroup``'s own default, GRPO's test). ``episodes``: how prompts
        become completions (None: ``SingleTurn``, one response to the prompt's text).
        ``samples``: transcripts a group keeps of its first samples, ``eval_samples``: an
        evaluation of its first prompts, for the run's sample log (asyncrl/samples.py).

        ``inflight``: the generator takes weights while it generates (its responses then span
        versions), so a runtime may run ``load_weights`` and the sampling ``probe`` beside ``generate``
        (``unordered_methods``). ``fingerprints``: a load answers with the generator's fingerprint
        of what it serves (the integrity guard's weight check); off, with None."""
        self.generator = generator
        self.fingerprints = fingerprints
        self.inflight = inflight
        self.unordered_methods = ("load_weights", "probe") if inflight else ()
        self.rewards = rewards
        self.tokenizer = tokenizer
        self.run_seed = run_seed
        self.group_size = group_size
        self.sampling = sampling
        self.pad_id = tokenizer.pad_token_id
        self.algorithm = algorithm
        self.episodes = episodes if episodes is not None else SingleTurn(generator, tokenizer)
        self.samples = samples
        self.eval_samples = eval_samples

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> str | None:
        """Load ``version``; the fingerprint of what the generator serves now (None: it cannot
        tell, or ``fingerprints`` is off: the integrity guard is)."""
        self.generator.load_weights(state_dict, version)
        return self.served_fingerprint()

    def served_fingerprint(self) -> str | None:
        return self.generator.fingerprint() if self.fingerprints else None

    def probe(self, prompts: Sequence[Prompt], version: int) -> RolloutGroup:
        """One response to each prompt, sampled with the run's sampling settings as one turn, with
        seeds of their own: the sampling probe the trainer scores after a sync (docs/integrity.md)."""
        seeds = [sample_seed(self.run_seed, f"probe/{version}/{p.uid}", 0) for p in prompts]
        rollouts = [c.rollout for c in SingleTurn(self.generator, self.tokenizer).run(prompts, seeds, self.sampling)]
        return RolloutGroup.from_rollouts("probe", rollouts, pad_id=self.pad_id, start_version=version)

    def generate(self, jobs: Sequence[RolloutJob]) -> RolloutBatch:
        """Sample ``group_size`` completions per job, score them, tensorize one group per job."""
        start = time.perf_counter()
        version = self.generator.version
        stale = [
            job.slot_id
            for job in jobs
            if job.start_version > version or (job.start_version < version and not self.inflight)
        ]
        if stale:
            raise RuntimeError(
                f"RolloutWorker.generate: slots {stale} were admitted for another weight version than the "
                f"loaded {self.generator.version}; a weight sync overtook its generation batch"
            )
        n = self.group_size
        prompts = [job.prompt for job in jobs for _ in range(n)]
        seeds = [sample_seed(self.run_seed, job.prompt.uid, i) for job in jobs for i in range(n)]
        results = self.episodes.run(prompts, seeds, self.sampling)
        failed = {jobs[i // n].slot_id: r for i, r in enumerate(results) if isinstance(r, EpisodeError)}
        kept = [job for job in jobs if job.slot_id not in failed]  # the others keep their completions
        completions = [
            r for j, job in enumerate(jobs) if job.slot_id not in failed for r in results[j * n : (j + 1) * n]
        ]
        rollouts = [c.rollout for c in completions]
        end_version = self.generator.version if not self.inflight else max([version, *_token_versions(rollouts)])
        scores = self._score(completions, [job.prompt.answer for job in kept for _ in range(n)])
        groups = [
            self._group(job, completions[j * n : (j + 1) * n], scores, slice(j * n, (j + 1) * n), end_version)
            for j, job in enumerate(kept)
        ]
        num_tokens = sum(_sampled_tokens(r) for r in rollouts)
        return RolloutBatch(groups, num_tokens, time.perf_counter() - start, failed=failed)

    def abandon(self) -> None:
        """The run is ending: the generator gives up the batch in flight (``Generator.abandon``)."""
        self.generator.abandon()

    def close(self) -> None:
        """Release what the generator and the episodes hold (a server it started, environment threads)."""
        close = getattr(self.episodes, "close", None)  # a multi-turn runner's environment threads
        if close is not None:
            close()
        self.generator.close()

    def evaluate(self, prompts: Sequence[Prompt]) -> EvalResult:
        """Greedy accuracy and mean reward of one completion per prompt."""
        start = time.perf_counter()
        seeds = [sample_seed(self.run_seed, p.uid, 0) for p in prompts]
        completions = self.episodes.run(prompts, seeds, self.sampling.greedy())
        failed = [c for c in completions if isinstance(c, EpisodeError)]
        if failed:
            raise failed[0]
        rollouts = [c.rollout for c in completions]
        scores = self._score(completions, [p.answer for p in prompts])
        count = max(len(prompts), 1)
        episode_metrics: dict[str, float] = {}
        for completion in completions:
            for key, value in completion.metrics.items():
                episode_metrics[key] = episode_metrics.get(key, 0.0) + value / count
        return EvalResult(
            num_prompts=len(prompts),
            accuracy=sum(scores.correct) / count,
            reward_mean=sum(scores.rewards) / count,
            response_length_mean=sum(_sampled_tokens(r) for r in rollouts) / count,
            seconds=time.perf_counter() - start,
            samples=[
                _sample_record(prompts[i], 0, completions[i], scores, i, self.generator.version)
                for i in range(min(self.eval_samples, len(prompts)))
            ],
            episode_metrics=episode_metrics,
        )

    def _score(self, completions: Sequence[Completion], answers: Sequence[str]) -> RewardResult:
        """The environment's reward where it gave one, else the run's rewards on the text.

        One scoring call for the batch: a reward that hangs costs one timeout, not one per group."""
        todo = [i for i, c in enumerate(completions) if c.reward is None]
        scored = self.rewards.score(
            [completions[i].text for i in todo],
            [answers[i] for i in todo],
            [_length_against_limit(completions[i]) for i in todo],
        )
        if len(todo) == len(completions):
            return scored
        rewards, errors = map(list, zip(*(_environment_reward(c.reward) for c in completions)))
        correct = [reward >= 1.0 for reward in rewards]  # the runner's rule: a score of 1 is a correct answer
        timeouts = [0] * len(completions)
        parts = {name: [0.0] * len(completions) for name in scored.per_function}  # 0 where the environment scored
        for k, i in enumerate(todo):
            rewards[i], correct[i] = scored.rewards[k], scored.correct[k]
            errors[i], timeouts[i] = scored.item_errors[k], scored.item_timeouts[k]
            for name, values in scored.per_function.items():
                parts[name][i] = values[k]
        return RewardResult(rewards, correct, parts, errors, timeouts)

    def _group(
        self, job: RolloutJob, samples: list[Completion], scores: RewardResult, rows: slice, end_version: int
    ) -> RolloutGroup:
        rollouts = [c.rollout for c in samples]
        for rollout, reward in zip(rollouts, scores.rewards[rows]):
            rollout.reward = reward
        group = RolloutGroup.from_rollouts(
            job.prompt.uid,
            rollouts,
            pad_id=self.pad_id,
            start_version=job.start_version,
            end_version=end_version,
            target_step=job.target_step,
        )
        episode_metrics: dict[str, float] = {}
        for completion in samples:
            for key, value in completion.metrics.items():
                episode_metrics[key] = episode_metrics.get(key, 0.0) + value
        records = [
            _sample_record(job.prompt, i, samples[i], scores, rows.start + i, job.start_version)
            for i in range(min(self.samples, len(samples)))
        ]
        return replace(
            group,
            informative=group.informative if self.algorithm is None else self.algorithm.informative(group.rewards),
            correct=torch.tensor(scores.correct[rows], dtype=torch.float32),
            reward_errors=sum(scores.item_errors[rows]),
            reward_timeouts=sum(scores.item_timeouts[rows]),
            retries=job.retries + sum(c.retries for c in samples),
            episode_metrics=episode_metrics,
            samples=records,
        )


def _sample_record(
    prompt: Prompt, index: int, completion: Completion, scores: RewardResult, row: int, version: int
) -> dict:
    """One sample as the sample log keeps it (docs/samples.md), JSON through and through: an
    environment's messages may hold anything, and what cannot be JSON is kept as its text."""
    rollout = completion.rollout
    versions = rollout.versions or []
    sampled = {v for v, trained in zip(versions, rollout.loss_mask or [1] * len(versions)) if trained}
    messages = completion.transcript
    if messages is None:
        turn = {"tokens": len(rollout.response_ids), "finish_reason": rollout.finish_reason}
        messages = [{"role": "assistant", "content": completion.text, **turn}]
    record = {
        "prompt_uid": prompt.uid,
        "sample": index,
        "prompt": prompt.text,
        "answer": prompt.answer,
        "messages": messages,
        "reward": scores.rewards[row],
        "reward_parts": (
            {"environment": scores.rewards[row]}
            if completion.reward is not None
            else {name: values[row] for name, values in scores.per_function.items()}
        ),
        "correct": bool(scores.correct[row]),
        "finish_reason": rollout.finish_reason,
        "versions": sorted(sampled) or [version],
        "tokens": {
            "prompt": len(rollout.prompt_ids),
            "response": len(rollout.response_ids),
            "sampled": _sampled_tokens(rollout),
        },
    }
    return json.loads(json.dumps(record, default=str))


def _environment_reward(reward: float | None) -> tuple[float, int]:
    """(score, error) of an environment's reward: one that is not a finite number scores 0 and
    counts as an error, as a reward function's does, so it cannot poison its group's advantages.
    None (the run's rewards score it) is a placeholder 0."""
    try:
        value = 0.0 if reward is None else float(reward)
    except (TypeError, ValueError):
        return 0.0, 1
    return (value, 0) if math.isfinite(value) else (0.0, 1)


def _sampled_tokens(rollout: Rollout) -> int:
    """Response tokens the generator sampled (an episode's observations are not)."""
    return len(rollout.response_ids) if rollout.loss_mask is None else sum(rollout.loss_mask)


def _length_against_limit(completion: Completion) -> int:
    """The length a reward holds against ``generation.max_new_tokens`` (``num_tokens``): the
    response's, or an episode's longest model turn, since that limit applies to each turn alone
    and an episode must not be punished for its number of turns."""
    if completion.longest_turn is not None:
        return completion.longest_turn
    return _sampled_tokens(completion.rollout)


def _token_versions(rollouts: Sequence[Rollout]) -> list[int]:
    return [v for r in rollouts if r.versions for v in r.versions]
